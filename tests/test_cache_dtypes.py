"""The inference layer on storage dtypes: KVCache with float16, bfloat16 and
int8 storage (appends round once or quantise, exactly as NumPy / ml_dtypes /
quantize_int8 do; nbytes; refused appends change nothing; truncate and
reset), merge_attention of 16-bit outputs, and MultiHeadAttention.new_cache.

Tests that call cache.attend or the layer need fastattn.attention's 16-bit
and int8 support (the kernel side of issue 10).
"""
import sys
from fractions import Fraction

import numpy as np
import pytest

import fastattn
from fastattn.cache import KVCache, key_channel_scales, quantize_int8
from _helpers import bf16, randn, tolerance

FLOAT_INPUTS = ["float32", "float64", "float16", "bfloat16"]
STORAGE = ["float32", "float64", "float16", "bfloat16", "int8"]


def _dtype(name):
    """np.dtype for a name; bfloat16 skips the test without ml_dtypes."""
    return np.dtype(bf16()) if name == "bfloat16" else np.dtype(name)


def _cache_dtype(name):
    return "bfloat16" if name == "bfloat16" else np.dtype(name)


def _bits(x):
    """The bytes of a float array as unsigned ints (NaN compares equal to itself)."""
    x = np.ascontiguousarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _state(cache):
    """Everything a cache holds, copied: buffers (scales too) and lengths."""
    bufs = [cache.key_buffer, cache.value_buffer]
    flat = [a for b in bufs for a in (b if isinstance(b, tuple) else (b,))]
    return [np.array(a, copy=True) for a in flat] + [cache.lengths.copy()]


def _assert_same_state(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(_bits(x) if x.dtype.kind in "fV" else x,
                                      _bits(y) if y.dtype.kind in "fV" else y)


def _rne_bfloat16(x):
    """float64 → bfloat16 rounded once to nearest even, by exact arithmetic."""
    bf = bf16()
    out = []
    for value in x:
        if not np.isfinite(value) or value == 0:
            out.append(np.array([value]).astype(bf)[0])  # nothing to round
            continue
        with np.errstate(over="ignore"):  # 1e300: inf, then the finite candidate below it
            bits = int(np.array([abs(value)], np.float32).astype(bf).view(np.uint16)[0])  # within an ulp
        cands = [b for b in (bits - 1, bits, bits + 1) if 0 <= b <= 0x7F80]  # 0x7F80: inf
        # inf counts as 2^128, where the next binade would start: a value half
        # an ulp or more past the largest finite bfloat16 rounds to it
        exact = [Fraction(2**128) if b == 0x7F80 else
                 Fraction(float(np.array([b], np.uint16).view(bf)[0])) for b in cands]
        dist = [abs(Fraction(abs(float(value))) - e) for e in exact]
        near = [b for b, d in zip(cands, dist) if d == min(dist)]
        pick = near[0] if len(near) == 1 else next(b for b in near if b % 2 == 0)
        out.append(np.array([pick | (0x8000 if value < 0 else 0)], np.uint16).view(bf)[0])
    return np.array(out, dtype=bf)


# --------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, want", [
    (np.float16, "float16"), ("float16", "float16"), (np.float32, "float32"),
    (np.dtype(np.float64), "float64"), ("int8", "int8"), (np.int8, "int8"),
])
def test_cache_dtypes_are_accepted(dtype, want):
    cache = KVCache(1, 2, 8, 4, dtype=dtype)
    assert cache.dtype == np.dtype(want) and cache.quantized == (want == "int8")
    assert f"dtype={want}" in repr(cache)


def test_bfloat16_by_name_type_or_dtype():
    bf = bf16()
    for dtype in ("bfloat16", bf, np.dtype(bf)):
        cache = KVCache(1, 1, 4, 2, dtype=dtype)
        assert cache.dtype == np.dtype(bf) and cache.key_buffer.dtype == np.dtype(bf)


