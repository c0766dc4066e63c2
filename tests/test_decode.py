"""Decoding shapes and the strategies behind them: row-layout items for a few
query rows (one per head, or a grouped-query group), split-KV chunks merged by
log-sum-exp, and grouped heads read together. Each is compared with the
reference for every ISA, and is bitwise the same for every thread count."""
import functools
import zlib

import numpy as np
import pytest

import fastattn
from _helpers import randn, read_only, tolerance

# (B, Hq, Hkv, L, S, E, Ev): row layout (g·L ≤ few rows), lane layout with
# grouped rows (g·L > few rows), split-KV (few row blocks, S ≥ 1024), tails
# of E and Ev that are not whole vectors, S not a multiple of the 64-key block.
SHAPES = [
    (1, 4, 4, 1, 1500, 64, 64),      # MHA decode, split-KV
    (1, 8, 2, 1, 1100, 33, 17),      # GQA g=4, odd head dims, split-KV
    (2, 8, 1, 1, 700, 16, 24),       # MQA g=8, no split (S < 1024)
    (1, 4, 1, 3, 2100, 40, 40),      # g·L = 12 rows: lanes, grouped, split
    (1, 32, 8, 2, 1030, 8, 8),       # g·L = 8: row layout on AVX-512
    (3, 2, 2, 4, 129, 7, 5),         # short S, rows of a block straddle nothing
    (1, 6, 3, 1, 4097, 32, 32),      # one key past a chunk boundary
    (2, 3, 3, 1, 1093, 128, 128),    # one row, two chunks of 547 keys: one short run of scores
    (4, 8, 8, 1, 4165, 20, 12),      # one row, no split: a run of 64 blocks' scores (FA_ROW_SUPER), a short last run
    (1, 16, 2, 1, 1300, 48, 96),     # g = 8: P·V in whole passes of 2 vectors (amx set) or 4 and a short one
]
OPTIONS = [
    {},
    {"causal": True},
    {"window": (300, 0)},
    {"kv_lengths": "random"},
    {"kv_lengths": "random", "causal": True},
    {"mask": "bool"},
    {"mask": "additive"},
]


def _inputs(rng, shape, dtype):
    B, Hq, Hkv, L, S, E, Ev = shape
    return randn(rng, (B, Hq, L, E), dtype), randn(rng, (B, Hkv, S, E), dtype), randn(rng, (B, Hkv, S, Ev), dtype)


def _options(rng, opts, shape):
    B, Hq, _, L, S, _, _ = shape
    kw = dict(opts)
    if kw.get("kv_lengths") == "random":
        kw["kv_lengths"] = rng.integers(0, S + 1, size=B)
        kw["kv_lengths"][0] = S  # one full entry, the others anywhere (0 too)
    if kw.get("mask") == "bool":
        kw["mask"] = rng.random((B, Hq, L, S)) > 0.2
    elif kw.get("mask") == "additive":
        kw["mask"] = np.where(rng.random((B, 1, L, S)) > 0.2, rng.standard_normal((B, 1, L, S)), -np.inf)
    return kw


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_matches_reference(isa, shape, opts, dtype):
    q, k, v, kw, ref, ref_lse, tol = _decode_case(shape, OPTIONS.index(opts), dtype)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == dtype and out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol)
    hidden = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), hidden), "rows with no visible key: lse -inf exactly there"
    assert np.all(out[hidden] == 0)
    np.testing.assert_allclose(lse[~hidden], ref_lse[~hidden], rtol=1e-5 if dtype == np.float32 else 1e-12,
                               atol=1e-5 if dtype == np.float32 else 1e-12)


@functools.lru_cache(maxsize=None)
def _decode_case(shape, i, dtype):
    """Inputs (read-only), reference (output and lse) and tolerance of one
    case of test_decode_matches_reference, with OPTIONS[i], computed once
    for every ISA."""
    rng = np.random.default_rng(zlib.crc32(repr((shape, str(OPTIONS[i]))).encode()))
    q, k, v = _inputs(rng, shape, dtype)
    kw = _options(rng, OPTIONS[i], shape)
    q, k, v, kw = (read_only(x) for x in (q, k, v, kw))
    ref, ref_lse = fastattn.reference.attention(q, k, v, return_lse=True, **kw)
    return q, k, v, kw, ref, ref_lse, tolerance(q, k, v, want=ref, **kw)


@pytest.mark.parametrize("E", [4, 8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_row_at_head_dims_of_whole_vectors(isa, E, dtype):
    """One row a head: where E is 4, 8 or 16 vectors of the ISA's width
    (float32 / float64 lanes: SSE2/NEON 4 / 2, AVX2 8 / 4, AVX-512 16 / 8),
    its scores run a copy with E a constant (kernel_rows.h, FA_ROW_RUN);
    other E the general loop (the scalar set takes the lane layout for one
    row). S = 1299: a ragged last block, keys not a multiple of 4."""
    rng = np.random.default_rng(E)
    shape = (2, 3, 3, 1, 1299, E, E)
    q, k, v = _inputs(rng, shape, dtype)
    for opts in ({}, {"kv_lengths": "random", "causal": True}):
        kw = _options(rng, opts, shape)
        out = fastattn.attention(q, k, v, **kw)
        ref = fastattn.reference.attention(q, k, v, **kw)
        np.testing.assert_allclose(out, ref, rtol=0, atol=tolerance(q, k, v, want=ref, **kw))


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[3], SHAPES[6]], ids=lambda s: "x".join(map(str, s)))
def test_split_kv_bitwise_for_every_thread_count(shape):
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, shape, np.float32)
    kw = {"kv_lengths": np.full(shape[0], shape[4] - 5), "causal": True}
    first, first_lse = fastattn.attention(q, k, v, num_threads=1, return_lse=True, **kw)
    for n in (2, 3, 8, 64):
        out, lse = fastattn.attention(q, k, v, num_threads=n, return_lse=True, **kw)
        assert np.array_equal(out, first) and np.array_equal(lse, first_lse), n


def test_nan_in_one_chunk_makes_only_its_row_nan():
    # Split-KV: the NaN sits in one key chunk; the merge must not hide it.
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, (1, 4, 4, 1, 3000, 32, 32), np.float32)
    k[0, 2, 2500, 0] = np.nan  # head 2 only
    out = fastattn.attention(q, k, v)
    assert np.isnan(out[0, 2]).all()
    assert np.isfinite(out[0, [0, 1, 3]]).all()


def test_grouped_heads_equal_repeated_heads():
    # Reading a K/V head once for its g query heads gives what repeating it does.
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, (2, 12, 3, 5, 300, 24, 24), np.float64)
    grouped = fastattn.attention(q, k, v, causal=True)
    repeated = fastattn.attention(q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1), causal=True)
    np.testing.assert_allclose(grouped, repeated, rtol=0, atol=1e-13)
