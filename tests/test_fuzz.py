"""Hypothesis fuzzing of fastattn.attention (layouts, aliasing, scales, every option, a random
ISA each): results match the reference and, bit for bit, the same call on contiguous copies; each
bad argument raises its documented error and writes nothing. bfloat16 and int8 K/V get a fuzzer
of their own (storage_problems). CI: 150 derandomized examples (a few s);
`HYPOTHESIS_PROFILE=thorough pytest tests/test_fuzz.py` runs 5000 + 1000 fresh ones (about 1 min)."""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fastattn
from fastattn import reference

f32, f64 = np.float32, np.float64

# Names of their own, so test_properties.py's profiles are left as they are.
settings.register_profile(
    "fuzz-ci", max_examples=120, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large])
settings.register_profile("fuzz-thorough", parent=settings.get_profile("fuzz-ci"),
                          max_examples=5000, derandomize=False)
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
PROFILE = settings.get_profile("fuzz-thorough" if THOROUGH else "fuzz-ci")
BAD_PROFILE = settings(PROFILE, max_examples=1000 if THOROUGH else 30)


def tolerance(q, k, v, **kw):
    """tests/_helpers.py's rule (float32: max(2 × textbook float32 NumPy error,
    16·2⁻²⁴·max|V|); float64: 1e-12·max(|V|, 1)), with two changes:

    - rows that a NaN in the mask makes NaN are left out of the textbook error;
    - a floor of 4·u·max|V|·max(1, max|logit|) (u = 2⁻²⁴ or 2⁻⁵³), the output
      error that rounding a logit of that size costs. With large logits (big
      inputs or scale) the max errors of the kernel and of textbook NumPy are
      both about u·max|V|·max|logit| (measured: at most 1.1×), and "2 × the
      textbook's" fails in 0.3-6 % of random problems on noise alone.
    """
    v = np.asarray(v)
    vmax = float(np.max(np.abs(v))) if v.size else 0.0
    steps, floor = logit_floor(q, k, v, vmax, **kw)
    if np.asarray(q).dtype == np.float64:
        return max(1e-12 * max(vmax, 1.0), floor)
    ref = steps.output
    f32_ = reference.attention(q, k, v, dtype=np.float32, **kw)
    diff = np.abs(f32_ - ref)
    textbook = float(np.nanmax(diff)) if ref.size and not np.isnan(diff).all() else 0.0
    tol = max(2 * textbook, 16 * 2.0**-24 * vmax, floor)
    if np.asarray(q).dtype.itemsize == 2:  # plus the one rounding of a float16 output
        finite = np.abs(ref[np.isfinite(ref)])
        tol += max(2.0**-11 * (float(finite.max()) if finite.size else 0.0), 2.0**-25)
    return tol


def logit_floor(q, k, v, vmax, **kw):
    """(the reference's steps, 4·u·max|V|·max(1, max|logit|)): what rounding
    the largest logit costs the output (u = 2⁻²⁴, or 2⁻⁵³ for float64)."""
    steps = reference.attention_steps(q, k, v, **kw)
    # The logits before the softcap count too: a score of 10³ rounded costs
    # 10³·u before the cap squeezes it. Huge finite mask values (finfo.min/max
    # padding) are left out: every score they touch rounds to the same value
    # in the kernel and the reference.
    logits = np.abs(np.concatenate([steps.masked[np.isfinite(steps.masked)], steps.scaled.ravel()]))
    logits = logits[logits < 1e20]
    lmax = float(logits.max()) if logits.size else 0.0
    u = 2.0**-53 if np.asarray(q).dtype == np.float64 else 2.0**-24
    return steps, 4 * u * vmax * max(1.0, lmax)


# --------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------

SIZES = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65]),
                  st.integers(0, 70))
KEYS = st.one_of(st.sampled_from([0, 1, 2, 63, 64, 65, 127, 128, 129]), st.integers(0, 140))
SCALES = st.sampled_from([None, None, 0.37, -0.8, -3.0, 0.0, -0.0, 1e-30, 1e-40, 5e-8, 2.5, 12.0,
                          np.float32(0.5), np.float64(-0.25), 3])
LAYOUTS = ["contiguous", "contiguous", "reversed", "broadcast_rows", "broadcast_heads", "misaligned",
           "byteswapped", "strided", "last_axis_strided", "fortran"]


