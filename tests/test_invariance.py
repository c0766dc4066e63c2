"""Bitwise invariances of fastattn.attention: the bits do not depend on the
thread count, the memory layout of the inputs, out= or an allocated output,
the rest of the batch or of the heads, or other Python threads calling at
once. Also the ISA switch (set_isa, available_isas) and cross-ISA agreement.
"""
import math
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import fastattn
from fastattn import reference
from _helpers import bf16, planned, randn, tolerance

f32, f64 = np.float32, np.float64


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _qkv(rng, B, Hq, Hkv, L, S, E, Ev, dtype):
    return (randn(rng, (B, Hq, L, E), dtype), randn(rng, (B, Hkv, S, E), dtype),
            randn(rng, (B, Hkv, S, Ev), dtype))


def assert_bitwise(a, b, what="results"):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert np.array_equal(a, b, equal_nan=True), f"{what} differ in their bits"


# --------------------------------------------------------------------------
# Thread counts
# --------------------------------------------------------------------------

THREAD_CASES = {
    # name: (B, Hq, Hkv, L, S, E, Ev, dtype, kwargs)
    "plain_f32": (2, 4, 4, 300, 300, 64, 64, f32, {}),
    "plain_f64": (2, 4, 4, 300, 300, 64, 64, f64, {}),
    "causal_f32": (2, 4, 4, 300, 300, 64, 64, f32, dict(causal=True)),
    "causal_top_left_L<S_f64": (2, 4, 4, 173, 301, 48, 80, f64, dict(causal="top_left")),
    "gqa4_causal_L>S": (2, 8, 2, 301, 173, 64, 64, f32, dict(causal=True)),
    "mqa": (2, 4, 1, 300, 300, 64, 32, f32, {}),
    "window_mask_kv_lengths": (2, 4, 2, 257, 300, 64, 64, f32,
                               dict(window=(40, 3), kv_lengths=[300, 181], mask="additive")),
    "bool_mask_f64": (2, 4, 4, 130, 333, 32, 32, f64, dict(mask="bool")),
    "decode_L=1": (2, 8, 2, 1, 4000, 64, 64, f32, {}),
}


def _case_inputs(name):
    B, Hq, Hkv, L, S, E, Ev, dtype, kw = THREAD_CASES[name]
    rng = _rng("threads", name)
    q, k, v = _qkv(rng, B, Hq, Hkv, L, S, E, Ev, dtype)
    kw = dict(kw)
    if kw.get("mask") == "additive":
        kw["mask"] = np.where(rng.random((B, 1, L, S)) < 0.1, -np.inf, rng.standard_normal((B, 1, L, S)))
    elif kw.get("mask") == "bool":
        kw["mask"] = rng.random((L, S)) < 0.6
    return q, k, v, kw


@pytest.mark.parametrize("name", THREAD_CASES)
def test_thread_count_does_not_change_bits(isa, name):
    q, k, v, kw = _case_inputs(name)
    p = planned(q, k, v, num_threads=8, **kw)
    assert not p["serial"] and p["threads"] > 1, p  # the call really uses the workers
    base, base_lse = fastattn.attention(q, k, v, num_threads=1, return_lse=True, **kw)
    assert np.isfinite(base).all()
    for n in (2, 3, 8, None):
        out, lse = fastattn.attention(q, k, v, num_threads=n, return_lse=True, **kw)
        assert_bitwise(out, base)
        assert_bitwise(lse, base_lse)


# --------------------------------------------------------------------------
# Layouts: strided views read in place, copies made by the API, stride 0
# --------------------------------------------------------------------------

def _misaligned(a):
    buf = bytearray(a.nbytes + 1)
    m = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    m[...] = a
    assert not m.flags.aligned
    return m


