"""The C API on its own: tests/c/test_capi.c built against src_c/ with the
system C compiler (no Python headers), run with every ISA and with
FASTATTN_ISA=scalar; and a check that fastattn.h compiles on its own."""
import os
import pathlib
import platform
import re
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SRC = REPO / "src_c"
CORE = ["attention.c", "check.c", "plan.c", "pool.c", "dispatch.c", "kernels_scalar.c", "kernels_vec128.c"]
# Per-ISA sources: compiled alone, each with its own flags (never -march=native).
AVX = [
    ("kernels_avx2.c", ["-mavx2", "-mfma"]),
    ("kernels_avx512.c", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]),
]
SUMMARY = re.compile(r"C API: (\d+) passed, (\d+) failed")


def _cc():
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc or gcc) on PATH")
    return cc


def _run(cmd, **kw):
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def capi_binary(tmp_path_factory):
    """tests/c/test_capi.c linked against src_c/ only, built once for the module."""
    cc = _cc()
    tmp = tmp_path_factory.mktemp("capi")
    flags = ["-O2", "-std=gnu99", "-fopenmp", f"-I{SRC}"]
    objects = []
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags += ["-DFA_HAVE_AVX2", "-DFA_HAVE_AVX512"]
        for name, isa_flags in AVX:
            obj = tmp / (name[:-2] + ".o")
            _run([cc, *flags, *isa_flags, "-c", str(SRC / name), "-o", str(obj)])
            objects.append(str(obj))
    exe = tmp / "test_capi"
    _run([cc, *flags, str(REPO / "tests" / "c" / "test_capi.c"), *(str(SRC / n) for n in CORE),
          *objects, "-o", str(exe), "-lm"])
    return exe


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
    _run([cc, "-O1", "-std=gnu99", "-fopenmp", f"-I{SRC}", str(src),
          *(str(SRC / n) for n in CORE), "-o", str(exe), "-lm"])
    r = _run([str(exe)])
    isa = re.search(r"^isa=(\S+)$", r.stdout, re.M)
    assert isa and isa.group(1) in ("avx512", "avx2", "sse2", "neon", "scalar"), r.stdout
    heads = re.search(r"^heads=(.+)$", r.stdout, re.M)
    assert heads and "Hkv" in heads.group(1), r.stdout


def test_capi_on_arm64_under_qemu(tmp_path):
    """The same C test cross-compiled for arm64 (NEON and scalar sets) and run
    under qemu-user: the build must run on arm64 too. Skipped unless Debian's
    gcc-aarch64-linux-gnu and qemu-user are installed."""
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if not (cc and qemu):
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    exe = tmp_path / "test_capi_arm64"
    _run([cc, "-O2", "-std=gnu99", "-fopenmp", "-static", f"-I{SRC}", str(REPO / "tests" / "c" / "test_capi.c"),
          *(str(SRC / n) for n in CORE), "-o", str(exe), "-lm"])
    result = _run([qemu, str(exe)])
    assert "neon: checked" in result.stdout, result.stdout
    _check_summary(result)
