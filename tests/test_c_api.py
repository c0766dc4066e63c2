"""The C API on its own: tests/c/test_capi.c linked against the library that
src_c/manifest.py builds with the system C compiler (no Python headers), run
with every ISA and with FASTATTN_ISA=scalar, and cross-built for arm64 under
qemu; the manifest itself; and a check that fastattn.h compiles on its own,
linked by the manifest's cc-line."""
import os
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


def _cc():
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc or gcc) on PATH")
    return cc


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


@pytest.fixture(scope="module")
def capi_binary(tmp_path_factory):
    return _build_capi(tmp_path_factory.mktemp("capi"), _cc())


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


def test_header_is_self_contained(tmp_path):
    """fastattn.h alone, strict C99: it includes what it needs itself."""
    cc = _cc()
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
    _run([cc, "-std=c99", "-pedantic", "-Wall", "-Werror", f"-I{SRC}", "-c", str(src),
          "-o", str(tmp_path / "uses_header.o")])
    # Then link and run it, to see the two calls answer.
    exe = tmp_path / "uses_header"
    _run(MANIFEST.cc_line(platform.machine(), cc, [str(src)], str(exe)), shell=True)
    r = _run([str(exe)])
    isa = re.search(r"^isa=(\S+)$", r.stdout, re.M)
    assert isa and isa.group(1) in ("amx", "avx512bf16", "avx512", "avx2", "sse2", "neon", "scalar"), r.stdout
    heads = re.search(r"^heads=(.+)$", r.stdout, re.M)
    assert heads and "Hkv" in heads.group(1), r.stdout


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


def test_manifest_flags_keep_fma_and_portability():
    flags = [f for _, own in MANIFEST.steps("x86_64") for f in own] + MANIFEST.cflags("x86_64")
    assert "-std=gnu99" in flags and "-std=c99" not in flags   # c99 turns FMA contraction off
    assert not {"-ffast-math", "-march=native"} & set(flags)