@st.composite
def broadcastable(draw, shape):
    """A shape that broadcasts to `shape`: leading axes dropped, others set to 1."""
    drop = draw(st.integers(0, len(shape)))
    return tuple(n if draw(st.booleans()) else 1 for n in shape[drop:])


def _misaligned(a):
    buf = bytearray(a.nbytes + 1)
    m = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    m[...] = a
    return m


def laid_out(a, layout, rng):
    """An array with a's shape, and values that depend only on a and layout, in
    the given memory layout."""
    if layout == "reversed":  # negative strides on every axis, or on the rows only
        axes = tuple(slice(None, None, -1) for _ in a.shape) if rng.random() < 0.5 else \
            (Ellipsis, slice(None, None, -1), slice(None))
        return np.ascontiguousarray(a[axes])[axes]
    if layout == "broadcast_rows" and a.shape[-2] > 0:  # stride 0 along rows: one row repeated
        return np.broadcast_to(a[..., :1, :], a.shape)
    if layout == "broadcast_heads" and a.ndim >= 3 and a.shape[-3] > 0:
        return np.broadcast_to(a[..., :1, :, :], a.shape)
    if layout == "misaligned":
        return _misaligned(a)
    if layout == "byteswapped":
        return a.astype(a.dtype.newbyteorder("S"))
    if layout == "strided":  # every other row of a wider buffer, columns offset by one
        big = np.zeros(a.shape[:-2] + (2 * a.shape[-2], a.shape[-1] + 3), a.dtype)
        view = big[..., ::2, 1:a.shape[-1] + 1]
        view[...] = a
        return view
    if layout == "last_axis_strided":  # the API must copy this one
        big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    if layout == "fortran":
        return np.asfortranarray(a)
    return a


@st.composite
def problems(draw, valid_batch_only=False):
    """(q, k, v, kw): arrays in random layouts and attention() keywords.
    kw may hold out= (pre-filled with NaN) and num_threads."""
    dtype = draw(st.sampled_from([f32, f64, np.float16]))  # float16 computes in float32
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    two_d = draw(st.integers(0, 5)) == 0
    batch = () if two_d else tuple(draw(st.lists(st.integers(1 if valid_batch_only else 0, 2), max_size=2)))
    Hkv = 1 if two_d else draw(st.integers(1, 3))
    Hq = Hkv * (1 if two_d else draw(st.sampled_from([1, 2, 3])))
    L, S = draw(SIZES), draw(KEYS)
    E, Ev = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    alias = draw(st.sampled_from([None, None, None, "v_is_k", "v_view_of_k", "q_is_k"]))
    if alias == "v_is_k":
        Ev = E
    elif alias == "v_view_of_k":
        Ev = min(Ev, E)
    amplitude = draw(st.sampled_from([1.0, 1.0, 4.0, 30.0]))

    def values(heads, rows, cols):
        lead = () if two_d else (draw(broadcastable(batch)) if batch else ()) + (heads,)
        return (amplitude * rng.standard_normal(lead + (rows, cols))).astype(dtype)

    q, k, v = values(Hq, L, E), values(Hkv, S, E), values(Hkv, S, Ev)
    q, k, v = (laid_out(a, draw(st.sampled_from(LAYOUTS)), rng) for a in (q, k, v))
    if alias == "v_is_k":
        v = k
    elif alias == "v_view_of_k":
        v = k[..., E - Ev:]
    elif alias == "q_is_k" and q.shape == k.shape:
        q = k

    full_batch = np.broadcast_shapes(*(a.shape[:-3] for a in (q, k, v)))
    scores_shape = (L, S) if two_d else full_batch + (Hq, L, S)
    kw = {}
    kind = draw(st.sampled_from([None, "bool", "additive", "neginf", "nan", "huge"]))
    if kind is not None:
        shape = draw(broadcastable(scores_shape))
        if kind == "bool":
            m = np.asarray(rng.random(shape) < draw(st.sampled_from([0.05, 0.5, 0.9, 1.0])))
        else:
            m = np.asarray(2 * rng.standard_normal(shape))
            if kind in ("neginf", "nan"):
                m[rng.random(shape) < 0.3] = -np.inf
            if kind == "nan":  # NaN in an additive mask: its row is NaN (or hidden)
                m[rng.random(shape) < 0.02] = np.nan
            m = m.astype(draw(st.sampled_from([f32, f64])))
            if kind == "huge":  # Hugging Face's padding: finfo.min on some or all keys, finfo.max on a few
                lim = np.finfo(m.dtype)
                m[rng.random(shape) < draw(st.sampled_from([0.3, 1.0]))] = lim.min
                m[rng.random(shape) < draw(st.sampled_from([0.0, 0.05, 1.0]))] = lim.max
        mask_layout = draw(st.sampled_from(["contiguous", "broadcast", "transposed", "misaligned",
                                            "byteswapped"]))
        if mask_layout == "broadcast":
            m = np.broadcast_to(m, scores_shape)
        elif mask_layout == "transposed":
            m = m.T.copy().T
        elif mask_layout == "misaligned":
            m = _misaligned(m)
        elif mask_layout == "byteswapped" and m.dtype.kind == "f":
            m = m.astype(m.dtype.newbyteorder("S"))
        kw["mask"] = m
    kw["causal"] = draw(st.sampled_from([False, True, "bottom_right", "top_left", None]))
    if draw(st.booleans()):
        kw["window"] = (draw(st.integers(-1, S + 3)), draw(st.integers(-1, S + 3)))
    if draw(st.booleans()):
        lens = rng.integers(0, S + 1, size=draw(broadcastable(full_batch)) if full_batch else ())
        kw["kv_lengths"] = lens.astype(draw(st.sampled_from([np.int64, np.int32, np.uint16])))
    kw["scale"] = draw(SCALES)
    # Score modifiers, each on or off.
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 5.0, 50.0]))
    if draw(st.booleans()):
        kw["alibi_slopes"] = rng.random(Hq) * draw(st.sampled_from([0.05, 1.0]))
    if draw(st.booleans()):
        sinks = 2 * rng.standard_normal(Hq)
        sinks[rng.random(Hq) < 0.2] = -np.inf
        kw["sinks"] = sinks
    if draw(st.booleans()):
        kw["q_start"] = int(draw(st.integers(-100, 300)))
        kw["k_start"] = int(draw(st.integers(-100, 300)))
    kw["return_lse"] = draw(st.booleans())
    kw["num_threads"] = draw(st.sampled_from([None, 1, 2, 3, 64]))
    out_layout = draw(st.sampled_from([None, None, "contiguous", "transposed", "slice_of_wider",
                                       "negative_rows"]))
    if out_layout is not None:
        lead = scores_shape[:-2]
        if out_layout == "transposed" and len(lead) >= 1:
            out = np.empty(lead[:-1] + (L, lead[-1], Ev), dtype).swapaxes(-2, -3)
        elif out_layout == "slice_of_wider":
            out = np.empty(lead + (L, Ev + 5), dtype)[..., 2:2 + Ev]
        elif out_layout == "negative_rows":
            out = np.empty(lead + (L, Ev), dtype)[..., ::-1, :]
        else:
            out = np.empty(lead + (L, Ev), dtype)
        out[...] = np.nan  # garbage: every element must be overwritten
        kw["out"] = out
    return q, k, v, kw


