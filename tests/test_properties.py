"""Property tests (hypothesis): random small shapes, dtypes, GQA ratios,
broadcast batch axes, bool/additive masks of random broadcastable shapes,
causal, windows and kv_lengths; fastattn must match the reference on all.

The default profile is fixed for CI (derandomized, ~100 examples per test and
ISA). To search much harder, with fresh random examples on every run:

    HYPOTHESIS_PROFILE=thorough pytest tests/test_properties.py   # 5000 examples
"""
import os

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import fastattn
from fastattn import reference
from _helpers import tolerance

settings.register_profile(
    "fastattn-ci", max_examples=100, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "thorough", parent=settings.get_profile("fastattn-ci"), max_examples=5000, derandomize=False)
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "fastattn-ci"))

f32, f64 = np.float32, np.float64


# --------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------

@st.composite
def broadcastable(draw, shape):
    """A shape that broadcasts to `shape`: leading axes dropped, others set to 1."""
    drop = draw(st.integers(0, len(shape)))
    return tuple(n if draw(st.booleans()) else 1 for n in shape[drop:])


@st.composite
def problems(draw, with_mask=True, with_restrictions=True):
    """(q, k, v, kwargs) for fastattn.attention and the reference."""
    dtype = draw(st.sampled_from([f32, f64]))
    L, S = draw(st.integers(0, 70)), draw(st.integers(0, 70))
    E, Ev = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    batch = tuple(draw(st.lists(st.integers(0, 2), max_size=2)))
    two_d = not batch and draw(st.booleans())  # (L, E) inputs: one head, no batch
    Hkv = 1 if two_d else draw(st.integers(1, 3))
    Hq = Hkv * (1 if two_d else draw(st.sampled_from([1, 2, 3, 4])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def tensor(heads, rows, cols):
        if two_d:
            return rng.standard_normal((rows, cols)).astype(dtype)
        lead = draw(broadcastable(batch)) if batch else ()
        return rng.standard_normal(lead + (heads, rows, cols)).astype(dtype)

    q, k, v = tensor(Hq, L, E), tensor(Hkv, S, E), tensor(Hkv, S, Ev)
    # the batch shape the call sees: the broadcast of what the tensors kept
    batch = np.broadcast_shapes(*(x.shape[:-3] for x in (q, k, v) if x.ndim > 3))
    kw = {}
    if with_mask:
        kind = draw(st.sampled_from([None, "bool", "additive", "additive_neginf"]))
        scores = (L, S) if two_d else batch + (Hq, L, S)
        shape = draw(broadcastable(scores))
        if kind == "bool":
            kw["mask"] = rng.random(shape) < draw(st.sampled_from([0.2, 0.8, 1.0]))
        elif kind is not None:
            m = 2 * rng.standard_normal(shape)
            if kind == "additive_neginf":
                m = np.where(rng.random(shape) < 0.5, -np.inf, m)
            kw["mask"] = m.astype(draw(st.sampled_from([f32, f64])))
    if with_restrictions:
        kw["causal"] = draw(st.sampled_from([False, True, "bottom_right", "top_left"]))
        if draw(st.booleans()):
            kw["window"] = (draw(st.integers(-1, 80)), draw(st.integers(-1, 80)))
        if draw(st.booleans()):
            kw["kv_lengths"] = rng.integers(0, S + 1, size=draw(broadcastable(batch)))
    return q, k, v, kw


# --------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------

@PROFILE
@given(problems())
def test_matches_reference(isa, problem):
    q, k, v, kw = problem
    got, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    assert got.shape == ref.shape and got.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == q.dtype
    # no NaN in the inputs, so none in the outputs (fully hidden rows are 0, lse -inf)
    assert not np.isnan(got).any() and not np.isnan(lse).any()
    if got.size:
        assert np.max(np.abs(got - ref)) <= tolerance(q, k, v, **kw)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_array_equal(got[np.isneginf(lse)], 0)
    finite = np.isfinite(ref_lse)
    atol = (1e-5 if q.dtype == f32 else 1e-11) * (1 + np.abs(ref_lse[finite]))
    assert np.all(np.abs(lse[finite] - ref_lse[finite]) <= atol)
    # the plain call (no return_lse) gives the same output
    assert np.array_equal(fastattn.attention(q, k, v, **kw), got)


def _visibility_mask(q, k, v, kw):
    """causal/window/kv_lengths written out as one bool mask, (*batch, 1, L, S)."""
    L, S = q.shape[-2], k.shape[-2]
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    lens = np.broadcast_to(kw.get("kv_lengths", S), batch)[..., None, None, None]
    causal, window = kw.get("causal", False), kw.get("window")
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    d = i if causal == "top_left" else i + lens - L
    vis = j < lens
    if causal:
        vis = vis & (j <= d)
    if window is not None:
        if window[0] >= 0:
            vis = vis & (j >= d - window[0])
        if window[1] >= 0:
            vis = vis & (j <= d + window[1])
    return np.broadcast_to(vis, batch + (1, L, S))


@PROFILE
@given(problems(with_mask=False))
def test_restrictions_equal_their_explicit_mask(problem):
    """causal, window and kv_lengths (computed from indices, with blocks
    skipped) give what the same visibility as a bool mask gives."""
    q, k, v, kw = problem
    if q.ndim < 3:
        q, k, v = q[None], k[None], v[None]
    vis = _visibility_mask(q, k, v, kw)
    got = fastattn.attention(q, k, v, **kw)
    explicit = fastattn.attention(q, k, v, mask=vis)
    if got.size:
        assert np.max(np.abs(got - explicit)) <= tolerance(q, k, v, mask=vis)
    no_key = ~np.broadcast_to(vis, got.shape[:-1] + vis.shape[-1:]).any(-1)
    assert np.all(got[no_key] == 0)


@PROFILE
@given(problems(with_mask=False, with_restrictions=False), st.data())
def test_sparse_bool_masks_give_zeros_not_nan(problem, data):
    """Most rows fully masked: those rows are exactly 0 with lse -inf."""
    q, k, v, _ = problem
    L, S = q.shape[-2], k.shape[-2]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    mask = rng.random((L, S)) < data.draw(st.sampled_from([0.0, 0.02, 0.1]))
    got, lse = fastattn.attention(q, k, v, mask=mask, return_lse=True)
    empty = ~mask.any(-1)
    assert not np.isnan(got).any() and not np.isnan(lse).any()
    assert np.all(got[..., empty, :] == 0) and np.all(np.isneginf(lse[..., empty]))
    assert np.all(np.isfinite(lse[..., ~empty]))
    if got.size:
        ref = reference.attention(q, k, v, mask=mask)
        assert np.max(np.abs(got - ref)) <= tolerance(q, k, v, mask=mask)