def test_bfloat16_without_ml_dtypes_says_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # `import ml_dtypes` now fails
    with pytest.raises(ImportError, match=r"dtype='bfloat16' needs the ml_dtypes package.*pip install ml_dtypes"):
        KVCache(1, 1, 4, 2, dtype="bfloat16")


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.complex64, "int4", "float8", bool, object])
def test_other_dtypes_are_refused(dtype):
    with pytest.raises(TypeError, match=r"dtype must be float32, float64, float16, 'bfloat16' \(ml_dtypes\) or 'int8'"):
        KVCache(1, 1, 4, 2, dtype=dtype)


@pytest.mark.parametrize("name, per_element", [
    ("float64", 8), ("float32", 4), ("float16", 2), ("bfloat16", 2), ("int8", 1)])
def test_nbytes_counts_what_is_stored(name, per_element):
    B, H, cap, E, Ev = 2, 3, 10, 4, 6
    cache = KVCache(B, H, cap, E, head_dim_v=Ev, dtype=_cache_dtype(name))
    if name == "bfloat16":
        _dtype(name)
    # int8: one float32 scale per row (K and V) and one per key channel and head
    scales = 2 * B * H * cap * 4 + B * H * E * 4 if name == "int8" else 0
    assert cache.nbytes == B * H * cap * (E + Ev) * per_element + scales
    assert cache.nbytes == sum(a.nbytes for a in _state(cache)[:-1])


# --------------------------------------------------------------------------
# Appends: rounded once, or quantised, exactly
# --------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("given", FLOAT_INPUTS)
def test_append_rounds_as_astype(storage, given):
    rng = np.random.default_rng(0)
    sd, gd = _dtype(storage), _dtype(given)
    cache = KVCache(2, 2, 9, 8, head_dim_v=3, dtype=_cache_dtype(storage))
    k = (rng.standard_normal((2, 2, 5, 8)) * 3).astype(gd)
    v = (rng.standard_normal((2, 2, 5, 3)) / 3).astype(gd)
    cache.append(k, v)
    cache.append(k[:, :, :2], v[:, :, :2], lengths=[2, 1])
    assert cache.keys.dtype == sd and cache.values.dtype == sd
    if storage == "bfloat16" and given == "float64":
        # ml_dtypes rounds float64 through float32 (twice); the cache rounds once
        rk, rv = (_rne_bfloat16(x.ravel()).reshape(x.shape) for x in (k, v))
    else:
        rk, rv = k.astype(sd), v.astype(sd)
    np.testing.assert_array_equal(_bits(cache.keys[:, :, :5]), _bits(rk))
    np.testing.assert_array_equal(_bits(cache.values[:, :, :5]), _bits(rv))
    np.testing.assert_array_equal(_bits(cache.key_buffer[0, :, 5:7]), _bits(rk[0, :, :2]))
    np.testing.assert_array_equal(_bits(cache.key_buffer[1, :, 5:6]), _bits(rk[1, :, :1]))
    np.testing.assert_array_equal(cache.lengths, [7, 6])


def test_float64_into_bfloat16_rounds_once_to_nearest_even():
    bf = bf16()
    # ties and near-ties that a float32 stop would round the wrong way
    x = np.array([1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-30), 1 + 2**-8, 1 + 3 * 2**-8,
                  1 + 2**-8 - 2**-40, 3.39e38, 3.4e38, 1e300, 1e-40, 2**-133 * 1.5, 0.0, -0.0,
                  np.inf, -np.inf])
    rng = np.random.default_rng(1)
    # plus random values next to bfloat16 midpoints, and plain ones
    mids = (rng.standard_normal(300) * 2.0**rng.integers(-130, 120, 300)).astype(np.float32)
    mids = mids.astype(bf).astype(np.float64) * (1 + 2**-9) * (1 + rng.uniform(-2**-28, 2**-28, 300))
    x = np.concatenate([x, mids, rng.standard_normal(300)])
    cache = KVCache(1, 1, len(x), 1, dtype="bfloat16")
    cache.append(x.reshape(1, 1, -1, 1), x.reshape(1, 1, -1, 1))
    got = cache.keys.ravel()
    want = _rne_bfloat16(x)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # a stop at float32 would give 1.0 (ml_dtypes' astype did so before 0.7; 0.7 rounds once too)
    assert float(got[0]) == 1 + 2**-7 and float(np.float32(x[0])) == 1 + 2**-8
    nan = KVCache(1, 1, 1, 1, dtype="bfloat16")
    nan.append(np.full((1, 1, 1, 1), np.nan), np.zeros((1, 1, 1, 1)))
    assert np.isnan(nan.keys.astype(np.float32)).all()


