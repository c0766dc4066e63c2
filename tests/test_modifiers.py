"""Score modifiers in the kernel: softcap, ALiBi, sinks, explicit positions,
returned weights and huge finite mask values, against fastattn.reference in
float64 for every ISA, both item layouts (forced), split-KV, GQA, masks,
causal both ways, windows and kv_lengths; bitwise across thread counts; the
softcap's tanh accuracy per ISA; every bad value refused before anything is
written."""
import functools
import itertools
import zlib

import numpy as np
import pytest

import fastattn
from fastattn import _api, _kernel, reference

from _helpers import read_only, tolerance

f32, f64 = np.float32, np.float64


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _qkv(rng, B, Hq, Hkv, L, S, E, Ev, dtype, spread=1.0):
    return (spread * rng.standard_normal((B, Hq, L, E))).astype(dtype), \
        rng.standard_normal((B, Hkv, S, E)).astype(dtype), rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)


def _expect(q, k, v, **kw):
    """(want, tol): the float64 reference (out, or (out, lse) with
    return_lse) and the tolerance on these inputs, for _check."""
    want = reference.attention(q, k, v, **kw)
    tol_kw = {n: x for n, x in kw.items() if n != "return_lse"}
    return want, tolerance(q, k, v, want=want[0] if kw.get("return_lse") else want, **tol_kw)


def _check(got, q, k, v, expected=None, **kw):
    """got (out, or (out, lse)) against the reference within tolerance;
    expected: _expect's answer for these inputs, where the caller has it."""
    want, tol = expected or _expect(q, k, v, **kw)
    if kw.get("return_lse"):
        (out, lse), (want, want_lse) = got, want
        fin = np.isfinite(want_lse)
        assert np.array_equal(fin, np.isfinite(lse)), "rows with and without a finite lse differ"
        assert np.allclose(lse[fin], want_lse[fin], rtol=1e-5, atol=1e-5), "lse"
        got = out
    err = float(np.max(np.abs(got.astype(f64) - want))) if want.size else 0.0
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"


# --------------------------------------------------------------------------
# The softcap's tanh
# --------------------------------------------------------------------------

SOFTCAP_ULP = {f32: 4.5, f64: 4.5}  # measured 4.02 and 3.84 on every ISA; stated in kernel_dtype.h and README.md
# Over |x/c| ≥ 1, where a capped softmax's weight sits: 1.47 and 1.45 measured
# (1 − 2w/d there); −u/d alone gave 2.74 and 2.78.
SOFTCAP_ULP_SATURATED = 1.75


@pytest.mark.parametrize("dtype", [f32, f64])
def test_softcap_tanh_error_in_ulp(isa, dtype):
    """c·tanh(x/c) over |x/c| from 1e-6 to 20 (and 0): the error against
    tanh in long double, in ulp of the result, stays under the stated bound."""
    c = 30.0
    mags = np.concatenate([np.geomspace(1e-6, 20, 200_000), np.linspace(0, 20, 100_000)])
    x = np.concatenate([mags, -mags]) * c
    x = x.astype(dtype)
    got = _kernel.softcap(x, isa, c)
    want = (c * np.tanh(x.astype(np.longdouble) / c))
    ulp = np.spacing(np.abs(want).astype(dtype)).astype(np.longdouble)
    errs = np.abs(got.astype(np.longdouble) - want) / ulp
    err = float(np.max(errs))
    assert err <= SOFTCAP_ULP[dtype], f"{err:.2f} ulp"
    saturated = float(np.max(errs[np.abs(x) >= c]))
    assert saturated <= SOFTCAP_ULP_SATURATED, f"{saturated:.2f} ulp over |x/c| >= 1"
    assert (np.sign(got) == np.sign(x)).all()


