#!/usr/bin/env bash
# tools/sanitize.sh — the whole test suite against a build of fastattn
# instrumented with AddressSanitizer and UndefinedBehaviorSanitizer, then the
# C API test program (tests/c/test_capi.c) built the same way. Any sanitizer
# report stops the run and the script exits non-zero; a clean run ends with
# "sanitize: ... ok".
#
# Usage: tools/sanitize.sh [VENV]
#   VENV   a virtual environment to (re)install fastattn into; default a fresh
#          one in a temporary directory. Its fastattn is the sanitized build
#          afterwards. The log goes to $RELIABILITY_LOG_DIR (default
#          build/reliability/sanitize.log).
#   SANITIZE_OPT   optimisation level, default -O2. Not -O1: GCC contracts
#          a*b+c into FMA only from -O2, and without FMA the vector exp2 is
#          1.11 ulp instead of 0.84, which tests/test_isa.py rightly refuses
#          for the FMA sets. -O1 -fexpensive-optimizations contracts too and
#          builds faster (kernels_avx2.c 73 s against 188 s), but the suite's
#          two halves then took 520 and 241 s against 271 and 149 s at -O2
#          (Zen 4, stop 26 against CI at stop 25): more than the build saves.
#          -O3 (what ships) also works, at twice the build time.
#
# How:
# - CC is a wrapper that adds -fsanitize=address,undefined to every compile
#   and link (setuptools links its OpenMP probe with plain $CC, so CFLAGS alone
#   would fail the probe and build a serial kernel; FASTATTN_REQUIRE_OPENMP=1
#   turns that into an error) and puts $SANITIZE_OPT last, after setup.py's -O3.
# - CFLAGS adds -fno-sanitize-recover=undefined (a UBSan report aborts) and
#   -fno-wrapv: Python's sysconfig CFLAGS carry -fwrapv, which makes signed
#   overflow defined and invisible to UBSan. Older setuptools append CFLAGS
#   after those (the later flag wins), newer ones replace them.
# - Python is not instrumented: libasan is preloaded, PYTHONMALLOC=malloc
#   sends Python's allocations through it, leak detection is off (the
#   interpreter keeps memory until exit) and allocator_may_return_null=1 lets
#   a huge allocation fail into MemoryError, as it does without ASan.
# - pytest runs with --capture=sys: a sanitizer writes to file descriptor 2 and
#   aborts, and pytest's default fd capture would swallow the report.
#
# Deselected from the main run: test_errors.py::test_repeated_failures_do_not_leak,
# which watches the process's peak RSS, and ASan's quarantine of freed memory
# (256 MB) raises that by design. It runs on its own afterwards with the
# quarantine off. Also left out: the files that run no kernel path of their
# own (the NumPy reference's tests, the bench harness, the command line and
# the examples, which call the same kernel the rest of the suite checks): on
# 2 cores they took about a minute of the run under the sanitizers, and CI
# should stay under 15 minutes. The run still holds ~3,500 tests, in two
# pytest processes at once (each on half of the files).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log_dir=${RELIABILITY_LOG_DIR:-build/reliability}
mkdir -p "$log_dir"
log_dir=$(cd "$log_dir" && pwd)
log=$log_dir/sanitize.log
: >"$log"
say() { echo "$*" | tee -a "$log"; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

venv=${1:-}
if [ -z "$venv" ]; then
    venv=$tmp/venv
    python3 -m venv "$venv"
fi
venv=$(cd "$venv" && pwd)
py=$venv/bin/python
[ -x "$py" ] || { echo "sanitize.sh: $venv is not a virtual environment" >&2; exit 2; }

base_cc=${CC:-gcc}
opt=${SANITIZE_OPT:--O2}
libasan=$("$base_cc" -print-file-name=libasan.so)
[ -f "$libasan" ] || { echo "sanitize.sh: $base_cc has no libasan.so" >&2; exit 2; }

cat >"$tmp/cc" <<EOF
#!/bin/sh
exec $base_cc -fsanitize=address,undefined "\$@" $opt
EOF
chmod +x "$tmp/cc"
san_cflags="-fno-sanitize-recover=undefined -fno-wrapv -fno-omit-frame-pointer -g"

# Build requirements first (pyproject's [build-system]), then fastattn with its
# test extras, without build isolation so that the build sees CC and CFLAGS,
# and without pip's wheel cache: pip caches the wheel it built from a folder
# whose path holds a '-' and would install the plain build of the main stage
# again (the check below caught that in CI at stop 16).
# Only the per-ISA kernels this CPU can run (FASTATTN_ISA_KERNELS, read by
# src_c/manifest.py for setup.py and the C API program's library), and of
# the AVX-512 family (amx, avx512bf16, avx512) only the best: the others
# would be compiled under the sanitizers for nothing, and each AVX-512 file
# takes minutes there. The family shares one copy of every setting
# (kernels_amx.c and kernels_avx512bf16.c include kernels_avx512.c), so the
# best set runs avx512's code for every entry but its own bfloat16 one, and
# the tests' isa fixture runs it in avx512's place. Set FASTATTN_ISA_KERNELS
# to override. Given to the two builds only, not to pytest.
kernels=${FASTATTN_ISA_KERNELS-$(python3 src_c/manifest.py kernels --runnable --checking)}
say "::: sanitize: build ($base_cc -fsanitize=address,undefined $opt; per-ISA kernels: ${kernels:-none})"
"$py" -m pip install -q "setuptools>=77" "cython>=3" "numpy>=2"
touch "$tmp/before-build"
CC=$tmp/cc CFLAGS=$san_cflags FASTATTN_REQUIRE_OPENMP=1 FASTATTN_ISA_KERNELS=$kernels \
    "$py" -m pip install -q --no-cache-dir --no-build-isolation ".[test]"
so=$(cd "$tmp" && LD_PRELOAD=$libasan ASAN_OPTIONS=detect_leaks=0 \
    "$py" -c 'import fastattn._kernel as k; print(k.__file__)')
# ldd's output is read whole before it is searched: `ldd | grep -q` under
# pipefail fails at random, because grep -q exits at the first match and ldd,
# still writing the lines after libasan's, dies of SIGPIPE (CI failed so at
# stop 22 with an instrumented build).
so_libs=$(ldd "$so")
case $so_libs in
*libasan*) ;;
*)
    say "sanitize: FAILED: the installed $so is not instrumented; ldd lists:"
    say "$so_libs"
    exit 1
    ;;
