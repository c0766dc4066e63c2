"""The reference on storage dtypes: float16, bfloat16 (ml_dtypes) and int8
(values, scales) pairs for k and v.

The reference converts every input exactly to float64 (int8 pairs
dequantized as values · scales) and computes from there, so it must equal a
naive float64 loop on those converted values, and equal itself called with
the converted arrays. With dtype=np.float32 it is textbook float32 on the same
inputs. Every bad pair is refused with an error naming the argument. The last
tests check tests/_helpers.tolerance for 16-bit outputs, and the kernel
against the reference on these dtypes (they need the kernel's dtype support).
"""
import math

import numpy as np
import pytest

import fastattn
from fastattn import reference as ref
from _helpers import bf16, tolerance


def naive(q, k, v, causal=False, kv_lengths=None):
    """(*batch, H, rows, cols) float64 attention, one row and one key at a time."""
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    (Hq, L, E), (Hkv, S, _), Ev = q.shape[-3:], k.shape[-3:], v.shape[-1]
    q, k, v = (np.broadcast_to(x, batch + x.shape[-3:]) for x in (q, k, v))
    lengths = np.broadcast_to(S if kv_lengths is None else kv_lengths, batch)
    out, lse = np.zeros(batch + (Hq, L, Ev)), np.full(batch + (Hq, L), -math.inf)
    for b in np.ndindex(*batch):
        S_b = int(lengths[b])
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(L):
                seen = [j for j in range(S_b) if not causal or j <= i + S_b - L]
                if not seen:
                    continue
                s = {j: sum(float(q[b][h, i, e]) * float(k[b][hk, j, e]) for e in range(E))
                     / math.sqrt(E) for j in seen}
                m = max(s.values())
                p = {j: math.exp(x - m) for j, x in s.items()}
                total = sum(p.values())
                for j in seen:
                    out[b][h, i] += p[j] / total * v[b][hk, j].astype(np.float64)
                lse[b][h, i] = m + math.log(total)
    return out, lse


def int8_pair(rng, shape):
    """Random int8 values (full range) and positive float32 scales, one per row."""
    values = rng.integers(-127, 128, shape).astype(np.int8)
    scales = (rng.random(shape[:-1]) * 0.05 + 1e-3).astype(np.float32)
    return values, scales


def exact(x):
    """What the reference computes from: the float64 value of each input."""
    if isinstance(x, tuple):
        x64 = x[0].astype(np.float64) * x[1].astype(np.float64)[..., None]
        if len(x) == 3:  # keys' channel factors, one E-vector per head
            x64 = x64 * x[2].astype(np.float64)[..., None, :]
        return x64
    return np.asarray(x).astype(np.float64)


def _16bit(name):
    return np.dtype(np.float16) if name == "float16" else np.dtype(bf16())


# --------------------------------------------------------------------------
# Against the naive loop
# --------------------------------------------------------------------------


@pytest.mark.parametrize("q_dtype, kv_dtype", [
    ("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float16"),
    ("float32", "bfloat16"), ("float16", "bfloat16"), ("bfloat16", "float32"),
])
@pytest.mark.parametrize("causal", [False, True])
def test_16bit_inputs_match_the_naive_loop_on_their_float64_values(q_dtype, kv_dtype, causal):
    rng = np.random.default_rng(0)
    qd = np.dtype(q_dtype) if q_dtype == "float32" else _16bit(q_dtype)
    kvd = np.dtype(kv_dtype) if kv_dtype == "float32" else _16bit(kv_dtype)
    q = (rng.standard_normal((2, 4, 3, 8)) * 2).astype(qd)
    k = (rng.standard_normal((2, 2, 6, 8)) * 2).astype(kvd)
    v = rng.standard_normal((2, 2, 6, 5)).astype(kvd)
    out, lse = ref.attention(q, k, v, causal=causal, return_lse=True)
    want, want_lse = naive(exact(q), exact(k), exact(v), causal=causal)
    assert out.dtype == lse.dtype == np.float64
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-13)


@pytest.mark.parametrize("q_dtype", ["float32", "float16", "bfloat16", "float64"])
def test_int8_pairs_match_the_naive_loop_on_values_times_scales(q_dtype):
    rng = np.random.default_rng(1)
    qd = _16bit(q_dtype) if q_dtype in ("float16", "bfloat16") else np.dtype(q_dtype)
    q = rng.standard_normal((3, 4, 2, 16)).astype(qd)  # GQA: 4 query heads on 2
    k, v = int8_pair(rng, (3, 2, 9, 16)), int8_pair(rng, (3, 2, 9, 7))
    lengths = np.array([9, 4, 0])
    out, lse = ref.attention(q, k, v, causal=True, kv_lengths=lengths, return_lse=True)
    want, want_lse = naive(exact(q), exact(k), exact(v), causal=True, kv_lengths=lengths)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=0, atol=1e-13)


