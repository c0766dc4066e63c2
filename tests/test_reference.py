"""Tests of fastattn.reference, the NumPy oracle the kernel is checked against.

The oracle is compared with a naive loop (one query row, one key, math.exp at
a time) on tiny inputs, with the lecture's worked example, the shape walk of
a multi-head layer, and exact properties (permutation, masking, edge cases).
The score modifiers (softcap, ALiBi, sinks, explicit positions) are checked
against the same loop, against other formulations of the same thing (BLOOM's
ALiBi, a sink as an extra key) and by merging key shards.
"""

import importlib.util
import itertools
import math
import pathlib
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st


def _load_reference():
    # fastattn/__init__.py may import the compiled kernel, which need not be
    # built for these tests: fall back to loading reference.py by file path.
    try:
        import fastattn.reference as module
    except ImportError:
        path = pathlib.Path(__file__).resolve().parents[1] / "fastattn" / "reference.py"
        spec = importlib.util.spec_from_file_location("_fastattn_reference", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


ref = _load_reference()
rng = np.random.default_rng(0)


def naive(q, k, v, mask=None, causal=False, window=None, kv_lengths=None, scale=None,
          softcap=None, alibi_slopes=None, sinks=None, q_start=None, k_start=None):
    """Attention of (*batch, H, rows, cols) inputs, one row and one key at a time."""
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    (Hq, L, E), (Hkv, S, _), Ev = q.shape[-3:], k.shape[-3:], v.shape[-1]
    q, k, v = (np.broadcast_to(x, batch + x.shape[-3:]) for x in (q, k, v))
    if mask is not None:
        mask = np.broadcast_to(mask, batch + (Hq, L, S))
    lengths = np.broadcast_to(S if kv_lengths is None else kv_lengths, batch)
    scale = 1 / math.sqrt(E) if scale is None else scale
    positions = q_start is not None or k_start is not None
    q_pos = np.broadcast_to(np.asarray(0 if q_start is None else q_start, object), batch)
    k_pos = np.broadcast_to(np.asarray(0 if k_start is None else k_start, object), batch)
    slopes = None if alibi_slopes is None else np.broadcast_to(alibi_slopes, batch + (Hq,))
    out, lse = np.zeros(batch + (Hq, L, Ev)), np.zeros(batch + (Hq, L))
    for b in np.ndindex(*batch):
        S_b = int(lengths[b])
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            sink = -math.inf if sinks is None else float(sinks[h])
            for i in range(L):
                if positions:  # global positions; Python ints, so no overflow
                    diag = int(q_pos[b]) + i - int(k_pos[b])
                else:
                    diag = i if causal == "top_left" else i + S_b - L
                logits = {}
                for j in range(S_b):
                    if causal and j > diag:
                        continue
                    if window and window[0] >= 0 and j < diag - window[0]:
                        continue
                    if window and window[1] >= 0 and j > diag + window[1]:
                        continue
                    s = sum(q[b][h, i, e] * k[b][hk, j, e] for e in range(E)) * scale
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= float(slopes[b][h]) * float(abs(j - diag))
                    if mask is not None and mask.dtype == bool:
                        if not mask[b][h, i, j]:
                            continue
                    elif mask is not None:
                        s += mask[b][h, i, j]
                    if s != -math.inf:
                        logits[j] = s
                m = max([*logits.values(), sink])
                if m == -math.inf:  # nothing visible and no sink
                    lse[b][h, i] = -math.inf
                    continue
                w = {j: math.exp(s - m) for j, s in logits.items()}
                total = sum(w.values()) + math.exp(sink - m)  # the sink: mass, no value
                lse[b][h, i] = m + math.log(total)
                for c in range(Ev):
                    out[b][h, i, c] = sum(w[j] * v[b][hk, j, c] for j in w) / total
    return out, lse


def qkv(batch=(2,), Hq=2, Hkv=None, L=3, S=4, E=5, Ev=None, q_batch=None):
    Hkv, Ev = Hkv or Hq, Ev or E
    q = rng.standard_normal((q_batch or batch) + (Hq, L, E))
    k = rng.standard_normal(batch + (Hkv, S, E))
    v = rng.standard_normal(batch + (Hkv, S, Ev))
    return q, k, v


def additive_mask(shape):
    m = rng.standard_normal(shape)
    m[rng.random(shape) < 0.3] = -np.inf
    return m


CASES = {
    "plain": (dict(), dict()),
    "bool_mask": (dict(), dict(mask=rng.random((2, 2, 3, 4)) < 0.6)),
    "bool_mask_broadcast": (dict(), dict(mask=rng.random((3, 4)) < 0.6)),
    "additive_mask_-inf": (dict(), dict(mask=additive_mask((2, 2, 3, 4)))),
    "scale": (dict(), dict(scale=0.7)),
    "window_no_causal": (dict(L=5, S=7), dict(window=(2, 1))),
    "window_top_left": (dict(L=5, S=7), dict(causal="top_left", window=(1, -1))),
    "window_causal_left_unbounded": (dict(L=4, S=6), dict(causal=True, window=(-1, 0))),
    "kv_lengths": (dict(L=3, S=6), dict(kv_lengths=np.array([6, 2]))),
    "kv_lengths_causal": (dict(L=2, S=6), dict(kv_lengths=np.array([4, 0]), causal=True)),
    "kv_lengths_window_top_left": (
        dict(L=4, S=6), dict(kv_lengths=np.array([3, 5]), causal="top_left", window=(1, 0))),
    "gqa_4_2": (dict(Hq=4, Hkv=2), dict(causal=True)),
    "mqa_4_1": (dict(Hq=4, Hkv=1), dict(mask=rng.random((4, 3, 4)) < 0.7)),
    "ev_ne_e": (dict(E=3, Ev=6), dict()),
    "broadcast_batch": (dict(batch=(1, 2), q_batch=(3, 1)), dict(kv_lengths=np.array([4, 1]))),
}
for causal, (L, S) in itertools.product(
        [True, "bottom_right", "top_left"], [(2, 5), (4, 4), (6, 3)]):
    CASES[f"causal_{causal}_L{L}_S{S}"] = (dict(L=L, S=S), dict(causal=causal))

# Score modifiers (issue 11), alone and together with the restrictions.
MODIFIER_CASES = {
    "softcap": (dict(), dict(softcap=0.8, scale=2.0)),
    "softcap_large": (dict(), dict(softcap=50.0)),
    "softcap_causal_additive_mask": (
        dict(L=4, S=6), dict(softcap=1.5, causal=True, mask=additive_mask((2, 2, 4, 6)))),
    "alibi": (dict(L=3, S=6), dict(alibi_slopes=np.array([0.5, 0.25]))),
    "alibi_causal": (dict(L=3, S=6), dict(alibi_slopes=[0.5, 0.125], causal=True)),
    "alibi_top_left": (dict(L=5, S=4), dict(alibi_slopes=[0.7, 0.1], causal="top_left")),
    "alibi_kv_lengths": (dict(L=2, S=6), dict(alibi_slopes=[1.0, 0.3], kv_lengths=np.array([6, 3]))),
    "alibi_per_batch_slopes": (dict(), dict(alibi_slopes=rng.random((2, 2)))),
    "alibi_int_slopes_window": (dict(L=4, S=7), dict(alibi_slopes=[1, 2], window=(2, 1))),
    "alibi_gqa": (dict(Hq=4, Hkv=2), dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625], causal=True)),
    "sinks": (dict(), dict(sinks=np.array([0.3, -1.0]))),
    "sinks_large": (dict(), dict(sinks=[5.0, 3.0], scale=0.1)),
    "sinks_minus_inf_for_one_head": (dict(), dict(sinks=[-np.inf, 2.0])),
    "sinks_empty_rows": (dict(L=2, S=6), dict(sinks=[0.5, -0.5], causal=True,
                                             kv_lengths=np.array([4, 0]))),
    "sinks_bool_mask": (dict(), dict(sinks=[1, 0], mask=rng.random((2, 2, 3, 4)) < 0.4)),
    "positions_causal": (dict(L=3, S=6), dict(q_start=7, k_start=3, causal=True)),
    "positions_top_left_same": (dict(L=3, S=6), dict(q_start=7, k_start=3, causal="top_left")),
    "positions_only_q_start": (dict(L=3, S=6), dict(q_start=2, causal=True, window=(1, 0))),
    "positions_only_k_start": (dict(L=3, S=6), dict(k_start=-2, causal=True)),
    "positions_per_batch": (dict(L=3, S=6), dict(q_start=np.array([10, 2]), k_start=np.array([8, 0]),
                                                 causal=True)),
    "positions_window_no_causal": (dict(L=4, S=7), dict(q_start=3, k_start=1, window=(1, 2))),
    "positions_alibi": (dict(L=3, S=6), dict(q_start=100, k_start=98, alibi_slopes=[0.5, 0.25])),
    "positions_kv_lengths": (dict(L=3, S=6), dict(q_start=4, k_start=0, causal=True,
                                                  kv_lengths=np.array([6, 3]))),
    "positions_future_keys": (dict(L=3, S=4), dict(q_start=0, k_start=50, causal=True,
                                                   sinks=[0.0, 1.0])),
    "positions_huge_shift": (dict(L=3, S=6), dict(q_start=2**60, k_start=2**60 - 2, causal=True,
                                                  window=(3, 0), alibi_slopes=[0.5, 0.25])),
    "positions_extreme_offset": (dict(L=2, S=3), dict(q_start=2**60, k_start=-2**60,
                                                      alibi_slopes=[1e-18, 2e-19], causal=True)),
    "positions_extreme_offset_window": (dict(L=2, S=3), dict(q_start=-2**60, k_start=2**60,
                                                             window=(5, 5), sinks=[0.0, 1.0])),
    "everything": (dict(Hq=4, Hkv=2, L=4, S=7),
                   dict(softcap=2.0, alibi_slopes=[0.5, 0.25, 0.125, 0.0625],
                        sinks=[0.1, -0.2, -np.inf, 1.0], q_start=np.array([9, 4]), k_start=5,
                        causal=True, window=(3, -1), mask=additive_mask((2, 4, 4, 7)),
                        kv_lengths=np.array([7, 5]), scale=0.9)),
}
CASES.update(MODIFIER_CASES)


