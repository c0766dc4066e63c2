"""Shared test set-up: refuse to test an un-built source tree, and helpers
that every test module uses (random inputs, the float32 tolerance rule)."""
import os
import pathlib

import numpy as np
import pytest

import fastattn

_REPO = pathlib.Path(__file__).resolve().parents[1]

# The suite tests the INSTALLED package (pip install ".[test]"), never the
# source folder: a stale or missing in-place build could otherwise hide a
# broken one. FASTATTN_TEST_INPLACE=1 allows a deliberate in-place run.
if (pathlib.Path(fastattn.__file__).resolve().parents[1] == _REPO
        and os.environ.get("FASTATTN_TEST_INPLACE") != "1"):
    raise pytest.UsageError(
        f"fastattn was imported from the source tree ({fastattn.__file__}), not from the "
        "installed build. Install it (pip install '.[test]') and run `pytest`, not `python -m pytest`.")

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


def randn(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def tolerance(q, k, v, **kw):
    """How far fastattn may be from the float64 reference on these inputs.

    float32: max(2 × the error of textbook float32 NumPy on the same inputs,
    16·2⁻²⁴·max|V|); float64: 1e-12 relative to max|V|.
    """
    v = np.asarray(v)
    vmax = float(np.max(np.abs(v))) if v.size else 0.0
    if np.asarray(q).dtype == np.float64:
        return 1e-12 * max(vmax, 1.0)
    ref = fastattn.reference.attention(q, k, v, **kw)
    f32 = fastattn.reference.attention(q, k, v, dtype=np.float32, **kw)
    textbook = float(np.max(np.abs(f32 - ref))) if ref.size else 0.0
    return max(2 * textbook, 16 * 2.0**-24 * vmax)