@pytest.mark.parametrize("dtype", [f32, f64])
def test_softcap_special_values(isa, dtype):
    x = np.array([0.0, -0.0, 1e30, -1e30, np.inf, -np.inf, np.nan], dtype)
    got = _kernel.softcap(x, isa, 50.0)
    assert got[0] == 0 and got[1] == 0
    assert got[2] == 50 and got[3] == -50 and got[4] == 50 and got[5] == -50
    assert np.isnan(got[6])


# --------------------------------------------------------------------------
# Every modifier, combined with the rest, every layout and ISA
# --------------------------------------------------------------------------

# (B, Hq, Hkv, L, S, E, Ev): lanes, rows (g·L small), split-KV (few row blocks, many keys)
SHAPES = [(2, 4, 2, 37, 150, 24, 40), (1, 8, 2, 1, 1300, 64, 64), (2, 3, 3, 5, 70, 33, 17)]
MODS = {
    "softcap": dict(softcap=3.0),
    "alibi": "alibi",
    "alibi_per_batch": "alibi_b",
    "sinks": "sinks",
    "positions": dict(q_start=500, k_start=480, causal=True),
    "all": "all",
}
RESTRICTIONS = {
    "none": {},
    "causal": dict(causal=True),
    "top_left_window_kvlen": dict(causal="top_left", window=(30, 2), kv_lengths=True),
    "mask_lse": dict(mask=True, return_lse=True),
}


def _kwargs(rng, shape, dtype, mod, restriction):
    B, Hq, Hkv, L, S, E, Ev = shape
    kw = dict(RESTRICTIONS[restriction])
    m = MODS[mod]
    if m in ("alibi", "all"):
        kw["alibi_slopes"] = 2.0 ** -np.arange(1, Hq + 1) * 4
    if m == "alibi_b":
        kw["alibi_slopes"] = rng.random((B, Hq))
    if m in ("sinks", "all"):
        kw["sinks"] = rng.standard_normal(Hq) * 2
    if m == "all":
        kw["softcap"] = 5.0
    if isinstance(m, dict):
        kw.update(m)
    if kw.get("mask") is True:
        kw["mask"] = np.where(rng.random((B, 1, L, S)) < 0.2, -np.inf, rng.standard_normal((B, 1, L, S)))
    if kw.get("kv_lengths") is True:
        kw["kv_lengths"] = rng.integers(S // 2, S + 1, size=B)
    if "q_start" in kw and "window" in kw:
        del kw["window"]
    return kw


@pytest.mark.parametrize("restriction", RESTRICTIONS)
@pytest.mark.parametrize("mod", MODS)
@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_modifier_matches_reference(isa, shape, dtype, mod, restriction):
    q, k, v, kw, expected = _modifier_case(shape, dtype, mod, restriction)
    _check(fastattn.attention(q, k, v, **kw), q, k, v, expected, **kw)
    for layout in ("lanes", "rows"):  # both layouts, with and without key chunks
        for chunk in (0, 97):
            got = _api.attention_with(q, k, v, {"layout": layout, "chunk_keys": chunk}, **kw)
            _check(got, q, k, v, expected, **kw)


@functools.lru_cache(maxsize=None)
def _modifier_case(shape, dtype, mod, restriction):
    """Inputs (read-only) and _expect's answer of one case, computed once for
    every ISA and kernel path checked against them."""
    rng = _rng(shape, dtype, mod, restriction)
    q, k, v = _qkv(rng, *shape, dtype, spread=3.0)
    kw = _kwargs(rng, shape, dtype, mod, restriction)
    q, k, v, kw = (read_only(x) for x in (q, k, v, kw))
    return q, k, v, kw, _expect(q, k, v, **kw)


@pytest.mark.parametrize("mod", ["softcap", "alibi", "sinks", "all"])
def test_modifiers_bitwise_across_threads(mod):
    rng = _rng("threads", mod)
    shape = (2, 8, 2, 70, 1100, 64, 64)
    q, k, v = _qkv(rng, *shape, f32, spread=3.0)
    kw = _kwargs(rng, shape, f32, mod, "causal")
    base = fastattn.attention(q, k, v, num_threads=1, return_lse=True, **kw)
    for n in (2, 3, 8):
        got = fastattn.attention(q, k, v, num_threads=n, return_lse=True, **kw)
        assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, base)), n