def _plain(q, k, v, kw):
    """The same call on native, contiguous copies, with default threads and no out=."""
    def copy(a):
        a = np.asarray(a)
        return np.array(a, dtype=a.dtype.newbyteorder("="), order="C")
    plain = {n: x for n, x in kw.items() if n not in ("out", "num_threads")}
    if "mask" in plain:
        plain["mask"] = copy(plain["mask"])
    return copy(q), copy(k), copy(v), plain


def _bitwise(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


# --------------------------------------------------------------------------
# Valid calls
# --------------------------------------------------------------------------

@PROFILE
@given(problem=problems(), isa=st.sampled_from(fastattn.available_isas()))
def test_fuzz_matches_reference(problem, isa, record_property):
    q, k, v, kw = problem
    fastattn.set_isa(isa)
    try:
        result = fastattn.attention(q, k, v, **kw)
        qc, kc, vc, plain = _plain(q, k, v, kw)
        want = fastattn.attention(qc, kc, vc, **plain)
    finally:
        fastattn.set_isa(None)
    got, lse = result if kw["return_lse"] else (result, None)
    want, want_lse = want if kw["return_lse"] else (want, None)
    if "out" in kw:
        assert got is kw["out"]
    assert got.dtype == qc.dtype and got.dtype.isnative
    # Layout, aliasing, out= and the thread count change no bit.
    assert _bitwise(got, want), "result differs from the same call on contiguous copies"
    if lse is not None:
        assert _bitwise(lse, want_lse)

    ref_kw = {n: x for n, x in plain.items() if n != "return_lse"}
    ref, ref_lse = reference.attention(qc, kc, vc, return_lse=True, **ref_kw)
    assert got.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    tol = tolerance(qc, kc, vc, **ref_kw)
    err = float(np.max(np.abs(got[ok].astype(f64) - ref[ok]))) if ok.any() else 0.0
    record_property("fa_compare", (err, tol))
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"
    if lse is not None:
        assert lse.shape == ref_lse.shape and lse.dtype == (f64 if got.dtype == f64 else f32)
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        assert np.all(got[np.isneginf(lse)] == 0), "a row with no visible key is not 0"
        fin = np.isfinite(ref_lse)
        # an lse beyond the output dtype's range (a float64 mask of finfo.max on
        # float32 inputs) is held at that range's edge
        lim = np.finfo(lse.dtype)
        ref_lse = np.where(fin, np.clip(ref_lse, float(lim.min), float(lim.max)), ref_lse)
        atol = lse_tolerance(qc, kc, ref_kw.get("scale"), ref_kw.get("mask"), ref_lse[fin])
        assert np.all(np.abs(lse[fin] - ref_lse[fin]) <= atol)


def lse_tolerance(q, k, scale, mask, ref_lse):
    """tests/test_attention.py's lse rule, (1e-5 or 1e-11)·(1 + |lse|), plus the
    rounding error of a logit in the inputs' precision: 4·u·√(E+1)·(1 + D + M)
    with D = |scale|·max‖q row‖·max‖k row‖ ≥ |scale|·Σₑ|qₑ·kₑ| and M the largest
    finite |mask|. A logit of 3 made of terms of 10⁴ (large inputs, cancellation)
    is only as good as 10⁴·u."""
    E = q.shape[-1]
    scale = 1 / np.sqrt(E) if scale is None else float(scale)
    norm = lambda a: float(np.max(np.linalg.norm(a.astype(f64), axis=-1))) if a.size else 0.0  # noqa: E731
    D = abs(scale) * norm(q) * norm(k)
    m = np.abs(np.asarray(mask, f64)) if mask is not None and np.asarray(mask).dtype.kind == "f" else None
    M = float(np.max(m[np.isfinite(m)])) if m is not None and np.isfinite(m).any() else 0.0
    u = 2.0**-53 if q.dtype == f64 else 2.0**-24
    return (1e-11 if q.dtype == f64 else 1e-5) * (1 + np.abs(ref_lse)) + 4 * u * np.sqrt(E + 1) * (1 + D + M)


# --------------------------------------------------------------------------
# Bad calls: one defect in an otherwise valid call
# --------------------------------------------------------------------------

def _heads_not_multiple(q, k, v, kw):
    if q.ndim < 3:
        return None
    Hq, Hkv = q.shape[-3], k.shape[-3]
    bad = next(h for h in range(Hkv + 1, Hkv + 8) if Hq % h)
    return dict(k=np.zeros(k.shape[:-3] + (bad,) + k.shape[-2:], k.dtype),
                v=np.zeros(v.shape[:-3] + (bad,) + v.shape[-2:], v.dtype))


def _out_overlaps_q(q, k, v, kw):
    out = kw["out"]
    if q.size == 0 or out.size < q.size or not out.flags.c_contiguous:
        return None
    return dict(q=out.reshape(-1)[:q.size].reshape(q.shape))


def _other(dtype):
    return f64 if np.dtype(dtype).newbyteorder("=") == f32 else f32


def _out_shape(out):
    return out.shape[:-1] + (out.shape[-1] + 1,)


# name: (make the replaced arguments from (q, k, v, kw), or None when not applicable;
#        exception; regex the message must match)
DEFECTS = {
    "q_rank_1": (lambda q, k, v, kw: dict(q=np.zeros(3, q.dtype)), ValueError, r"q must have at least 2"),
    "q_int": (lambda q, k, v, kw: dict(q=np.zeros(q.shape, np.int32)), TypeError, r"q must be float16, bfloat16, float32 or float64"),
    "k_float16": (lambda q, k, v, kw: None if k.dtype.itemsize == 2 else dict(k=np.zeros(k.shape, np.float16)),
                  TypeError,
                  r"k and v must have the same dtype"),
    "v_other_dtype": (lambda q, k, v, kw: dict(v=np.zeros(v.shape, _other(v.dtype))), TypeError,
                      r"k and v must have the same dtype"),
    "E_mismatch": (lambda q, k, v, kw: dict(k=np.zeros(k.shape[:-1] + (k.shape[-1] + 1,), k.dtype)),
                   ValueError, r"k's last axis must equal q's"),
    "S_mismatch": (lambda q, k, v, kw: dict(v=np.zeros(v.shape[:-2] + (v.shape[-2] + 1, v.shape[-1]), v.dtype)),
                   ValueError, r"v must have as many rows as k"),
    "E_zero": (lambda q, k, v, kw: dict(q=np.zeros(q.shape[:-1] + (0,), q.dtype),
                                        k=np.zeros(k.shape[:-1] + (0,), k.dtype)),
               ValueError, r"head dims must be at least 1"),
    "heads_not_multiple": (_heads_not_multiple, ValueError, r"must be a multiple of|same number of heads"),
    "mask_int": (lambda q, k, v, kw: dict(mask=np.ones((q.shape[-2], k.shape[-2]), np.int64)), TypeError,
                 r"mask must be bool"),
    "mask_wrong_S": (lambda q, k, v, kw: dict(mask=np.ones((q.shape[-2], k.shape[-2] + 2), bool)), ValueError,
                     r"mask of shape .* does not broadcast"),
    "causal_word": (lambda q, k, v, kw: dict(causal="top-left"), ValueError, r"causal must be"),
    "causal_int": (lambda q, k, v, kw: dict(causal=2), ValueError, r"causal must be"),
    "window_below": (lambda q, k, v, kw: dict(window=(-2, 3)), ValueError, r"window must be \(left, right\)"),
    "window_int": (lambda q, k, v, kw: dict(window=3), TypeError, r"window must be None or a pair"),
    "window_float": (lambda q, k, v, kw: dict(window=(1.5, 2)), TypeError, r"window must be None or a pair"),
    "kv_lengths_above_S": (lambda q, k, v, kw: dict(kv_lengths=k.shape[-2] + 1), ValueError,
                           r"kv_lengths must lie in \[0, S="),
    "kv_lengths_negative": (lambda q, k, v, kw: dict(kv_lengths=-1), ValueError, r"kv_lengths must lie in"),
    "kv_lengths_float": (lambda q, k, v, kw: dict(kv_lengths=1.0), TypeError, r"kv_lengths must be integers"),
    "scale_nan": (lambda q, k, v, kw: dict(scale=float("nan")), ValueError, r"scale must be finite"),
    "scale_inf": (lambda q, k, v, kw: dict(scale=-np.inf), ValueError, r"scale must be finite"),
    "scale_str": (lambda q, k, v, kw: dict(scale="0.5"), TypeError, r"scale must be a real number"),
    "threads_0": (lambda q, k, v, kw: dict(num_threads=0), ValueError, r"num_threads must be >= 1"),
    "threads_float": (lambda q, k, v, kw: dict(num_threads=2.0), TypeError, r"num_threads must be an int"),
    "out_dtype": (lambda q, k, v, kw: dict(out=np.full(kw["out"].shape, 7, _other(kw["out"].dtype))),
                  TypeError, r"out must have dtype"),
    "out_shape": (lambda q, k, v, kw: dict(out=np.full(_out_shape(kw["out"]), 7, kw["out"].dtype)),
                  ValueError, r"out must have shape"),
    "out_list": (lambda q, k, v, kw: dict(out=kw["out"].tolist()), TypeError, r"out must be a NumPy array"),
    "out_overlaps_q": (_out_overlaps_q, ValueError, r"out must not overlap its inputs; it shares memory with q"),
}


@BAD_PROFILE
@given(problem=problems(valid_batch_only=True))
def test_fuzz_bad_input_raises_documented_error(problem, record_property):
    """Every defect of DEFECTS in turn, each alone in this otherwise valid call."""
    q, k, v, kw = problem
    kw = dict(kw)
    out = np.empty(np.broadcast_shapes(*(a.shape[:-3] for a in (q, k, v))) + (
        (q.shape[-3],) if q.ndim >= 3 else ()) + (q.shape[-2], v.shape[-1]), np.asarray(q).dtype.newbyteorder("="))
    out[...] = 7.0
    kw["out"] = out
    fastattn.attention(q, k, v, **dict(kw, out=np.empty_like(out)))  # the call without a defect is valid
    for defect, (make, exc, match) in DEFECTS.items():
        change = make(q, k, v, kw)
        if change is None:  # not applicable to this problem
            continue
        args = dict(q=q, k=k, v=v, **kw)
        args.update(change)
        before = {n: np.array(a, copy=True) for n, a in args.items() if isinstance(a, np.ndarray)}
        with pytest.raises(exc, match=match) as info:
            fastattn.attention(**args)
        record_property("fa_bad_input", (defect, type(info.value).__name__))
        for name, was in before.items():  # nothing written: not out, not any input
            assert _bitwise(np.asarray(args[name]), was), f"{defect}: {name} was written by a failing call"


# --------------------------------------------------------------------------
# Storage dtypes: bfloat16 and int8 K/V (float16 runs in problems() above)
# --------------------------------------------------------------------------

@st.composite
def storage_problems(draw):
    """(q, k, v, kw): bfloat16 or int8 K/V (pairs, or keys with channel
    factors), q in float32, float16 or bfloat16, and attention() keywords."""
    from _helpers import bf16
    from fastattn.cache import key_channel_scales, quantize_int8
    BF16 = np.dtype(bf16())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    Hq = Hkv * draw(st.sampled_from([1, 2, 4]))
    L, S = draw(SIZES), draw(KEYS)
    E, Ev = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    amplitude = draw(st.sampled_from([1.0, 4.0]))
    q = (amplitude * rng.standard_normal((B, Hq, L, E))).astype(draw(st.sampled_from([f32, np.float16, BF16])))
    k = amplitude * rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, Ev))
    if E > 1 and draw(st.booleans()):
        k[..., int(rng.integers(E))] *= 20  # an outlier channel
    storage = draw(st.sampled_from(["bfloat16", "int8", "int8_channels"]))
    if storage == "bfloat16":
        k, v = k.astype(BF16), v.astype(BF16)
        if draw(st.booleans()):  # strided K/V: every other row of a wider buffer
            k = np.repeat(k, 2, axis=2)[:, :, ::2]
    elif storage == "int8":
        k, v = quantize_int8(k), quantize_int8(v)
    else:
        c = key_channel_scales(k) if S else np.ones((B, Hkv, E), f32)
        k, v = quantize_int8(k / c[..., None, :]) + (c,), quantize_int8(v)
    kw = {"causal": draw(st.sampled_from([False, True, "top_left"]))}
    if draw(st.booleans()):
        kw["window"] = (draw(st.integers(-1, S + 3)), draw(st.integers(-1, S + 3)))
    if draw(st.booleans()):
        kw["kv_lengths"] = rng.integers(0, S + 1, size=B)
    if L and S and draw(st.booleans()):
        kw["mask"] = rng.random((B, 1, L, S)) < 0.8
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 5.0, 50.0]))
    if draw(st.booleans()):
        kw["alibi_slopes"] = rng.random(Hq) * 0.1
    if draw(st.booleans()):
        kw["sinks"] = rng.standard_normal(Hq)
    if draw(st.booleans()):
        kw["q_start"], kw["k_start"] = int(draw(st.integers(-50, 200))), int(draw(st.integers(-50, 200)))
    return q, k, v, kw