@pytest.mark.parametrize("shape, kwargs", CASES.values(), ids=CASES.keys())
def test_matches_naive_loop(shape, kwargs):
    q, k, v = qkv(**shape)
    out, lse = ref.attention(q, k, v, return_lse=True, **kwargs)
    want_out, want_lse = naive(q, k, v, **kwargs)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2), st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2)]),
       st.integers(0, 5), st.integers(0, 5), st.integers(1, 3),
       st.sampled_from([False, True, "top_left"]),
       st.sampled_from([None, (0, 0), (1, -1), (-1, 2)]), st.booleans(), st.integers(0, 99))
def test_matches_naive_loop_property(B, heads, L, S, E, causal, window, use_lengths, seed):
    g = np.random.default_rng(seed)
    (Hq, Hkv) = heads
    q = g.standard_normal((B, Hq, L, E))
    k, v = g.standard_normal((2, B, Hkv, S, E))
    lengths = g.integers(0, S + 1, B) if use_lengths else None
    kw = dict(causal=causal, window=window, kv_lengths=lengths)
    out, lse = ref.attention(q, k, v, return_lse=True, **kw)
    want_out, want_lse = naive(q, k, v, **kw)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_lecture_worked_example():
    Q = [[1, 0, 1, 0], [0, 1, 0, 1]]
    K = [[1, 0, 1, 0], [1, 1, 1, 1]]
    V = [[10, 0], [0, 10]]
    steps = ref.attention_steps(Q, K, V)
    np.testing.assert_array_equal(steps.scores, [[2, 2], [0, 2]])
    np.testing.assert_array_equal(steps.scaled, [[1, 1], [0, 1]])  # / sqrt(d_k) = 2
    np.testing.assert_array_equal(steps.masked, steps.scaled)
    e = math.e
    np.testing.assert_allclose(steps.weights, [[0.5, 0.5], [1 / (1 + e), e / (1 + e)]],
                               rtol=1e-15)
    np.testing.assert_allclose(steps.output, [[5, 5], [10 / (1 + e), 10 * e / (1 + e)]],
                               rtol=1e-15)
    np.testing.assert_allclose(steps.output[1], [2.689414, 7.310586], atol=1e-6)
    np.testing.assert_allclose(steps.lse, [1 + math.log(2), math.log(1 + e)], rtol=1e-15)


