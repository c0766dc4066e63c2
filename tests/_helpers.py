"""Helpers every test module shares: `from _helpers import randn, tolerance`
(pytest's `pythonpath = ["tests"]` puts this folder, not the repository root,
on sys.path)."""
import importlib.util
import pathlib

import numpy as np

import fastattn


REPO = pathlib.Path(__file__).resolve().parents[1]


def c_manifest():
    """src_c/manifest.py (the C sources and their flags), loaded by file path."""
    spec = importlib.util.spec_from_file_location("fastattn_c_manifest", REPO / "src_c" / "manifest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def planned(q, k, v, strategy=None, **kw):
    """What the driver decides for ``fastattn.attention(q, k, v, **kw)``: the
    plan of its one kernel call (layout, rows_per_item, chunk_keys, threads,
    row_blocks, key_chunks, items, serial, key_block). Tests ask this instead
    of copying the driver's constants."""
    from fastattn import _api
    plans = _api.plan(q, k, v, strategy, **kw)
    assert len(plans) == 1, f"{len(plans)} kernel calls"
    return plans[0]