@pytest.mark.parametrize("given", FLOAT_INPUTS)
def test_int8_append_stores_the_quantiser_s_values_and_scales(given):
    rng = np.random.default_rng(2)
    gd = _dtype(given)
    cache = KVCache(2, 3, 12, 16, head_dim_v=5, dtype="int8", key_channels=None)  # per-token only
    k = (rng.standard_normal((2, 3, 7, 16)) * 4).astype(gd)
    v = rng.standard_normal((2, 3, 7, 5)).astype(gd)
    k[0, 1, 2] = 0  # a zero row: scale 0, values 0
    cache.append(k, v, lengths=[7, 4])
    (k8, ks), (v8, vs) = cache.key_buffer, cache.value_buffer
    assert k8.dtype == v8.dtype == np.int8 and ks.dtype == vs.dtype == np.float32
    assert ks.shape == vs.shape == (2, 3, 12)
    for (vals, scales), x in (((k8, ks), k), ((v8, vs), v)):
        want_vals, want_scales = quantize_int8(x)
        np.testing.assert_array_equal(vals[0, :, :7], want_vals[0])
        np.testing.assert_array_equal(vals[1, :, :4], want_vals[1, :, :4])
        np.testing.assert_array_equal(_bits(scales[0, :, :7]), _bits(want_scales[0]))
        np.testing.assert_array_equal(_bits(scales[1, :, :4]), _bits(want_scales[1, :, :4]))
        assert not vals[1, :, 4:].any() and not scales[1, :, 4:].any()  # padding rows not stored
    assert ks[0, 1, 2] == 0 and not k8[0, 1, 2].any()
    # keys / values: dequantized float32 copies of the filled part
    keys = cache.keys
    assert keys.dtype == np.float32 and keys.shape == (2, 3, 7, 16)
    np.testing.assert_array_equal(keys, k8[:, :, :7].astype(np.float32) * ks[:, :, :7, None])
    assert not keys.flags.writeable and not np.shares_memory(keys, k8)


@pytest.mark.parametrize("given", FLOAT_INPUTS)
def test_int8_keys_are_quantised_after_dividing_by_the_prompt_s_channel_factors(given):
    rng = np.random.default_rng(12)
    gd = _dtype(given)
    cache = KVCache(2, 3, 12, 16, head_dim_v=5, dtype="int8")
    k = (rng.standard_normal((2, 3, 9, 16)) * 4).astype(gd)
    k[..., 5] *= 20  # an outlier channel
    v = rng.standard_normal((2, 3, 9, 5)).astype(gd)
    cache.append(k[:, :, :6], v[:, :, :6], lengths=[6, 0])  # entry 1's prompt comes later
    cache.append(k[:, :, 6:], v[:, :, 6:], lengths=[3, 2])
    c = cache.key_channels
    assert c.dtype == np.float32 and c.shape == (2, 3, 16)
    np.testing.assert_array_equal(_bits(c[0]), _bits(key_channel_scales(k[0, :, :6])))
    np.testing.assert_array_equal(_bits(c[1]), _bits(key_channel_scales(k[1, :, 6:8])))
    k8, ks, kc = cache.key_buffer
    np.testing.assert_array_equal(kc, c)
    for b, rows in ((0, slice(0, 9)), (1, slice(6, 8))):  # every stored row: quantised x / c
        n = rows.stop - rows.start
        want_vals, want_scales = quantize_int8(k[b, :, rows].astype(np.float64) / c[b, :, None, :])
        np.testing.assert_array_equal(k8[b, :, :n], want_vals)
        np.testing.assert_array_equal(_bits(ks[b, :, :n]), _bits(want_scales))
    # values are per token only; keys dequantize with the factors
    np.testing.assert_array_equal(cache.value_buffer[0][0, :, :9], quantize_int8(v[0])[0])
    want_keys = (k8[:, :, :9] * ks[:, :, :9, None].astype(np.float64) * c[:, :, None, :]).astype(np.float32)
    np.testing.assert_array_equal(cache.keys, want_keys)


