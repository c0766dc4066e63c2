"""merge_attention(..., sinks=): the attention sink applied once, at the merge.

Partial results over disjoint key shards, each computed WITHOUT the sink,
merged with ``sinks=`` must equal one ``reference.attention(..., sinks=)``
over all the keys: for random splits (1 to 5 parts, some of them empty),
float32 and float64, parts from the kernel and from the reference.
"""
import numpy as np
import pytest

import fastattn
from _helpers import randn, tolerance
from fastattn import reference


def _close(got, want, atol):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    err = float(np.max(np.abs(got.astype(np.float64) - want))) if want.size else 0.0
    assert err <= atol, f"max error {err:.3g} > {atol:.3g}"


def _cuts(rng, S, parts):
    """Sorted cut points in [0, S], repeats allowed (empty parts)."""
    return [0, *np.sort(rng.integers(0, S + 1, size=parts - 1)).tolist(), S]


def _sinks(rng, Hq):
    s = rng.normal(0.0, 2.0, Hq)
    s[rng.random(Hq) < 0.25] = -np.inf  # some heads without a sink
    return s


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(8))
def test_merge_with_sinks_of_kernel_parts_equals_one_reference_call(dtype, seed):
    rng = np.random.default_rng(300 + seed)
    B, Hq, Hkv, L, S, E, Ev = 2, 4, 2, 5, int(rng.integers(1, 200)), 16, 12
    q = randn(rng, (B, Hq, L, E), dtype)
    k, v = randn(rng, (B, Hkv, S, E), dtype), randn(rng, (B, Hkv, S, Ev), dtype)
    # whole stretches of keys hidden, so some rows see nothing in some parts
    # and row 0 of head 0 sees nothing at all (its result is the sink's)
    mask = rng.random((B, Hq, L, S)) > 0.5
    mask[:, :, :, : S // 3] &= rng.random((B, Hq, L, 1)) > 0.5
    mask[0, 0, 0] = False
    sinks = _sinks(rng, Hq)
    sinks[0] = 1.5
    cuts = [0, 0, S, S] if seed == 0 else _cuts(rng, S, int(rng.integers(1, 6)))
    parts = [fastattn.attention(q, k[..., a:b, :], v[..., a:b, :], mask=mask[..., a:b],
                                return_lse=True) for a, b in zip(cuts, cuts[1:])]
    out, lse = fastattn.merge_attention(*zip(*parts), sinks=sinks)
    assert out.dtype == lse.dtype == dtype
    want, want_lse = reference.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True)
    _close(out, want, 2 * tolerance(q, k, v, mask=mask, sinks=sinks))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    _close(lse, want_lse, 1e-5 if dtype == np.float32 else 1e-12)
    assert not out[0, 0, 0].any() and lse[0, 0, 0] == dtype(1.5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(8))
def test_merge_with_sinks_of_shards_with_positions(dtype, seed):
    """Causal, window, ALiBi and softcap over shards placed by k_start (computed
    by the reference in ``dtype``, as the kernel would)."""
    rng = np.random.default_rng(400 + seed)
    B, Hq, Hkv, L, S = 2, 4, 1, int(rng.integers(1, 8)), int(rng.integers(1, 120))
    q = randn(rng, (B, Hq, L, 8), dtype)
    k, v = randn(rng, (B, Hkv, S, 8), dtype), randn(rng, (B, Hkv, S, 8), dtype)
    kw = dict(causal=True, alibi_slopes=2.0 ** -np.arange(1, Hq + 1), softcap=4.0,
              window=(int(rng.integers(0, S)), 0) if seed % 2 else None)
    sinks = _sinks(rng, Hq)
    cuts = _cuts(rng, S, int(rng.integers(1, 6)))
    base = int(rng.integers(0, 10**6))  # global position of key 0
    parts = [reference.attention(q, k[..., a:b, :], v[..., a:b, :], dtype=dtype, return_lse=True,
                                 q_start=base + S - L, k_start=base + a, **kw)
             for a, b in zip(cuts, cuts[1:])]
    out, lse = fastattn.merge_attention(*zip(*parts), sinks=sinks)
    assert out.dtype == lse.dtype == dtype
    want, want_lse = reference.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    _close(out, want, 2 * tolerance(q, k, v, sinks=sinks, **kw))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    _close(lse[fin], want_lse[fin], 1e-5 * max(1.0, np.abs(want_lse[fin]).max(initial=0))
           if dtype == np.float32 else 1e-12 * max(1.0, np.abs(want_lse[fin]).max(initial=0)))


