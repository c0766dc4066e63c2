"""The amx set: bfloat16 attention with its two products on AMX tiles.

Where the CPU has AMX-BF16 (and Linux grants the tile state), the amx set
is the avx512 set with one entry changed: bfloat16 q, K, V and out on the
lane layout, E a multiple of 32 and Ev of 16, run Q·Kᵀ and P·V as tile
products (src_c/kernel_amx.h). Everything else falls back to the avx512
code, bit for bit. Checked here against the float64 reference on every
path the entry has (layouts forced, split-KV, GQA, masks, causal both
ways, windows, kv_lengths, modifiers, explicit positions), with shapes
whose L and S are not multiples of the tiles (16) or the key block (64).
Skipped where the CPU has no AMX."""
import numpy as np
import pytest

import fastattn
from fastattn import _api, reference

pytest.importorskip("ml_dtypes")
from _bf16_sets import (BF16, F32, OPTIONS, case as _case, check as _check, needs_avx512,  # noqa: E402
                        seeded as _rng, with_isa as _with)

pytestmark = pytest.mark.skipif("amx" not in fastattn.available_isas(),
                                reason="this CPU (or OS) offers no AMX-BF16")


@pytest.fixture
def amx():
    fastattn.set_isa("amx")
    yield
    fastattn.set_isa(None)


# B, Hq, Hkv, L, S, E, Ev: E multiples of 32, Ev of 16; L, S ragged
SHAPES = [(2, 4, 2, 77, 150, 64, 64), (1, 3, 1, 45, 301, 32, 48), (1, 2, 2, 19, 1000, 128, 16)]


@pytest.mark.parametrize("opt", OPTIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_amx_matches_reference(amx, shape, opt):
    q, k, v, kw = _case(shape, opt)
    _check(fastattn.attention(q, k, v, **kw), q, k, v, **kw)
    for rows in (0, 16, 33):          # lanes items of every height: tiles of 16 lanes, partly filled
        for chunk in (0, 97):         # split-KV: each part a float32 partial, merged after
            got = _api.attention_with(q, k, v, {"layout": "lanes", "rows_per_item": rows, "chunk_keys": chunk},
                                      **kw)
            _check(got, q, k, v, **kw)


def test_amx_is_bitwise_the_same_across_thread_counts(amx):
    q, k, v, kw = _case((2, 8, 2, 70, 1100, 64, 64), "causal_kvlen")
    base, base_lse = fastattn.attention(q, k, v, num_threads=1, return_lse=True, **kw)
    for n in (2, 3, 8):
        got, lse = fastattn.attention(q, k, v, num_threads=n, return_lse=True, **kw)
        assert np.array_equal(got.view(np.uint16), base.view(np.uint16)) and np.array_equal(lse, base_lse), n


@needs_avx512
def test_amx_takes_the_tiles_only_for_its_entry():
    """The tiles compute other bits than the float code: a bfloat16 call of
    the right shape differs from avx512's somewhere (lse, float32, shows it);
    float32 or float16 q (the output is q's dtype), E not a multiple of 32
    or Ev of 16 fall back to avx512's code and give its bits exactly."""
    rng = _rng("fallback")
    q, k, v = (rng.standard_normal((1, 4, 100, 64)).astype(BF16) for _ in range(3))

    def both(fn):
        return _with("amx", fn), _with("avx512", fn)

    (o1, l1), (o2, l2) = both(lambda: fastattn.attention(q, k, v, causal=True, return_lse=True))
    assert not np.array_equal(l1, l2), "the amx set did not take the tiles"
    cases = {
        "float32 q": lambda: fastattn.attention(q.astype(F32), k, v, causal=True, return_lse=True),
        "float16 q": lambda: fastattn.attention(q.astype(np.float16), k, v, causal=True, return_lse=True),
        "E = 48": lambda: fastattn.attention(q[..., :48], k[..., :48], v, causal=True, return_lse=True),
        "Ev = 40": lambda: fastattn.attention(q, k, v[..., :40], causal=True, return_lse=True),
    }
    for name, fn in cases.items():
        (o1, l1), (o2, l2) = both(fn)
        assert np.array_equal(o1.view(np.uint8), o2.view(np.uint8)) and np.array_equal(l1, l2), name


def test_amx_rows_with_no_visible_key():
    """A row that sees no key: output 0 and lse −inf, as every set gives;
    with a sink, lse is the sink."""
    rng = _rng("empty")
    q, k, v = (rng.standard_normal((1, 2, 40, 64)).astype(BF16) for _ in range(3))
    mask = np.ones((1, 1, 40, 40), bool)
    mask[0, 0, 5] = False
    out, lse = _with("amx", lambda: fastattn.attention(q, k, v, mask=mask, return_lse=True))
    assert np.all(out[:, :, 5].astype(F32) == 0) and np.all(lse[:, :, 5] == -np.inf)
    sinks = np.array([0.5, -1.0])
    out, lse = _with("amx", lambda: fastattn.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True))
    assert np.all(out[:, :, 5].astype(F32) == 0) and np.allclose(lse[0, :, 5], sinks)


@pytest.mark.parametrize("natural", [False, True], ids=["raw_scores", "additive_mask"])
def test_amx_reference_max_that_lags_and_moves(amx, natural):
    """The tile softmax moves a lane's reference maximum m only when a block's
    scores pass it by more than 8 (natural units), so p = e^(s − m) reaches
    e^8 and alpha stays 1 between moves (kernel_amx.h, FA_AMX_LAG). Scores
    built to rise by 6 a key block (m lags, then moves every other block),
    with a jump of 30 at block 5 and a different slope per query row (lanes
    move at different blocks), against the reference: the output and the
    lse, which shows a wrong rescale of l at float32 precision. With a zero
    additive mask the scores are scaled before the softmax (its natural
    branch)."""
    rng = _rng("lagging max", natural)
    L, S, E = 40, 1000, 64
    scale = E ** -0.5
    q = np.zeros((1, 2, L, E), F32)
    q[..., 0] = (1 + np.arange(L) / L) * 4           # row i's scores scale by 1 + i/L
    q[..., 1:] = rng.standard_normal((1, 2, L, E - 1)) * 0.1
    block = np.arange(S) // 64
    target = 6.0 * block + 30.0 * (block >= 5) + rng.standard_normal(S)
    k = rng.standard_normal((1, 2, S, E)).astype(F32) * 0.1
    k[..., 0] = target / (4 * scale)
    q, k = q.astype(BF16), k.astype(BF16)
    v = rng.standard_normal((1, 2, S, E)).astype(BF16)
    kw = dict(mask=np.zeros((1, 1, L, S), F32)) if natural else {}
    got, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    _check(got, q, k, v, **kw)
    _, want_lse = reference.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                      return_lse=True, **kw)
    assert np.max(np.abs(lse - want_lse) / np.abs(want_lse)) < 1e-5