def test_int8_keys_with_channel_factors_match_the_naive_loop():
    rng = np.random.default_rng(11)
    q = rng.standard_normal((3, 4, 2, 16)).astype(np.float32)
    k = int8_pair(rng, (3, 2, 9, 16)) + (rng.uniform(0.1, 20, (3, 2, 16)).astype(np.float32),)
    v = int8_pair(rng, (3, 2, 9, 7))
    out, lse = ref.attention(q, k, v, causal=True, return_lse=True)
    want, want_lse = naive(exact(q), exact(k), exact(v), causal=True)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-12)
    # one head, 2-D: factors (E,)
    k2 = (k[0][0, 0], k[1][0, 0], k[2][0, 0])
    np.testing.assert_allclose(ref.attention(q[0, 0], k2, (v[0][0, 0], v[1][0, 0])),
                               ref.attention(q[0, 0], exact(k2), exact((v[0][0, 0], v[1][0, 0]))), atol=1e-14)


def test_int8_pairs_of_2d_and_broadcast_inputs():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((5, 8)).astype(np.float32)
    k, v = int8_pair(rng, (11, 8)), int8_pair(rng, (11, 3))  # one head: scales (S,)
    np.testing.assert_allclose(ref.attention(q, k, v), naive(exact(q)[None], exact(k)[None],
                                                             exact(v)[None])[0][0], atol=1e-13)
    # batch axes broadcast: one cache shared by a batch of 2 queries
    qb = rng.standard_normal((2, 1, 3, 8)).astype(np.float32)
    kb, vb = int8_pair(rng, (1, 1, 11, 8)), int8_pair(rng, (1, 1, 11, 3))
    assert ref.attention(qb, kb, vb).shape == (2, 1, 3, 3)
    np.testing.assert_allclose(ref.attention(qb, kb, vb), naive(exact(qb), exact(kb), exact(vb))[0],
                               atol=1e-13)