# --------------------------------------------------------------------------
# Sinks
# --------------------------------------------------------------------------

@pytest.mark.parametrize("split", [0, 64], ids=["one_chunk", "split_kv"])
def test_sinks_rows_with_no_visible_key_are_zero_with_lse_the_sink(isa, split):
    rng = _rng("sink_empty")
    q, k, v = _qkv(rng, 1, 2, 2, 3, 300, 16, 16, f32)
    sinks = np.array([0.5, -2.0])
    mask = np.ones((3, 300), bool)
    mask[1] = False  # row 1 sees nothing
    out, lse = _api.attention_with(q, k, v, {"chunk_keys": split}, mask=mask, sinks=sinks, return_lse=True)
    assert (out[:, :, 1] == 0).all()
    assert np.allclose(lse[0, :, 1], sinks)
    _check((out, lse), q, k, v, mask=mask, sinks=sinks, return_lse=True)


def test_sink_of_minus_inf_is_no_sink():
    rng = _rng("sink_inf")
    q, k, v = _qkv(rng, 1, 2, 2, 9, 40, 16, 16, f64)
    with_none = fastattn.attention(q, k, v, sinks=np.array([-np.inf, -np.inf]))
    assert np.array_equal(with_none, fastattn.attention(q, k, v))


def test_sinks_over_key_shards_merge_exactly():
    """Parts computed without the sink, the sink applied once at the merge."""
    rng = _rng("sink_merge")
    q, k, v = _qkv(rng, 1, 4, 2, 6, 500, 32, 32, f64)
    sinks = rng.standard_normal(4)
    cuts = [0, 123, 124, 400, 500]
    parts = [fastattn.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True, k_start=a, q_start=494,
                                causal=True) for a, b in zip(cuts, cuts[1:])]
    out, lse = fastattn.merge_attention(*zip(*parts), sinks=sinks)
    want, want_lse = reference.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert np.allclose(out, want, rtol=1e-10, atol=1e-12) and np.allclose(lse, want_lse, rtol=1e-10)


# --------------------------------------------------------------------------
# Explicit positions: a shard gets exactly its part
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [f32, f64])
def test_shards_with_positions_merge_into_one_call(isa, dtype):
    """Keys cut anywhere, each shard called with its k_start (and the queries'
    q_start): causal, window and ALiBi see global positions, so merging the
    shards equals one call over the whole cache."""
    rng = _rng("shards", dtype)
    q, k, v = _qkv(rng, 2, 4, 2, 5, 2000, 32, 32, dtype)
    slopes = rng.random(4)
    kw = dict(causal=True, window=(700, 0), alibi_slopes=slopes)
    whole, whole_lse = fastattn.attention(q, k, v, return_lse=True, **kw)  # bottom-right: row i at 1995 + i
    cuts = [0, 63, 700, 1301, 1999, 2000]
    parts = [fastattn.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True, q_start=1995, k_start=a, **kw)
             for a, b in zip(cuts, cuts[1:])]
    out, lse = fastattn.merge_attention(*zip(*parts))
    tol = 1e-5 if dtype == f32 else 1e-12
    assert np.allclose(out, whole, rtol=tol, atol=tol) and np.allclose(lse, whole_lse, rtol=tol, atol=tol)
    _check(whole, q, k, v, **kw)


def test_positions_per_batch_entry():
    rng = _rng("pos_batch")
    q, k, v = _qkv(rng, 3, 2, 2, 4, 90, 16, 16, f64)
    qs, ks = np.array([10, 200, 89]), np.array([0, 150, 0])
    got = fastattn.attention(q, k, v, causal=True, q_start=qs, k_start=ks)
    for b in range(3):
        want = reference.attention(q[b], k[b], v[b], causal=True, q_start=int(qs[b]), k_start=int(ks[b]))
        assert np.allclose(got[b], want, atol=1e-12)