def test_shape_walk_of_a_multi_head_layer():
    X = rng.standard_normal((10, 512))
    heads = []
    for _ in range(8):
        Wq, Wk, Wv = rng.standard_normal((3, 512, 64)) / math.sqrt(512)
        Q, K, V = X @ Wq, X @ Wk, X @ Wv
        assert Q.shape == K.shape == V.shape == (10, 64)
        steps = ref.attention_steps(Q, K, V)
        assert steps.scores.shape == steps.weights.shape == (10, 10)
        assert steps.output.shape == (10, 64) and steps.lse.shape == (10,)
        heads.append((Q, K, V, steps.output))
    Q, K, V, per_head = (np.stack(x) for x in zip(*heads))
    out = ref.attention(Q, K, V)
    assert out.shape == (8, 10, 64)
    np.testing.assert_allclose(out, per_head, rtol=1e-13, atol=1e-13)


def test_single_key_gives_value_broadcast():
    q, k, v = qkv(S=1)
    out = ref.attention(q, k, v)
    np.testing.assert_allclose(out, np.broadcast_to(v, out.shape), rtol=1e-15)


def test_permuting_keys_and_values_together_changes_nothing():
    q, k, v = qkv(S=9)
    perm = rng.permutation(9)
    np.testing.assert_allclose(ref.attention(q, k[..., perm, :], v[..., perm, :]),
                               ref.attention(q, k, v), rtol=1e-13)


def test_fully_masked_rows_give_zero_and_lse_minus_inf_without_warnings():
    q, k, v = qkv(L=3, S=4)
    mask = np.ones((3, 4), bool)
    mask[1] = False
    additive = np.where(mask, 0.0, -np.inf)
    with np.errstate(all="raise"):
        for kwargs in (dict(mask=mask), dict(mask=additive), dict(kv_lengths=0),
                       dict(causal=True, kv_lengths=np.array([1, 0]))):
            out, lse = ref.attention(q, k, v, return_lse=True, **kwargs)
            steps = ref.attention_steps(q, k, v, **kwargs)
            assert not np.isnan(out).any() and not np.isnan(steps.weights).any()
            np.testing.assert_array_equal(out[..., 1, :], 0)
            np.testing.assert_array_equal(steps.weights[..., 1, :], 0)
            assert np.all(lse[..., 1] == -np.inf)


