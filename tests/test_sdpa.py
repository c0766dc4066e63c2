"""fastattn.scaled_dot_product_attention keeps PyTorch's meaning: top-left
is_causal, bool masks True = attend, float masks added, scale 1/sqrt(E), GQA
head h -> h // (Hq/Hkv). Checked against fastattn.reference (always) and
against torch.nn.functional.scaled_dot_product_attention when torch is present."""
import math

import numpy as np
import pytest

import fastattn
from fastattn import reference

sdpa = fastattn.scaled_dot_product_attention


def _inputs(seed, B=2, Hq=4, Hkv=4, L=5, S=9, E=8, Ev=6, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, L, E)).astype(dtype),
            rng.standard_normal((B, Hkv, S, E)).astype(dtype),
            rng.standard_normal((B, Hkv, S, Ev)).astype(dtype))


def _close64(got, want):
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


# ------------------------------------------------------- against the reference

@pytest.mark.parametrize("L, S", [(5, 9), (9, 5), (7, 7), (1, 12), (12, 1)])
def test_is_causal_is_top_left(L, S):
    q, k, v = _inputs(1, L=L, S=S)
    got = sdpa(q, k, v, is_causal=True)
    _close64(got, reference.attention(q, k, v, causal="top_left"))
    # The same as the explicit lower triangle of the L x S matrix (row i sees j <= i) ...
    _close64(got, sdpa(q, k, v, attn_mask=np.tril(np.ones((L, S), bool))))
    # ... and not the bottom-right (KV-cache) alignment, where they differ.
    if L != S:
        assert not np.allclose(got, fastattn.attention(q, k, v, causal=True), rtol=0, atol=1e-6)


def test_is_causal_rows_beyond_S_see_every_key():
    # L > S, top-left: rows i >= S - 1 see all S keys, so they equal the unmasked rows.
    q, k, v = _inputs(2, L=10, S=4)
    got = sdpa(q, k, v, is_causal=True)
    _close64(got[..., 3:, :], sdpa(q, k, v)[..., 3:, :])


def test_bool_mask_true_means_attend():
    q, k, v = _inputs(3)
    mask = np.random.default_rng(30).random((2, 4, 5, 9)) < 0.7
    mask[..., 0] = True  # every row sees something
    got = sdpa(q, k, v, attn_mask=mask)
    _close64(got, reference.attention(q, k, v, mask=mask))
    # True = attend: an all-True mask is no mask; inverting it changes the result.
    _close64(sdpa(q, k, v, attn_mask=np.ones((5, 9), bool)), sdpa(q, k, v))
    assert not np.allclose(got, sdpa(q, k, v, attn_mask=~mask | (np.arange(9) == 0)))


def test_float_mask_is_added():
    q, k, v = _inputs(4)
    rng = np.random.default_rng(40)
    mask = rng.standard_normal((4, 5, 9))  # broadcasts over the batch
    mask[:, :, 2] = -np.inf
    got = sdpa(q, k, v, attn_mask=mask)
    _close64(got, reference.attention(q, k, v, mask=mask))
    # Adding a per-row constant to the scores changes nothing (softmax shift).
    _close64(sdpa(q, k, v, attn_mask=mask + rng.standard_normal((4, 5, 1))), got)


def test_bool_and_float_masks_agree():
    q, k, v = _inputs(5)
    keep = np.random.default_rng(50).random((5, 9)) < 0.6
    keep[:, 4] = True
    _close64(sdpa(q, k, v, attn_mask=keep), sdpa(q, k, v, attn_mask=np.where(keep, 0.0, -np.inf)))


def test_default_scale_is_inverse_sqrt_E():
    q, k, v = _inputs(6, E=16)
    _close64(sdpa(q, k, v), reference.attention(q, k, v, scale=1 / math.sqrt(16)))


@pytest.mark.parametrize("scale", [0.05, 1.0, 2.5, -0.3])
def test_custom_scale(scale):
    q, k, v = _inputs(7)
    got = sdpa(q, k, v, scale=scale)
    _close64(got, reference.attention(q, k, v, scale=scale))
    # scale multiplies the scores: the same as scaling q.
    _close64(got, sdpa(q * (scale * math.sqrt(q.shape[-1])), k, v))


@pytest.mark.parametrize("Hq, Hkv", [(6, 2), (4, 1), (8, 4)])
def test_enable_gqa(Hq, Hkv):
    q, k, v = _inputs(8, Hq=Hq, Hkv=Hkv)
    got = sdpa(q, k, v, enable_gqa=True)
    _close64(got, reference.attention(q, k, v))
    # query head h reads kv head h // (Hq/Hkv): each kv head repeated in place.
    g = Hq // Hkv
    _close64(got, sdpa(q, np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)))
    _close64(sdpa(q, k, v, enable_gqa=True, is_causal=True),
             sdpa(q, np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3), is_causal=True))