esac

export LD_PRELOAD=$libasan
export PYTHONMALLOC=malloc
asan_common="detect_leaks=0:allocator_may_return_null=1:log_path=$log_dir/asan"
export ASAN_OPTIONS=$asan_common
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
rm -f "$log_dir"/asan.*

status=ok
LEAK_TEST="test_repeated_failures_do_not_leak"
run() {  # run NAME CMD...: run CMD, append its output to the log, note a failure
    local name=$1 rc
    shift
    say "::: sanitize: $name"
    set +e
    "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" -eq 0 ] || { status="FAILED"; say "sanitize: $name exited $rc"; }
}

t0=$(date +%s)
# tests/test_c_api.py and the C example build programs with the system compiler
# (not instrumented); the C API program is built with the sanitizers below.
#
# Two pytest processes at once, each on half of the files: most tests are
# small calls where Python, not the kernel's two threads, keeps a core busy.
# The files are dealt heaviest first onto the lighter half, weighed by the
# seconds each took under this script's build, two files at a time (stop 41,
# Xeon with AMX: avx2, amx, sse2 and scalar sets; first measured at stop 29);
# a file not listed weighs 4. Split by file size before, the halves took 164
# and 277 s; by stop 29's weights at stop 41, 342 and 292 s in CI.
harness_only=" test_c_api.py test_reference.py test_dtypes_reference.py test_benchmarks.py test_cli.py test_examples.py "
seconds_under_asan() {
    case $1 in
    test_reliability.py) echo 82 ;; test_strategy.py) echo 52 ;; test_invariance.py) echo 22 ;;
    test_dtypes.py) echo 22 ;; test_attention.py) echo 20 ;; test_threads.py) echo 19 ;;
    test_long_context.py) echo 19 ;; test_modifiers.py) echo 14 ;; test_decode.py) echo 13 ;;
    test_amx.py) echo 10 ;; test_properties.py) echo 9 ;; test_fuzz.py) echo 8 ;; test_isa.py) echo 6 ;;
    *) echo 4 ;;
    esac
}
half_a=() half_b=()
load_a=0 load_b=0
for f in $(cd tests && for f in test_*.py; do echo "$(seconds_under_asan "$f") $f"; done | sort -k1,1nr -k2 | cut -d' ' -f2); do
    case "$harness_only" in *" $f "*) continue ;; esac
    s=$(seconds_under_asan "$f")
    if [ "$load_a" -le "$load_b" ]; then half_a+=("tests/$f"); load_a=$((load_a + s))
    else half_b+=("tests/$f"); load_b=$((load_b + s)); fi