def test_key_channel_scales_by_its_definition():
    rng = np.random.default_rng(13)
    k = rng.standard_normal((3, 40, 8))
    k[0, :, 2] *= 50
    k[1] = 0
    k[2, :, 6] *= 1e-3  # a small channel: floored at the median
    c = key_channel_scales(k)
    amax = np.abs(k).max(axis=1)
    want = np.maximum(amax, np.median(amax, axis=-1, keepdims=True))
    want[1] = 1  # an all-zero head: factors 1
    np.testing.assert_array_equal(c, want.astype(np.float32))
    assert c[2, 6] == np.float32(np.median(amax[2]))
    np.testing.assert_array_equal(key_channel_scales(np.swapaxes(k, 1, 2), axis=-1), c)
    with pytest.raises(TypeError, match="k must be floating point .* got int32"):
        key_channel_scales(np.ones((2, 3), np.int32))
    with pytest.raises(ValueError, match="NaN or inf"):
        key_channel_scales(np.array([[1.0, np.inf]]))
    with pytest.raises(ValueError, match="one token"):
        key_channel_scales(np.ones((0, 4)))


def test_key_channels_given_none_reset_and_refusals():
    rng = np.random.default_rng(14)
    k, v = rng.standard_normal((2, 2, 4, 8)), rng.standard_normal((2, 2, 4, 8))
    given = rng.uniform(0.5, 4, (2, 1, 8))  # broadcasts over heads
    fixed = KVCache(2, 2, 10, 8, dtype="int8", key_channels=given)
    fixed.append(k, v)
    np.testing.assert_array_equal(fixed.key_channels, np.broadcast_to(given, (2, 2, 8)).astype(np.float32))
    fixed.reset()  # given factors outlive reset
    np.testing.assert_array_equal(fixed.key_channels, np.broadcast_to(given, (2, 2, 8)).astype(np.float32))
    prompt = KVCache(2, 2, 10, 8, dtype="int8")
    assert (prompt.key_channels == 1).all()  # no prompt yet
    prompt.append(k, v)
    first = prompt.key_channels
    prompt.append(k * 100, v)  # later appends do not move them
    np.testing.assert_array_equal(prompt.key_channels, first)
    prompt.truncate([0, 0])
    np.testing.assert_array_equal(prompt.key_channels, first)
    prompt.reset()  # a new sequence takes factors from its own prompt
    prompt.append(k * 3, v)
    np.testing.assert_array_equal(prompt.key_channels, key_channel_scales(k * 3))
    plain = KVCache(2, 2, 10, 8, dtype="int8", key_channels=None)
    plain.append(k, v)
    assert plain.key_channels is None and len(plain.key_buffer) == 2
    # a refused first append sets no factors
    fresh = KVCache(1, 2, 10, 8, dtype="int8")
    bad = k[:1].copy()
    bad[0, 1, 3, 0] = np.nan
    before = _state(fresh)
    with pytest.raises(ValueError, match="k holds NaN or inf"):
        fresh.append(bad, v[:1])
    _assert_same_state(_state(fresh), before)
    fresh.append(k[:1], v[:1])
    np.testing.assert_array_equal(fresh.key_channels, key_channel_scales(k[:1]))
    for bad_channels, error, match in [
            (np.ones((2, 3, 8)), ValueError, r"broadcast to \(batch, num_kv_heads, head_dim\) = \(2, 2, 8\)"),
            (np.zeros((2, 2, 8)), ValueError, "finite and > 0"),
            (np.full((2, 2, 8), np.nan), ValueError, "finite and > 0"),
            (np.ones((2, 2, 8), np.int64), TypeError, "'prompt', None or floating"),
            ("tokens", TypeError, "'prompt', None or floating")]:
        with pytest.raises(error, match=match):
            KVCache(2, 2, 10, 8, dtype="int8", key_channels=bad_channels)
    with pytest.raises(ValueError, match="key_channels applies to int8 caches only; this cache stores float16"):
        KVCache(2, 2, 10, 8, dtype=np.float16, key_channels=given)


