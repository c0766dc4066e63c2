"""Shared test set-up: refuse to test an un-built source tree or a stale build,
report the build in the header, and the `isa` fixture. Helpers live in _helpers.py."""
import os
import pathlib

import pytest

import fastattn
from _helpers import c_manifest

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


def _fixture_isas():
    """Every micro-kernel set this CPU supports, less those FASTATTN_TEST_SKIP_ISAS
    names (comma-separated): tools/sanitize.sh skips amx and avx512bf16, whose
    entries but one are avx512's code again (tests/test_amx.py and
    tests/test_dpbf16.py still run that one there)."""
    skip = set(os.environ.get("FASTATTN_TEST_SKIP_ISAS", "").split(","))
    return [name for name in fastattn.available_isas() if name not in skip]


@pytest.fixture(params=_fixture_isas())
def isa(request):
    """Runs a test once per micro-kernel set this CPU supports, then restores auto."""
    fastattn.set_isa(request.param)
    yield request.param
    fastattn.set_isa(None)