def _strided(rng, layout, dtype, B=2, H=4, L=150, S=150, D=64):
    """(q, k, v) in the given layout, and contiguous copies of the same values."""
    if layout == "fused_projection":  # (B, L, 3, H, D), the output of one QKV matmul
        x = randn(rng, (B, L, 3, H, D), dtype)
        qkv = tuple(x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        assert not qkv[0].flags.c_contiguous
        return qkv, tuple(np.ascontiguousarray(a) for a in qkv)
    q, k, v = _qkv(rng, B, H, H, L, S, D, D, dtype)
    if layout == "row_slices":  # every other row and a slice of a wider head dim
        wide = tuple(randn(rng, (B, H, 2 * n, D + 7), dtype) for n in (L, S, S))
        qkv = tuple(a[:, :, ::2, 3:D + 3] for a in wide)
    elif layout == "negative_strides":
        qkv = tuple(a[::-1, ::-1, ::-1] for a in (q, k, v))
    elif layout == "last_axis_strided":
        qkv = tuple(np.repeat(a, 2, axis=-1)[..., ::2] for a in (q, k, v))
    elif layout == "fortran_order":
        qkv = tuple(np.asfortranarray(a) for a in (q, k, v))
    elif layout == "byteswapped":
        qkv = tuple(a.astype(a.dtype.newbyteorder(">")) for a in (q, k, v))
    elif layout == "misaligned":
        qkv = tuple(_misaligned(a) for a in (q, k, v))
    else:
        raise AssertionError(layout)
    return qkv, tuple(np.ascontiguousarray(a, dtype=dtype) for a in qkv)


LAYOUTS = ["fused_projection", "row_slices", "negative_strides", "last_axis_strided",
           "fortran_order", "byteswapped", "misaligned"]


@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_equals_contiguous(isa, layout, dtype):
    (q, k, v), (qc, kc, vc) = _strided(_rng("layout", layout, dtype), layout, dtype)
    for kw in ({}, dict(causal=True)):
        assert_bitwise(fastattn.attention(q, k, v, **kw), fastattn.attention(qc, kc, vc, **kw))


@pytest.mark.parametrize("dtype", [f32, f64])
def test_broadcast_batch_equals_materialised(isa, dtype):
    """A batch axis of 1 is read with stride 0: same bits as a real copy."""
    rng = _rng("broadcast", dtype)
    q, k, v = _qkv(rng, 1, 4, 2, 100, 130, 32, 16, dtype)
    k3, v3 = randn(rng, (3,) + k.shape[1:], dtype), randn(rng, (3,) + v.shape[1:], dtype)
    q3 = np.repeat(q, 3, axis=0)
    assert_bitwise(fastattn.attention(q, k3, v3, causal=True), fastattn.attention(q3, k3, v3, causal=True))
    # N-D batch that cannot merge into one strided axis vs the explicit copy
    qn = randn(rng, (2, 1, 4, 100, 32), dtype)
    kn, vn = randn(rng, (1, 3, 2, 130, 32), dtype), randn(rng, (3, 2, 130, 16), dtype)
    full = [np.ascontiguousarray(np.broadcast_to(a, (2, 3) + a.shape[-3:])) for a in (qn, kn, vn)]
    assert_bitwise(fastattn.attention(qn, kn, vn), fastattn.attention(*full))


@pytest.mark.parametrize("kind", ["bool", "additive", "f64_mask_f32_q"])
def test_broadcast_mask_equals_materialised(isa, kind):
    rng = _rng("mask-broadcast", kind)
    q, k, v = _qkv(rng, 2, 4, 4, 100, 130, 32, 32, f32)
    small = rng.random((4, 100, 1)) < 0.7 if kind == "bool" else rng.standard_normal((1, 130))
    if kind == "additive":
        small = small.astype(f32)
    full = np.ascontiguousarray(np.broadcast_to(small, (2, 4, 100, 130)))
    if kind == "f64_mask_f32_q":
        full = full.astype(f32)
    assert_bitwise(fastattn.attention(q, k, v, mask=small), fastattn.attention(q, k, v, mask=full))
    assert_bitwise(fastattn.attention(q, k, v, mask=full.T.copy().T), fastattn.attention(q, k, v, mask=full))


# --------------------------------------------------------------------------
# The API's call paths (plain arrays take a fast path; keywords, broadcasting
# or copies take the general one) give the same bits
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("E", [8, 59, 64, 128])
def test_default_scale_is_exactly_one_over_sqrt_E(isa, E, dtype):
    rng = _rng("scale", E, dtype)
    q, k, v = _qkv(rng, 2, 4, 2, 70, 90, E, 16, dtype)
    for kw in ({}, dict(causal=True)):
        want = fastattn.attention(q, k, v, scale=1 / math.sqrt(E), **kw)
        assert_bitwise(fastattn.attention(q, k, v, **kw), want)
        assert_bitwise(fastattn.attention(q[0], k[0], v[0], **kw), want[0])
        assert_bitwise(fastattn.attention(q[0, 0], k[0, 0], v[0, 0], **kw), want[0, 0])


def _dtype(name):
    return np.dtype(name) if name != "bfloat16" else bf16()


# (q's dtype, k's and v's): the binding's fast path takes each of these
CALL_DTYPES = [("float32",) * 2, ("float64",) * 2, ("float16",) * 2, ("bfloat16",) * 2,
               ("float32", "float16"), ("float32", "bfloat16"), ("float16", "float32")]


@pytest.mark.parametrize("dtypes", CALL_DTYPES, ids="/".join)
@pytest.mark.parametrize("causal", [False, True])
def test_every_call_path_gives_the_same_bits(isa, causal, dtypes):
    rng = _rng("paths", causal, dtypes)
    q, k, v = _qkv(rng, 2, 4, 2, 130, 150, 64, 48, f64)
    q, k, v = q.astype(_dtype(dtypes[0])), k.astype(_dtype(dtypes[1])), v.astype(_dtype(dtypes[1]))
    plain = fastattn.attention(q, k, v, causal=causal)
    assert plain.dtype == q.dtype
    named = "bottom_right" if causal else False
    variants = {
        "return_lse": fastattn.attention(q, k, v, causal=causal, return_lse=True)[0],
        "out": fastattn.attention(q, k, v, causal=causal, out=np.empty_like(plain)),
        "num_threads": fastattn.attention(q, k, v, causal=causal, num_threads=2),
        "causal_by_name": fastattn.attention(q, k, v, causal=named),
        "window_unbounded": fastattn.attention(q, k, v, causal=causal, window=(-1, -1)),
        "all_true_mask": fastattn.attention(q, k, v, causal=causal, mask=np.ones((130, 150), bool)),
        "full_kv_lengths": fastattn.attention(q, k, v, causal=causal, kv_lengths=150),
        "list_batch": np.stack([fastattn.attention(q[b], k[b], v[b], causal=causal) for b in range(2)]),
    }
    for name, out in variants.items():
        assert_bitwise(out, plain, name)


@pytest.mark.parametrize("dtypes", CALL_DTYPES, ids="/".join)
def test_the_binding_takes_the_common_call_in_every_dtype(dtypes):
    """The binding's fast path (checks and run in C, microseconds for a small
    call) takes plain arrays of every dtype pair attention accepts, and leaves
    a float64/16-bit mix to the general path, which words the error."""
    from fastattn import _kernel
    rng = _rng("fast", dtypes)
    q, k, v = _qkv(rng, 1, 4, 2, 10, 10, 64, 64, f64)
    q, k, v = q.astype(_dtype(dtypes[0])), k.astype(_dtype(dtypes[1])), v.astype(_dtype(dtypes[1]))
    got = _kernel.attention_fast(q, k, v, False)
    assert got is not None and got.dtype == q.dtype
    assert_bitwise(got, fastattn.attention(q, k, v, mask=np.ones((10, 10), bool)))
    if "float64" not in dtypes:
        assert _kernel.attention_fast(q.astype(f64), k, v, False) is None
        with pytest.raises(TypeError, match="float64"):
            fastattn.attention(q.astype(f64), k, v)


# --------------------------------------------------------------------------
# out=
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("form", ["contiguous", "transposed_BLHD", "slice_of_wider", "negative_rows"])
def test_out_equals_allocated(isa, form, dtype):
    rng = _rng("out", form, dtype)
    B, H, L, S, Ev = 2, 4, 150, 120, 48
    q, k, v = _qkv(rng, B, H, 2, L, S, 32, Ev, dtype)
    kw = dict(causal=True)  # L > S: the first 30 rows have no key and must be written as 0
    want, want_lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    if form == "contiguous":
        out = np.empty((B, H, L, Ev), dtype)
    elif form == "transposed_BLHD":
        out = np.empty((B, L, H, Ev), dtype).transpose(0, 2, 1, 3)
    elif form == "slice_of_wider":
        out = np.empty((B, H, L, Ev + 16), dtype)[..., 8:8 + Ev]
    else:
        out = np.empty((B, H, L, Ev), dtype)[:, :, ::-1]
    out[...] = np.nan  # garbage: every element must be overwritten
    got = fastattn.attention(q, k, v, out=out, **kw)
    assert got is out
    assert_bitwise(out, want)
    out[...] = np.nan
    got, lse = fastattn.attention(q, k, v, out=out, return_lse=True, **kw)
    assert got is out
    assert_bitwise(out, want)
    assert_bitwise(lse, want_lse)
    assert np.all(out[:, :, :L - S] == 0)


# --------------------------------------------------------------------------
# Independence of the rest of the call
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [f32, f64])
def test_batch_entry_alone_equals_inside_batch(isa, dtype):
    rng = _rng("batch-alone", dtype)
    B, S = 3, 200
    q, k, v = _qkv(rng, B, 4, 2, 150, S, 64, 32, dtype)
    mask = rng.standard_normal((B, 1, 150, S))
    lens = np.array([S, 77, 0])
    kw = dict(causal=True, window=(60, -1))
    base, base_lse = fastattn.attention(q, k, v, mask=mask, kv_lengths=lens, return_lse=True, **kw)
    for b in range(B):
        alone, lse = fastattn.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask=mask[b:b + 1],
                                        kv_lengths=lens[b:b + 1], return_lse=True, **kw)
        assert_bitwise(alone, base[b:b + 1])
        assert_bitwise(lse, base_lse[b:b + 1])
        no_batch = fastattn.attention(q[b], k[b], v[b], mask=mask[b], kv_lengths=lens[b], **kw)
        assert_bitwise(no_batch, base[b])