@pytest.mark.parametrize("big", [1e4, -1e4])
def test_large_logits_stay_finite(big):
    q, k, v = qkv()
    q[..., 0, :] *= big
    out, lse = ref.attention(q, k, v, return_lse=True, scale=1.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


@pytest.mark.parametrize("L, S", [(2, 5), (4, 4), (6, 3)])
def test_causal_alignments_equal_explicit_masks(L, S):
    q, k, v = qkv(L=L, S=S)
    bottom_right = np.tril(np.ones((L, S), bool), k=S - L)
    want = ref.attention(q, k, v, mask=bottom_right)
    np.testing.assert_array_equal(ref.attention(q, k, v, causal=True), want)
    np.testing.assert_array_equal(ref.attention(q, k, v, causal="bottom_right"), want)
    np.testing.assert_array_equal(ref.attention(q, k, v, causal="top_left"),
                                  ref.attention(q, k, v, mask=np.tril(np.ones((L, S), bool))))


def test_nan_in_one_query_row_only_affects_that_row():
    q, k, v = qkv(L=4)
    clean = ref.attention(q, k, v)
    q[1, 0, 2, 3] = np.nan
    out, lse = ref.attention(q, k, v, return_lse=True)
    assert np.isnan(out[1, 0, 2]).all() and np.isnan(lse[1, 0, 2])
    out[1, 0, 2] = clean[1, 0, 2]
    np.testing.assert_array_equal(out, clean)


def test_empty_shapes():
    q, k, v = qkv(L=3, S=0)
    out, lse = ref.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 2, 3, 5) and not out.any() and np.all(lse == -np.inf)
    q, k, v = qkv(L=0, S=4)
    out, lse = ref.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 2, 0, 5) and lse.shape == (2, 2, 0)
    q, k, v = qkv(batch=(0,), Hq=4, Hkv=2)
    assert ref.attention(q, k, v).shape == (0, 4, 3, 5)
    assert ref.attention(np.ones((0, 3, 5)), np.ones((0, 4, 5)), np.ones((0, 4, 2))).shape \
        == (0, 3, 2)


def test_head_axis_and_broadcasting_of_mixed_ranks():
    q3, k4, v2 = rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 1, 6, 4)), \
        rng.standard_normal((6, 7))
    out = ref.attention(q3, k4, v2)
    assert out.shape == (5, 2, 3, 7)
    np.testing.assert_allclose(out[3, 1], ref.attention(q3[1], k4[3, 0], v2), rtol=1e-14)
    assert ref.attention(q3[0], k4[0, 0], v2).shape == (3, 7)


def test_float32_dtype_computes_in_float32():
    q, k, v = qkv()
    out, lse = ref.attention(q, k, v, return_lse=True, dtype=np.float32,
                             mask=np.zeros((3, 4)))
    assert out.dtype == lse.dtype == np.float32
    np.testing.assert_allclose(out, ref.attention(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(k=np.ones((3, 4, 5)), v=np.ones((3, 4, 5))), "multiple of key/value heads"),
    (dict(k=np.ones((2, 4, 6))), "last dimension E"),
    (dict(v=np.ones((2, 3, 5))), "same length S"),
    (dict(causal="bottom_left"), "causal must be"),
])
def test_errors(kwargs, match):
    args = dict(q=np.ones((4, 3, 5)), k=np.ones((2, 4, 5)), v=np.ones((2, 4, 5)))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ref.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


# --------------------------------------------------------------------------
# Score modifiers: softcap, ALiBi, sinks, explicit positions (issue 11)
# --------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (4, 2)]),
       st.integers(0, 4), st.integers(0, 5),
       st.sampled_from([False, True, "top_left"]),
       st.sampled_from([None, (0, 0), (1, -1), (-1, 2)]),
       st.sampled_from([None, 0.5, 3.0]), st.booleans(), st.booleans(),
       st.sampled_from([None, (0, 0), (7, 3), (2, 9), (-4, 0)]), st.integers(0, 99))
def test_modifiers_match_naive_loop_property(B, heads, L, S, causal, window, softcap,
                                             use_alibi, use_sinks, positions, seed):
    g = np.random.default_rng(seed)
    (Hq, Hkv) = heads
    q = g.standard_normal((B, Hq, L, 3))
    k, v = g.standard_normal((2, B, Hkv, S, 3))
    kw = dict(causal=causal, window=window, softcap=softcap,
              alibi_slopes=g.random(Hq) if use_alibi else None,
              sinks=g.standard_normal(Hq) if use_sinks else None)
    if positions is not None:
        kw.update(q_start=positions[0], k_start=positions[1])
    out, lse = ref.attention(q, k, v, return_lse=True, **kw)
    want_out, want_lse = naive(q, k, v, **kw)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_softcap_bounds_scores_and_is_nearly_the_identity_for_small_ones():
    q, k, v = qkv(L=4, S=6)
    q[..., 0, :] *= 1e4  # row 0: logits in the thousands
    steps = ref.attention_steps(q, k, v, softcap=5.0)
    assert np.abs(steps.capped).max() <= 5.0
    assert np.abs(steps.scaled[..., 0, :]).max() > 100
    np.testing.assert_array_equal(steps.biased, steps.capped)  # no ALiBi
    # tanh(x) = x - x³/3 + ...: a cap far above the scores changes them by ~s³/(3c²)
    wide = ref.attention_steps(q[..., 1:, :], k, v, softcap=1e3)
    np.testing.assert_allclose(wide.capped, wide.scaled, rtol=1e-5)
    assert not np.array_equal(wide.capped, wide.scaled)


