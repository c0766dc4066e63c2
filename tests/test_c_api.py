"""The C API on its own: tests/c/test_capi.c linked against the library that
src_c/manifest.py builds with the system C compiler (no Python headers), run
with every ISA and with FASTATTN_ISA=scalar, and cross-built for arm64 under
qemu; the manifest itself; and a check that fastattn.h compiles on its own.
The host programs link against the session's one build of the library
(conftest's c_library)."""
import os
import pathlib
import platform
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import fastattn
from _helpers import REPO, c_manifest

SRC = REPO / "src_c"
MANIFEST = c_manifest()
SUMMARY = re.compile(r"C API: (\d+) passed, (\d+) failed")
# The compiler the session's library was built with (conftest's c_library: the
# manifest's lib command takes $CC, else cc).
CC = os.environ.get("CC", "cc")


def _run(cmd, **kw):
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, **kw)
    shown = cmd if isinstance(cmd, str) else shlex.join(map(str, cmd))
    assert r.returncode == 0, f"{shown} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


def _build_capi(out, cc, cflags=""):
    """The manifest's own command: out/libfastattn.a for cc's target, and
    tests/c/test_capi.c linked against it as out/test_capi."""
    _run([sys.executable, str(SRC / "manifest.py"), "lib", "--cc", cc, "--out", str(out),
          f"--cflags={cflags}", "--program", "tests/c/test_capi.c"])
    return out / "test_capi"


def _link(c_library, program, exe):
    """program linked against the session's library (conftest's c_library),
    by the manifest's own link command for the compiler's target."""
    _run(MANIFEST.link_command(CC, [str(program)], [str(c_library / MANIFEST.LIB)], str(exe),
                               MANIFEST._ask(CC, "-dumpmachine"), accepts=MANIFEST.compiler_accepts(CC)))
    return exe


@pytest.fixture(scope="module")
def capi_binary(c_library, tmp_path_factory):
    return _link(c_library, REPO / "tests" / "c" / "test_capi.c", tmp_path_factory.mktemp("capi") / "test_capi")


def _check_summary(result):
    m = SUMMARY.search(result.stdout)
    assert m, f"no summary line in output:\n{result.stdout}"
    passed, failed = int(m.group(1)), int(m.group(2))
    assert failed == 0, result.stdout
    assert passed > 0, result.stdout
    return passed


def test_capi_program_passes(capi_binary):
    r = _run([str(capi_binary)], env={k: v for k, v in os.environ.items() if k != "FASTATTN_ISA"})
    _check_summary(r)
    # At least the scalar kernel set is always checked.
    assert "scalar: checked" in r.stdout


def test_capi_program_passes_with_scalar_isa(capi_binary):
    env = dict(os.environ, FASTATTN_ISA="scalar")
    r = _run([str(capi_binary)], env=env)
    _check_summary(r)


