"""Every bad input to fastattn.attention and scaled_dot_product_attention: the
exception type, a message that names the argument, what it got and what it
needs, and no byte of `out` (or of any input) written. Also the edge sizes
that are not errors, and that repeated failures do not leak memory."""
import gc
import resource
import tracemalloc

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import fastattn

SENTINEL = 7.0
_rng = np.random.default_rng(1234)


def _r(*shape, dtype=np.float32):
    return _rng.standard_normal(shape).astype(dtype)


# Base call: q (B=2, Hq=3, L=4, E=5), k (2, 3, S=6, 5), v (2, 3, 6, Ev=7) -> out (2, 3, 4, 7).
Q, K, V = _r(2, 3, 4, 5), _r(2, 3, 6, 5), _r(2, 3, 6, 7)
OUT_SHAPE = (2, 3, 4, 7)


def _q(**over):
    """The base call's arguments with some replaced."""
    args = dict(q=Q, k=K, v=V)
    args.update(over)
    return args


def _out_view_of_v():
    buf = np.full((2, 3, 10, 7), SENTINEL, np.float32)
    return _q(v=buf[:, :, :6], out=buf[:, :, 3:7])


def _out_is_q():
    q = _r(2, 3, 4, 5)
    return _q(q=q, v=_r(2, 3, 6, 5), out=q)


def _out_rows_alias():
    # Writeable, right shape/dtype, contiguous last axis, but every row is
    # the same memory: only the C-side check can see it.
    buf = np.full(64, SENTINEL, np.float32)
    return _q(out=as_strided(buf, OUT_SHAPE, (0, 0, 0, 4)))


def _out_over_kv_lengths():
    # A 4-D decoding-style call (the binding's fast path takes out there):
    # kv_lengths is int64 read from the first bytes of out's own buffer.
    buf = np.full(OUT_SHAPE, SENTINEL, np.float32)
    lens = buf.reshape(-1)[:4].view(np.int64)
    lens[:] = 6
    return _q(out=buf, kv_lengths=lens)


def _readonly_out():
    out = np.full(OUT_SHAPE, SENTINEL, np.float32)
    out.setflags(write=False)
    return _q(out=out)