def test_softcap_comes_before_alibi_and_masks():
    """The capped scores are within (-c, c), but the bias and the mask are added
    after the cap, so they can take a logit beyond it."""
    q, k, v = qkv(L=3, S=5)
    mask = np.full((3, 5), -7.0)
    steps = ref.attention_steps(q, k, v, softcap=1.0, alibi_slopes=[2.0, 3.0], mask=mask)
    assert np.abs(steps.capped).max() < 1.0
    assert steps.biased.min() < -1.0 and steps.masked.max() < -6.0
    np.testing.assert_allclose(steps.masked, steps.biased + mask, rtol=1e-15)


@pytest.mark.parametrize("L, S, causal", [(5, 9, True), (6, 6, True), (4, 7, "top_left"),
                                          (7, 3, "top_left")])
def test_alibi_equals_bloom_style_bias_on_causal_rows(L, S, causal):
    """BLOOM adds slope[h]·j (key position) to every score under a causal mask;
    ALiBi's -slope·|j - d(i)| differs from it by slope·d(i), a constant per row."""
    Hq = 8
    slopes = 2.0 ** (-8 * np.arange(1, Hq + 1) / Hq)  # BLOOM's slopes for 8 heads
    q, k, v = qkv(batch=(2,), Hq=Hq, L=L, S=S, E=16)
    bloom_bias = slopes[:, None, None] * np.arange(S)[None, None, :]  # (Hq, 1, S)
    bloom_bias = np.broadcast_to(bloom_bias, (Hq, L, S))
    want, want_lse = ref.attention(q, k, v, mask=bloom_bias, causal=causal, return_lse=True)
    got, lse = ref.attention(q, k, v, alibi_slopes=slopes, causal=causal, return_lse=True)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    d = np.arange(L) if causal == "top_left" else np.arange(L) + S - L
    seen = d >= 0  # rows that see a key (L > S bottom-right: the first rows see none)
    np.testing.assert_allclose((want_lse - lse)[..., seen], np.broadcast_to(
        slopes[:, None] * d[None, :], lse.shape)[..., seen], rtol=1e-12, atol=1e-12)
    # without causal the two differ: ALiBi penalises keys after the diagonal too
    assert not np.allclose(ref.attention(q, k, v, alibi_slopes=slopes),
                           ref.attention(q, k, v, mask=bloom_bias))


def test_alibi_uses_the_same_diagonal_as_causal():
    """With kv_lengths the diagonal moves to i + S_b - L: the key on it has no bias."""
    q, k, v = qkv(L=2, S=6)
    steps = ref.attention_steps(q, k, v, alibi_slopes=[1.0, 2.0], kv_lengths=np.array([6, 4]))
    bias = steps.biased - steps.scaled
    for b, S_b in enumerate([6, 4]):
        for i in range(2):
            d = i + S_b - 2
            np.testing.assert_array_equal(bias[b, :, i, d], 0)
            np.testing.assert_allclose(bias[b, 1, i, :], -2.0 * np.abs(np.arange(6) - d))


