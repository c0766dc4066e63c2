"""Shared test set-up: refuse to test an un-built source tree or a stale build,
report the build in the header, the `isa` fixture and the session's C library
(`c_library`). Helpers live in _helpers.py."""
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

import fastattn
from _helpers import C_BUILD, c_manifest

_REPO = pathlib.Path(__file__).resolve().parents[1]

# The suite tests the INSTALLED package (pip install ".[test]"), never the
# source folder: a stale or missing in-place build could otherwise hide a
# broken one. FASTATTN_TEST_INPLACE=1 allows a deliberate in-place run.
if (pathlib.Path(fastattn.__file__).resolve().parents[1] == _REPO
        and os.environ.get("FASTATTN_TEST_INPLACE") != "1"):
    raise pytest.UsageError(
        f"fastattn was imported from the source tree ({fastattn.__file__}), not from the "
        "installed build. Install it (pip install '.[test]') and run `pytest`, not `python -m pytest`.")

# ... and never a build of other sources. pip keeps the wheel it built from a
# folder whose path holds a '-' in its cache and installs that again, unchanged,
# the next time: the suite would pass against the previous sources.
if os.environ.get("FASTATTN_TEST_INPLACE") != "1":
    _built, _here = fastattn._kernel.source_digest(), c_manifest().source_digest(str(_REPO))
    if _built != _here:
        raise pytest.UsageError(
            f"the installed fastattn ({pathlib.Path(fastattn.__file__).parent}) was built from other "
            f"sources than this checkout (source digest {_built}, checkout {_here}): a stale build, "
            "perhaps a wheel pip cached for this folder. Rebuild it: "
            "pip install --no-cache-dir '.[test]'")

REPO = _REPO


def pytest_report_header(config):
    i = fastattn.info()
    return (f"fastattn {i['version']} from {pathlib.Path(fastattn.__file__).parent}; "
            f"isa {i['isa']} (available {', '.join(i['isas'])}); openmp {i['openmp']}, "
            f"max_threads {i['max_threads']}")


@pytest.fixture(params=fastattn.available_isas())
def isa(request):
    """Runs a test once per micro-kernel set this CPU supports, then restores auto."""
    fastattn.set_isa(request.param)
    yield request.param
    fastattn.set_isa(None)


def _isa_objects_of_the_build():
    """["--isa-objects", DIR] where FASTATTN_TEST_ISA_OBJECTS=build asks for
    them, else []. .ci/run sets it: in its fresh clone, pip has just built the
    installed extension in the tree, and its kernels' objects (build/temp.*/
    src_c/kernels_*.o, compiled by setup.py from src_c/manifest.py's steps with
    the same compiler, flags and macros as the library build) are archived as
    they are instead of compiled a second time, which took about 100 s of both
    cores of CI's main stage (stop 29). The other sources are still compiled
    by the READMEs' command. Each object must be newer than every source
    file, or the run stops."""
    if os.environ.get("FASTATTN_TEST_ISA_OBJECTS", "") != "build":
        return []
    found = sorted({p.parent for p in REPO.glob("build/temp.*/src_c/kernels_*.o")})
    if len(found) != 1:
        raise pytest.UsageError(f"FASTATTN_TEST_ISA_OBJECTS=build: needs one folder of kernel "
                                f"objects under {REPO / 'build'}, found {[str(d) for d in found] or 'none'}")
    newest_source = max(f.stat().st_mtime for f in (REPO / "src_c").iterdir() if f.suffix in (".c", ".h"))
    stale = [o.name for o in found[0].glob("kernels_*.o") if o.stat().st_mtime < newest_source]
    if stale:
        raise pytest.UsageError(f"FASTATTN_TEST_ISA_OBJECTS=build: {stale} in {found[0]} are older than "
                                "a source in src_c: a stale build")
    return ["--isa-objects", str(found[0])]


@pytest.fixture(scope="session")
def c_library(tmp_path_factory):
    """The folder holding libfastattn.a and examples/c/decode.c's program, built
    once for the session by the READMEs' command (C_BUILD) with the system
    compiler: tests/test_examples.py runs the program, tests/test_c_api.py
    links its own programs against the library. One build, not one per test
    file: each takes a minute of both cores on the CI machines."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler `cc` on PATH")
    out = tmp_path_factory.mktemp("c_library")
    cmd = [sys.executable, *shlex.split(C_BUILD)[1:], "--out", str(out), *_isa_objects_of_the_build()]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{shlex.join(cmd)} failed:\n{r.stdout}\n{r.stderr}"
    (out / "build.log").write_text(r.stdout)   # each command it ran, one a line
    return out
