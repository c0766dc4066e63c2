"""The driver's strategy as a knob (src_c/plan.c): every way of cutting a call
into work items gives the reference's answer, and the same bits wherever the
math of a row is the same. Strategies are forced through the private hook
fastattn._api.attention_with and read back through fastattn._api.plan.

What keeps the bits, and why:
- the thread count, always (items and chunks come from the shape);
- the rows per item within one layout when no causal or window range cuts
  the keys (each row's sums run over the same key blocks in the same order).
What may change them, within tolerance: the layout (a score is a sum of E
products in another order), key chunks (merged by log-sum-exp), and rows per
item under causal/window (an item's first key block starts where its rows'
ranges start).
"""
import itertools
import zlib

import numpy as np
import pytest

import fastattn
from fastattn import _api, reference

from _helpers import as_float64, bf16, planned, tolerance

f32, f64 = np.float32, np.float64

# (B, Hq, Hkv, L, S, E, Ev): off every block size; GQA; decode-like and prefill-like.
SHAPES = [
    (1, 2, 2, 37, 150, 24, 40),
    (2, 4, 2, 9, 260, 33, 17),
    (1, 8, 1, 1, 700, 64, 64),
    (1, 3, 3, 70, 65, 80, 8),
]
OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "top_left_window": dict(causal="top_left", window=(20, 3)),
    "mask_kv_lengths_lse": dict(mask="bool", kv_lengths=True, return_lse=True),
}