def test_alibi_and_sinks_on_two_dimensional_inputs_have_one_head():
    q, k, v = (rng.standard_normal((n, 4)) for n in (3, 5, 5))
    out, lse = ref.attention(q, k, v, alibi_slopes=[0.5], sinks=[0.25], return_lse=True)
    assert out.shape == (3, 4) and lse.shape == (3,)
    want_out, want_lse = naive(q[None], k[None], v[None], alibi_slopes=[0.5], sinks=[0.25])
    np.testing.assert_allclose(out, want_out[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(ref.attention(q, k, v, alibi_slopes=0.5), 
                                  ref.attention(q, k, v, alibi_slopes=[0.5]))


def test_sink_is_a_key_with_zero_value_and_its_logit_as_score():
    """A sink logit z_h behaves exactly like one more key whose score is z_h
    (here: k = 0 and an additive mask of z_h) and whose value is 0."""
    q, k, v = qkv(batch=(3,), Hq=4, Hkv=2, L=5, S=6)
    sinks = np.array([0.5, -1.0, 3.0, 0.0])
    got, lse = ref.attention(q, k, v, sinks=sinks, causal=True, return_lse=True)
    k1 = np.concatenate([k, np.zeros(k.shape[:-2] + (1, k.shape[-1]))], axis=-2)
    v1 = np.concatenate([v, np.zeros(v.shape[:-2] + (1, v.shape[-1]))], axis=-2)
    mask = np.zeros((4, 5, 7))
    mask[..., :6] = np.where(np.tril(np.ones((5, 6), bool), k=1), 0.0, -np.inf)
    mask[..., 6] = sinks[:, None]
    want, want_lse = ref.attention(q, k1, v1, mask=mask, return_lse=True)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13)
    # the weights on the real keys sum to 1 - exp(sink - lse), the sink's share
    steps = ref.attention_steps(q, k, v, sinks=sinks, causal=True)
    np.testing.assert_allclose(steps.weights.sum(-1), 1 - np.exp(sinks[:, None] - lse), rtol=1e-13)


def test_rows_with_no_visible_key_get_zeros_and_lse_equal_to_the_sink():
    q, k, v = qkv(L=3, S=4)
    sinks = np.array([0.7, -2.5])
    mask = np.ones((3, 4), bool)
    mask[1] = False
    with np.errstate(all="raise"):
        for kwargs in (dict(mask=mask), dict(mask=np.where(mask, 0.0, -np.inf)),
                       dict(kv_lengths=np.array([0, 4]))):
            out, lse = ref.attention(q, k, v, sinks=sinks, return_lse=True, **kwargs)
            steps = ref.attention_steps(q, k, v, sinks=sinks, **kwargs)
            row = (slice(None), slice(None), 1) if "mask" in kwargs else (0,)
            np.testing.assert_array_equal(out[row], 0)
            np.testing.assert_array_equal(steps.weights[row], 0)
            np.testing.assert_array_equal(lse[row], np.broadcast_to(
                sinks[:, None] if row == (0,) else sinks, lse[row].shape))
            assert not np.isnan(out).any() and np.isfinite(lse).all()


def test_a_sink_of_minus_inf_is_no_sink():
    q, k, v = qkv(L=4, S=5)
    for kw in (dict(), dict(causal=True), dict(kv_lengths=np.array([0, 3]))):
        want, want_lse = ref.attention(q, k, v, return_lse=True, **kw)
        got, lse = ref.attention(q, k, v, sinks=[-np.inf, -np.inf], return_lse=True, **kw)
        np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
        np.testing.assert_array_equal(lse, want_lse)
    # and per head: head 0 without a sink, head 1 with one
    out = ref.attention(q, k, v, sinks=[-np.inf, 1.0])
    np.testing.assert_allclose(out[:, 0], ref.attention(q, k, v)[:, 0], rtol=1e-15)
    assert not np.allclose(out[:, 1], ref.attention(q, k, v)[:, 1])


def test_a_large_sink_stays_finite():
    q, k, v = qkv()
    out, lse = ref.attention(q, k, v, sinks=[800.0, -800.0], return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(lse[:, 0], 800.0, rtol=1e-15)
    assert np.abs(out[:, 0]).max() < 1e-300


@pytest.mark.parametrize("causal", [True, "bottom_right", "top_left"])
def test_with_positions_every_causal_alignment_means_the_same(causal):
    q, k, v = qkv(L=4, S=6)
    want = ref.attention(q, k, v, q_start=5, k_start=3, causal=True, window=(2, 0))
    np.testing.assert_array_equal(
        ref.attention(q, k, v, q_start=5, k_start=3, causal=causal, window=(2, 0)), want)
    mask = (np.arange(6)[None, :] + 3 <= np.arange(4)[:, None] + 5) \
        & (np.arange(6)[None, :] + 3 >= np.arange(4)[:, None] + 5 - 2)
    np.testing.assert_array_equal(want, ref.attention(q, k, v, mask=mask))


def test_default_positions_are_the_alignment_rules():
    """q_start = S - L (bottom-right) or 0 (top-left) with k_start = 0 give the
    same result as the alignment rule."""
    q, k, v = qkv(L=3, S=7)
    kw = dict(alibi_slopes=[0.3, 0.6], window=(2, 1))
    np.testing.assert_array_equal(ref.attention(q, k, v, causal=True, q_start=4, **kw),
                                  ref.attention(q, k, v, causal=True, **kw))
    np.testing.assert_array_equal(ref.attention(q, k, v, causal="top_left", k_start=0, **kw),
                                  ref.attention(q, k, v, causal="top_left", **kw))


def test_shifting_both_positions_changes_nothing_even_near_2_to_the_60():
    q, k, v = qkv(L=3, S=8)
    kw = dict(alibi_slopes=[0.3, 0.6], window=(4, 1), causal=True)
    want = ref.attention(q, k, v, q_start=6, k_start=1, **kw)
    for shift in (10**6, 2**53 + 1, 2**60 - 6, -2**60 + 1):
        np.testing.assert_array_equal(
            ref.attention(q, k, v, q_start=6 + shift, k_start=1 + shift, **kw), want)


def _cuts(g, S, parts):
    """Sorted cut points in [0, S], repeats allowed (empty shards)."""
    return [0, *np.sort(g.integers(0, S + 1, size=parts - 1)).tolist(), S]


@pytest.mark.parametrize("seed", range(8))
def test_merged_shards_with_positions_equal_one_full_call(seed):
    """A shard k[..., a:b, :] with k_start = a (and the queries' own global
    position) gets exactly its part of the full causal/window/ALiBi call; the
    sink is applied once, at the merge."""
    from fastattn.merge import merge_attention
    g = np.random.default_rng(seed)
    B, Hq, Hkv, L, S = 2, 4, 2, int(g.integers(1, 6)), int(g.integers(1, 40))
    q = g.standard_normal((B, Hq, L, 8))
    k, v = g.standard_normal((2, B, Hkv, S, 8))
    kw = dict(causal=True, alibi_slopes=g.random(Hq), softcap=3.0,
              window=(int(g.integers(0, S + 1)), 0) if seed % 2 else None)
    sinks = g.standard_normal(Hq)
    sinks[0] = -np.inf if seed % 3 == 0 else sinks[0]
    # the full call: bottom-right, the queries are the last L of the S keys
    want, want_lse = ref.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    # a global offset, so that k_start = 0 is not the same as "no positions"
    base = int(g.integers(0, 10**9))
    cuts = _cuts(g, S, int(g.integers(1, 6)))
    parts = [ref.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True,
                           q_start=base + S - L, k_start=base + a, **kw)
             for a, b in zip(cuts, cuts[1:])]
    out, lse = merge_attention(*zip(*parts), sinks=sinks)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_shards_with_per_batch_positions():
    """Each batch entry's queries at their own global position (decoding of
    sequences of different lengths); kv_lengths hides each shard's padding."""
    from fastattn.merge import merge_attention
    g = np.random.default_rng(5)
    q = g.standard_normal((2, 2, 1, 4))
    k, v = g.standard_normal((2, 2, 2, 30, 4))
    lengths = np.array([30, 17])
    kw = dict(causal=True, window=(9, 0), alibi_slopes=[0.25, 0.5])
    want, want_lse = ref.attention(q, k, v, kv_lengths=lengths, return_lse=True, **kw)
    cuts = [0, 11, 20, 30]
    parts = [ref.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True,
                           q_start=lengths - 1, k_start=a,
                           kv_lengths=np.clip(lengths - a, 0, b - a), **kw)
             for a, b in zip(cuts, cuts[1:])]
    out, lse = merge_attention(*zip(*parts))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------