def test_fix_key_channels_gives_empty_entries_the_prompt_s_factors():
    """A cache holding a later part of a sequence takes the prompt's factors
    instead of its own first rows'; entries with factors keep them."""
    rng = np.random.default_rng(17)
    k, v = rng.standard_normal((2, 2, 5, 8)), rng.standard_normal((2, 2, 5, 8))
    prompt_factors = rng.uniform(0.5, 9, (2, 2, 8)).astype(np.float32)
    part = KVCache(2, 2, 10, 8, dtype="int8")
    part.append(k[:, :, :2], v[:, :, :2], lengths=[2, 0])  # entry 0 has its own factors now
    own = part.key_channels[0].copy()
    took = part.fix_key_channels(prompt_factors)
    np.testing.assert_array_equal(took, [False, True])
    np.testing.assert_array_equal(part.key_channels[0], own)
    np.testing.assert_array_equal(part.key_channels[1], prompt_factors[1])
    part.append(k[:, :, 2:], v[:, :, 2:], lengths=[0, 3])  # entry 1 quantises with them
    k8, ks, _ = part.key_buffer
    want = quantize_int8(k[1, :, 2:5] / prompt_factors[1, :, None, :])
    np.testing.assert_array_equal(k8[1, :, :3], want[0])
    np.testing.assert_array_equal(ks[1, :, :3], want[1])
    fresh = KVCache(2, 2, 10, 8, dtype="int8")
    np.testing.assert_array_equal(fresh.fix_key_channels(prompt_factors, entries=[1]), [False, True])
    assert (fresh.key_channels[0] == 1).all()
    with pytest.raises(ValueError, match="finite and > 0"):
        fresh.fix_key_channels(np.zeros((2, 2, 8)))
    with pytest.raises(ValueError, match="entries must be batch entry indices"):
        fresh.fix_key_channels(prompt_factors, entries=[5])
    for cache, what in ((KVCache(1, 1, 4, 8, dtype="int8", key_channels=np.ones(8)), "has given factors"),
                        (KVCache(1, 1, 4, 8, dtype="int8", key_channels=None), "without channel factors"),
                        (KVCache(1, 1, 4, 8), "stores float32 keys")):
        with pytest.raises(ValueError, match=what):
            cache.fix_key_channels(np.ones(8))


def test_channel_factors_remove_the_outlier_channel_penalty():
    """The reason for the factors (docs/int8.md): with one key channel 20x
    the others, int8 attention with per-token scales only is an order of
    magnitude further from the float32 cache's than with channel factors."""
    rng = np.random.default_rng(15)
    B, Hq, Hkv, S, E = 1, 8, 2, 600, 64
    k = rng.standard_normal((B, Hkv, S, E)).astype(np.float32)
    k[..., 7] *= 20
    v = rng.standard_normal((B, Hkv, S, E)).astype(np.float32)
    q = rng.standard_normal((B, Hq, 4, E)).astype(np.float32)
    exact = fastattn.reference.attention(q, k, v, causal=True)
    errors = {}
    for mode in ("prompt", None):
        cache = KVCache(B, Hkv, S, E, dtype="int8", key_channels=mode)
        cache.append(k[:, :, :128], v[:, :, :128])  # the prompt
        cache.append(k[:, :, 128:], v[:, :, 128:])
        errors[mode] = float(np.abs(cache.attend(q) - exact).max())
    assert errors["prompt"] * 4 < errors[None], errors


