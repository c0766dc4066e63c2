"""16-bit and int8 storage in the kernel: float16 and bfloat16 q/k/v/out and
int8 (values, scales) K/V (keys also with per-channel factors, there with
an outlier channel), against the float64 reference on the same rounded
or dequantized inputs, for every ISA, both item layouts (forced), split-KV,
GQA, masks, causal both ways, windows, kv_lengths and modifiers; bitwise
across thread counts; float32 and float64 untouched; bad dtype combinations
refused before anything is written.

Tolerance: twice the error of textbook float32 NumPy on the same rounded
inputs, plus half an ulp of the output dtype at the largest output."""
import collections
import functools
import zlib

import numpy as np
import pytest

import fastattn
from fastattn import _api, reference
from fastattn.cache import key_channel_scales, quantize_int8 as quantize

from _helpers import as_float64 as as_f64, read_only, tolerance

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def store(x, kind, key=False):
    """x as stored: 16-bit, an int8 pair, or for keys of kind "int8ch" the
    triple with per-channel factors (values, scales, channels)."""
    if kind == "int8ch" and key:
        c = key_channel_scales(x)
        return quantize(x / c[..., None, :]) + (c,)
    if kind.startswith("int8"):
        return quantize(x)
    return x.astype({"float16": F16, "bfloat16": BF16, "float32": F32}[kind])


def check(got, case):
    """got (a kernel path's output) against the case's float64 reference."""
    assert got.dtype == case.q.dtype
    err = float(np.max(np.abs(got.astype(F64) - case.want))) if case.want.size else 0.0
    assert err <= case.tol, f"max error {err:.3g} > tolerance {case.tol:.3g}"


SHAPES = [(2, 4, 2, 37, 150, 40, 24), (1, 8, 2, 1, 1300, 64, 64), (2, 3, 3, 5, 70, 33, 17)]
KV_KINDS = ["float16", "bfloat16", "int8", "int8ch"]
Q_KINDS = {"float32": F32, "float16": F16, "bfloat16": BF16}
OPTIONS = {
    "plain": {},
    "causal_kvlen": dict(causal=True, kv_lengths=True),
    "top_left_window_mask": dict(causal="top_left", window=(20, 3), mask=True),
    "modifiers": dict(softcap=5.0, sinks=True, causal=True),
}


Case = collections.namedtuple("Case", "q k v kw want want_lse tol")