# --------------------------------------------------------------------------
# Exact conversions: the same as calling with the converted arrays
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_int8_pair_equals_its_dequantized_array_bitwise(dtype):
    """float64: values · scales is exact; float32: the textbook path rounds
    each dequantized value once to float32, then computes in float32."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 2, 4, 16)).astype(np.float32)
    k, v = int8_pair(rng, (2, 1, 30, 16)), int8_pair(rng, (2, 1, 30, 16))
    got = ref.attention_steps(q, k, v, causal=True, dtype=dtype)
    kd, vd = exact(k).astype(dtype), exact(v).astype(dtype)
    want = ref.attention_steps(q, kd, vd, causal=True, dtype=dtype)
    for name in ("scores", "weights", "output", "lse"):
        assert getattr(got, name).dtype == dtype
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def test_dequantize_is_exact_in_float64():
    values = np.array([[127, -127, 1, 0]], np.int8)
    scales = np.array([np.float32(1 / 3)])
    got = ref.dequantize(values, scales)
    assert got.dtype == np.float64
    s = float(np.float32(1 / 3))
    np.testing.assert_array_equal(got, [[127 * s, -127 * s, s, 0.0]])
    # 127 · (float32 with 24 significant bits) needs 31 bits: float64 keeps them
    assert got[0, 0] != np.float32(127 * s)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_16bit_inputs_equal_their_exact_conversion_bitwise(name, dtype):
    rng = np.random.default_rng(4)
    d = _16bit(name)
    q, k, v = (rng.standard_normal((1, 2, 7, 8)).astype(d) for _ in range(3))
    got = ref.attention(q, k, v, causal=True, dtype=dtype, return_lse=True)
    want = ref.attention(*(x.astype(dtype) for x in (q, k, v)), causal=True, dtype=dtype,
                         return_lse=True)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_array_equal(g, w)


# --------------------------------------------------------------------------
# Bad inputs: each error names the argument
# --------------------------------------------------------------------------


def _bad_cases():
    k8 = np.ones((2, 5, 4), np.int8)
    s = np.ones((2, 5), np.float32)
    f = np.ones((2, 5, 4), np.float32)
    return [
        (dict(k=k8, v=k8), TypeError, r"k is int8: int8 keys and values are passed as a pair \(values, scales\)"),
        (dict(k=f, v=k8), TypeError, r"v is int8: .* pair \(values, scales\)"),
        (dict(q=np.ones((2, 3, 4), np.int8)), TypeError, r"q must not be int8"),
        (dict(k=(k8, s), v=f), TypeError,
         r"k and v must both be int8 \(values, scales\) pairs or both arrays; got k a pair and v an array of float32"),
        (dict(k=f, v=(k8, s)), TypeError, r"got v a pair and k an array of float32"),
        (dict(k=(k8, s[:, :4]), v=(k8, s)), ValueError,
         r"k's scales \(k\[1\]\) must have shape values.shape\[:-1\] = \(2, 5\), one per row; got \(2, 4\)"),
        (dict(k=(k8, s), v=(k8, s[..., None])), ValueError, r"v's scales \(v\[1\]\) must have shape .* got \(2, 5, 1\)"),
        (dict(k=(k8, s.astype(np.int32)), v=(k8, s)), TypeError,
         r"k's scales \(k\[1\]\) must be floating point; got int32"),
        (dict(k=(k8, s), v=(k8, s > 0)), TypeError, r"v's scales \(v\[1\]\) must be floating point; got bool"),
        (dict(k=(f, s), v=(k8, s)), TypeError, r"k's values \(k\[0\]\) must be int8; got float32"),
        (dict(k=(k8.astype(np.uint8), s), v=(k8, s)), TypeError, r"k's values \(k\[0\]\) must be int8; got uint8"),
        (dict(k=(k8, s, s, s), v=(k8, s)), TypeError,
         r"k must be an array or an int8 pair \(values, scales\) or triple \(values, scales, channels\); "
         r"got a tuple of 4"),
        (dict(k=(k8, s), v=(k8, s, s)), TypeError,
         r"v must be an array or an int8 pair \(values, scales\); got a tuple of 3"),
        (dict(k=(k8, s, s), v=(k8, s)), ValueError,
         r"k's channel factors \(k\[2\]\) must have shape values.shape\[:-2\] \+ \(E,\)"),
        (dict(k=(k8, s, s[..., :4].astype(np.int16)), v=(k8, s)), TypeError,
         r"k's channel factors \(k\[2\]\) must be floating point; got int16"),
        (dict(k=(k8[0, 0], s[0, 0]), v=(k8, s)), ValueError, r"k must have at least 2 dimensions"),
    ]


@pytest.mark.parametrize("kw, error, match", _bad_cases())
def test_bad_storage_inputs_are_refused_by_name(kw, error, match):
    args = dict(q=np.ones((2, 3, 4), np.float32), k=np.ones((2, 5, 4)), v=np.ones((2, 5, 4)))
    args.update(kw)
    with pytest.raises(error, match=match):
        ref.attention(args["q"], args["k"], args["v"])
    with pytest.raises(error, match=match):  # the textbook float32 path alike
        ref.attention_steps(args["q"], args["k"], args["v"], dtype=np.float32)


# --------------------------------------------------------------------------
# tests/_helpers.tolerance on 16-bit outputs
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name, half_ulp", [("float16", 2.0**-11), ("bfloat16", 2.0**-8)])
def test_tolerance_of_16bit_outputs_covers_one_rounding_of_the_exact_output(name, half_ulp):
    """A perfect kernel (the float64 reference rounded once to q's dtype)
    passes; the tolerance is the float32 rule plus half an ulp at max|out|."""
    rng = np.random.default_rng(5)
    d = _16bit(name)
    q, k, v = (rng.standard_normal((2, 4, 5, 32)).astype(d) for _ in range(3))
    tol = tolerance(q, k, v, causal=True)
    want = ref.attention(q, k, v, causal=True)
    f32 = tolerance(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), causal=True)
    assert tol == pytest.approx(f32 + half_ulp * np.max(np.abs(want)), rel=1e-12)
    perfect = want.astype(d).astype(np.float64)
    assert np.max(np.abs(perfect - want)) <= tol
    # ... and a kernel off by two ulps of the output somewhere does not
    off = perfect.copy()
    off.flat[np.argmax(np.abs(want))] += 8 * half_ulp * np.max(np.abs(want))
    assert np.max(np.abs(off - want)) > tol


def test_tolerance_of_int8_pairs_uses_the_dequantized_values():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 2, 3, 16)).astype(np.float32)
    k, v = int8_pair(rng, (1, 2, 20, 16)), int8_pair(rng, (1, 2, 20, 16))
    tol = tolerance(q, k, v)
    same = tolerance(q, exact(k).astype(np.float32), exact(v).astype(np.float32))
    assert tol > 0 and tol == pytest.approx(same, rel=0.5)
    assert tol >= 16 * 2.0**-24 * np.max(np.abs(exact(v)))


# --------------------------------------------------------------------------
# The kernel on these dtypes (needs fastattn.attention's 16-bit and int8 support)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("q_name, kv_name", [
    ("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float16"),
    ("float32", "bfloat16"), ("float32", "int8"), ("float16", "int8"), ("bfloat16", "int8"),
])
def test_kernel_matches_the_reference_on_storage_dtypes(q_name, kv_name):
    rng = np.random.default_rng(7)
    qd = np.dtype(np.float32) if q_name == "float32" else _16bit(q_name)
    q = rng.standard_normal((2, 4, 3, 64)).astype(qd)
    if kv_name == "int8":
        k, v = int8_pair(rng, (2, 2, 77, 64)), int8_pair(rng, (2, 2, 77, 64))
    else:
        k, v = (rng.standard_normal((2, 2, 77, 64)).astype(_16bit(kv_name)) for _ in range(2))
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    want, want_lse = ref.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == qd and lse.dtype == np.float32
    err = float(np.max(np.abs(out.astype(np.float64) - want)))
    tol = tolerance(q, k, v, causal=True)
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-4)