def test_quantize_int8_by_its_definition():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 64)) * rng.uniform(1e-3, 1e3, (50, 1))
    values, scales = quantize_int8(x)
    assert values.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (50,)
    np.testing.assert_array_equal(scales, (np.max(np.abs(x), axis=-1) / 127).astype(np.float32))
    assert (np.abs(values.astype(int)).max(axis=-1) == 127).all()  # the largest element maps to ±127
    s = scales.astype(np.float64)[:, None]
    assert (np.abs(values * s - x) <= s / 2 * (1 + 1e-12)).all()  # round to nearest
    np.testing.assert_array_equal(values, np.clip(np.rint(x / s), -127, 127))


def test_quantize_int8_ties_to_even_zero_rows_and_refusals():
    values, scales = quantize_int8(np.array([[127, 0.5, 1.5, -0.5, -2.5, 2.5], [0, 0, 0, 0, 0, 0]]))
    np.testing.assert_array_equal(scales, [1, 0])  # scale 127/127 = 1 exactly
    np.testing.assert_array_equal(values, [[127, 0, 2, 0, -2, 2], [0] * 6])
    for bad in (np.nan, np.inf, 1e300):
        with pytest.raises(ValueError, match=r"x row \(1,\) holds NaN or inf, or values beyond float32"):
            quantize_int8(np.array([[1.0, 2.0], [bad, 0.0]]))
    with pytest.raises(TypeError, match="x must be floating point"):
        quantize_int8(np.ones((2, 2), np.int32))


def test_append_refuses_non_floats_and_any_refusal_changes_nothing():
    for dtype in ("float16", "int8"):
        cache = KVCache(2, 1, 4, 2, dtype=dtype)
        cache.append(np.ones((2, 1, 3, 2)), np.ones((2, 1, 3, 2)))
        before = _state(cache)
        what = "quantised" if dtype == "int8" else "rounded"
        with pytest.raises(TypeError, match=rf"k must be floating point \(float16, bfloat16, float32 or float64; it is {what} into the cache's {dtype}\); got int64"):
            cache.append(np.ones((2, 1, 1, 2), np.int64), np.ones((2, 1, 1, 2)))
        with pytest.raises(TypeError, match=r"v must be floating point .* got int8"):
            cache.append(np.ones((2, 1, 1, 2)), np.ones((2, 1, 1, 2), np.int8))
        with pytest.raises(ValueError, match=r"KVCache capacity 4 exceeded: batch entry 0 holds 3 keys.*unchanged"):
            cache.append(np.full((2, 1, 2, 2), 7.0), np.full((2, 1, 2, 2), 7.0))
        with pytest.raises(ValueError, match=r"k must have shape"):
            cache.append(np.full((2, 1, 1, 3), 7.0), np.full((2, 1, 1, 2), 7.0))
        _assert_same_state(_state(cache), before)