def test_lib_archives_kernel_objects_it_is_given_without_compiling_them(tmp_path, monkeypatch):
    """`manifest.py lib --isa-objects DIR` (tools/sanitize.sh hands it the
    extension build's objects, and so does CI's suite: conftest's c_library):
    every kernel's object, per-ISA and portable, comes from DIR into the
    archive, none of them is compiled, the other sources are; a DIR that
    lacks one is refused, naming it. The commands are recorded, not run
    (tools/sanitize.sh links and runs the C API program built this way)."""
    ran = []

    def fake_run(cmd, **kw):
        ran.append(list(cmd))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")
    monkeypatch.setattr(MANIFEST.subprocess, "run", fake_run)
    monkeypatch.delenv(MANIFEST.ONLY_ENV, raising=False)
    kernels = [path for path, own in MANIFEST.steps("x86_64") if os.path.basename(path).startswith("kernels_")]
    assert len(kernels) == len(MANIFEST.ISA_X86_64) + 2   # and the scalar and 128-bit sets
    objs = tmp_path / "objs"
    objs.mkdir()
    for path in kernels:
        (objs / os.path.basename(path).replace(".c", ".o")).write_bytes(b"")
    MANIFEST.build_lib("cc", str(tmp_path / "out"), target="x86_64", isa_objects=str(objs))
    compiled = [c[c.index("-c") + 1] for c in ran if "-c" in c and c[c.index("-c") + 1].endswith(".c")]
    assert sorted(compiled) == sorted(f"src_c/{n}" for n in MANIFEST.SOURCES if not n.startswith("kernels_"))
    archive = next(c for c in ran if "rcs" in c)
    assert [str(objs / os.path.basename(p).replace(".c", ".o")) for p in kernels] == \
        [o for o in archive if o.startswith(str(objs))]
    for missing in ("kernels_avx512.o", "kernels_vec128.o"):
        (objs / missing).unlink()
        with pytest.raises(FileNotFoundError, match=rf"--isa-objects {re.escape(str(objs))}: no {missing} there"):
            MANIFEST.build_lib("cc", str(tmp_path / "out2"), target="x86_64", isa_objects=str(objs))
        (objs / missing).write_bytes(b"")


def test_header_is_self_contained(tmp_path, c_library):
    """fastattn.h alone, strict C99: it includes what it needs itself."""
    src = tmp_path / "uses_header.c"
    src.write_text(
        '#include "fastattn.h"\n'
        "#include <stdio.h>\n"
        "int main(void) {\n"
        '    printf("isa=%s\\n", fa_isa());\n'
        '    printf("heads=%s\\n", fa_strerror(FA_ERR_HEADS));\n'
        "    return 0;\n"
        "}\n")
    # The header check proper: this file alone, compiled with -c under -Werror.
    _run([CC, "-std=c99", "-pedantic", "-Wall", "-Werror", f"-I{SRC}", "-c", str(src),
          "-o", str(tmp_path / "uses_header.o")])
    # Then link and run it, to see the two calls answer.
    r = _run([str(_link(c_library, src, tmp_path / "uses_header"))])
    isa = re.search(r"^isa=(\S+)$", r.stdout, re.M)
    assert isa and isa.group(1) in ("amx", "avx512bf16", "avx512", "avx2", "sse2", "neon", "scalar"), r.stdout
    heads = re.search(r"^heads=(.+)$", r.stdout, re.M)
    assert heads and "Hkv" in heads.group(1), r.stdout


def test_cc_line_compiles_what_the_library_build_does(c_library):
    """`manifest.py cc-line`, the READMEs' one-line build without a library:
    each per-ISA kernel compiled alone with the very command the library build
    ran (which the tests above link against and run), then one command that
    compiles the common sources with the library build's flags and links.
    Compared, not run: running it compiles every kernel once more, a minute
    of CI time for the same compiler commands."""
    ran = [shlex.split(line) for line in (c_library / "build.log").read_text().splitlines()]
    compiled = {c[c.index("-c") + 1]: c[:c.index("-c")] for c in ran if "-c" in c}   # source -> flags
    exe = "/somewhere/prog"
    commands = [shlex.split(c) for c in MANIFEST.cc_line(platform.machine(), "cc", ["prog.c"], exe).split(" && ")]
    *kernels, last = commands
    for c in kernels:
        source, obj = c[c.index("-c") + 1], c[c.index("-o") + 1]
        if source in compiled:   # the library build leaves out a kernel its compiler cannot build
            assert c[:c.index("-c")] == compiled[source], source
        assert obj == f"/somewhere/{pathlib.PurePath(source).stem}.o"
    assert [c[c.index("-c") + 1] for c in kernels] == [p for p, own in MANIFEST.steps(platform.machine()) if own]
    common = [p for p, own in MANIFEST.steps(platform.machine()) if not own]
    assert last[:len(compiled[common[0]])] == compiled[common[0]]   # the same flags as the library's sources
    objects = [c[c.index("-o") + 1] for c in kernels]
    assert last[len(compiled[common[0]]):] == ["prog.c", *common, *objects, "-o", exe, *MANIFEST.LIBS]
    # CI's suite archives the extension build's kernel objects (conftest's
    # c_library): there only the other sources are compiled, and the kernels'
    # commands above are compared where this build ran them (local runs).
    prebuilt = os.environ.get("FASTATTN_TEST_ISA_OBJECTS") == "build"
    assert {c[c.index("-c") + 1] for c in ran if "-c" in c} >= \
        {p for p in common if not (prebuilt and pathlib.PurePath(p).name.startswith("kernels_"))}


