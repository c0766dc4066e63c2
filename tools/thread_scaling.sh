#!/usr/bin/env bash
# Thread scaling on a machine with more cores than CI's two (issue 12, part 4),
# as one bounded run: the CPU and fastattn's build; the bitwise tests at this
# core count (64 threads equal to one, every thread count equal, and the amx
# and AVX512-BF16 sets where the CPU has them); then `python -m fastattn bench`
# in float32 at 1, 2, 4, … threads up to the core count, against the peers
# installed (PyTorch, ONNX Runtime and its GroupQueryAttention, OpenVINO; not
# textbook NumPy, whose many-thread speed is no question here); then bfloat16
# at 1 thread and all of them; then the AVX2 set forced (FASTATTN_ISA=avx2)
# against NumPy on OpenBLAS's Haswell kernel, the AVX2 matmul peak.
# Each step has its own time limit and writes to OUTDIR as it goes, so a run
# cut short still leaves what it measured.
#
# Usage: bash tools/thread_scaling.sh OUTDIR [PYTHON]
#   PYTHON (default python3) must import an installed fastattn built from this
#   checkout (the tests compare its source digest with this tree's).
set -uo pipefail
out=${1:?usage: tools/thread_scaling.sh OUTDIR [PYTHON]}
py=${2:-python3}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"

cores=$(nproc)
threads=1
for n in 2 4 8 16 32 64 128; do
    [ "$n" -le "$cores" ] && threads="$threads,$n"
done
[ "${threads##*,}" = "$cores" ] || threads="$threads,$cores"
# the bench's own default peers (those installed), less textbook NumPy
peers=$("$py" -P -c 'from fastattn.bench import peers
print(",".join(n for n in peers.default_peers() if n != "numpy"))')
few_threads=1
[ "$cores" -gt 1 ] && few_threads="1,$cores"

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, log to OUTDIR/NAME.log
    local name=$1 limit=$2 t0 rc
    shift 2
    echo "::: $name (limit ${limit} s)"
    t0=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    tail -n 60 "$out/$name.log"
    echo "::: $name: exit $rc after $(( $(date +%s) - t0 )) s"
}

{ lscpu; echo; "$py" -P -m fastattn info; } > "$out/machine.txt" 2>&1
grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L3" "$out/machine.txt"
tail -n 8 "$out/machine.txt"
echo "::: thread counts $threads; peers ${peers:-none}"

# -P everywhere: the checkout's fastattn/ source folder stays off sys.path
step tests 60 "$py" -P -m pytest -q -p no:cacheprovider -x \
    tests/test_threads.py tests/test_invariance.py tests/test_amx.py tests/test_dpbf16.py

bench=("$py" -P -m fastattn bench --repeat 10 --min-time 0.3)
with_peers=()
[ -n "$peers" ] && with_peers=(--peers "$peers")
step bench_float32 300 "${bench[@]}" "${with_peers[@]}" --threads "$threads" \
    --json "$out/bench_float32.json" --shapes enc1024,long,d128,causal2048,dec4k,dec8k_gqa,dec32k_mqa
step bench_bfloat16 100 "${bench[@]}" "${with_peers[@]}" --threads "$few_threads" \
    --dtype float32,bfloat16 --json "$out/bench_bfloat16.json" --shapes enc1024,causal2048,dec8k_gqa
step bench_avx2 80 env -u OPENBLAS_L2_SIZE FASTATTN_ISA=avx2 OPENBLAS_CORETYPE=Haswell \
    "${bench[@]}" --peers numpy --threads "$few_threads" \
    --json "$out/bench_avx2.json" --shapes d128,causal2048,dec4k,dec32k_mqa