P = pytest.param
# (make the arguments, exception, regex the message must match)
ATTENTION_CASES = [
    # rank
    P(lambda: _q(q=Q[0, 0, 0]), ValueError, r"q must have at least 2 dimensions.*got shape \(5,\)", id="q-1d"),
    P(lambda: _q(k=K[0, 0, 0]), ValueError, r"k must have at least 2 dimensions.*got shape \(5,\)", id="k-1d"),
    P(lambda: _q(v=np.float32(1.0)), ValueError, r"v must have at least 2 dimensions.*got shape \(\)", id="v-0d"),
    # dtypes
    P(lambda: _q(q=Q.astype(np.float64)), TypeError,
      r"float64 computes in float64: q, k and v must then all be float64.*got q float64, k float32, v float32",
      id="dtypes-differ-q"),
    P(lambda: _q(v=V.astype(np.float64)), TypeError,
      r"k and v must have the same dtype; got k float32, v float64", id="dtypes-differ-v"),
    P(lambda: _q(q=Q.astype(np.int32)), TypeError, r"q must be float16, bfloat16, float32 or float64; got int32", id="q-int"),
    P(lambda: _q(k=K.astype(np.int64)), TypeError, r"k must be float16, bfloat16, float32 or float64 \(or an int8 pair.*got int64", id="k-int"),
    P(lambda: _q(q=Q.astype(np.complex64)), TypeError, r"q must be float16, bfloat16, float32 or float64; got complex64", id="q-complex"),
    P(lambda: _q(v=V.astype(object)), TypeError, r"v must be float16, bfloat16, float32 or float64 \(or an int8 pair.*got object", id="v-object"),
    P(lambda: _q(q=Q > 0), TypeError, r"q must be float16, bfloat16, float32 or float64; got bool", id="q-bool"),
    P(lambda: _q(q=Q.astype(np.float16), k=K.astype(np.float64), v=V.astype(np.float64)), TypeError,
      r"float64 computes in float64.*got q float16, k float64, v float64", id="float16-with-float64"),
    P(lambda: _q(k=K.astype(np.int8)), TypeError, r"k is int8: pass it with its scales", id="int8-without-scales"),
    P(lambda: _q(q=[[1, 2], [3, 4]]), TypeError, r"q must be float16, bfloat16, float32 or float64; got int64", id="q-int-list"),
    # shapes
    P(lambda: _q(k=_r(2, 3, 6, 4)), ValueError,
      r"k's last axis must equal q's \(E\): q has E=5, k has 4", id="E-mismatch"),
    P(lambda: _q(v=_r(2, 3, 5, 7)), ValueError,
      r"v must have as many rows as k \(S\): k has S=6, v has 5", id="S-mismatch"),
    P(lambda: _q(v=_r(2, 1, 6, 7)), ValueError,
      r"k and v must have the same number of heads; got 3 and 1", id="kv-heads-differ"),
    P(lambda: _q(k=_r(3, 3, 6, 5), v=_r(3, 3, 6, 7)), ValueError,
      r"leading \(batch\) shapes of q \(2,\), k \(3,\) and v \(3,\) do not broadcast", id="batch-no-broadcast"),
    P(lambda: _q(k=_r(2, 2, 6, 5), v=_r(2, 2, 6, 7)), ValueError,
      r"q's heads \(Hq=3\) must be a multiple of k's and v's heads \(Hkv=2\)", id="Hq-not-multiple"),
    # mask
    P(lambda: _q(mask=np.ones((4, 6), np.int64)), TypeError,
      r"mask must be bool .* or floating .*; got int64", id="mask-int"),
    P(lambda: _q(mask=np.zeros((4, 6), np.complex128)), TypeError,
      r"mask must be bool .* or floating .*; got complex128", id="mask-complex"),
    P(lambda: _q(mask=np.ones((4, 5), bool)), ValueError,
      r"mask of shape \(4, 5\) does not broadcast to the scores' shape \(2, 3, 4, 6\)", id="mask-bad-S"),
    P(lambda: _q(mask=np.ones((2, 2, 4, 6), bool)), ValueError,
      r"mask of shape \(2, 2, 4, 6\) does not broadcast to .*\(2, 3, 4, 6\)", id="mask-bad-heads"),
    P(lambda: _q(mask=np.zeros((5, 2, 3, 4, 6), np.float32)), ValueError,
      r"mask of shape \(5, 2, 3, 4, 6\) does not broadcast to .*\(2, 3, 4, 6\)", id="mask-extra-batch"),
    # causal
    P(lambda: _q(causal="yes"), ValueError,
      r"causal must be False, True, 'bottom_right' or 'top_left'; got 'yes'", id="causal-yes"),
    P(lambda: _q(causal=2), ValueError, r"causal must be .*'top_left'; got 2", id="causal-2"),
    P(lambda: _q(causal="top-left"), ValueError, r"causal must be .*'top_left'; got 'top-left'", id="causal-top-left-dash"),
    # window
    P(lambda: _q(window=(-2, 0)), ValueError, r"window must be \(left, right\) with each >= -1.*got \(-2, 0\)",
      id="window-left-below"),
    P(lambda: _q(window=(3, -5)), ValueError, r"window .* >= -1.*got \(3, -5\)", id="window-right-below"),
    P(lambda: _q(window=3), TypeError, r"window must be None or a pair of ints \(left, right\); got 3", id="window-int"),
    P(lambda: _q(window=(1,)), TypeError, r"window must be None or a pair of ints.*got \(1,\)", id="window-1"),
    P(lambda: _q(window=(1, 2, 3)), TypeError, r"window must be None or a pair.*got \(1, 2, 3\)", id="window-3"),
    P(lambda: _q(window=(1.5, 2)), TypeError, r"window must be None or a pair of ints.*got \(1\.5, 2\)",
      id="window-float"),
    # kv_lengths
    P(lambda: _q(kv_lengths=[1, 2, 3]), ValueError,
      r"kv_lengths of shape \(3,\) does not broadcast to the batch shape \(2,\)", id="kvlen-shape"),
    P(lambda: _q(kv_lengths=np.ones((2, 2), np.int64)), ValueError,
      r"kv_lengths of shape \(2, 2\) does not broadcast to the batch shape \(2,\)", id="kvlen-2d"),
    P(lambda: _q(kv_lengths=[1.0, 2.0]), TypeError, r"kv_lengths must be integers; got float64", id="kvlen-float"),
    P(lambda: _q(kv_lengths=[-1, 2]), ValueError, r"kv_lengths must lie in \[0, S=6\]; got values from -1 to 2",
      id="kvlen-negative"),
    P(lambda: _q(kv_lengths=[2, 7]), ValueError, r"kv_lengths must lie in \[0, S=6\]; got values from 2 to 7",
      id="kvlen-above-S"),
    # num_threads
    P(lambda: _q(num_threads=0), ValueError, r"num_threads must be >= 1 .*; got 0", id="threads-0"),
    P(lambda: _q(num_threads=-1), ValueError, r"num_threads must be >= 1 .*; got -1", id="threads-neg"),
    P(lambda: _q(num_threads=1.5), TypeError, r"num_threads must be an int or None; got 1\.5", id="threads-float"),
    # scale
    P(lambda: _q(scale=float("nan")), ValueError, r"scale must be finite; got nan", id="scale-nan"),
    P(lambda: _q(scale=float("inf")), ValueError, r"scale must be finite; got inf", id="scale-inf"),
    P(lambda: _q(scale=-np.inf), ValueError, r"scale must be finite; got -inf", id="scale-neg-inf"),
    P(lambda: _q(scale="abc"), TypeError, r"scale must be a real number; got 'abc'", id="scale-str"),
    # A numeric string is still a string: torch refuses it ("must be float, not str").
    P(lambda: _q(scale="0.5"), TypeError, r"scale must be a real number; got '0\.5'", id="scale-numeric-str"),
    P(lambda: _q(scale=1j), TypeError, r"scale must be a real number; got 1j", id="scale-complex"),
    # out
    P(lambda: _q(out=np.full((2, 3, 4, 5), SENTINEL, np.float32)), ValueError,
      r"out must have shape \(2, 3, 4, 7\); got \(2, 3, 4, 5\)", id="out-shape"),
    P(lambda: _q(out=np.full(OUT_SHAPE, SENTINEL, np.float64)), TypeError,
      r"out must have dtype float32 \(q's\); got float64", id="out-dtype"),
    P(_readonly_out, ValueError, r"out must be writeable; got a read-only array", id="out-readonly"),
    P(lambda: _q(out=np.full(OUT_SHAPE, SENTINEL).tolist()), TypeError, r"out must be a NumPy array; got list",
      id="out-list"),
    P(lambda: _q(out=np.full((2, 3, 4, 14), SENTINEL, np.float32)[..., ::2]), ValueError,
      r"out must be .*contiguous last axis; got strides \(672, 224, 56, 8\)", id="out-strided-last-axis"),
    P(_out_is_q, ValueError, r"out must not overlap its inputs; it shares memory with q", id="out-is-q"),
    P(_out_view_of_v, ValueError, r"out must not overlap its inputs; it shares memory with v", id="out-view-of-v"),
    P(_out_rows_alias, ValueError, r"out.* overlap", id="out-rows-alias"),
    P(_out_over_kv_lengths, ValueError, r"out must not overlap its inputs; it shares memory with kv_lengths",
      id="out-over-kv_lengths"),
]


