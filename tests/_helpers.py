"""Helpers every test module shares: `from _helpers import randn, tolerance, bf16`
(pytest's `pythonpath = ["tests"]` puts this folder, not the repository root,
on sys.path)."""
import importlib.util
import pathlib

import numpy as np
import pytest

import fastattn


REPO = pathlib.Path(__file__).resolve().parents[1]


def c_manifest():
    """src_c/manifest.py (the C sources and their flags), loaded by file path."""
    spec = importlib.util.spec_from_file_location("fastattn_c_manifest", REPO / "src_c" / "manifest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The C build command of the READMEs and examples/c/decode.c, verbatim:
# src_c/manifest.py's library and the decode example linked against it.
C_BUILD = "python3 src_c/manifest.py lib --program examples/c/decode.c"


def randn(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# Half an ulp of the 16-bit output dtypes, relative (2^-(mantissa bits + 1)),
# and half their smallest subnormal, below which the relative bound fails.
_HALF_ULP = {"float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 2.0**-134)}


def bf16():
    """ml_dtypes.bfloat16, or skip the calling test when ml_dtypes is missing."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")
    return ml_dtypes.bfloat16


def as_float64(x):
    """int8 storage, (values, scales) or keys' (values, scales, channels), as
    the float64 array it stands for."""
    if isinstance(x, tuple):
        return fastattn.reference.dequantize(*(np.asarray(a) for a in x))
    return np.asarray(x).astype(np.float64)


def read_only(x):
    """x (an array, a tuple of arrays such as an int8 pair, or a dict of
    keyword arguments) with every array in it made read-only, and returned:
    for inputs a test caches and shares between cases, which no call may
    change."""
    for a in (x.values() if isinstance(x, dict) else x if isinstance(x, tuple) else (x,)):
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
    return x


def tolerance(q, k, v, *, want=None, **kw):
    """How far fastattn may be from the float64 reference on these inputs.

    The output has q's dtype. float32: max(2 × the error of textbook float32
    NumPy on the same inputs, 16·2⁻²⁴·max|V|); float64: 1e-12 relative to
    max|V|; float16 and bfloat16: the float32 rule (the kernel computes in
    float32) plus half an ulp of the output dtype at max|out| (2⁻¹¹ and 2⁻⁸
    relative), for the one rounding of the output. k and v may be int8
    (values, scales) pairs; max|V| is then of the dequantized values. int8
    keys with channel factors add the bound of the fold's rounding
    (_fold_error). want: the float64 reference's output on the same inputs
    and options, where the caller has it; otherwise it is computed here.
    """
    v64 = as_float64(v)
    vmax = float(np.max(np.abs(v64))) if v64.size else 0.0
    out_dtype = np.asarray(q).dtype
    if out_dtype == np.float64:
        return 1e-12 * max(vmax, 1.0)
    ref = fastattn.reference.attention(q, k, v, **kw) if want is None else want
    f32 = fastattn.reference.attention(q, k, v, dtype=np.float32, **kw)
    textbook = float(np.max(np.abs(f32 - ref))) if ref.size else 0.0
    tol = max(2 * textbook, 16 * 2.0**-24 * vmax)
    if isinstance(k, tuple) and len(k) == 3:
        tol += 2 * vmax * _fold_error(q, k, kw.get("scale"))
    if out_dtype.name in _HALF_ULP:
        relative, floor = _HALF_ULP[out_dtype.name]
        outmax = float(np.max(np.abs(ref))) if ref.size else 0.0
        tol += max(relative * outmax, floor)
    return tol


def _fold_error(q, k, scale):
    """The largest score error the kernel's fold of int8 keys' channel
    factors into q adds: each term (q_e·c_e·scale)·k8_je·t_j carries one more
    float32 rounding than textbook NumPy's (which rounds k8·t·c once, as it
    rounds every key), so a score moves by at most
    2⁻²⁴·scale·Σ_e |q_e·c_e·k8_je·t_j|. A softmax whose scores all move by at
    most ε moves each output by at most 2ε·max|V| (first order), which
    tolerance() adds. With an outlier channel this term dominates."""
    values, scales, channels = (np.asarray(a, np.float64) for a in k)
    q64 = as_float64(q)
    E = q64.shape[-1]
    s = 1 / np.sqrt(E) if scale is None else scale
    kabs = np.abs(values * scales[..., None])                 # (..., Hkv, S, E)
    G = q64.shape[-3] // kabs.shape[-3] if q64.ndim >= 3 and kabs.ndim >= 3 else 1
    qc = np.abs(q64 * np.repeat(channels, G, axis=-2)[..., None, :]) if kabs.ndim >= 3 else np.abs(q64 * channels)
    terms = qc @ np.swapaxes(np.repeat(kabs, G, axis=-3) if kabs.ndim >= 3 else kabs, -1, -2)
    return 2.0**-24 * abs(s) * float(terms.max()) if terms.size else 0.0


def planned(q, k, v, strategy=None, **kw):
    """What the driver decides for ``fastattn.attention(q, k, v, **kw)``: the
    plan of its one kernel call (layout, rows_per_item, chunk_keys, threads,
    row_blocks, key_chunks, items, serial, key_block, lane_block). Tests ask this instead
    of copying the driver's constants."""
    from fastattn import _api
    plans = _api.plan(q, k, v, strategy, **kw)
    assert len(plans) == 1, f"{len(plans)} kernel calls"
    return plans[0]
