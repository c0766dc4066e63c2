"""The inference layer: KVCache (in-place appends, lengths, attention over
the filled part, capacity errors), merge_attention (splitting the keys
anywhere and merging equals one call) and MultiHeadAttention (against a plain
NumPy layer; cached decoding equals the full causal call)."""
import numpy as np
import pytest

import fastattn
from _helpers import randn, tolerance


def _close(got, want, atol):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert err <= atol, f"max error {err:.3g} > {atol:.3g}"


def _same_lse(got, want, atol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    # -inf rows must agree exactly; finite rows within atol.
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    _close(got[fin], want[fin], atol)


# --------------------------------------------------------------------------
# KVCache
# --------------------------------------------------------------------------


def test_cache_append_fills_in_place_and_views_the_filled_part():
    rng = np.random.default_rng(0)
    cache = fastattn.KVCache(2, 3, 10, 4, head_dim_v=5)
    assert cache.keys.shape == (2, 3, 0, 4) and cache.values.shape == (2, 3, 0, 5)
    k1, v1 = randn(rng, (2, 3, 4, 4)), randn(rng, (2, 3, 4, 5))
    k2, v2 = randn(rng, (2, 3, 2, 4)), randn(rng, (2, 3, 2, 5))
    buffer = cache.key_buffer
    cache.append(k1, v1)
    cache.append(k2, v2)
    np.testing.assert_array_equal(cache.lengths, [6, 6])
    assert cache.lengths.dtype == np.int64
    np.testing.assert_array_equal(cache.keys, np.concatenate([k1, k2], axis=2))
    np.testing.assert_array_equal(cache.values, np.concatenate([v1, v2], axis=2))
    # In place: a view taken before the appends sees them.
    np.testing.assert_array_equal(buffer[:, :, :6], cache.keys)
    assert np.shares_memory(cache.keys, buffer)
    assert cache.key_buffer.shape == (2, 3, 10, 4)
    assert cache.nbytes == 2 * 3 * 10 * (4 + 5) * 4


def test_cache_views_and_lengths_are_read_only():
    cache = fastattn.KVCache(1, 1, 4, 2)
    cache.append(np.ones((1, 1, 2, 2), np.float32), np.ones((1, 1, 2, 2), np.float32))
    for view in (cache.keys, cache.values, cache.key_buffer, cache.value_buffer, cache.lengths):
        with pytest.raises(ValueError, match="read-only"):
            view[...] = 0
    np.testing.assert_array_equal(cache.lengths, [2])


def test_cache_append_accepts_transposed_views():
    """(B, n, Hkv, E) projections transposed to (B, Hkv, n, E): the layer's layout."""
    rng = np.random.default_rng(1)
    cache = fastattn.KVCache(2, 4, 8, 6, dtype=np.float64)
    k = randn(rng, (2, 3, 4, 6), np.float64).swapaxes(1, 2)
    v = randn(rng, (2, 3, 4, 6), np.float64).swapaxes(1, 2)
    assert not k.flags.c_contiguous
    cache.append(k, v)
    np.testing.assert_array_equal(cache.keys, k)
    np.testing.assert_array_equal(cache.values, v)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_cache_attend_matches_reference_over_filled_keys(dtype, causal):
    rng = np.random.default_rng(2)
    B, Hq, Hkv, cap, E = 2, 8, 2, 200, 16
    cache = fastattn.KVCache(B, Hkv, cap, E, dtype=dtype)
    k, v = randn(rng, (B, Hkv, 77, E), dtype), randn(rng, (B, Hkv, 77, E), dtype)
    cache.append(k, v)
    q = randn(rng, (B, Hq, 3, E), dtype)
    out, lse = cache.attend(q, causal=causal, return_lse=True)
    ref, ref_lse = fastattn.reference.attention(q, k, v, causal=causal, return_lse=True)
    tol = tolerance(q, k, v, causal=causal)
    _close(out, ref, tol)
    _same_lse(lse, ref_lse, 1e-5 if dtype == np.float32 else 1e-12)


def test_cache_attend_never_reads_past_the_lengths():
    """NaN left behind by a reset never reaches the output: kv_lengths hides it."""
    rng = np.random.default_rng(3)
    cache = fastattn.KVCache(2, 2, 300, 8)
    poison = np.full((2, 2, 300, 8), np.nan, np.float32)
    cache.append(poison, poison)
    cache.reset()
    np.testing.assert_array_equal(cache.lengths, [0, 0])
    k, v = randn(rng, (2, 2, 130, 8)), randn(rng, (2, 2, 130, 8))
    cache.append(k, v)
    q = randn(rng, (2, 4, 1, 8))
    out = cache.attend(q)
    assert np.isfinite(out).all()
    _close(out, fastattn.reference.attention(q, k, v, causal=True), tolerance(q, k, v, causal=True))


def test_cache_per_entry_lengths():
    rng = np.random.default_rng(4)
    cache = fastattn.KVCache(3, 2, 12, 4, dtype=np.float64)
    k1, v1 = randn(rng, (3, 2, 5, 4), np.float64), randn(rng, (3, 2, 5, 4), np.float64)
    cache.append(k1, v1, lengths=[5, 2, 0])
    k2, v2 = randn(rng, (3, 2, 3, 4), np.float64), randn(rng, (3, 2, 3, 4), np.float64)
    cache.append(k2, v2, lengths=[1, 3, 3])
    np.testing.assert_array_equal(cache.lengths, [6, 5, 3])
    assert cache.keys.shape == (3, 2, 6, 4)
    # Entry by entry, the valid rows of each append follow one another.
    np.testing.assert_array_equal(cache.keys[0], np.concatenate([k1[0], k2[0, :, :1]], axis=1))
    np.testing.assert_array_equal(cache.keys[1, :, :5], np.concatenate([k1[1, :, :2], k2[1]], axis=1))
    np.testing.assert_array_equal(cache.values[2, :, :3], v2[2])
    # Attention over the ragged cache equals per-entry attention over its own keys.
    q = randn(rng, (3, 4, 1, 4), np.float64)
    out = cache.attend(q)
    for b, n in enumerate(cache.lengths):
        ref = fastattn.reference.attention(q[b], cache.keys[b, :, :n], cache.values[b, :, :n], causal=True)
        _close(out[b], ref, 1e-12)


def test_cache_truncate_rolls_back_to_an_earlier_state():
    """Appending draft tokens, truncating them away and appending others equals
    never having drafted (speculative decoding's rollback)."""
    rng = np.random.default_rng(14)
    k1, v1 = randn(rng, (2, 2, 9, 4), np.float64), randn(rng, (2, 2, 9, 4), np.float64)
    draft = randn(rng, (2, 2, 3, 4), np.float64)
    k2, v2 = randn(rng, (2, 2, 2, 4), np.float64), randn(rng, (2, 2, 2, 4), np.float64)
    rolled, plain = fastattn.KVCache(2, 2, 16, 4, dtype=np.float64), fastattn.KVCache(2, 2, 16, 4, dtype=np.float64)
    rolled.append(k1, v1)
    rolled.append(draft, draft)
    rolled.truncate([10, 9])  # entry 0 keeps one draft token, entry 1 none
    np.testing.assert_array_equal(rolled.lengths, [10, 9])
    rolled.truncate(9)        # a scalar broadcasts
    rolled.append(k2, v2)
    plain.append(k1, v1)
    plain.append(k2, v2)
    np.testing.assert_array_equal(rolled.lengths, plain.lengths)
    np.testing.assert_array_equal(rolled.keys, plain.keys)
    np.testing.assert_array_equal(rolled.values, plain.values)
    q = randn(rng, (2, 4, 2, 4), np.float64)
    np.testing.assert_array_equal(rolled.attend(q), plain.attend(q))


@pytest.mark.parametrize("lengths, exc, match", [
    ([5, 7], ValueError, r"batch entry 1 holds 6 keys; cannot keep 7 .* the cache is unchanged"),
    (-1, ValueError, r"batch entry 0 holds 6 keys; cannot keep -1"),
    ([1, 2, 3], ValueError, r"lengths of shape \(3,\) does not broadcast to the batch \(2,\)"),
    (2.5, TypeError, r"lengths must be integers; got dtype float64"),
])
def test_cache_truncate_rejects_and_changes_nothing(lengths, exc, match):
    cache = fastattn.KVCache(2, 1, 8, 4)
    k = np.ones((2, 1, 6, 4), np.float32)
    cache.append(k, k)
    with pytest.raises(exc, match=match):
        cache.truncate(lengths)
    np.testing.assert_array_equal(cache.lengths, [6, 6])


def test_cache_capacity_error_names_capacity_and_length_and_changes_nothing():
    rng = np.random.default_rng(5)
    cache = fastattn.KVCache(2, 1, 8, 4)
    k = randn(rng, (2, 1, 6, 4))
    cache.append(k, k)
    keys_before = cache.key_buffer.copy()
    with pytest.raises(ValueError, match=r"capacity 8.*needs length 9"):
        cache.append(randn(rng, (2, 1, 3, 4)), randn(rng, (2, 1, 3, 4)))
    np.testing.assert_array_equal(cache.lengths, [6, 6])
    np.testing.assert_array_equal(cache.key_buffer, keys_before)
    # Per-entry counts: only entry 1 overflows, and entry 0 is not written either.
    with pytest.raises(ValueError, match=r"capacity 8.*batch entry 1.*needs length 9"):
        cache.append(randn(rng, (2, 1, 3, 4)), randn(rng, (2, 1, 3, 4)), lengths=[1, 3])
    np.testing.assert_array_equal(cache.lengths, [6, 6])
    np.testing.assert_array_equal(cache.key_buffer, keys_before)
    cache.append(randn(rng, (2, 1, 2, 4)), randn(rng, (2, 1, 2, 4)))  # exactly full is fine
    np.testing.assert_array_equal(cache.lengths, [8, 8])


@pytest.mark.parametrize("k_shape, v_shape, kw, error, match", [
    ((2, 3, 1, 4), (2, 3, 1, 4), {}, ValueError, r"k must have shape \(batch=2, num_kv_heads=2, n, 4\).*\(2, 3, 1, 4\)"),
    ((2, 2, 1, 5), (2, 2, 1, 4), {}, ValueError, r"k must have shape .*got \(2, 2, 1, 5\)"),
    ((2, 2, 1, 4), (2, 2, 1, 3), {}, ValueError, r"v must have shape \(batch=2, num_kv_heads=2, n, 4\)"),
    ((2, 2, 4), (2, 2, 4), {}, ValueError, r"k must have shape"),
    ((2, 2, 2, 4), (2, 2, 1, 4), {}, ValueError, r"same number of new rows; got k 2 and v 1"),
    ((2, 2, 2, 4), (2, 2, 2, 4), {"lengths": [1, 3]}, ValueError, r"lengths must lie in \[0, n=2\]"),
    ((2, 2, 2, 4), (2, 2, 2, 4), {"lengths": [1, 1, 1]}, ValueError, r"does not broadcast to the batch"),
    ((2, 2, 2, 4), (2, 2, 2, 4), {"lengths": [1.0, 1.0]}, TypeError, r"lengths must be integers"),
])
def test_cache_append_rejects_bad_input(k_shape, v_shape, kw, error, match):
    cache = fastattn.KVCache(2, 2, 8, 4)
    with pytest.raises(error, match=match):
        cache.append(np.zeros(k_shape, np.float32), np.zeros(v_shape, np.float32), **kw)
    np.testing.assert_array_equal(cache.lengths, [0, 0])


def test_cache_rejects_wrong_dtype_and_kv_lengths():
    cache = fastattn.KVCache(1, 1, 8, 4)
    # float input of another width is rounded into the cache's dtype; integers are refused
    with pytest.raises(TypeError, match=r"v must be floating point"):
        cache.append(np.zeros((1, 1, 1, 4), np.float32), np.zeros((1, 1, 1, 4), np.int64))
    np.testing.assert_array_equal(cache.lengths, [0])
    with pytest.raises(TypeError, match="kv_lengths"):
        cache.attend(np.zeros((1, 1, 1, 4), np.float32), kv_lengths=[1])


@pytest.mark.parametrize("args, kw, error, match", [
    ((0, 1, 8, 4), {}, ValueError, "batch must be >= 1; got 0"),
    ((1, 1, 8, 4), {"dtype": np.int32}, TypeError, "dtype must be float32, float64, float16"),
    ((1, 1, 8.0, 4), {}, TypeError, "capacity must be an int"),
    ((1, 1, 8, 4), {"head_dim_v": 0}, ValueError, "head_dim_v must be >= 1"),
])
def test_cache_constructor_rejects_bad_sizes(args, kw, error, match):
    with pytest.raises(error, match=match):
        fastattn.KVCache(*args, **kw)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_decoding_through_the_cache_equals_one_causal_call(dtype, heads):
    """Prefill P tokens, then one token at a time: each step's rows are the
    matching rows of one causal call over the whole sequence."""
    rng = np.random.default_rng(6)
    Hq, Hkv = heads
    B, T, P, E = 2, 40, 13, 16
    q, k, v = randn(rng, (B, Hq, T, E), dtype), randn(rng, (B, Hkv, T, E), dtype), randn(rng, (B, Hkv, T, E), dtype)
    full = fastattn.attention(q, k, v, causal=True)
    ref = fastattn.reference.attention(q, k, v, causal=True)
    tol = tolerance(q, k, v, causal=True)
    cache = fastattn.KVCache(B, Hkv, 64, E, dtype=dtype)
    cache.append(k[:, :, :P], v[:, :, :P])
    steps = [cache.attend(q[:, :, :P])]
    for t in range(P, T):
        cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        steps.append(cache.attend(q[:, :, t:t + 1]))
    got = np.concatenate(steps, axis=2)
    _close(got, ref, tol)
    _close(got, full, 2 * tol)


def test_sliding_window_decoding_through_the_cache():
    rng = np.random.default_rng(7)
    B, H, T, E = 1, 2, 30, 8
    q, k, v = (randn(rng, (B, H, T, E), np.float64) for _ in range(3))
    ref = fastattn.reference.attention(q, k, v, causal=True, window=(5, 0))
    cache = fastattn.KVCache(B, H, T, E, dtype=np.float64)
    rows = []
    for t in range(T):
        cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        rows.append(cache.attend(q[:, :, t:t + 1], window=(5, 0)))
    _close(np.concatenate(rows, axis=2), ref, 1e-12)


# --------------------------------------------------------------------------
# merge_attention
# --------------------------------------------------------------------------


def _split_points(rng, S, parts):
    """Sorted cut points in [0, S], repeats allowed (empty parts)."""
    cuts = np.sort(rng.integers(0, S + 1, size=parts - 1))
    return [0, *cuts.tolist(), S]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(6))