# Huge finite masks (Hugging Face fills hidden keys with np.finfo(dtype).min)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("value", [np.finfo(np.float32).min, np.finfo(np.float32).max])
def test_a_huge_finite_mask_on_every_key_of_a_row_gives_the_mean_of_v(dtype, value):
    q, k, v = qkv(L=4, S=6)
    mask = np.zeros((4, 6), np.float32)
    mask[2] = value  # all scores of row 2 become (about) the same huge number
    with np.errstate(all="raise"):
        out, lse = ref.attention(q, k, v, mask=mask, dtype=dtype, return_lse=True)
    assert out.dtype == dtype
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    eps = np.finfo(dtype).eps
    np.testing.assert_allclose(out[..., 2, :], v.mean(axis=-2), rtol=0, atol=16 * eps)
    np.testing.assert_allclose(lse[..., 2], value + np.log(6), rtol=eps)
    # the other rows do not notice
    np.testing.assert_allclose(np.delete(out, 2, axis=-2),
                               np.delete(ref.attention(q, k, v), 2, axis=-2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_huge_finite_masks_act_like_hiding_when_some_key_is_not_hidden(dtype):
    q, k, v = qkv(L=4, S=6)
    hidden = rng.random((2, 2, 4, 6)) < 0.5
    hidden[..., 0] = False
    f = np.finfo(np.float32)
    want = ref.attention(q, k, v, mask=~hidden, dtype=dtype)
    with np.errstate(all="raise"):
        got = ref.attention(q, k, v, mask=np.where(hidden, f.min, 0).astype(np.float32),
                            dtype=dtype)
        # finfo.max on the keys to keep and finfo.min on the rest: the
        # difference overflows to -inf in float32, which exp takes to 0
        both = ref.attention(q, k, v, mask=np.where(hidden, f.min, f.max).astype(np.float32),
                             dtype=dtype)
    np.testing.assert_allclose(got, want, rtol=0, atol=16 * np.finfo(dtype).eps)
    seen = ~hidden[..., None]
    mean_seen = np.einsum("bhls,bhse->bhle", seen[..., 0], v) / seen[..., 0].sum(-1)[..., None]
    np.testing.assert_allclose(both, mean_seen, rtol=0, atol=16 * np.finfo(dtype).eps)


# --------------------------------------------------------------------------
# Every bad modifier raises the right exception type, naming the argument
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(softcap=0), ValueError, r"softcap must be a finite number > 0, got 0"),
    (dict(softcap=-1.5), ValueError, r"softcap must be a finite number > 0, got -1.5"),
    (dict(softcap=np.nan), ValueError, r"softcap must be a finite number > 0, got nan"),
    (dict(softcap=np.inf), ValueError, r"softcap must be a finite number > 0, got inf"),
    (dict(softcap="30"), TypeError, r"softcap must be None or a real number, got '30'"),
    (dict(softcap=True), TypeError, r"softcap must be None or a real number, got True"),
    (dict(softcap=1j), TypeError, r"softcap must be None or a real number, got 1j"),
    (dict(softcap=[30.0]), TypeError, r"softcap must be None or a real number, got \[30.0\]"),
    (dict(alibi_slopes=[0.5, 0.25, 0.125]), ValueError,
     r"alibi_slopes must have shape \(Hq,\) = \(4,\) or broadcast to \(\*batch, Hq\) = \(4,\), "
     r"got shape \(3,\)"),
    (dict(alibi_slopes=np.ones((2, 4))), ValueError, r"alibi_slopes must .* got shape \(2, 4\)"),
    (dict(alibi_slopes=[0.5, np.nan, 0.1, 0.1]), ValueError, r"alibi_slopes must be finite, got nan"),
    (dict(alibi_slopes=[0.5, 0.5, -np.inf, 0.1]), ValueError, r"alibi_slopes must be finite, got -inf"),
    (dict(alibi_slopes=np.ones(4, complex)), TypeError,
     r"alibi_slopes must hold real numbers, got dtype complex128"),
    (dict(alibi_slopes=np.ones(4, bool)), TypeError, r"alibi_slopes must hold real numbers, got dtype bool"),
    (dict(alibi_slopes=["a"] * 4), TypeError, r"alibi_slopes must hold real numbers"),
    (dict(sinks=[0.0, 1.0, 2.0]), ValueError,
     r"sinks must have shape \(Hq,\) = \(4,\), one logit per query head, got shape \(3,\)"),
    (dict(sinks=0.5), ValueError, r"sinks must have shape \(Hq,\) = \(4,\).* got shape \(\)"),
    (dict(sinks=np.zeros((1, 4))), ValueError, r"sinks must have shape .* got shape \(1, 4\)"),
    (dict(sinks=[0.0, np.nan, 0.0, 0.0]), ValueError,
     r"sinks must not be NaN or \+inf \(-inf means no sink\), got nan for head 1"),
    (dict(sinks=[0.0, 0.0, 0.0, np.inf]), ValueError, r"sinks must not be NaN or \+inf.*got inf for head 3"),
    (dict(sinks=np.zeros(4, complex)), TypeError, r"sinks must hold real numbers, got dtype complex128"),
    (dict(q_start=1.5), TypeError, r"q_start must be an int or an array of integers, got 1.5"),
    (dict(q_start=np.array(3.0)), TypeError, r"q_start must be an int or an array of integers"),
    (dict(q_start=True), TypeError, r"q_start must be an int or an array of integers, got True"),
    (dict(q_start="3"), TypeError, r"q_start must be an int or an array of integers, got '3'"),
    (dict(k_start=[1.0]), TypeError, r"k_start must be an int or an array of integers, got \[1.0\]"),
    (dict(q_start=2**60 + 1), ValueError, r"q_start must lie in \[-2\*\*60, 2\*\*60\], got 1152921504606846977"),
    (dict(q_start=2**63), ValueError, r"q_start must lie in \[-2\*\*60, 2\*\*60\]"),
    (dict(k_start=-2**60 - 1), ValueError, r"k_start must lie in \[-2\*\*60, 2\*\*60\]"),
    (dict(k_start=-2**70), ValueError, r"k_start must lie in \[-2\*\*60, 2\*\*60\]"),
    (dict(k_start=np.array([0, 2**63], np.uint64)), ValueError, r"k_start must lie in"),
    (dict(q_start=np.array([1, 2])), ValueError,
     r"q_start must be an int or broadcast to the batch shape \(\), got shape \(2,\)"),
])
def test_modifier_errors(kwargs, error, match):
    q, k, v = np.ones((4, 3, 5)), np.ones((2, 4, 5)), np.ones((2, 4, 5))
    with pytest.raises(error, match=match):
        ref.attention(q, k, v, **kwargs)