def test_capi_on_arm64_under_qemu(tmp_path):
    """The same C test cross-compiled for arm64 (NEON and scalar sets) and run
    under qemu-user: the build must run on arm64 too. Skipped unless Debian's
    gcc-aarch64-linux-gnu and qemu-user are installed."""
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if not (cc and qemu):
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    exe = _build_capi(tmp_path, cc, "-static")   # the manifest asks cc for its target
    assert not list(tmp_path.glob("kernels_avx*.o")), "x86-64 kernels in an arm64 build"
    result = _run([qemu, str(exe)])
    assert "neon: checked" in result.stdout, result.stdout
    _check_summary(result)


def test_manifest_lists_every_c_source():
    """A .c file in src_c/ that the manifest does not name would be left out of every build."""
    listed = MANIFEST.SOURCES + [name for name, _, _ in MANIFEST.ISA_X86_64]
    assert sorted(listed) == sorted(p.name for p in SRC.glob("*.c"))


def test_installed_build_carries_the_checkout_s_source_digest():
    """conftest refuses a stale build by this digest; here: it is a real one."""
    built = fastattn._kernel.source_digest()
    assert re.fullmatch(r"[0-9a-f]{16}", built), built
    assert built == MANIFEST.source_digest(str(REPO))


@pytest.mark.parametrize("changed", ["src_c/attention.c", "src_c/vec.h", "fastattn/_kernel_raw.pxi",
                                     "fastattn/_kernel.pyx", "fastattn/bench/run.py", "fastattn/cache.py"])
def test_source_digest_changes_with_any_built_file(tmp_path, changed):
    """Every file a wheel is made of moves the digest: one byte more in any of
    them, or a new header, gives another; the same tree gives the same one."""
    for rel in {"src_c", "fastattn"}:
        shutil.copytree(REPO / rel, tmp_path / rel, ignore=shutil.ignore_patterns("__pycache__", "*.so", "_kernel.c"))
    before = MANIFEST.source_digest(str(tmp_path))
    assert MANIFEST.source_digest(str(tmp_path)) == before
    with open(tmp_path / changed, "a") as f:
        f.write("\n")
    after = MANIFEST.source_digest(str(tmp_path))
    assert after != before
    (tmp_path / "src_c" / "new.h").write_text("/* new */\n")
    assert MANIFEST.source_digest(str(tmp_path)) not in (before, after)
    # the generated binding is no source: Cython rewrites it at every build
    (tmp_path / "fastattn" / "_kernel.c").write_text("/* generated */\n")
    (tmp_path / "src_c" / "new.h").unlink()
    assert MANIFEST.source_digest(str(tmp_path)) == after


X86_64 = ["x86_64", "AMD64", "linux-x86_64", "macosx-10.9-x86_64", "x86_64-linux-gnu"]
OTHER = ["aarch64", "arm64", "macosx-11.0-arm64", "macosx-10.9-universal2", "aarch64-linux-gnu"]