def test_int8_cache_refuses_nan_and_inf_in_stored_rows_only():
    cache = KVCache(2, 2, 6, 3, dtype="int8")
    cache.append(np.ones((2, 2, 2, 3)), np.ones((2, 2, 2, 3)))
    before = _state(cache)
    k, v = np.ones((2, 2, 3, 3)), np.ones((2, 2, 3, 3))
    v[1, 0, 2, 1] = np.inf
    with pytest.raises(ValueError, match=r"v holds NaN or inf .* at batch entry 1, head 0, new row 2; "
                                         r"an int8 cache stores finite values only. The cache is unchanged"):
        cache.append(k, v)
    _assert_same_state(_state(cache), before)
    k[0, 1, 1, 0] = np.nan
    with pytest.raises(ValueError, match=r"k holds NaN or inf .* batch entry 0, head 1, new row 1"):
        cache.append(k, v, lengths=[2, 3])
    _assert_same_state(_state(cache), before)
    cache.append(k, v, lengths=[1, 2])  # the non-finite rows are padding: not stored
    np.testing.assert_array_equal(cache.lengths, [3, 4])
    assert np.isfinite(cache.keys).all() and np.isfinite(cache.values).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_cache_stores_nan_and_overflows_to_inf(dtype):
    _dtype(dtype)
    cache = KVCache(1, 1, 2, 2, dtype=dtype)
    cache.append(np.array([[[[np.nan, 1e6], [1e39, -1e39]]]]), np.zeros((1, 1, 2, 2)))
    keys = cache.keys.astype(np.float64)
    assert np.isnan(keys[0, 0, 0, 0])
    assert keys[0, 0, 0, 1] == (np.inf if dtype == "float16" else float(np.float32(1e6).astype(_dtype(dtype))))
    assert list(keys[0, 0, 1]) == [np.inf, -np.inf]


@pytest.mark.parametrize("storage", STORAGE)
def test_truncate_reset_and_overwrite(storage):
    rng = np.random.default_rng(4)
    cache = KVCache(2, 2, 8, 4, dtype=_cache_dtype(storage))
    if storage == "bfloat16":
        _dtype(storage)
    a, b = rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 3, 4))
    cache.append(a, a)
    keys5 = np.array(cache.keys, copy=True)
    cache.truncate([2, 4])
    np.testing.assert_array_equal(cache.lengths, [2, 4])
    before = _state(cache)
    with pytest.raises(ValueError, match="truncate: batch entry 0 holds 2 keys; cannot keep 3"):
        cache.truncate([3, 1])
    _assert_same_state(_state(cache), before)
    cache.append(b, b, lengths=[3, 1])
    # an int8 cache's key channel factors came from `a`: the same ones for fresh
    fresh = KVCache(2, 2, 8, 4, dtype=_cache_dtype(storage), key_channels=cache.key_channels)
    fresh.append(b, b)
    keys = cache.keys
    np.testing.assert_array_equal(keys[0, :, :2], keys5[0, :, :2])
    np.testing.assert_array_equal(keys[0, :, 2:5], fresh.keys[0])
    np.testing.assert_array_equal(keys[1, :, :4], keys5[1, :, :4])
    np.testing.assert_array_equal(keys[1, :, 4:5], fresh.keys[1, :, :1])
    cache.reset()
    np.testing.assert_array_equal(cache.lengths, [0, 0])
    assert cache.keys.shape == (2, 2, 0, 4)


def test_int8_views_are_read_only():
    cache = KVCache(1, 1, 4, 2, dtype="int8")
    cache.append(np.ones((1, 1, 2, 2)), np.ones((1, 1, 2, 2)))
    for view in (*cache.key_buffer, *cache.value_buffer, cache.keys, cache.values):
        with pytest.raises(ValueError, match="read-only"):
            view[...] = 0


# --------------------------------------------------------------------------
# merge_attention of 16-bit outputs (parts from the reference)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_merge_of_16bit_parts_is_within_the_16bit_tolerance(name):
    d = _dtype(name)
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s).astype(d) for s in ((2, 4, 3, 16), (2, 2, 40, 16), (2, 2, 40, 8)))
    parts = []
    for a, b in [(0, 7), (7, 8), (8, 40)]:
        o, lse = fastattn.reference.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True)
        parts.append((o.astype(d), lse.astype(np.float32)))  # what a 16-bit call returns
    out, lse = fastattn.merge_attention(*zip(*parts))
    assert out.dtype == d and lse.dtype == np.float32
    want, want_lse = fastattn.reference.attention(q, k, v, return_lse=True)
    # the parts' own rounding plus the merged output's: three half-ulps at most
    err = np.max(np.abs(out.astype(np.float64) - want))
    assert err <= 3 * tolerance(q, k, v)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-5)
    # mixed with float32 parts: float32 arithmetic and output
    out32, _ = fastattn.merge_attention([parts[0][0], parts[1][0].astype(np.float32)],
                                        [parts[0][1], parts[1][1]])
    assert out32.dtype == np.float32