def test_rows_empty_in_every_part_get_zeros_and_lse_equal_to_the_sink():
    outs = [np.array([[1.0, 2.0], [np.nan, np.nan]]), np.array([[3.0, 4.0], [5.0, 6.0]])]
    lses = [np.array([0.0, -np.inf]), np.array([np.log(2.0), -np.inf])]
    sinks = np.array([np.log(3.0)])  # 1-D lses (2-D calls): one head
    out, lse = fastattn.merge_attention(outs, lses, sinks=sinks)
    # row 0: masses 1, 2 and the sink's 3: weights 1/6 and 2/6
    np.testing.assert_allclose(out[0], [(1 + 6) / 6, (2 + 8) / 6], rtol=1e-15)
    np.testing.assert_allclose(lse[0], np.log(6.0), rtol=1e-15)
    np.testing.assert_array_equal(out[1], [0.0, 0.0])
    assert lse[1] == np.log(3.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_sink_of_minus_inf_changes_nothing(dtype):
    rng = np.random.default_rng(7)
    outs = [randn(rng, (2, 3, 4, 5), dtype) for _ in range(3)]
    lses = [randn(rng, (2, 3, 4), dtype) for _ in range(3)]
    lses[1][0, 1, 2] = -np.inf
    plain = fastattn.merge_attention(outs, lses)
    for got, want in zip(fastattn.merge_attention(outs, lses, sinks=np.full(3, -np.inf)), plain):
        np.testing.assert_array_equal(got, want)


def test_sinks_are_applied_per_head_and_merging_in_stages_needs_them_only_once():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 3, 4, 6)) for _ in range(3))
    sinks = np.array([0.5, -np.inf, 2.0])
    parts = [reference.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True)
             for a, b in [(0, 1), (1, 3), (3, 4)]]
    once = fastattn.merge_attention(*zip(*parts), sinks=sinks)
    first = fastattn.merge_attention(*zip(*parts[:2]))  # no sink yet
    staged = fastattn.merge_attention([first[0], parts[2][0]], [first[1], parts[2][1]], sinks=sinks)
    for a, b in zip(staged, once):
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-15)
    want, want_lse = reference.attention(q, k, v, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(once[0], want, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(once[1], want_lse, rtol=1e-13)
    np.testing.assert_array_equal(once[0][:, 1], fastattn.merge_attention(*zip(*parts))[0][:, 1])


def test_float32_parts_with_float64_sinks_stay_float32_and_large_logits_stay_finite():
    rng = np.random.default_rng(9)
    outs = [randn(rng, (2, 3, 5)) for _ in range(2)]
    lses = [np.full((2, 3), 3000.0, np.float32), np.full((2, 3), -3000.0, np.float32)]
    out, lse = fastattn.merge_attention(outs, lses, sinks=np.array([3000.0, 0.0]))
    assert out.dtype == lse.dtype == np.float32
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    # head 0: part 0 and the sink have equal mass; head 1: part 0 has it all
    np.testing.assert_allclose(out[0], outs[0][0] / 2, rtol=1e-6)
    np.testing.assert_allclose(out[1], outs[0][1], rtol=1e-6)
    np.testing.assert_allclose(lse[0], 3000.0 + np.log(2.0), rtol=1e-7)


@pytest.mark.parametrize("outs, lses, sinks, error, match", [
    ([np.zeros((3, 2, 4))], [np.zeros((3, 2))], np.zeros(2), ValueError,
     r"sinks must have shape \(Hq,\) = \(3,\), one logit per query head \(axis -2 of the lses, "
     r"shape \(3, 2\)\); got shape \(2,\)"),
    ([np.zeros((2, 4))], [np.zeros(2)], np.zeros(2), ValueError,
     r"sinks must have shape \(Hq,\) = \(1,\).*got shape \(2,\)"),
    ([np.zeros((3, 2, 4))], [np.zeros((3, 2))], 0.0, ValueError, r"sinks must have shape .*got shape \(\)"),
    ([np.zeros((3, 2, 4))], [np.zeros((3, 2))], [0.0, np.nan, 0.0], ValueError,
     r"sinks must not be NaN or \+inf \(-inf means no sink\); got nan for head 1"),
    ([np.zeros((3, 2, 4))], [np.zeros((3, 2))], [0.0, 0.0, np.inf], ValueError,
     r"sinks must not be NaN or \+inf.*got inf for head 2"),
    ([np.zeros((3, 2, 4))], [np.zeros((3, 2))], np.zeros(3, complex), TypeError,
     r"sinks must hold real numbers; got dtype complex128"),
    ([np.zeros((3, 2, 4))], [np.zeros((3, 2))], ["a", "b", "c"], TypeError,
     r"sinks must hold real numbers"),
])
def test_merge_rejects_bad_sinks(outs, lses, sinks, error, match):
    with pytest.raises(error, match=match):
        fastattn.merge_attention(outs, lses, sinks=sinks)