@pytest.mark.parametrize("target", X86_64 + OTHER)
def test_manifest_gives_per_isa_kernels_to_x86_64_only(target):
    paths = [path for path, _ in MANIFEST.steps(target)]
    avx = [path for path in paths if "avx" in path or "amx" in path]
    if target in X86_64:
        assert avx == ["src_c/kernels_avx2.c", "src_c/kernels_avx512.c", "src_c/kernels_avx512bf16.c",
                       "src_c/kernels_amx.c"]
        assert {"-DFA_HAVE_AVX512", "-DFA_HAVE_AVX512BF16", "-DFA_HAVE_AMX"} <= set(MANIFEST.cflags(target))
    else:
        assert avx == [] and MANIFEST.macros(target) == []
    assert paths[:len(MANIFEST.SOURCES)] == [f"src_c/{n}" for n in MANIFEST.SOURCES]


def test_manifest_leaves_out_kernels_the_compiler_cannot_build(tmp_path):
    """A compiler that does not know a kernel's flags (GCC 9 and 10 have no
    AMX flags) builds the library without that kernel, not a failed build;
    the probe asks the real compiler, here a wrapper refusing -mamx-tile."""
    old = tmp_path / "old-cc"
    old.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -mamx-tile ] && exit 1; done\nexec cc "$@"\n')
    old.chmod(0o755)
    accepts = MANIFEST.compiler_accepts(str(old))
    assert accepts(("-mavx2",)) and not accepts(("-mavx2", "-mamx-tile"))
    paths = [path for path, _ in MANIFEST.steps("x86_64", accepts)]
    assert "src_c/kernels_amx.c" not in paths and "src_c/kernels_avx512.c" in paths
    flags = MANIFEST.cflags("x86_64", accepts=accepts)
    assert "-DFA_HAVE_AVX512" in flags and "-DFA_HAVE_AMX" not in flags
    # the probe does not drop what a compiler can build: every compiler that
    # builds fastattn knows the AVX2 and AVX-512 flags (AVX512-BF16's came
    # with GCC 10, AMX's with GCC 11)
    cc = MANIFEST.compiler_accepts("cc")
    assert all(cc(tuple(own)) for name, _, own in MANIFEST.ISA_X86_64
               if name not in ("kernels_avx512bf16.c", "kernels_amx.c"))


def test_isa_kernels_variable_builds_only_the_kernels_it_names(monkeypatch):
    """FASTATTN_ISA_KERNELS (tools/sanitize.sh and tools/valgrind.sh build
    only what the CPU runs): the named kernels' steps and macros, no others;
    empty: none; a name of no kernel is refused, naming it."""
    monkeypatch.setenv(MANIFEST.ONLY_ENV, "avx512, avx2")
    paths = [path for path, _ in MANIFEST.steps("x86_64")]
    assert paths == [f"src_c/{n}" for n in MANIFEST.SOURCES] + ["src_c/kernels_avx2.c", "src_c/kernels_avx512.c"]
    assert MANIFEST.macros("x86_64") == ["FA_HAVE_AVX2", "FA_HAVE_AVX512"]
    monkeypatch.setenv(MANIFEST.ONLY_ENV, "")
    assert MANIFEST.macros("x86_64") == [] and "-DFA_HAVE_AVX2" not in MANIFEST.cflags("x86_64")
    monkeypatch.setenv(MANIFEST.ONLY_ENV, "avx2,avx3")
    with pytest.raises(ValueError, match=r"FASTATTN_ISA_KERNELS='avx2,avx3' names no per-ISA kernel: avx3; "
                                         r"it takes a comma-separated list of amx, avx2, avx512, avx512bf16"):
        MANIFEST.steps("x86_64")
    monkeypatch.delenv(MANIFEST.ONLY_ENV)
    assert len(MANIFEST.macros("x86_64")) == len(MANIFEST.ISA_X86_64)