@PROFILE
@given(problem=storage_problems(), isa=st.sampled_from(fastattn.available_isas()),
       threads=st.sampled_from([2, 3, 64]))
def test_fuzz_storage_dtypes_match_reference(problem, isa, threads, record_property):
    """bfloat16 and int8 K/V against the float64 reference on the stored
    values (tests/_helpers.py's tolerance: the float32 rule, half an ulp of a
    16-bit output, the channel fold's rounding; plus tolerance()'s floor for
    large logits), and bitwise across thread counts, on a random ISA."""
    from _helpers import as_float64, tolerance as storage_tolerance
    q, k, v, kw = problem
    fastattn.set_isa(isa)
    try:
        got, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=1, **kw)
        again, lse_again = fastattn.attention(q, k, v, return_lse=True, num_threads=threads, **kw)
    finally:
        fastattn.set_isa(None)
    assert got.dtype == q.dtype and lse.dtype == f32
    assert _bitwise(got, again) and _bitwise(lse, lse_again), "result depends on the thread count"
    v64 = as_float64(v)
    steps, floor = logit_floor(q, k, v, float(np.max(np.abs(v64))) if v64.size else 0.0, **kw)
    ref = steps.output
    tol = storage_tolerance(q, k, v, **kw) + floor
    err = float(np.max(np.abs(got.astype(f64) - ref))) if ref.size else 0.0
    record_property("fa_compare", (err, tol))
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"
    if lse.size:  # a row with no visible key: zeros, lse -inf or the sink
        np.testing.assert_array_equal(got[np.isneginf(lse)], 0)
