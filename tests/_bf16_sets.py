"""What tests/test_amx.py and tests/test_dpbf16.py share: the sets whose
bfloat16 entry computes its products on bfloat16 hardware (the amx set's
tiles, the avx512bf16 set's VDPBF16PS) are checked on the same cases, with
bfloat16 q, k, v and out: every option set the lane layout has, against the
float64 reference."""
import zlib

import numpy as np
import pytest

import fastattn
from fastattn import reference

from _helpers import bf16, tolerance

BF16, F32, F64 = np.dtype(bf16()), np.dtype(np.float32), np.dtype(np.float64)

OPTIONS = {
    "plain": {},
    "causal_kvlen": dict(causal=True, kv_lengths=True),
    "top_left_window_bool_mask": dict(causal="top_left", window=(40, 3), mask="bool"),
    "additive_mask": dict(mask="add"),
    "modifiers": dict(softcap=5.0, sinks=True, alibi=True, causal=True),
    "positions": dict(causal=True, positions=True, window=(64, 0)),
}


# For the tests that compare a set's bits with avx512's: tools/sanitize.sh
# builds only the best AVX-512 set, so avx512 itself may be missing.
needs_avx512 = pytest.mark.skipif("avx512" not in fastattn.available_isas(),
                                  reason="built without the avx512 set to compare with (tools/sanitize.sh)")


def seeded(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def with_isa(isa, fn):
    fastattn.set_isa(isa)
    try:
        return fn()
    finally:
        fastattn.set_isa(None)


def case(shape, opt):
    """q, k, v in bfloat16 of shape (B, Hq, Hkv, L, S, E, Ev) and the keyword
    arguments of OPTIONS[opt], drawn from a seed of both."""
    B, Hq, Hkv, L, S, E, Ev = shape
    rng = seeded(shape, opt)
    q = rng.standard_normal((B, Hq, L, E)).astype(BF16)
    k = rng.standard_normal((B, Hkv, S, E)).astype(BF16)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(BF16)
    kw = dict(OPTIONS[opt])
    if kw.pop("kv_lengths", False):
        kw["kv_lengths"] = rng.integers(S // 2, S + 1, size=B)
    mask = kw.pop("mask", None)
    if mask == "bool":
        kw["mask"] = rng.random((B, 1, L, S)) < 0.8
    elif mask == "add":  # finfo.min hides, as transformers' padding masks do
        add = rng.standard_normal((B, Hq, L, S)).astype(F32)
        add[rng.random(add.shape) < 0.2] = np.finfo(F32).min
        kw["mask"] = add
    if kw.pop("sinks", False):
        kw["sinks"] = rng.standard_normal(Hq)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = 2.0 ** -rng.integers(1, 8, size=Hq).astype(F64)
    if kw.pop("positions", False):
        kw["q_start"] = rng.integers(S - L, S + 5, size=B)
        kw["k_start"] = rng.integers(0, 7, size=B)
    return q, k, v, kw


def check(got, q, k, v, **kw):
    want = reference.attention(q.astype(F64), k.astype(F64), v.astype(F64), **kw)
    tol = tolerance(q, k, v, want=want, **kw)
    assert got.dtype == BF16
    err = float(np.max(np.abs(got.astype(F64) - want)))
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"