@pytest.mark.parametrize("dtype", [f32, f64])
def test_head_alone_equals_inside_call(isa, dtype):
    rng = _rng("head-alone", dtype)
    Hq, Hkv = 8, 2
    q, k, v = _qkv(rng, 2, Hq, Hkv, 150, 200, 64, 32, dtype)
    mask = rng.random((Hq, 150, 200)) < 0.8
    base = fastattn.attention(q, k, v, mask=mask, causal="top_left")
    g = Hq // Hkv
    for h in range(Hq):
        hk = slice(h // g, h // g + 1)
        alone = fastattn.attention(q[:, h:h + 1], k[:, hk], v[:, hk], mask=mask[h:h + 1],
                                   causal="top_left")
        assert_bitwise(alone, base[:, h:h + 1])
        two_d = fastattn.attention(q[1, h], k[1, h // g], v[1, h // g], mask=mask[h], causal="top_left")
        assert_bitwise(two_d, base[1, h])


# --------------------------------------------------------------------------
# Concurrent Python threads (the binding releases the GIL)
# --------------------------------------------------------------------------

def test_python_threads_calling_at_once():
    rng = _rng("concurrency")
    problems = []
    q, k, v = _qkv(rng, 2, 4, 4, 128, 128, 64, 64, f32)
    problems.append(((q, k, v), {}))
    q, k, v = _qkv(rng, 2, 4, 2, 100, 160, 32, 48, f64)
    problems.append(((q, k, v), dict(causal=True, mask=rng.random((100, 160)) < 0.9)))
    for args, kw in problems:
        assert not planned(*args, **kw)["serial"]
    expected = [fastattn.attention(*args, **kw) for args, kw in problems]

    n_threads, calls = 8, 50
    start = threading.Barrier(n_threads)

    def worker(t):
        start.wait()
        mismatches = 0
        for c in range(calls):
            i = (t + c) % len(problems)
            args, kw = problems[i]
            if not np.array_equal(fastattn.attention(*args, **kw), expected[i]):
                mismatches += 1
        return mismatches

    with ThreadPoolExecutor(n_threads) as pool:
        mismatches = list(pool.map(worker, range(n_threads)))
    assert mismatches == [0] * n_threads


# --------------------------------------------------------------------------
# ISAs
# --------------------------------------------------------------------------

@pytest.mark.parametrize("case", [
    (2, 4, 2, 130, 150, 64, 80, f32, {}),
    (1, 4, 4, 67, 200, 59, 16, f32, dict(causal=True)),
    (2, 2, 1, 150, 70, 16, 8, f64, dict(causal="top_left", window=(5, 5))),
    (1, 2, 2, 1, 1000, 128, 128, f32, {}),
], ids=["plain", "causal", "window_f64", "decode"])
def test_every_isa_agrees(case):
    B, Hq, Hkv, L, S, E, Ev, dtype, kw = case
    q, k, v = _qkv(_rng("isas", B, Hq, L, S), B, Hq, Hkv, L, S, E, Ev, dtype)
    tol = tolerance(q, k, v, **kw)
    results = {}
    try:
        for name in fastattn.available_isas():
            fastattn.set_isa(name)
            results[name] = fastattn.attention(q, k, v, **kw)
    finally:
        fastattn.set_isa(None)
    first = next(iter(results.values()))
    for name, out in results.items():
        assert np.max(np.abs(out.astype(f64) - first)) <= tol, name


KNOWN_ISAS = ["amx", "avx512bf16", "avx512", "avx2", "sse2", "neon", "scalar"]


def test_set_isa_and_available_isas():
    available = fastattn.available_isas()
    assert available and "scalar" in available
    assert len(set(available)) == len(available)
    assert fastattn.info()["isas"] == available
    rng = _rng("set_isa")
    q, k, v = _qkv(rng, 1, 2, 2, 9, 9, 8, 8, f64)
    ref = reference.attention(q, k, v)
    try:
        for name in available:
            fastattn.set_isa(name)
            assert fastattn.info()["isa"] == name
            np.testing.assert_allclose(fastattn.attention(q, k, v), ref, rtol=0, atol=1e-12)
        fastattn.set_isa("scalar")
        with pytest.raises(ValueError):
            fastattn.set_isa("nonexistent")
        assert fastattn.info()["isa"] == "scalar"  # a refused name changes nothing
        for name in KNOWN_ISAS:
            if name not in available:  # compiled out, or this CPU cannot run it
                with pytest.raises(ValueError):
                    fastattn.set_isa(name)
        for auto in (None, "auto"):
            fastattn.set_isa("scalar")
            fastattn.set_isa(auto)
            assert fastattn.info()["isa"] == available[0]
    finally:
        fastattn.set_isa(None)