def test_enable_gqa_with_equal_heads_is_plain():
    q, k, v = _inputs(9)
    _close64(sdpa(q, k, v, enable_gqa=True), sdpa(q, k, v))


def test_float32_in_float32_out():
    q, k, v = _inputs(10, dtype=np.float32)
    got = sdpa(q, k, v, is_causal=True)
    assert got.dtype == np.float32 and got.shape == (2, 4, 5, 6)
    want = reference.attention(q, k, v, causal="top_left")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_fully_masked_row_is_zero():
    q, k, v = _inputs(11)
    keep = np.ones((5, 9), bool)
    keep[2] = False
    got = sdpa(q, k, v, attn_mask=keep)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[..., 2, :], 0.0)
    additive = np.where(keep, 0.0, -np.inf)
    np.testing.assert_array_equal(sdpa(q, k, v, attn_mask=additive)[..., 2, :], 0.0)


# --------------------------------------------------------------- against torch

def _torch_sdpa(torch, q, k, v, attn_mask=None, **kw):
    t = [torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v)]
    m = None if attn_mask is None else torch.from_numpy(np.ascontiguousarray(attn_mask))
    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=m, **kw).numpy()


TORCH_CASES = [
    pytest.param(dict(L=5, S=9), dict(is_causal=True), id="causal-L<S"),
    pytest.param(dict(L=9, S=5), dict(is_causal=True), id="causal-L>S"),
    pytest.param(dict(L=1, S=33), dict(is_causal=True), id="causal-decode-row"),
    pytest.param(dict(L=6, S=6), dict(is_causal=True, scale=0.7), id="causal-scale"),
    pytest.param(dict(L=5, S=9), dict(scale=0.17), id="scale"),
    pytest.param(dict(Hq=6, Hkv=2, L=5, S=9), dict(enable_gqa=True), id="gqa"),
    pytest.param(dict(Hq=8, Hkv=1, L=7, S=3), dict(enable_gqa=True, is_causal=True), id="gqa-causal-L>S"),
    pytest.param(dict(Hq=4, Hkv=2, L=70, S=130, E=64, Ev=64), dict(enable_gqa=True, is_causal=True),
                 id="gqa-causal-large"),
]


@pytest.mark.parametrize("shape, kw", TORCH_CASES)
def test_matches_torch(shape, kw):
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(20, dtype=np.float32, **shape)
    got = sdpa(q, k, v, **kw)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, _torch_sdpa(torch, q, k, v, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", [(5, 9), (2, 1, 5, 9), (4, 5, 9)], ids=["LS", "B1LS", "HLS"])
def test_matches_torch_with_mask(kind, mask_shape):
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(21, dtype=np.float32)
    rng = np.random.default_rng(22)
    if kind == "bool":
        mask = rng.random(mask_shape) < 0.6
        mask[..., 3] = True
    else:
        mask = rng.standard_normal(mask_shape).astype(np.float32)
        mask[..., 1] = -np.inf
    got = sdpa(q, k, v, attn_mask=mask, scale=0.4)
    np.testing.assert_allclose(got, _torch_sdpa(torch, q, k, v, attn_mask=mask, scale=0.4),
                               rtol=1e-5, atol=1e-5)


def test_matches_torch_gqa_with_mask():
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(23, Hq=6, Hkv=3, dtype=np.float32)
    mask = np.random.default_rng(24).random((6, 5, 9)) < 0.5
    mask[..., 0] = True
    got = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    np.testing.assert_allclose(got, _torch_sdpa(torch, q, k, v, attn_mask=mask, enable_gqa=True),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_row_vs_torch(kind):
    """A row with no visible key.

    fastattn returns zeros for it, always. PyTorch's math path used to give
    NaN there (softmax of an all -inf row); torch 2.13 (CPU, checked for both
    bool and all -inf float masks, default and MATH backends) returns zeros
    too, so the two agree. Older torch may return NaN for the whole row.
    """
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(25, dtype=np.float32)
    keep = np.ones((5, 9), bool)
    keep[1] = False
    mask = keep if kind == "bool" else np.where(keep, 0.0, -np.inf).astype(np.float32)
    got = sdpa(q, k, v, attn_mask=mask)
    want = _torch_sdpa(torch, q, k, v, attn_mask=mask)
    np.testing.assert_array_equal(got[..., 1, :], 0.0)
    row = want[..., 1, :]
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version >= (2, 13):
        np.testing.assert_array_equal(row, 0.0)
    else:
        assert np.all(row == 0) or np.all(np.isnan(row)), row
    # Every other row agrees.
    rows = [0, 2, 3, 4]
    np.testing.assert_allclose(got[..., rows, :], want[..., rows, :], rtol=1e-5, atol=1e-5)