# --------------------------------------------------------------------------
# ALiBi as BLOOM writes it
# --------------------------------------------------------------------------

def test_alibi_equals_bloom_slope_times_key_on_causal_rows(isa):
    """BLOOM adds slope·j to every row; on causal rows (j ≤ i) that is
    −slope·|j − i| plus slope·i, a per-row constant the softmax ignores."""
    rng = _rng("bloom")
    q, k, v = _qkv(rng, 1, 4, 4, 50, 50, 32, 32, f64)
    slopes = 2.0 ** -np.arange(1, 5)
    bias = slopes[:, None, None] * np.arange(50)[None, None, :]
    bloom = reference.attention(q, k, v, mask=bias, causal=True)
    assert np.allclose(fastattn.attention(q, k, v, causal=True, alibi_slopes=slopes), bloom, atol=1e-12)


# --------------------------------------------------------------------------
# Huge finite mask values (Hugging Face's finfo.min padding)
# --------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["min", "max"])
@pytest.mark.parametrize("dtype", [f32, f64])
def test_huge_finite_mask_everywhere_gives_the_mean_of_v(isa, dtype, value):
    rng = _rng("huge", dtype, value)
    q, k, v = _qkv(rng, 1, 2, 2, 7, 90, 16, 16, dtype)
    mask = np.full((7, 90), getattr(np.finfo(dtype), value), dtype)
    out, lse = fastattn.attention(q, k, v, mask=mask, return_lse=True)
    assert np.isfinite(out).all()
    mean = v.astype(f64).mean(axis=-2, keepdims=True)
    assert np.allclose(out, mean, rtol=1e-5, atol=1e-5)
    want, want_lse = reference.attention(q, k, v, mask=mask, return_lse=True)
    assert np.allclose(lse, want_lse, rtol=1e-6)


def test_huge_finite_mask_on_some_keys_hides_them(isa):
    rng = _rng("huge_some")
    q, k, v = _qkv(rng, 2, 2, 2, 7, 90, 16, 16, f32)
    mask = np.zeros((2, 1, 7, 90), f32)
    mask[0, ..., 40:] = np.finfo(f32).min   # padding
    mask[1, ..., :3] = np.finfo(f32).max    # and absurdly preferred keys
    _check(fastattn.attention(q, k, v, mask=mask), q, k, v, mask=mask)


# --------------------------------------------------------------------------
# Returned weights
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, dict(causal=True, sinks=np.array([1.0, -1.0, 0.0])),
                                dict(softcap=2.0, alibi_slopes=np.array([0.5, 0.25, 0.1]), window=(4, 1))],
                         ids=["plain", "causal_sinks", "softcap_alibi_window"])
def test_weights_from_the_kernel_lse(kw):
    rng = _rng("weights", str(kw))
    q, k, v = _qkv(rng, 2, 3, 3, 9, 20, 8, 8, f64)
    out, lse, w = fastattn.attention(q, k, v, return_lse=True, return_weights=True, **kw)
    steps = reference.attention_steps(q, k, v, **kw)
    assert w.shape == (2, 3, 9, 20)
    assert np.allclose(w, steps.weights, atol=1e-12)
    assert np.allclose(w @ v, out, atol=1e-12)
    if "sinks" not in kw:
        assert np.allclose(w.sum(-1), 1)
    else:
        assert (w.sum(-1) < 1).all()