@functools.lru_cache(maxsize=None)
def _case(shape, kv, qk, opt):
    """One case: its inputs (read-only), their float64 reference (output and
    lse) and the tolerance (the float32 rule on the stored values, + half an
    ulp of a 16-bit output), computed once for every ISA and kernel path
    checked against them."""
    B, Hq, Hkv, L, S, E, Ev = shape
    rng = _rng(shape, kv, qk, opt)
    q = rng.standard_normal((B, Hq, L, E)).astype(Q_KINDS[qk])
    k = rng.standard_normal((B, Hkv, S, E)).astype(F32)
    if kv == "int8ch":
        k[..., 3] *= 20  # an outlier channel, as real keys have: what channel factors are for
    k = store(k, kv, key=True)
    v = store(rng.standard_normal((B, Hkv, S, Ev)).astype(F32), kv)
    kw = dict(OPTIONS[opt])
    if kw.get("kv_lengths"):
        kw["kv_lengths"] = rng.integers(S // 2, S + 1, size=B)
    if kw.get("mask"):
        kw["mask"] = rng.random((B, 1, L, S)) < 0.8
    if kw.get("sinks"):
        kw["sinks"] = rng.standard_normal(Hq)
    q, k, v, kw = (read_only(x) for x in (q, k, v, kw))
    want, want_lse = reference.attention(as_f64(q), as_f64(k), as_f64(v), return_lse=True, **kw)
    return Case(q, k, v, kw, want, want_lse, tolerance(q, k, v, want=want, **kw))


@pytest.mark.parametrize("opt", OPTIONS)
@pytest.mark.parametrize("qk", Q_KINDS)
@pytest.mark.parametrize("kv", KV_KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_storage_dtype_matches_reference(isa, shape, kv, qk, opt):
    c = _case(shape, kv, qk, opt)
    q, k, v, kw = c[:4]
    check(fastattn.attention(q, k, v, **kw), c)
    for layout in ("lanes", "rows"):
        for chunk in (0, 97):
            got = _api.attention_with(q, k, v, {"layout": layout, "chunk_keys": chunk}, **kw)
            check(got, c)


@pytest.mark.parametrize("kv", ["float16", "int8"])  # 2 bytes a key element, and 1
def test_storage_dtype_one_row_over_long_runs(isa, kv):
    """One row a head and 32 heads, so the driver does not split the keys:
    each item scores runs of 64 key blocks (FA_ROW_SUPER on AVX-512 and AVX2), int8
    four keys at a time, with a short last run and a ragged last block."""
    c = _case((2, 16, 16, 1, 4200, 24, 40), kv, "float32", "causal_kvlen")
    q, k, v, kw = c[:4]
    assert _api.plan(q, k, v, **kw)[0]["key_chunks"] == 1
    check(fastattn.attention(q, k, v, **kw), c)


@pytest.mark.parametrize("kv", KV_KINDS)
def test_storage_dtype_one_row_at_head_dims_of_whole_vectors(isa, kv):
    """One row a head at E = 4, 8 and 16 vectors of every ISA's float32 width,
    where the scores run with E a constant (FA_ROW_RUN), int8 four keys at a
    time summed by one tree (v_hsums4); E = 48 takes the general loop."""
    for E in (16, 32, 48, 64, 128, 256):
        c = _case((2, 4, 4, 1, 1299, E, E), kv, "float32", "causal_kvlen")
        q, k, v, kw = c[:4]
        check(fastattn.attention(q, k, v, **kw), c)


@pytest.mark.parametrize("qk", ["float32", "bfloat16"])
def test_bfloat16_one_row_in_pair_order(isa, qk):
    """One row over bfloat16 storage on the AVX2 and AVX-512 sets reads each
    pair of whole vectors of K and V as its even elements, then its odd ones
    (FA_ROW1_PAIRS), with q packed and o summed in that order: E and Ev of
    odd vector counts and tails on either width (40, 48, 72, 136, 24),
    P·V 4 and 8 vectors at a time and, over 8 vectors, whole rows (16 on
    AVX2: Ev = 72 and 136), folds (over 8 key blocks), split-KV chunks, and
    the lse; float32 and bfloat16 q."""
    for shape in [(1, 3, 3, 1, 1300, 40, 72), (2, 2, 2, 1, 700, 48, 136), (1, 2, 2, 1, 300, 136, 24)]:
        for opt in ("causal_kvlen", "modifiers"):
            c = _case(shape, "bfloat16", qk, opt)
            q, k, v, kw = c[:4]
            for chunk in (0, 256):
                got, lse = _api.attention_with(q, k, v, {"layout": "rows", "chunk_keys": chunk}, return_lse=True, **kw)
                check(got, c)
                np.testing.assert_allclose(lse, c.want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", KV_KINDS)
def test_storage_dtype_eight_rows_in_passes(isa, kv):
    """g = 8 query heads a K/V head, one new row each: items of 8 rows, whose
    P·V runs over V in passes of a few vectors (2 on the amx set, 4
    elsewhere), whole passes and a short last one (Ev = 72: 4½ vectors of 16)."""
    for shape in [(1, 16, 2, 1, 1300, 48, 96), (2, 8, 1, 1, 700, 40, 72)]:
        c = _case(shape, kv, "float32", "causal_kvlen")
        q, k, v, kw = c[:4]
        check(fastattn.attention(q, k, v, **kw), c)


@pytest.mark.parametrize("kv", KV_KINDS)
def test_storage_dtype_many_rows_at_whole_vector_head_dims(isa, kv):
    """Items of 5-8 rows whose head dim is 4 or 8 whole vectors of the set
    (E = 32, 64, 128: W = 4, 8 or 16 lanes), where the AVX-512 sets sum the
    scores of 16-bit and int8 storage with E a constant (FA_ROWS_E_CONST)
    and take the keys two at a time (FA_ROWS_KEY_PAIRS), with tails of keys
    (not a multiple of 16; an odd last key at 333) and split-KV chunks."""
    for shape in [(1, 8, 1, 1, 700, 128, 128), (2, 12, 2, 1, 530, 64, 64), (1, 5, 1, 1, 333, 32, 48)]:
        c = _case(shape, kv, "float32", "causal_kvlen")
        q, k, v, kw = c[:4]
        for chunk in (0, 256):
            got = _api.attention_with(q, k, v, {"layout": "rows", "chunk_keys": chunk}, **kw)
            check(got, c)


@pytest.mark.parametrize("kv", KV_KINDS)
def test_storage_dtype_grouped_rows_in_passes(isa, kv):
    """2, 3 and 4 query heads a K/V head with rows of over 8 vectors: on avx2
    16-bit and int8 storage take P·V 4 and 2 vectors at a time
    (FA_ROWS_CONVERT_G), whole passes (Ev = 128) and a one-vector last pass
    (Ev = 136: 17 vectors of 8); the AVX-512 sets take 8 at a time, as for
    float32."""
    for shape in [(1, 8, 2, 1, 1100, 72, 136), (2, 6, 2, 1, 800, 128, 128), (1, 4, 2, 1, 900, 136, 128)]:
        c = _case(shape, kv, "float32", "causal_kvlen")
        q, k, v, kw = c[:4]
        check(fastattn.attention(q, k, v, **kw), c)


@pytest.mark.parametrize("kv", KV_KINDS)
def test_storage_dtype_bitwise_across_threads(kv):
    c = _case((2, 8, 2, 70, 1100, 64, 64), kv, "bfloat16", "causal_kvlen")
    q, k, v, kw = c[:4]
    base, base_lse = fastattn.attention(q, k, v, num_threads=1, return_lse=True, **kw)
    assert base_lse.dtype == F32
    for n in (2, 3, 8):
        got, lse = fastattn.attention(q, k, v, num_threads=n, return_lse=True, **kw)
        assert np.array_equal(got.view(np.uint16), base.view(np.uint16)) and np.array_equal(lse, base_lse), n


def test_output_is_rounded_once_to_nearest_even():
    """A 16-bit output is the float32 result rounded once: the same bits as
    rounding the float32 call's output (both computed in float32)."""
    rng = _rng("round")
    q = rng.standard_normal((1, 4, 33, 40)).astype(F32)
    k, v = (rng.standard_normal((1, 4, 90, 40)).astype(F16) for _ in range(2))
    f32 = fastattn.attention(q, k.astype(F32), v.astype(F32))
    for dt in (F16, BF16):
        out = np.empty(f32.shape, dt)
        fastattn.attention(q.astype(dt), k, v, out=out)
        # q rounded to dt first, so compare against the same rounded q in float32
        want = fastattn.attention(q.astype(dt).astype(F32), k.astype(F32), v.astype(F32)).astype(dt)
        assert np.array_equal(out.view(np.uint16), want.view(np.uint16)), dt


def test_int8_scales_are_applied_per_row():
    """Scaling one key row's int8 values down and its scale up by 2 changes nothing."""
    rng = _rng("i8rows")
    q = rng.standard_normal((1, 2, 3, 16)).astype(F32)
    k8, ks = quantize(rng.standard_normal((1, 2, 50, 16)).astype(F32))
    v8, vs = quantize(rng.standard_normal((1, 2, 50, 16)).astype(F32))
    k8[..., 7, :] = k8[..., 7, :] // 2 * 2
    base = fastattn.attention(q, (k8, ks), (v8, vs))
    k8b, ksb = k8.copy(), ks.copy()
    k8b[..., 7, :] //= 2
    ksb[..., 7] *= 2
    assert np.allclose(fastattn.attention(q, (k8b, ksb), (v8, vs)), base, rtol=1e-6, atol=1e-7)


def test_int8_channel_factors_fold_into_the_query():
    """Keys (values, scales, c) are values·scales·c, computed as the pair
    (values, scales) with q·c: with powers of two for c (every product
    exact) the same bits; and factors of ones change no bit."""
    rng = _rng("i8chan")
    q = rng.standard_normal((2, 4, 5, 24)).astype(F32)
    k8, ks = quantize(rng.standard_normal((2, 2, 60, 24)).astype(F32))
    vv = quantize(rng.standard_normal((2, 2, 60, 24)).astype(F32))
    c = 2.0 ** rng.integers(-3, 6, (2, 2, 24)).astype(F32)
    for layout in ("lanes", "rows"):
        got = _api.attention_with(q, (k8, ks, c), vv, {"layout": layout}, causal=True)
        qc = q * np.repeat(c, 2, axis=1)[:, :, None, :]  # query head h reads K head h // 2
        want = _api.attention_with(qc, (k8, ks), vv, {"layout": layout}, causal=True)
        assert np.array_equal(got, want)
        ones = _api.attention_with(q, (k8, ks, np.ones_like(c)), vv, {"layout": layout}, causal=True)
        plain = _api.attention_with(q, (k8, ks), vv, {"layout": layout}, causal=True)
        assert np.array_equal(ones, plain)


def test_float_dtypes_still_compute_as_before():
    """float32 in, float32 out and lse; float64 stays float64 throughout."""
    rng = _rng("f3264")
    for dt in (F32, F64):
        q, k, v = (rng.standard_normal((1, 2, 9, 8)).astype(dt) for _ in range(3))
        out, lse = fastattn.attention(q, k, v, return_lse=True)
        assert out.dtype == lse.dtype == dt


BAD = [
    (lambda q, k, v: (q.astype(F16), k.astype(F64), v.astype(F64)), TypeError, "float64"),
    (lambda q, k, v: (q.astype(F64), k.astype(F16), v.astype(F16)), TypeError, "float64"),
    (lambda q, k, v: (q, k.astype(F16), v.astype(BF16)), TypeError, "same dtype"),
    (lambda q, k, v: (q, quantize(k)[0], quantize(v)), TypeError, "int8"),
    (lambda q, k, v: (q, (quantize(k)[0], quantize(k)[1][..., :-1]), quantize(v)), ValueError, "scales"),
    (lambda q, k, v: (q, (k.astype(F16), quantize(k)[1]), quantize(v)), TypeError, "int8"),
    (lambda q, k, v: (q, quantize(k), v), TypeError, "same dtype"),
    (lambda q, k, v: (q.astype(np.int8), k, v), TypeError, "q must be"),
]


def _channels(k):
    k8, ks = quantize(k)
    return k8, ks, np.ones(k.shape[:-2] + k.shape[-1:], F32)


BAD += [
    (lambda q, k, v: (q, _channels(k)[:2] + (_channels(k)[2][..., :-1],), quantize(v)), ValueError,
     r"k's channel factors \(k\[2\]\) must have shape \(1, 2, 8\)"),
    (lambda q, k, v: (q, _channels(k)[:2] + (_channels(k)[2] * np.nan,), quantize(v)), ValueError, "finite"),
    (lambda q, k, v: (q, _channels(k)[:2] + (_channels(k)[2].astype(np.int32),), quantize(v)), TypeError,
     "must be floating"),
    (lambda q, k, v: (q, _channels(k), _channels(v)), TypeError, "per-channel factors are for keys only"),
    (lambda q, k, v: (q, _channels(k) + (1,), quantize(v)), TypeError, r"got 4 items"),
]


@pytest.mark.parametrize("make, error, match", BAD, ids=[m for _, _, m in BAD])
def test_bad_dtype_combinations_are_refused(make, error, match):
    rng = _rng("bad")
    q, k, v = (rng.standard_normal((1, 2, 4, 8)).astype(F32) for _ in range(3))
    q2, k2, v2 = make(q, k, v)
    out = np.full((1, 2, 4, 8), 7, np.asarray(q2).dtype if np.asarray(q2).dtype.kind == "f" else F32)
    with pytest.raises(error, match=match):
        fastattn.attention(q2, k2, v2, out=out)
    assert (out == 7).all()


def test_bfloat16_output_rounds_whole_vectors_like_single_values(isa):
    """The output's rounding to bfloat16, a vector at a time where a row has
    whole vectors: ties to even, inf and NaN as ml_dtypes rounds them. With
    q = 0 both keys weigh 1/2, so out = (v0 + v1)/2 exactly in float32."""
    Ev = 40  # two vectors of 16 (avx512) or five of 8, and a tail of 8
    one, ulp = 1.0, 2.0**-7   # bfloat16's spacing at 1
    v0 = np.full(Ev, one, F32)
    v1 = np.full(Ev, one, F32)
    v1[0::4] = one + ulp          # mean 1 + 2^-8: a tie, to even (1)
    v1[1::4] = one + 3 * ulp      # mean 1 + 3·2^-8: a tie, to even (1 + 2^-6)
    v1[2::4] = one + ulp / 2      # not a bfloat16: cast first, below
    v0[3], v0[7], v0[11] = np.inf, np.nan, -np.inf
    v = np.stack([v0, v1]).astype(BF16)[None, None]          # (1, 1, 2, Ev)
    q = np.zeros((1, 1, 3, 32), BF16)
    k = np.zeros((1, 1, 2, 32), BF16)
    mean = (v[0, 0, 0].astype(F32) + v[0, 0, 1].astype(F32)) / 2
    want = np.broadcast_to(mean.astype(BF16), (3, Ev))
    for layout in ("rows", "lanes"):  # a whole row at once; a vector of lanes at a time
        got = _api.attention_with(q, k, v, {"layout": layout})
        same = (got[0, 0].view(np.uint16) == want.view(np.uint16)) | (np.isnan(got[0, 0].astype(F32)) &
                                                                       np.isnan(want.astype(F32)))
        assert same.all(), (layout, np.argwhere(~same))


def test_float16_output_rounds_whole_vectors_like_single_values(isa):
    """The output's rounding to float16 (F16C or AVX-512 a vector at a time,
    convert.h's single values in the tail and on other CPUs): ties to even,
    the overflow boundary, subnormals, and a NaN's sign, all as NumPy rounds
    them. With q = 0 both keys weigh 1/2, so out = (v0 + v1)/2 exactly in
    float32; v float32, q float16, so out is float16."""
    Ev = 40  # two vectors of 16 (avx512) or five of 8, and a tail of 8
    v0 = np.full(Ev, 1.0, F32)
    v1 = np.full(Ev, 1.0, F32)
    v1[0::8] = 1 + 2.0**-10             # mean 1 + 2^-11: a tie, to even (1)
    v1[1::8] = 1 + 3 * 2.0**-10         # mean 1 + 3·2^-11: a tie, to even (1 + 2^-9)
    v0[2::8], v1[2::8] = 65504, 65536   # mean 65520: the tie at the top, to inf
    v0[3::8], v1[3::8] = 65504, 65535   # mean 65519.5: stays 65504
    v0[4::8], v1[4::8] = 2.0**-24, 0    # mean 2^-25: a tie between 0 and the least subnormal, to 0
    v0[5::8], v1[5::8] = 3 * 2.0**-24, 0  # mean 1.5·2^-24: a tie, to even (2^-23)
    v0[6::8] = np.nan                   # a NaN keeps its sign
    v0[7::8] = -np.nan
    v = np.stack([v0, v1])[None, None]  # (1, 1, 2, Ev)
    q = np.zeros((1, 1, 3, 32), F16)
    k = np.zeros((1, 1, 2, 32), F32)
    with np.errstate(over="ignore"):  # 65520 rounds to inf, as meant
        want = np.broadcast_to(((v0 + v1) / 2).astype(F16), (3, Ev))
    assert np.signbit(want[0, 7]) and not np.signbit(want[0, 6])
    for layout in ("rows", "lanes"):  # a whole row at once; a vector of lanes at a time
        got = _api.attention_with(q, k, v, {"layout": layout})
        assert got.dtype == F16
        assert np.array_equal(got[0, 0].view(np.uint16), want.view(np.uint16)), (
            layout, np.argwhere(got[0, 0].view(np.uint16) != want.view(np.uint16)))
