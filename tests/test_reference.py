"""Tests of fastattn.reference, the NumPy oracle the kernel is checked against.

The oracle is compared with a naive loop (one query row, one key, math.exp at
a time) on tiny inputs, with the lecture's worked example, the shape walk of
a multi-head layer, and exact properties (permutation, masking, edge cases).
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


def naive(q, k, v, mask=None, causal=False, window=None, kv_lengths=None, scale=None):
    """Attention of (*batch, H, rows, cols) inputs, one row and one key at a time."""
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    (Hq, L, E), (Hkv, S, _), Ev = q.shape[-3:], k.shape[-3:], v.shape[-1]
    q, k, v = (np.broadcast_to(x, batch + x.shape[-3:]) for x in (q, k, v))
    if mask is not None:
        mask = np.broadcast_to(mask, batch + (Hq, L, S))
    lengths = np.broadcast_to(S if kv_lengths is None else kv_lengths, batch)
    scale = 1 / math.sqrt(E) if scale is None else scale
    out, lse = np.zeros(batch + (Hq, L, Ev)), np.zeros(batch + (Hq, L))
    for b in np.ndindex(*batch):
        S_b = int(lengths[b])
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(L):
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
                    if mask is not None and mask.dtype == bool:
                        if not mask[b][h, i, j]:
                            continue
                    elif mask is not None:
                        s += mask[b][h, i, j]
                    if s != -math.inf:
                        logits[j] = s
                if not logits:
                    lse[b][h, i] = -math.inf
                    continue
                m = max(logits.values())
                w = {j: math.exp(s - m) for j, s in logits.items()}
                total = sum(w.values())
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
