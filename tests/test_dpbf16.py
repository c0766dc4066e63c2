"""The avx512bf16 set: bfloat16 scores on AVX512-BF16's VDPBF16PS.

Where the CPU has AVX512-BF16 (AMD Zen 4 and 5, Intel Sapphire Rapids on),
the avx512bf16 set is the avx512 set with one entry changed: with bfloat16 q
and K and an even E, the lane layout computes Q·Kᵀ as sums of exact
bfloat16 products, two elements of E an instruction, reading K in place
(src_c/kernel_dpbf16.h). Everything else falls back to the avx512 code, bit
for bit. Checked here against the float64 reference on every path the entry
has, with E and Ev that are not multiples of a vector (16) and L and S that
are not multiples of the tiles or the key block (64). Skipped where the CPU
has no AVX512-BF16."""
import numpy as np
import pytest

import fastattn
from fastattn import _api, reference

pytest.importorskip("ml_dtypes")
from _bf16_sets import BF16, F32, F64, OPTIONS, case, check, needs_avx512, seeded, with_isa  # noqa: E402

pytestmark = pytest.mark.skipif("avx512bf16" not in fastattn.available_isas(),
                                reason="this CPU offers no AVX512-BF16")


@pytest.fixture
def dpbf16():
    fastattn.set_isa("avx512bf16")
    yield
    fastattn.set_isa(None)


# B, Hq, Hkv, L, S, E, Ev: E even (a last pair past 32-element blocks: 46, 98), Ev anything
SHAPES = [(2, 4, 2, 77, 150, 64, 64), (1, 3, 1, 45, 301, 46, 37), (1, 2, 2, 19, 1000, 98, 16),
          (1, 2, 1, 70, 130, 2, 5)]


def _lse_tolerance(q, k, lse_ref, scale=None):
    """The scores are float32 sums of E exact products, then times scale:
    |error| ≤ (E + 1)·2⁻²⁴·|scale|·Σ_e |q_e·k_e| (each of the E additions and
    the scaling round once); lse = m + ln l moves by at most that plus its
    own float32 roundings, a few ulp of |lse|."""
    E = q.shape[-1]
    s = 1 / np.sqrt(E) if scale is None else abs(scale)
    q64, k64 = np.abs(q.astype(F64)), np.abs(k.astype(F64))
    G = q.shape[1] // k.shape[1]
    terms = q64 @ np.swapaxes(np.repeat(k64, G, axis=1), -1, -2)
    finite = lse_ref[np.isfinite(lse_ref)]
    return (E + 1) * 2.0**-24 * s * float(terms.max()) + 8 * 2.0**-24 * max(1.0, float(np.abs(finite).max()))