def _snapshot(args):
    return {n: a.copy() for n, a in args.items() if isinstance(a, np.ndarray)}


@pytest.mark.parametrize("make, exc, match", ATTENTION_CASES)
def test_attention_rejects(make, exc, match):
    args = make()
    if "out" not in args:
        args["out"] = np.full(OUT_SHAPE, SENTINEL, np.float32)
    before = _snapshot(args)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=match):
        fastattn.attention(q, k, v, **args)
    after = dict(args, q=q, k=k, v=v)
    for name, was in before.items():
        np.testing.assert_array_equal(after[name], was, err_msg=f"{name} was written on error")
    out = args["out"]
    lens = args.get("kv_lengths")
    if isinstance(out, np.ndarray) and not np.shares_memory(out, q) and not (
            isinstance(lens, np.ndarray) and np.shares_memory(out, lens)):
        assert np.all(out == SENTINEL), "out was written on error"


SDPA_CASES = [
    P(dict(dropout_p=0.1), ValueError, r"dropout_p must be 0.*inference.*dropout.*got 0\.1", id="dropout"),
    P(dict(attn_mask=np.ones((4, 6), bool), is_causal=True), ValueError,
      r"attn_mask and is_causal=True cannot be combined", id="mask-and-causal"),
    P(dict(key=K[:, :1], value=V[:, :1]), ValueError,
      r"query has 3 heads and key 1: different head counts need enable_gqa=True", id="gqa-without-flag"),
    # torch: "argument 'is_causal' must be bool, not str"; a truthy string must not pass as True.
    P(dict(is_causal="yes"), TypeError, r"is_causal", id="is_causal-str"),
]


@pytest.mark.parametrize("kw, exc, match", SDPA_CASES)
def test_sdpa_rejects(kw, exc, match):
    args = dict(query=Q, key=K, value=V)
    args.update(kw)
    before = _snapshot(args)
    with pytest.raises(exc, match=match):
        fastattn.scaled_dot_product_attention(**args)
    for name, was in before.items():
        np.testing.assert_array_equal(args[name], was)


# ---------------------------------------------------------------- not errors

def _z(*shape):
    return np.zeros(shape, np.float32)


ZERO_SIZES = pytest.mark.parametrize("q_shape, kv_heads, out_shape", [
    ((0, 3, 4, 5), 3, (0, 3, 4, 7)),      # B = 0
    ((2, 0, 4, 5), 0, (2, 0, 4, 7)),      # H = 0 (query and key/value)
    ((2, 0, 4, 5), 1, (2, 0, 4, 7)),      # Hq = 0 with one kv head
    ((2, 3, 0, 5), 3, (2, 3, 0, 7)),      # L = 0
], ids=["B0", "H0", "Hq0", "L0"])


