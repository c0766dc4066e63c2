"""64 threads on however many cores there are (issue 12, part 4): every shape
gives the bits of one thread, prefill and decoding, split-KV or not, with
64 items or more so that the 64 threads really take part (the plan caps the
threads at the items; docs/threading.md derives the counts). On a 2-core
machine 64 threads mostly wait for a core, and each takes items in whatever
order the scheduler lets it: that order must not reach the bits."""
import zlib

import numpy as np
import pytest

import fastattn
from fastattn import _api

from _helpers import planned

f32, f64, f16 = np.float32, np.float64, np.float16

# name: (B, Hq, Hkv, L, S, E, Ev, dtype, call kwargs, forced strategy or None)
CASES = {
    "prefill": (2, 8, 8, 333, 257, 40, 24, f32, {}, None),
    "prefill_causal_gqa": (1, 16, 4, 517, 517, 64, 64, f32, dict(causal=True), None),
    "prefill_window_mask_f64": (4, 4, 2, 301, 290, 33, 17, f64, dict(window=(50, 7), mask=True), None),
    "prefill_split_kv": (1, 4, 2, 70, 3000, 64, 48, f32, dict(causal="top_left"), {"chunk_keys": 250}),
    "prefill_long_folds": (2, 8, 8, 200, 9000, 16, 16, f32, dict(kv_lengths=[7777, 9000]), None),
    "prefill_float16": (1, 16, 4, 300, 300, 64, 64, f16, dict(causal=True), None),
    "decode_split_kv": (1, 4, 4, 1, 20000, 64, 64, f32, {}, {"chunk_keys": 320}),
    "decode_split_kv_auto": (2, 8, 2, 1, 5000, 128, 128, f32, {}, None),
    "decode_gqa_lanes_split": (1, 32, 8, 4, 4100, 64, 64, f32, dict(causal=True), {"chunk_keys": 576}),
    "decode_many_heads_lse": (4, 32, 32, 1, 700, 64, 64, f32, dict(kv_lengths=[700, 1, 350, 0]), None),
}


def _inputs(name):
    B, Hq, Hkv, L, S, E, Ev, dtype, kw, force = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)
    kw = dict(kw)
    if kw.get("mask") is True:
        kw["mask"] = rng.random((B, 1, L, S)) < 0.7
    return q, k, v, kw, force


def _run(q, k, v, kw, force, threads):
    if force is None:
        return fastattn.attention(q, k, v, num_threads=threads, return_lse=True, **kw)
    return _api.attention_with(q, k, v, dict(force, threads=threads), return_lse=True, **kw)


@pytest.mark.parametrize("name", CASES)
def test_64_threads_give_the_bits_of_one(isa, name):
    q, k, v, kw, force = _inputs(name)
    plan = planned(q, k, v, dict(force or {}, threads=64), **kw)
    assert not plan["serial"]
    assert plan["threads"] == min(64, plan["items"]), plan
    if name != "decode_split_kv_auto":  # (that plan has fewer items: the last test)
        assert plan["items"] >= 64 and plan["threads"] == 64, plan  # every thread has an item to take
    if "split" in name:
        assert plan["key_chunks"] > 1, plan
    one, one_lse = _run(q, k, v, kw, force, 1)
    assert np.isfinite(one).all()
    for _ in range(3):  # different interleavings each time
        out, lse = _run(q, k, v, kw, force, 64)
        assert out.dtype == one.dtype and np.array_equal(out, one), "output bits differ from one thread"
        assert np.array_equal(lse, one_lse, equal_nan=True), "lse bits differ from one thread"


def test_automatic_decode_plan_caps_threads_at_its_items():
    """A decode call planned automatically has at most FA_SPLIT_ITEMS-ish items
    (docs/threading.md): 64 requested threads become that many, never more."""
    q, k, v, kw, _ = _inputs("decode_split_kv_auto")
    plan = planned(q, k, v, num_threads=64, **kw)
    assert plan["key_chunks"] > 1 and plan["threads"] == plan["items"] < 64, plan