def test_modifier_values_at_the_edges_of_what_is_allowed():
    q, k, v = np.ones((4, 3, 5)), np.ones((2, 4, 5)), np.ones((2, 4, 5))
    ref.attention(q, k, v, q_start=2**60, k_start=-2**60)
    ref.attention(q, k, v, q_start=np.uint64(5), k_start=np.int8(-3))
    ref.attention(q, k, v, softcap=np.float32(1e-30), alibi_slopes=[-1, 0, 1, 2],
                  sinks=[-np.inf, 0, -1e300, 1e300])
    assert ref.attention(q[0], k[0], v[0], alibi_slopes=np.float32(0.5)).shape == (3, 5)


def test_modifiers_in_float32_stay_close_to_float64():
    q, k, v = qkv(batch=(2,), Hq=4, Hkv=2, L=6, S=9)
    kw = dict(softcap=2.0, alibi_slopes=[0.5, 0.25, 0.125, 0.0625], sinks=[0.1, -0.2, -np.inf, 1.0],
              q_start=np.array([20, 3]), k_start=np.array([14, 0]), causal=True, window=(4, 0))
    out, lse = ref.attention(q, k, v, return_lse=True, **kw)
    out32, lse32 = ref.attention(q, k, v, return_lse=True, dtype=np.float32, **kw)
    assert out32.dtype == lse32.dtype == np.float32
    np.testing.assert_allclose(out32, out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse32, lse, rtol=1e-5, atol=1e-5)