def test_merge_16bit_with_a_float64_lse_computes_in_float64():
    o = np.ones((2, 3), np.float16)
    out, lse = fastattn.merge_attention([o, o], [np.zeros(2), np.zeros(2, np.float32)])
    assert out.dtype == np.float16 and lse.dtype == np.float64
    np.testing.assert_array_equal(lse, np.log(2))


# --------------------------------------------------------------------------
# MultiHeadAttention.new_cache(dtype=)
# --------------------------------------------------------------------------


def test_new_cache_dtype_and_float64_layers():
    layer = fastattn.MultiHeadAttention(32, 4, 2, rng=0)
    assert layer.new_cache(1, 8).dtype == np.float32
    cache = layer.new_cache(2, 8, dtype="int8")
    assert cache.quantized and (cache.batch, cache.num_kv_heads, cache.capacity, cache.head_dim) == (2, 2, 8, 8)
    wide = fastattn.MultiHeadAttention(32, 4, rng=0, dtype=np.float64)
    assert wide.new_cache(1, 8).dtype == np.float64
    with pytest.raises(TypeError, match="a float64 layer needs a float64 cache .* got dtype float16"):
        wide.new_cache(1, 8, dtype=np.float16)


# --------------------------------------------------------------------------
# Attention over the cache (needs fastattn.attention's 16-bit and int8 support)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["float16", "bfloat16", "int8"])
@pytest.mark.parametrize("q_name", ["float32", "float16"])
def test_attend_over_a_16bit_or_int8_cache_matches_the_reference(storage, q_name):
    rng = np.random.default_rng(6)
    B, Hq, Hkv, cap, E = 2, 8, 2, 200, 64
    cache = KVCache(B, Hkv, cap, E, dtype=_cache_dtype(storage))
    if storage == "bfloat16":
        _dtype(storage)
    k, v = randn(rng, (B, Hkv, 77, E)), randn(rng, (B, Hkv, 77, E))
    cache.append(k, v, lengths=[77, 50])
    q = randn(rng, (B, Hq, 3, E), _dtype(q_name))
    out, lse = cache.attend(q, return_lse=True)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    kb, vb = cache.key_buffer, cache.value_buffer  # what is stored, as attention takes it
    want, want_lse = fastattn.reference.attention(q, kb, vb, causal=True, kv_lengths=cache.lengths,
                                                  return_lse=True)
    err = float(np.max(np.abs(out.astype(np.float64) - want)))
    tol = tolerance(q, kb, vb, causal=True, kv_lengths=cache.lengths)
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("storage", ["float16", "int8"])
def test_decoding_a_layer_over_a_16bit_or_int8_cache(storage):
    """Token-by-token decoding with a float32 layer over a compressed cache
    equals the reference over what the cache stores."""
    rng = np.random.default_rng(7)
    layer = fastattn.MultiHeadAttention(64, 4, 2, rng=rng)
    x = rng.standard_normal((2, 6, 64)).astype(np.float32)
    cache = layer.new_cache(2, 8, dtype=storage)
    layer(x[:, :4], causal=True, cache=cache)
    steps = [layer(x[:, t:t + 1], causal=True, cache=cache) for t in (4, 5)]
    np.testing.assert_array_equal(cache.lengths, [6, 6])
    q, _, _ = layer.project(x)
    heads = fastattn.reference.attention(q, cache.key_buffer, cache.value_buffer, causal=True,
                                         kv_lengths=cache.lengths)
    want = heads.transpose(0, 2, 1, 3).reshape(2, 6, 64) @ layer.W_O
    for t, y in zip((4, 5), steps):
        np.testing.assert_allclose(y[:, 0], want[:, t], rtol=0, atol=1e-4)