def test_runnable_kernels_read_the_cpu_flags_as_the_dispatch_does(tmp_path):
    """manifest.runnable_kernels (what tools/sanitize.sh builds) from a
    cpuinfo's flags; on this machine it agrees with the kernels dispatch.c
    finds (less AMX, which also needs the OS's leave)."""
    assert set(MANIFEST.RUNS_ON) == {name for name, _, _ in MANIFEST.ISA_X86_64}
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl\n")
    assert MANIFEST.runnable_kernels(str(info)) == ["avx2"]   # no avx512dq: no AVX-512 kernel
    info.write_text("flags\t: sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16\n")
    assert MANIFEST.runnable_kernels(str(info)) == ["avx2", "avx512", "avx512bf16"]
    assert MANIFEST.runnable_kernels(str(tmp_path / "missing")) == ["avx2", "avx512", "avx512bf16", "amx"]
    # tools/sanitize.sh's build: avx2 and the best of the AVX-512 family
    assert MANIFEST.checking_kernels(["avx2", "avx512", "avx512bf16", "amx"]) == ["avx2", "amx"]
    assert MANIFEST.checking_kernels(["avx2", "avx512", "avx512bf16"]) == ["avx2", "avx512bf16"]
    assert MANIFEST.checking_kernels(["avx2", "avx512"]) == ["avx2", "avx512"]
    assert MANIFEST.checking_kernels(["avx2"]) == ["avx2"] and MANIFEST.checking_kernels([]) == []
    if not (platform.machine() == "x86_64" and os.path.exists("/proc/cpuinfo")):
        return
    names = {MANIFEST.kernel_name(f) for f in MANIFEST.RUNS_ON}
    here, found = set(MANIFEST.runnable_kernels()), set(fastattn.available_isas()) & names
    assert found <= here
    if os.environ.get(MANIFEST.ONLY_ENV) is None:   # a build of every kernel
        assert here - {"amx"} <= found


def test_decode_timing_tool_builds_and_times_every_storage_dtype(c_library, tmp_path):
    """tools/decode_timing.c (the kernel A/Bs of docs/tuning.md) links against
    the library and prints a positive median for each storage dtype, causal
    too; a wrong dtype is refused with a usage message; tools/decode_ab.py
    runs two builds in turn and prints both medians and their ratio."""
    if not (REPO / "tools" / "decode_timing.c").is_file():
        pytest.skip("no tools/ in this tree (an sdist holds the library and its tests only)")
    (tmp_path / "a").mkdir()
    exe = _link(c_library, REPO / "tools" / "decode_timing.c", tmp_path / "a" / "decode_timing")
    for dtype in ("f32", "f16", "bf16", "i8"):
        for causal in ("0", "1"):
            r = _run([str(exe), dtype, "1", "4", "2", "2", "130", "40", "2", "3", "2", causal])
            assert float(r.stdout) > 0, r.stdout
    r = subprocess.run([str(exe), "f64", *"1 1 1 1 1 8 1 1 1".split()], capture_output=True, text=True)
    assert r.returncode == 2 and "DTYPE must be f32, f16, bf16 or i8" in r.stderr
    (tmp_path / "b").mkdir()
    shutil.copy(exe, tmp_path / "b" / "decode_timing")
    r = _run([sys.executable, "tools/decode_ab.py", "run", "2", "i8 1 2 1 1 70 24 1 2 1",
              str(tmp_path / "a"), str(tmp_path / "b")])
    lines = r.stdout.splitlines()
    assert lines[0].startswith("i8 1 2 1 1 70 24 1 2 1 (") and "2 rounds" in lines[0]
    assert re.fullmatch(r"  .*/b: median [0-9.]+ ms; over .*/a: median [0-9.]+ \(min [0-9.]+, max [0-9.]+\)",
                        lines[2]), lines


def test_manifest_flags_keep_fma_and_portability():
    flags = [f for _, own in MANIFEST.steps("x86_64") for f in own] + MANIFEST.cflags("x86_64")
    assert "-std=gnu99" in flags and "-std=c99" not in flags   # c99 turns FMA contraction off
    assert not {"-ffast-math", "-march=native"} & set(flags)