done
pytest_half() {  # pytest_half LOG FILES...: one half, its output (and its 10 slowest tests) to LOG
    local out=$1
    shift
    "$venv/bin/pytest" -q --capture=sys -p no:cacheprovider --durations=10 \
        -k "not $LEAK_TEST and not c_decode_example" "$@" >"$out" 2>&1
}
both_halves() {
    local rc_a rc_b
    pytest_half "$tmp/half_a.log" "${half_a[@]}" &
    local pid_a=$!
    pytest_half "$tmp/half_b.log" "${half_b[@]}" || rc_b=$?
    wait "$pid_a" || rc_a=$?
    cat "$tmp/half_a.log" "$tmp/half_b.log"
    return $(( ${rc_a:-0} | ${rc_b:-0} ))
}
run "pytest (all but $LEAK_TEST, the plain C builds and the harness-only files), two halves at once" \
    both_halves
ASAN_OPTIONS=$asan_common:quarantine_size_mb=0 run "pytest $LEAK_TEST (quarantine off)" \
    "$venv/bin/pytest" -q --capture=sys -p no:cacheprovider tests/test_errors.py -k "$LEAK_TEST"

# The C API program, instrumented the same way (no preload: it links the
# runtime), linked against the library that src_c/manifest.py builds. Its
# kernels (the per-ISA ones and, since stop 29, the scalar and 128-bit sets)
# are the objects the extension's build above just compiled with the same
# wrapper, flags and kernels (pip builds in the tree, into
# build/temp.*/src_c): compiling the per-ISA ones again took 430 s of CI's
# 1159 s sanitizer stage at stop 25 (three kernels on Zen 4). Where no fresh
# objects are found (pip built elsewhere), the manifest compiles them.
isa_objects=()
fresh=$(find build -path '*/src_c/kernels_*.o' -newer "$tmp/before-build" 2>/dev/null | sed 's|/[^/]*$||' | sort -u)
if [ -n "$fresh" ] && [ "$(echo "$fresh" | wc -l)" -eq 1 ]; then
    isa_objects=(--isa-objects "$fresh")
    say "::: sanitize: the C API program takes the kernels the build left in $fresh"
else
    say "::: sanitize: no fresh kernel objects of the build found (${fresh:-none}): compiling them again"
fi
LD_PRELOAD= FASTATTN_ISA_KERNELS=$kernels "$py" src_c/manifest.py lib --cc "$tmp/cc" --out "$tmp/capi" --cflags="$san_cflags" \
    "${isa_objects[@]}" --program tests/c/test_capi.c >>"$log"
LD_PRELOAD= run "C API program (tests/c/test_capi.c)" "$tmp/capi/test_capi"

# Belt and braces: any report anywhere (the log, or a child's ASan log file)
# fails the run even if an exit status was lost on the way. ASan's files also
# hold warnings that are no error ("failed to allocate 0x200000000000 bytes"
# is the MemoryError tests asking for 2^45 bytes): shown, not counted.
report='ERROR: AddressSanitizer|runtime error:|SUMMARY: (Address|UndefinedBehavior)Sanitizer'
if grep -qE "$report" "$log"; then
    status=FAILED
fi
for f in "$log_dir"/asan.*; do
    [ -e "$f" ] || continue
    if grep -qE "$report" "$f"; then status=FAILED; fi
    say "--- $f"
    tee -a "$log" <"$f"
done
tests=$(grep -E '^([0-9]+ failed, )?[0-9]+ passed' "$log" | grep -oE '[0-9]+ passed' | awk '{s += $1} END {print s + 0}')
capi=$(grep -oE 'C API: [0-9]+ passed' "$log" | grep -oE '[0-9]+' || echo 0)
say "sanitize: ASan+UBSan ($opt): $tests pytest tests and $capi C API checks passed in $(( $(date +%s) - t0 )) s: $status"
[ "$status" = ok ]