def test_weights_over_int8_keys_and_values():
    """return_weights takes int8 storage too: pairs, and keys with channel factors."""
    from fastattn.cache import key_channel_scales, quantize_int8
    rng = _rng("weights_int8")
    q, k, v = _qkv(rng, 1, 4, 2, 3, 30, 16, 8, f32)
    c = key_channel_scales(k)
    for kq in (quantize_int8(k), quantize_int8(k / c[..., None, :]) + (c,)):
        vq = quantize_int8(v)
        out, w = fastattn.attention(q, kq, vq, causal=True, return_weights=True)
        steps = reference.attention_steps(q, kq, vq, causal=True)
        assert w.shape == (1, 4, 3, 30)
        assert np.allclose(w, steps.weights, atol=1e-5)
        assert np.allclose(w.sum(-1), 1, atol=1e-5)


def test_weights_refused_above_the_limit():
    q = np.zeros((1, 1, 2048, 8), f32)
    k = np.zeros((1, 1, 4096, 8), f32)
    out = np.full((1, 1, 2048, 8), 7, f32)
    with pytest.raises(ValueError, match=r"return_weights.*2\*\*22"):
        fastattn.attention(q, k, k, return_weights=True, out=out)
    assert (out == 7).all()


# --------------------------------------------------------------------------
# Bad values: a clear error naming the argument, nothing written
# --------------------------------------------------------------------------

BAD = [
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap="big"), TypeError, "softcap"),
    (dict(alibi_slopes=np.ones(5)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.ones((3, 3))), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.array([1.0, np.nan, 1.0])), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.array(["a", "b", "c"])), TypeError, "alibi_slopes"),
    (dict(sinks=np.ones(2)), ValueError, "sinks"),
    (dict(sinks=np.array([0.0, np.nan, 1.0])), ValueError, "sinks"),
    (dict(sinks=np.array([0.0, np.inf, 1.0])), ValueError, "sinks"),
    (dict(q_start=1.5), TypeError, "q_start"),
    (dict(k_start=2**61), ValueError, "k_start"),
    (dict(q_start=np.array([1, 2, 3])), ValueError, "q_start"),
]


@pytest.mark.parametrize("over, error, name", BAD, ids=[f"{n}-{i}" for i, (_, _, n) in enumerate(BAD)])
def test_bad_modifier_values_are_refused(over, error, name):
    rng = _rng("bad")
    q, k, v = _qkv(rng, 2, 3, 3, 4, 6, 5, 7, f32)
    out = np.full((2, 3, 4, 7), 7, f32)
    with pytest.raises(error, match=name):
        fastattn.attention(q, k, v, out=out, **over)
    assert (out == 7).all()


@pytest.mark.parametrize("over", [
    dict(softcap=-2.0), dict(softcap="2"), dict(alibi_slopes=np.ones(4)), dict(alibi_slopes=[np.inf] * 3),
    dict(sinks=np.ones(5)), dict(sinks=[0.0, np.nan, 0.0]), dict(q_start=2.5), dict(k_start=-2**70),
    dict(q_start=2**61), dict(k_start=np.array([1, 2, 3])),
], ids=lambda o: ",".join(o))
def test_reference_and_kernel_refuse_modifiers_alike(over):
    rng = _rng("twins")
    q, k, v = _qkv(rng, 2, 3, 3, 4, 6, 5, 7, f64)
    with pytest.raises((TypeError, ValueError)) as kernel_error:
        fastattn.attention(q, k, v, **over)
    with pytest.raises((TypeError, ValueError)) as reference_error:
        reference.attention(q, k, v, **over)
    assert type(kernel_error.value) is type(reference_error.value), (kernel_error.value, reference_error.value)


def test_float64_mask_of_its_finfo_min_on_float32_inputs_stays_finite():
    """Hugging Face may hand a float64 padding mask to float32 attention: its
    finfo(float64).min must act as a huge finite value, as in the reference."""
    rng = _rng("f64mask")
    q, k, v = _qkv(rng, 1, 2, 2, 3, 10, 8, 8, f32)
    mask = np.full((3, 10), np.finfo(f64).min)
    out = fastattn.attention(q, k, v, mask=mask)
    assert np.allclose(out, v.astype(f64).mean(axis=-2, keepdims=True), atol=1e-6)