@pytest.mark.parametrize("opt", OPTIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dpbf16_matches_reference(dpbf16, shape, opt):
    q, k, v, kw = case(shape, opt)
    got, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    check(got, q, k, v, **kw)
    if "softcap" not in kw and "sinks" not in kw:  # the scores unmodified: lse holds them to float32's bound
        _, want = reference.attention(q.astype(F64), k.astype(F64), v.astype(F64), return_lse=True, **kw)
        seen = np.isfinite(want)
        assert np.array_equal(seen, np.isfinite(lse))
        err = float(np.max(np.abs(lse[seen] - want[seen]))) if seen.any() else 0.0
        tol = _lse_tolerance(q, k, want)
        assert err <= tol, f"lse error {err:.3g} > {tol:.3g}"
    for rows in (0, 16, 33):          # lanes items of every height: 1 to 4 vectors of lanes, partly filled
        for chunk in (0, 97):         # split-KV: each part a float32 partial, merged after
            got = _api.attention_with(q, k, v, {"layout": "lanes", "rows_per_item": rows, "chunk_keys": chunk},
                                      **kw)
            check(got, q, k, v, **kw)


def test_dpbf16_scale_multiplies_the_sums():
    """q is not scaled before the products (q·scale is no bfloat16): the sums
    are. A negative and a tiny scale give the reference's answer too."""
    q, k, v, _ = case((1, 2, 1, 33, 200, 64, 40), "plain")
    for scale in (-0.7, 1e-3, 3.0):
        got = with_isa("avx512bf16", lambda: fastattn.attention(q, k, v, scale=scale))
        check(got, q, k, v, scale=scale)


def test_dpbf16_is_bitwise_the_same_across_thread_counts(dpbf16):
    q, k, v, kw = case((2, 8, 2, 70, 1100, 64, 64), "causal_kvlen")
    base, base_lse = fastattn.attention(q, k, v, num_threads=1, return_lse=True, **kw)
    for n in (2, 3, 8):
        got, lse = fastattn.attention(q, k, v, num_threads=n, return_lse=True, **kw)
        assert np.array_equal(got.view(np.uint16), base.view(np.uint16)) and np.array_equal(lse, base_lse), n


@needs_avx512
def test_dpbf16_only_for_its_entry():
    """VDPBF16PS gives other bits than the float tiles: a bfloat16 call with
    an even E differs from avx512's somewhere (lse, float32, shows it);
    float32 or float16 q, an odd E, and the row layout (decoding) fall back
    to avx512's code and give its bits exactly."""
    rng = seeded("dpbf16 fallback")
    q, k, v = (rng.standard_normal((1, 4, 100, 64)).astype(BF16) for _ in range(3))

    def both(fn):
        return with_isa("avx512bf16", fn), with_isa("avx512", fn)

    (o1, l1), (o2, l2) = both(lambda: fastattn.attention(q, k, v, causal=True, return_lse=True))
    assert not np.array_equal(l1, l2), "the avx512bf16 set did not take VDPBF16PS"
    cases = {
        "float32 q": lambda: fastattn.attention(q.astype(F32), k, v, causal=True, return_lse=True),
        "float16 q": lambda: fastattn.attention(q.astype(np.float16), k, v, causal=True, return_lse=True),
        "E = 47": lambda: fastattn.attention(q[..., :47], k[..., :47], v, causal=True, return_lse=True),
        "float32 k, v": lambda: fastattn.attention(q.astype(F32), k.astype(F32), v.astype(F32), return_lse=True),
        "decoding (rows)": lambda: fastattn.attention(q[:, :, :1], k, v, return_lse=True),
    }
    for name, fn in cases.items():
        (o1, l1), (o2, l2) = both(fn)
        assert np.array_equal(o1.view(np.uint8), o2.view(np.uint8)) and np.array_equal(l1, l2), name


def test_dpbf16_rows_with_no_visible_key():
    """A row that sees no key: output 0 and lse −inf; with a sink, lse is the sink."""
    rng = seeded("dpbf16 empty")
    q, k, v = (rng.standard_normal((1, 2, 40, 64)).astype(BF16) for _ in range(3))
    mask = np.ones((1, 1, 40, 40), bool)
    mask[0, 0, 5] = False
    out, lse = with_isa("avx512bf16", lambda: fastattn.attention(q, k, v, mask=mask, return_lse=True))
    assert np.all(out[:, :, 5].astype(F32) == 0) and np.all(lse[:, :, 5] == -np.inf)
    sinks = np.array([0.5, -1.0])
    out, lse = with_isa("avx512bf16", lambda: fastattn.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True))
    assert np.all(out[:, :, 5].astype(F32) == 0) and np.allclose(lse[0, :, 5], sinks)


def test_dpbf16_reads_k_in_place_with_any_row_stride():
    """K and q as views with row strides that are not their E (a cache's
    slice, a head-major layout transposed): the pairs are read where they are."""
    rng = seeded("dpbf16 strides")
    big_k = rng.standard_normal((1, 300, 3, 70)).astype(BF16)   # (B, S, H, E+6): rows 210 elements apart
    k = big_k[..., :64].transpose(0, 2, 1, 3)                    # (1, 3, 300, 64), not contiguous
    v = rng.standard_normal((1, 3, 300, 48)).astype(BF16)
    q = rng.standard_normal((1, 45, 3, 64)).astype(BF16).transpose(0, 2, 1, 3)
    got = with_isa("avx512bf16", lambda: fastattn.attention(q, k, v, causal=True))
    check(got, q, k, v, causal=True)
    same = with_isa("avx512bf16", lambda: fastattn.attention(np.ascontiguousarray(q), np.ascontiguousarray(k),
                                                             v, causal=True))
    assert np.array_equal(got.view(np.uint16), same.view(np.uint16))