def test_merge_of_any_split_equals_one_call(dtype, seed):
    rng = np.random.default_rng(100 + seed)
    B, Hq, Hkv, L, S, E, Ev = 2, 4, 2, 5, int(rng.integers(1, 300)), 16, 12
    q, k, v = randn(rng, (B, Hq, L, E), dtype), randn(rng, (B, Hkv, S, E), dtype), randn(rng, (B, Hkv, S, Ev), dtype)
    # A bool mask hides whole stretches of keys, so some rows see nothing in
    # some parts (and row 0 of head 0 sees nothing at all).
    mask = rng.random((B, Hq, L, S)) > 0.6
    mask[:, :, :, : S // 3] &= rng.random((B, Hq, L, 1)) > 0.5
    mask[0, 0, 0] = False
    cuts = _split_points(rng, S, int(rng.integers(1, 6)))
    if seed == 0:
        cuts = [0, 0, S, S]  # empty parts at both ends
    parts = [fastattn.attention(q, k[..., a:b, :], v[..., a:b, :], mask=mask[..., a:b], return_lse=True)
             for a, b in zip(cuts, cuts[1:])]
    out, lse = fastattn.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    assert out.dtype == dtype and lse.dtype == dtype
    ref, ref_lse = fastattn.reference.attention(q, k, v, mask=mask, return_lse=True)
    tol = tolerance(q, k, v, mask=mask)
    _close(out, ref, 2 * tol)
    _same_lse(lse, ref_lse, 1e-5 if dtype == np.float32 else 1e-12)
    assert np.isneginf(lse[0, 0, 0]) and not out[0, 0, 0].any()
    whole, whole_lse = fastattn.attention(q, k, v, mask=mask, return_lse=True)
    _close(out, whole, 2 * tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("L, S", [(7, 50), (50, 50), (60, 20)])
def test_merge_with_causal_through_explicit_masks_per_part(dtype, L, S):
    """Causal (bottom-right) over the whole key range becomes one slice of the
    full causal mask per part; with L > S the first rows see nothing."""
    rng = np.random.default_rng(L * 1000 + S)
    q, k, v = randn(rng, (1, 3, L, 8), dtype), randn(rng, (1, 3, S, 8), dtype), randn(rng, (1, 3, S, 8), dtype)
    causal = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
    cuts = [0, 3, 3, S // 2, S - 1, S]
    parts = [fastattn.attention(q, k[..., a:b, :], v[..., a:b, :], mask=causal[:, a:b], return_lse=True)
             for a, b in zip(cuts, cuts[1:])]
    out, lse = fastattn.merge_attention(*zip(*parts))
    ref, ref_lse = fastattn.reference.attention(q, k, v, causal=True, return_lse=True)
    _close(out, ref, 2 * tolerance(q, k, v, causal=True))
    _same_lse(lse, ref_lse, 1e-5 if dtype == np.float32 else 1e-12)


def test_merge_float64_is_exact_to_1e12_with_large_logits():
    rng = np.random.default_rng(8)
    q, k, v = (randn(rng, (2, 3, 40, 32), np.float64) for _ in range(3))
    scale = 60.0  # logits in the hundreds: a naive Σ exp(lse_i) would overflow
    parts = [fastattn.attention(q, k[..., a:b, :], v[..., a:b, :], scale=scale, return_lse=True)
             for a, b in [(0, 13), (13, 14), (14, 40)]]
    out, lse = fastattn.merge_attention(*zip(*parts))
    ref, ref_lse = fastattn.reference.attention(q, k, v, scale=scale, return_lse=True)
    assert np.isfinite(out).all() and lse.max() > 500
    _close(out, ref, 1e-12 * np.abs(v).max())
    _close(lse, ref_lse, 1e-12 * np.abs(ref_lse).max())


def test_merge_rows_empty_everywhere_and_parts_that_saw_nothing():
    out_a = np.array([[1.0, 2.0], [3.0, 4.0], [np.nan, np.nan]])
    out_b = np.array([[5.0, 6.0], [np.nan, np.nan], [np.nan, 0.0]])
    lse_a = np.array([0.0, 1.0, -np.inf])
    lse_b = np.array([np.log(3.0), -np.inf, -np.inf])
    out, lse = fastattn.merge_attention([out_a, out_b], [lse_a, lse_b])
    # Row 0: weights 1/4 and 3/4. Row 1: only part a. Row 2: nothing anywhere.
    np.testing.assert_allclose(out[0], [4.0, 5.0], rtol=1e-15)
    np.testing.assert_array_equal(out[1], [3.0, 4.0])
    np.testing.assert_array_equal(out[2], [0.0, 0.0])
    np.testing.assert_allclose(lse[:2], [np.log(4.0), 1.0], rtol=1e-15)
    assert lse[2] == -np.inf
    # A single part comes back as it is (its empty rows as zeros).
    one, one_lse = fastattn.merge_attention([out_a], [lse_a])
    np.testing.assert_array_equal(one[:2], out_a[:2])
    np.testing.assert_array_equal(one[2], [0.0, 0.0])
    np.testing.assert_array_equal(one_lse, lse_a)


def test_merge_propagates_nan_lse():
    out, lse = fastattn.merge_attention([np.ones((2, 3)), np.ones((2, 3))],
                                        [np.array([0.0, np.nan]), np.array([0.0, 0.0])])
    assert np.isnan(lse[1]) and np.isnan(out[1]).all()
    np.testing.assert_allclose(out[0], 1.0, rtol=1e-15)


@pytest.mark.parametrize("outs, lses, error, match", [
    ([], [], ValueError, "at least one part"),
    ([np.zeros((2, 3))], [np.zeros(2), np.zeros(2)], ValueError, "1 outputs and 2 lses"),
    ([np.zeros((2, 3)), np.zeros((2, 4))], [np.zeros(2), np.zeros(2)], ValueError, r"outs\[1\] has \(2, 4\)"),
    ([np.zeros((2, 3))], [np.zeros(3)], ValueError, r"lses\[0\] must have .* \(2,\); got \(3,\)"),
    ([np.zeros((2, 3), np.int64)], [np.zeros(2)], TypeError, r"outs\[0\] must be floating point; got int64"),
])
def test_merge_rejects_bad_input(outs, lses, error, match):
    with pytest.raises(error, match=match):
        fastattn.merge_attention(outs, lses)


# --------------------------------------------------------------------------
# MultiHeadAttention
# --------------------------------------------------------------------------


def numpy_mha(layer, x, context=None, causal=False, mask=None):
    """The same layer, textbook NumPy, head by head in float64 (the oracle)."""
    x = np.asarray(x, np.float64)
    c = x if context is None else np.asarray(context, np.float64)
    squeeze = x.ndim == 2
    x, c = (x[None] if x.ndim == 2 else x), (c[None] if c.ndim == 2 else c)
    dk, g = layer.d_k, layer.num_heads // layer.num_kv_heads

    def w(name):
        a = getattr(layer, name)
        return None if a is None else a.astype(np.float64)

    WQ, WK, WV, WO = w("W_Q"), w("W_K"), w("W_V"), w("W_O")
    bQ, bK, bV, bO = (w(n) if w(n) is not None else 0.0 for n in ("b_Q", "b_K", "b_V", "b_O"))
    L, S = x.shape[1], c.shape[1]
    heads = []
    for h in range(layer.num_heads):
        hk = h // g
        Q = x @ WQ[:, h * dk:(h + 1) * dk] + (bQ[h * dk:(h + 1) * dk] if np.ndim(bQ) else 0)
        K = c @ WK[:, hk * dk:(hk + 1) * dk] + (bK[hk * dk:(hk + 1) * dk] if np.ndim(bK) else 0)
        V = c @ WV[:, hk * dk:(hk + 1) * dk] + (bV[hk * dk:(hk + 1) * dk] if np.ndim(bV) else 0)
        scores = Q @ K.swapaxes(-1, -2) / np.sqrt(dk)
        if causal:
            scores = np.where(np.arange(S) <= np.arange(L)[:, None] + S - L, scores, -np.inf)
        if mask is not None:
            scores = np.where(np.broadcast_to(mask, (x.shape[0], layer.num_heads, L, S))[:, h], scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        heads.append(weights / weights.sum(-1, keepdims=True) @ V)
    y = np.concatenate(heads, axis=-1) @ WO + bO
    return y[0] if squeeze else y


def _randomise_biases(layer, rng):
    for name in ("b_Q", "b_K", "b_V", "b_O"):
        b = getattr(layer, name)
        setattr(layer, name, rng.standard_normal(b.shape).astype(b.dtype))


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (4, 1)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_mha_self_attention_matches_numpy_layer(heads, bias, causal):
    rng = np.random.default_rng(9)
    layer = fastattn.MultiHeadAttention(64, *heads, rng=rng, dtype=np.float64, bias=bias)
    if bias:
        _randomise_biases(layer, rng)
    x = rng.standard_normal((3, 11, 64))
    _close(layer(x, causal=causal), numpy_mha(layer, x, causal=causal), 1e-12)


def test_mha_two_dimensional_input_and_float32():
    rng = np.random.default_rng(10)
    layer = fastattn.MultiHeadAttention(32, 4, 2, rng=1)
    x = rng.standard_normal((9, 32)).astype(np.float32)
    y = layer(x, causal=True)
    assert y.shape == (9, 32) and y.dtype == np.float32
    _close(y, numpy_mha(layer, x, causal=True), 1e-4)
    np.testing.assert_array_equal(y, layer(x[None], causal=True)[0])


def test_mha_cross_attention_matches_numpy_layer():
    rng = np.random.default_rng(11)
    layer = fastattn.MultiHeadAttention(48, 6, 3, rng=rng, dtype=np.float64, bias=True)
    _randomise_biases(layer, rng)
    x, context = rng.standard_normal((2, 5, 48)), rng.standard_normal((2, 17, 48))
    mask = rng.random((2, 1, 5, 17)) > 0.3
    _close(layer(x, context), numpy_mha(layer, x, context), 1e-12)
    _close(layer(x, context, mask=mask), numpy_mha(layer, x, context, mask=mask), 1e-12)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_mha_cached_decoding_equals_full_causal_call(heads):
    """Prefill 6 tokens, then one at a time through the cache: the same rows
    as one causal call over all 20 tokens, and as the NumPy layer."""
    rng = np.random.default_rng(12)
    layer = fastattn.MultiHeadAttention(64, *heads, rng=rng, dtype=np.float64)
    x = rng.standard_normal((2, 20, 64))
    full = layer(x, causal=True)
    _close(full, numpy_mha(layer, x, causal=True), 1e-12)
    cache = layer.new_cache(batch=2, capacity=32)
    steps = [layer(x[:, :6], causal=True, cache=cache)]
    for t in range(6, 20):
        steps.append(layer(x[:, t:t + 1], causal=True, cache=cache))
    np.testing.assert_array_equal(cache.lengths, [20, 20])
    _close(np.concatenate(steps, axis=1), full, 1e-12)


def test_mha_rejected_call_leaves_the_cache_unchanged():
    rng = np.random.default_rng(13)
    layer = fastattn.MultiHeadAttention(16, 2, rng=rng)
    cache = layer.new_cache(1, 8)
    layer(rng.standard_normal((1, 3, 16)).astype(np.float32), causal=True, cache=cache)
    with pytest.raises(ValueError, match="mask"):
        layer(rng.standard_normal((1, 1, 16)).astype(np.float32), cache=cache, mask=np.ones((1, 5), bool))
    np.testing.assert_array_equal(cache.lengths, [3])


def test_mha_reproduces_the_lecture_shapes():
    """d_model 512, 8 heads: d_k 64; X (10, 512) → Q, K, V (10, 64) per head,
    scores (10, 10), head outputs (10, 64), concat (10, 512), W_O → (10, 512)."""
    rng = np.random.default_rng(14)
    layer = fastattn.MultiHeadAttention(512, 8, rng=rng)
    assert layer.d_k == 64
    assert layer.W_Q.shape == layer.W_K.shape == layer.W_V.shape == layer.W_O.shape == (512, 512)
    x = rng.standard_normal((10, 512)).astype(np.float32)
    q, k, v = layer.project(x)
    assert q.shape == k.shape == v.shape == (1, 8, 10, 64)
    assert q[0, 3].shape == (10, 64)
    steps = fastattn.reference.attention_steps(q, k, v)
    assert steps.scores.shape == (1, 8, 10, 10)
    assert steps.output.shape == (1, 8, 10, 64)
    concat = steps.output[0].swapaxes(0, 1).reshape(10, 512)
    y = layer(x)
    assert y.shape == (10, 512)
    _close(y, concat @ layer.W_O.astype(np.float64), 1e-4)


def test_mha_passes_heads_as_transposed_views():
    """Q, K, V are (B, L, H, d_k) matmul results seen as (B, H, L, d_k): no copy."""
    layer = fastattn.MultiHeadAttention(32, 4, 2, rng=0)
    x = np.random.default_rng(15).standard_normal((2, 7, 32)).astype(np.float32)
    q, k, v = layer.project(x)
    assert q.shape == (2, 4, 7, 8) and k.shape == (2, 2, 7, 8)
    assert not q.flags.c_contiguous and q.strides == (7 * 32 * 4, 8 * 4, 32 * 4, 4)
    assert q.base is not None and k.base is not None and v.base is not None


def test_mha_same_seed_same_weights():
    a, b = fastattn.MultiHeadAttention(16, 4, rng=7), fastattn.MultiHeadAttention(16, 4, rng=7)
    c = fastattn.MultiHeadAttention(16, 4, rng=8)
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.W_Q, c.W_Q)
    assert a.b_Q is None


@pytest.mark.parametrize("args, kw, error, match", [
    ((30, 4), {}, ValueError, r"num_heads \(4\) must divide d_model \(30\)"),
    ((32, 4, 3), {}, ValueError, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
    ((32, 0), {}, ValueError, "num_heads must be >= 1"),
    ((32, 4), {"dtype": np.int32}, TypeError, "float32 or float64"),
])
def test_mha_constructor_rejects_bad_sizes(args, kw, error, match):
    with pytest.raises(error, match=match):
        fastattn.MultiHeadAttention(*args, **kw)


def test_mha_call_rejects_bad_input():
    layer = fastattn.MultiHeadAttention(16, 2)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, length, d_model=16\).*\(3, 15\)"):
        layer(np.zeros((3, 15), np.float32))
    with pytest.raises(TypeError, match="x must have the layer's dtype float32; got float64"):
        layer(np.zeros((3, 16)))
    with pytest.raises(ValueError, match=r"context must have the batch size of x \(2\); got 3"):
        layer(np.zeros((2, 3, 16), np.float32), np.zeros((3, 4, 16), np.float32))