@ZERO_SIZES
def test_zero_size_gives_empty_result(q_shape, kv_heads, out_shape):
    B = q_shape[0]
    q, k, v = _z(*q_shape), _z(B, kv_heads, 6, 5), _z(B, kv_heads, 6, 7)
    res = fastattn.attention(q, k, v)
    assert res.shape == out_shape and res.dtype == np.float32
    res, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    assert res.shape == out_shape and lse.shape == out_shape[:-1]


@ZERO_SIZES
def test_zero_size_accepts_out(q_shape, kv_heads, out_shape):
    # NumPy gives a zero-size np.empty() all-zero strides; that is still a
    # valid `out` (there is no element to misplace).
    B = q_shape[0]
    q, k, v = _z(*q_shape), _z(B, kv_heads, 6, 5), _z(B, kv_heads, 6, 7)
    out = np.empty(out_shape, np.float32)
    assert fastattn.attention(q, k, v, out=out) is out


def test_zero_size_2d():
    res = fastattn.attention(_z(0, 5), _r(6, 5), _r(6, 7))
    assert res.shape == (0, 7)


def test_no_keys_gives_zeros():
    out = np.full(OUT_SHAPE, SENTINEL, np.float32)
    res, lse = fastattn.attention(Q, _z(2, 3, 0, 5), _z(2, 3, 0, 7), out=out, return_lse=True)
    assert res is out
    np.testing.assert_array_equal(out, 0.0)
    assert lse.shape == (2, 3, 4) and np.all(np.isneginf(lse))
    two_d = fastattn.attention(_r(4, 5, dtype=np.float64), _z(0, 5).astype(np.float64),
                               _z(0, 3).astype(np.float64))
    assert two_d.shape == (4, 3) and two_d.dtype == np.float64
    np.testing.assert_array_equal(two_d, 0.0)


# ---------------------------------------------------------------- no leaks

def _failing_mask_then_out():
    # A float64 mask is converted (a ~200 KB float32 copy) before `out` is
    # found to have the wrong dtype: a leaked copy would show at once.
    return dict(q=_r(1, 2, 64, 8), k=_r(1, 2, 256, 8), v=_r(1, 2, 256, 8),
                mask=np.zeros((1, 2, 64, 256)), out=np.zeros((1, 2, 64, 8), np.float64))


def _failing_in_kernel():
    # Passes every Python check and is refused by the C argument check.
    return dict(_out_rows_alias())


@pytest.mark.parametrize("make", [_failing_mask_then_out, _failing_in_kernel], ids=["python-check", "c-check"])
def test_repeated_failures_do_not_leak(make):
    args = make()
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")

    def fail(n):
        for _ in range(n):
            try:
                fastattn.attention(q, k, v, **args)
            except (TypeError, ValueError):
                pass
            else:
                raise AssertionError("the call was expected to fail")

    fail(50)  # warm up caches and lazily created objects
    gc.collect()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        fail(2000)
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end - start < 256 * 1024, f"traced memory grew by {end - start} bytes over 2000 failing calls"
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert rss_growth < 64 * 1024, f"max RSS grew by {rss_growth} KiB over 2000 failing calls"


# --------------------------------------------------------------------------
# The twins agree: the reference and the kernel raise the same exception type
# --------------------------------------------------------------------------

@pytest.mark.parametrize("over", [
    dict(kv_lengths=np.array([1.5, 2.0])),        # not integers
    dict(kv_lengths=np.array([7, 2])),            # above S
    dict(kv_lengths=np.array([-1, 2])),           # negative
    dict(mask=np.zeros((4, 6), np.int32)),        # neither bool nor float
    dict(mask=np.zeros((4, 5), bool)),            # does not broadcast
    dict(window=(1.5, 2)),                        # not ints
    dict(window=(-2, 0)),                         # below -1
    dict(causal="bottom_left"),                   # not an alignment
    dict(k=_r(2, 3, 6, 4)),                       # E differs
    dict(v=_r(2, 3, 5, 7)),                       # S differs
    dict(k=_r(2, 2, 6, 5), v=_r(2, 2, 6, 7)),     # Hq not a multiple of Hkv
], ids=lambda o: ",".join(f"{n}" for n in o))
def test_reference_and_kernel_raise_the_same_type(over):
    args = _q(**over)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises((TypeError, ValueError)) as kernel_error:
        fastattn.attention(q, k, v, **args)
    with pytest.raises((TypeError, ValueError)) as reference_error:
        fastattn.reference.attention(q, k, v, **args)
    assert type(reference_error.value) is type(kernel_error.value), (
        f"kernel: {kernel_error.value!r}; reference: {reference_error.value!r}")