def _case(shape, dtype, opt):
    B, Hq, Hkv, L, S, E, Ev = shape
    rng = np.random.default_rng(zlib.crc32(repr((shape, opt)).encode()))
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)
    kw = dict(OPTIONS[opt])
    if kw.get("mask") == "bool":
        kw["mask"] = rng.random((B, 1, L, S)) < 0.8
    if kw.get("kv_lengths"):
        kw["kv_lengths"] = rng.integers(S // 3, S + 1, size=B)
    return q, k, v, kw


def _most_rows(layout, dtype):
    """The most rows an item of that layout holds in the ISA in use (asked of the driver)."""
    q = np.zeros((1, 1, 256, 8), dtype)
    return planned(q, q, q, {"layout": layout})["rows_per_item"]


def _strategies(shape, dtype):
    """Layouts × rows per item × key chunks, each a dict for attention_with."""
    B, Hq, Hkv, L, S, E, Ev = shape
    for layout in ("lanes", "rows"):
        for rows, chunk in itertools.product(sorted({1, 3, _most_rows(layout, dtype)}), (0, 64, 100, S // 2 + 1)):
            yield {"layout": layout, "rows_per_item": rows, "chunk_keys": chunk}


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


@pytest.mark.parametrize("opt", OPTIONS)
@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_strategy_gives_the_reference(isa, shape, dtype, opt):
    q, k, v, kw = _case(shape, dtype, opt)
    want = reference.attention(q, k, v, **kw)
    want_out = want[0] if isinstance(want, tuple) else want
    tol = tolerance(q, k, v, **{n: x for n, x in kw.items() if n != "return_lse"})
    structural = "causal" in kw or "window" in kw
    by_layout = {}
    for strategy in _strategies(shape, dtype):
        got = _api.attention_with(q, k, v, dict(strategy, threads=1), **kw)
        out = got[0] if isinstance(got, tuple) else got
        err = float(np.max(np.abs(out.astype(f64) - want_out)))
        assert err <= tol, f"{strategy}: max error {err:.3g} > tolerance {tol:.3g}"
        if isinstance(got, tuple):
            assert np.allclose(got[1], want[1], rtol=1e-5, atol=1e-5, equal_nan=True), strategy
        for threads in (2, 5):  # the thread count never changes a bit
            again = _api.attention_with(q, k, v, dict(strategy, threads=threads), **kw)
            assert _same(again if not isinstance(again, tuple) else again[0], out), (strategy, threads)
        # Same layout and key chunks, other rows per item: same bits unless a
        # causal or window range decides where an item's key blocks start.
        key = (strategy["layout"], strategy.get("chunk_keys", 0))
        if not structural and key in by_layout:
            assert _same(out, by_layout[key]), f"rows per item changed bits: {strategy}"
        by_layout.setdefault(key, out)


def test_plan_answers_what_was_forced():
    q, k, v, kw = _case(SHAPES[1], f32, "plain")
    p = planned(q, k, v, {"layout": "rows", "rows_per_item": 3, "chunk_keys": 64, "threads": 2})
    B, Hq, Hkv, L, S, E, Ev = SHAPES[1]
    assert p["layout"] == "rows" and p["rows_per_item"] == 3 and p["threads"] == 2
    assert p["chunk_keys"] == 64 and p["key_chunks"] == -(-S // 64)
    # g·L = 18 rows per key/value head, in items of 3 rows: 6 per head
    assert p["row_blocks"] == B * Hkv * 6 and p["items"] == p["row_blocks"] * p["key_chunks"]


def test_plan_of_the_default_call():
    """Decoding picks the row layout where the kernel has one (not scalar),
    split keys over few row blocks; a prefill picks lanes, no split."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 8, 1, 64)).astype(f32), rng.standard_normal((1, 8, 4096, 64)).astype(f32)
    dec = planned(q, k, k)
    assert dec["layout"] == ("lanes" if fastattn.info()["isa"] == "scalar" else "rows")
    assert dec["key_chunks"] > 1 and dec["row_blocks"] == 8 and not dec["serial"]
    q = rng.standard_normal((1, 8, 512, 64)).astype(f32)
    pre = planned(q, k[:, :, :512], k[:, :, :512])
    assert pre["layout"] == "lanes" and pre["key_chunks"] == 1 and pre["chunk_keys"] == 512
    tiny = planned(q[:, :1, :4], k[:, :1, :4], k[:, :1, :4])
    assert tiny["serial"] and tiny["threads"] == 1


@pytest.mark.parametrize("strategy, what", [
    ({"layout": "rows", "rows_per_item": 9}, "rows per item above the row layout's 8"),
    ({"rows_per_item": -1}, "negative rows"),
    ({"chunk_keys": 1}, "over 256 chunks"),
    ({"threads": -2}, "negative threads"),
])
def test_forced_strategy_out_of_range_is_refused(strategy, what):
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((1, 2, 16, 8)).astype(f32), rng.standard_normal((1, 2, 300, 8)).astype(f32)
    out = np.full((1, 2, 16, 8), 7, f32)
    with pytest.raises(ValueError, match="forced strategy"):
        _api.attention_with(q, k, k, strategy, out=out)
    assert (out == 7).all(), f"{what}: out was written"


# --------------------------------------------------------------------------
# Items of several sub-blocks
# --------------------------------------------------------------------------
# A lane-layout item holds up to a few blocks of the kernel's rows which
# take each key block in turn (kernel_lanes.h, FA_SUBS): converting storage
# (16-bit, int8) converts the block once for all of them, and every storage
# reads it once from memory. Each block must compute exactly what an item of
# its rows alone computes, whatever cuts its keys (causal, windows that start
# each block elsewhere, rows that see no key, split-KV parts).

SUB_OPTIONS = {
    "plain": {},
    "causal_L>S": dict(causal=True),             # the first rows see no key
    "window": dict(causal="top_left", window=(45, 7)),  # blocks start off each other's grid
    "mask_kv_lengths": dict(mask="bool", kv_lengths=True),
}


def _stored(x, kind):
    if kind == "int8":
        from fastattn.cache import quantize_int8
        return quantize_int8(x)
    return x.astype(bf16() if kind == "bfloat16" else np.dtype(kind))


@pytest.mark.parametrize("opt", SUB_OPTIONS)
@pytest.mark.parametrize("kind", ["float32", "float64", "float16", "bfloat16", "int8"])
def test_sub_blocks_compute_what_items_of_their_rows_do(isa, kind, opt):
    B, Hq, Hkv, L, S, E, Ev = 2, 4, 2, 150, 133, 40, 24  # 300 rows per K/V head; L > S
    rng = np.random.default_rng(zlib.crc32(repr(("sub", kind, opt)).encode()))
    q = rng.standard_normal((B, Hq, L, E)).astype(f64 if kind == "float64" else f32)
    k, v = _stored(rng.standard_normal((B, Hkv, S, E)), kind), _stored(rng.standard_normal((B, Hkv, S, Ev)), kind)
    kw = dict(SUB_OPTIONS[opt])
    if kw.get("mask") == "bool":
        kw["mask"] = rng.random((B, 1, L, S)) < 0.8
    if kw.get("kv_lengths"):
        kw["kv_lengths"] = np.array([S, S // 2])
    plan = planned(q, k, v, {"layout": "lanes"}, **kw)
    block, most = plan["lane_block"], plan["rows_per_item"]  # one sub-block's rows; an item's
    assert most % block == 0 and most >= block
    if isa in ("avx2", "sse2", "neon", "scalar"):  # blocks of under 64 rows: items hold several
        assert most > block
    want = reference.attention(as_float64(q), as_float64(k), as_float64(v), **kw)
    tol = tolerance(q, k, v, **kw)
    for chunk in (0, 64):
        alone = _api.attention_with(q, k, v, {"layout": "lanes", "rows_per_item": block, "chunk_keys": chunk}, **kw)
        assert float(np.max(np.abs(alone - want))) <= tol
        for rows in range(2 * block, most + 1, block):  # L ≥ rows: items stay in one head, as blocks do
            strategy = {"layout": "lanes", "rows_per_item": rows, "chunk_keys": chunk}
            got = _api.attention_with(q, k, v, dict(strategy, threads=1), **kw)
            assert _same(got, alone), f"{strategy}: sub-blocks changed bits"
            assert _same(_api.attention_with(q, k, v, dict(strategy, threads=3), **kw), got), strategy
        # rows that are not a whole number of blocks: other cuts, same answer within tolerance
        odd = _api.attention_with(q, k, v, {"layout": "lanes", "rows_per_item": most - 3, "chunk_keys": chunk}, **kw)
        assert float(np.max(np.abs(odd - want))) <= tol


@pytest.mark.parametrize("dtype", [f32, f64])
def test_split_kv_merge_of_rows_wider_than_one_merge_run(isa, dtype):
    """Ev over the 256 output elements the split-KV merge takes at a time
    (FA_MERGE_RUN in src_c/attention.c): each run of a row is merged from its
    own columns of every chunk's part."""
    rng = np.random.default_rng(zlib.crc32(b"merge runs"))
    q = rng.standard_normal((1, 2, 1, 16)).astype(dtype)
    k = rng.standard_normal((1, 2, 300, 16)).astype(dtype)
    v = rng.standard_normal((1, 2, 300, 600)).astype(dtype)
    strategy = {"chunk_keys": 64, "threads": 2}
    assert planned(q, k, v, strategy)["key_chunks"] == 5
    want = reference.attention(q, k, v)
    got = _api.attention_with(q, k, v, strategy)
    err = float(np.max(np.abs(got.astype(f64) - want)))
    assert err <= tolerance(q, k, v, want=want), f"max error {err:.3g}"
