"""The C kernel against the NumPy reference, on every micro-kernel set (ISA):
a grid of shapes off the block sizes, every mask form, causal, windows,
kv_lengths, edge cases, exact properties and every input layout the API takes.
Bitwise invariances are in test_invariance.py, random shapes in test_properties.py.
"""
import functools
import zlib

import numpy as np
import pytest

import fastattn
from fastattn import reference
from _helpers import randn, tolerance


f32, f64 = np.float32, np.float64


def _rng(*key):
    """A generator seeded from the test's parameters: stable across runs and ISAs."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _inputs(rng, q_shape, k_shape, v_shape, dtype):
    return randn(rng, q_shape, dtype), randn(rng, k_shape, dtype), randn(rng, v_shape, dtype)


def _lse_atol(ref_lse, dtype):
    return (1e-5 if dtype == f32 else 1e-11) * (1 + np.abs(ref_lse))


def assert_close_to_reference(got, got_lse, ref, ref_lse, tol, dtype):
    """Output within tol of the float64 reference, same NaN pattern, lse close."""
    assert got.shape == ref.shape
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    if got.size:
        err = np.max(np.abs(np.nan_to_num(got.astype(f64) - ref)))
        assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"
    if got_lse is None:
        return
    assert got_lse.shape == ref_lse.shape
    assert got_lse.dtype == dtype
    np.testing.assert_array_equal(np.isnan(got_lse), np.isnan(ref_lse))
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_less(np.abs(got_lse[finite] - ref_lse[finite]),
                                 _lse_atol(ref_lse[finite], dtype))


def check(q, k, v, **kw):
    """Run fastattn and the reference on the same inputs and compare them:
    the plain call (which may take the API's fast path) and return_lse=True."""
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    tol, dtype = tolerance(q, k, v, want=ref, **kw), np.asarray(q).dtype.newbyteorder("=")
    assert_close_to_reference(fastattn.attention(q, k, v, **kw), None, ref, ref_lse, tol, dtype)
    got, got_lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    assert_close_to_reference(got, got_lse, ref, ref_lse, tol, dtype)
    return got, got_lse


# --------------------------------------------------------------------------
# The grid: sizes off the block sizes (query blocks of 4..64 rows, key blocks
# of 64), head dims, GQA ratios, L < S, L = S, L > S, both dtypes. Pairwise
# rather than a cartesian product; every row is also run with each causal
# alignment and on every ISA.
# --------------------------------------------------------------------------

GRID = [
    # B, Hq, Hkv, L,    S,    E,   Ev,  dtype
    (1, 1, 1, 1, 1, 1, 1, f32),
    (1, 1, 1, 1, 7, 8, 16, f64),
    (2, 2, 1, 7, 1, 16, 8, f32),  # MQA
    (1, 2, 2, 7, 63, 59, 64, f64),
    (2, 4, 2, 63, 65, 64, 80, f32),  # GQA 2
    (1, 4, 1, 65, 63, 80, 59, f64),  # MQA
    (2, 8, 1, 113, 7, 128, 1, f32),  # MQA, Ev = 1
    (1, 8, 2, 7, 113, 256, 128, f32),  # GQA 4
    (2, 8, 8, 65, 203, 16, 59, f64),
    (1, 8, 1, 203, 65, 8, 256, f64),  # GQA 8 = MQA
    (2, 3, 3, 113, 113, 1, 8, f32),
    (1, 4, 4, 203, 203, 59, 16, f32),
    (2, 2, 2, 1, 203, 256, 64, f64),
    (1, 8, 4, 63, 1, 80, 128, f32),  # GQA 2
    (3, 8, 1, 64, 64, 128, 80, f32),  # GQA 8, exactly one block each
    (1, 2, 1, 1023, 1023, 64, 80, f32),
    (1, 1, 1, 7, 1023, 16, 8, f64),
]


def _grid_id(case):
    B, Hq, Hkv, L, S, E, Ev, dtype = case
    return f"B{B}-H{Hq}/{Hkv}-L{L}-S{S}-E{E}-Ev{Ev}-{np.dtype(dtype).name}"


@functools.lru_cache(maxsize=None)
def _grid_expected(case, causal):
    """Inputs, reference and tolerance of one grid cell, shared by every ISA."""
    B, Hq, Hkv, L, S, E, Ev, dtype = case
    q, k, v = _inputs(_rng(case), (B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev), dtype)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    return q, k, v, ref, ref_lse, tolerance(q, k, v, want=ref, causal=causal)


@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_grid_matches_reference(isa, case, causal):
    q, k, v, ref, ref_lse, tol = _grid_expected(case, causal)
    got = fastattn.attention(q, k, v, causal=causal)
    assert_close_to_reference(got, None, ref, ref_lse, tol, q.dtype)
    got, got_lse = fastattn.attention(q, k, v, causal=causal, return_lse=True)
    assert_close_to_reference(got, got_lse, ref, ref_lse, tol, q.dtype)


# --------------------------------------------------------------------------
# Masks: every broadcast shape, bool and additive, -inf, mixed dtypes
# --------------------------------------------------------------------------

B_, H_, L_, S_ = 2, 3, 65, 70
MASK_SHAPES = {
    "BHLS": (B_, H_, L_, S_),
    "LS": (L_, S_),
    "11LS": (1, 1, L_, S_),
    "B11S": (B_, 1, 1, S_),
    "HL1": (H_, L_, 1),
    "S": (S_,),
    "1": (1,),
    "11": (1, 1),
    "0d": (),
}
MASK_KINDS = ["bool", "additive", "additive_neginf", "f64_mask_f32_q", "f32_mask_f64_q"]


def _make_mask(rng, shape, kind):
    if kind == "bool":
        return rng.random(shape) < 0.7
    m = rng.standard_normal(shape) * 3
    if kind == "additive_neginf":
        m = np.where(rng.random(shape) < 0.3, -np.inf, m)
    return m.astype(f32 if kind == "f32_mask_f64_q" else f64)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
def test_mask_broadcast_shapes(isa, shape, kind):
    rng = _rng("mask", shape, kind)
    dtype = f64 if kind == "f32_mask_f64_q" else f32
    q, k, v = _inputs(rng, (B_, H_, L_, 16), (B_, 1, S_, 16), (B_, 1, S_, 8), dtype)
    mask = _make_mask(rng, MASK_SHAPES[shape], kind)
    if kind == "f64_mask_f32_q":
        assert mask.dtype == f64 and q.dtype == f32
    check(q, k, v, mask=mask)


@pytest.mark.parametrize("layout", ["transposed_view", "byteswapped", "broadcast_to", "strided_rows"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_mask_layouts(isa, layout, kind):
    """Masks are read through their strides: views and odd layouts are fine."""
    rng = _rng("mask-layout", layout, kind)
    q, k, v = _inputs(rng, (2, 2, 33, 8), (2, 2, 71, 8), (2, 2, 71, 8), f32)
    if layout == "transposed_view":
        mask = _make_mask(rng, (71, 33), kind).T
    elif layout == "byteswapped":
        mask = _make_mask(rng, (33, 71), kind)
        mask = mask.astype(mask.dtype.newbyteorder(">")) if kind == "additive" else mask
    elif layout == "broadcast_to":
        mask = np.broadcast_to(_make_mask(rng, (1, 71), kind), (2, 2, 33, 71))
    else:
        mask = _make_mask(rng, (66, 142), kind)[::2, ::2]
    check(q, k, v, mask=mask)


# --------------------------------------------------------------------------
# causal, window, kv_lengths
# --------------------------------------------------------------------------

def _explicit_visibility(L, S, causal=False, window=None, S_b=None):
    """The bool mask that causal/window/kv_lengths stand for, built by hand."""
    S_b = S if S_b is None else S_b
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    d = i if causal == "top_left" else i + S_b - L
    vis = j < S_b
    if causal:
        vis = vis & (j <= d)
    if window is not None:
        left, right = window
        if left >= 0:
            vis = vis & (j >= d - left)
        if right >= 0:
            vis = vis & (j <= d + right)
    return vis


@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("causal", [True, "bottom_right", "top_left"])
@pytest.mark.parametrize("L,S", [(7, 63), (65, 130), (65, 65), (113, 113), (113, 7), (130, 66), (1, 203), (203, 1)])
def test_causal_matches_reference_and_explicit_mask(isa, L, S, causal, dtype):
    rng = _rng("causal", L, S, causal, dtype)
    q, k, v = _inputs(rng, (2, 2, L, 16), (2, 1, S, 16), (2, 1, S, 24), dtype)
    got, _ = check(q, k, v, causal=causal)
    offset = 0 if causal == "top_left" else S - L
    tril = np.tril(np.ones((L, S), bool), k=offset)
    assert np.array_equal(tril, _explicit_visibility(L, S, causal))
    explicit = fastattn.attention(q, k, v, mask=tril)
    tol = tolerance(q, k, v, mask=tril)
    assert np.max(np.abs(got.astype(f64) - explicit)) <= tol
    if L == S:  # the two alignments agree on square problems
        other = "top_left" if causal != "top_left" else "bottom_right"
        assert np.max(np.abs(got.astype(f64) - fastattn.attention(q, k, v, causal=other))) <= tol


WINDOWS = [(0, 0), (-1, 3), (3, -1), (5, 2), (0, -1), (-1, 0), (70, 70), (200, 0)]
WINDOW_SHAPES = [(65, 63), (7, 130), (130, 130), (1, 90)]


@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_window(isa, window, causal):
    L, S = WINDOW_SHAPES[(WINDOWS.index(window) + [False, True, "top_left"].index(causal)) % 4]
    dtype = f64 if window[0] % 2 else f32
    rng = _rng("window", window, causal)
    q, k, v = _inputs(rng, (2, 2, L, 16), (2, 2, S, 16), (2, 2, S, 8), dtype)
    got, _ = check(q, k, v, window=window, causal=causal)
    vis = _explicit_visibility(L, S, causal, window)
    explicit = fastattn.attention(q, k, v, mask=vis)
    assert np.max(np.abs(got.astype(f64) - explicit)) <= tolerance(q, k, v, mask=vis)


@pytest.mark.parametrize("window", [None, (3, 1), (-1, 0)], ids=str)
@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("L,S", [(7, 70), (65, 65), (70, 7)])
def test_kv_lengths(isa, L, S, causal, window):
    """Per-batch key counts, 0 and S included; bottom-right aligns to kv_lengths[b]."""
    rng = _rng("kv", L, S, causal, window)
    lens = np.array([0, 1, S // 2 + 1, S])
    q, k, v = _inputs(rng, (4, 2, L, 16), (4, 1, S, 16), (4, 1, S, 8), f32)
    got, got_lse = check(q, k, v, kv_lengths=lens, causal=causal, window=window)
    assert np.all(got[0] == 0) and np.all(np.isneginf(got_lse[0]))  # no key at all
    vis = np.stack([_explicit_visibility(L, S, causal, window, S_b=n) for n in lens])[:, None]
    explicit = fastattn.attention(q, k, v, mask=vis)
    assert np.max(np.abs(got.astype(f64) - explicit)) <= tolerance(q, k, v, mask=vis)


@pytest.mark.parametrize("lens_shape", [(2, 1), (3,), (2, 3), ()])
def test_kv_lengths_broadcast_over_nd_batch(isa, lens_shape):
    rng = _rng("kv-nd", lens_shape)
    S = 40
    q, k, v = _inputs(rng, (2, 3, 2, 9, 8), (2, 3, 1, S, 8), (2, 3, 1, S, 5), f64)
    lens = rng.integers(0, S + 1, size=lens_shape)
    check(q, k, v, kv_lengths=lens, causal=True)


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "posinf"])
@pytest.mark.parametrize("hidden_by", ["causal", "window", "kv_lengths"])
def test_additive_mask_at_hidden_keys_has_no_effect(isa, hidden_by, value):
    """The restrictions AND together: a key hidden by causal/window/kv_lengths
    stays hidden whatever the additive mask holds there (the reference hides
    it with -inf after adding the mask)."""
    rng = _rng("hidden-mask", hidden_by, value)
    L, S = 9, 12
    q, k, v = _inputs(rng, (2, 2, L, 8), (2, 2, S, 8), (2, 2, S, 8), f32)
    kw = {"causal": dict(causal=True), "window": dict(window=(2, 1)),
          "kv_lengths": dict(kv_lengths=[S - 3, S - 5])}[hidden_by]
    vis = np.stack([_explicit_visibility(L, S, kw.get("causal", False), kw.get("window"), S_b=n)
                    for n in kw.get("kv_lengths", [S, S])])[:, None]
    mask = np.where(vis, rng.standard_normal(vis.shape), value)
    got, _ = check(q, k, v, mask=mask, **kw)
    assert not np.isnan(got).any()


# --------------------------------------------------------------------------
# Edge cases
# --------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["bool", "neginf"])
@pytest.mark.parametrize("dtype", [f32, f64])
def test_fully_masked_rows_are_zero(isa, dtype, form):
    """Rows 0, 65 and 129 (first, middle, last query block) see no key."""
    rng = _rng("fully-masked", dtype, form)
    L, S = 130, 100
    q, k, v = _inputs(rng, (2, 2, L, 16), (2, 2, S, 16), (2, 2, S, 8), dtype)
    keep = rng.random((2, 2, L, S)) < 0.8
    rows = [0, 65, 129]
    keep[:, :, rows] = False
    mask = keep if form == "bool" else np.where(keep, 0.0, -np.inf)
    got, lse = check(q, k, v, mask=mask)
    assert np.all(got[:, :, rows] == 0)
    assert np.all(np.isneginf(lse[:, :, rows]))
    assert not np.isnan(got).any() and not np.isnan(lse).any()
    others = np.setdiff1d(np.arange(L), rows)
    assert np.all(np.isfinite(lse[:, :, others]))


@pytest.mark.parametrize("dtype", [f32, f64])
def test_rows_before_the_diagonal_are_zero(isa, dtype):
    """Bottom-right causal with L > S: the first L - S rows see no key."""
    rng = _rng("causal-empty", dtype)
    q, k, v = _inputs(rng, (1, 2, 100, 8), (1, 2, 30, 8), (1, 2, 30, 8), dtype)
    got, lse = check(q, k, v, causal=True)
    assert np.all(got[:, :, :70] == 0) and np.all(np.isneginf(lse[:, :, :70]))
    assert np.all(np.isfinite(lse[:, :, 70:])) and not np.isnan(got).any()


@pytest.mark.parametrize("dtype", [f32, f64])
def test_huge_negative_additive_mask_is_a_shift(isa, dtype):
    """A mask of -1e5 everywhere only shifts every score: same as no mask.

    Adding -1e5 rounds each score to the spacing of 1e5 (about 1.5e-11 in
    float64, 8e-3 in float32), so the bound is that rounding, not 1e-12:
    float32 uses the textbook rule on the masked problem, float64 64 ulp of 1e5.
    """
    rng = _rng("shift", dtype)
    q, k, v = _inputs(rng, (2, 2, 70, 16), (2, 2, 67, 16), (2, 2, 67, 8), dtype)
    mask = np.full((70, 67), -1e5)
    got, lse = fastattn.attention(q, k, v, mask=mask, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True)
    if dtype == f32:
        tol = tolerance(q, k, v, mask=mask)
    else:
        tol = 64 * np.spacing(1e5) * np.max(np.abs(v))
    assert np.all(np.isfinite(got))
    assert np.max(np.abs(got - ref)) <= tol
    np.testing.assert_allclose(lse, ref_lse - 1e5, rtol=1e-6 if dtype == f32 else 1e-13)


@pytest.mark.parametrize("dtype", [f32, f64])
def test_huge_logits_stay_finite(isa, dtype):
    """Scores of order ±1e4: exp would overflow without the running max."""
    rng = _rng("huge", dtype)
    q, k, v = _inputs(rng, (2, 2, 70, 16), (2, 2, 67, 16), (2, 2, 67, 8), dtype)
    q = q * dtype(1e4)
    s = reference.attention_steps(q, k, v).scaled
    assert np.max(np.abs(s)) > 1e4
    got, lse = check(q, k, v)
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(lse))
    got, lse = check(q, k, v, causal="top_left")  # every row sees key 0
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(lse))


@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("row", [0, 37, 69])
def test_nan_in_one_query_row_stays_in_that_row(isa, row, dtype):
    rng = _rng("nan-q", row, dtype)
    q, k, v = _inputs(rng, (2, 2, 70, 16), (2, 1, 80, 16), (2, 1, 80, 8), dtype)
    tol = tolerance(q, k, v)
    ref = reference.attention(q, k, v)
    q[1, 0, row, 3] = np.nan
    got, lse = fastattn.attention(q, k, v, return_lse=True)
    assert np.all(np.isnan(got[1, 0, row])) and np.isnan(lse[1, 0, row])
    clean = np.ones(got.shape[:-1], bool)
    clean[1, 0, row] = False
    assert np.all(np.isfinite(got[clean])) and np.all(np.isfinite(lse[clean]))
    assert np.max(np.abs(got[clean] - ref[clean])) <= tol


@pytest.mark.parametrize("where", ["k_visible", "v_visible", "k_hidden_by_bool_mask", "k_hidden_by_causal"])
def test_nan_in_keys_and_values(isa, where):
    """NaN at a visible key spreads as in the reference; at a key hidden by a
    mask or causal, it does not (the score is replaced, not added to)."""
    rng = _rng("nan-kv", where)
    L, S = 20, 150
    q, k, v = _inputs(rng, (2, 2, L, 8), (2, 2, S, 8), (2, 2, S, 8), f64)
    kw = {}
    if where == "k_visible":
        k[0, 1, 100, 2] = np.nan
    elif where == "v_visible":
        v[1, 0, 3, 5] = np.nan
    elif where == "k_hidden_by_bool_mask":
        k[0, 1, 100, 2] = np.nan
        mask = np.ones((L, S), bool)
        mask[:, 100] = False
        kw = dict(mask=mask)
    else:
        k[0, 1, S - 1, 2] = np.nan  # only the last query row sees the last key
        kw = dict(causal=True)
    got, _ = fastattn.attention(q, k, v, return_lse=True, **kw)
    with np.errstate(invalid="ignore"):
        ref = reference.attention(q, k, v, **kw)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(got).any() == (where != "k_hidden_by_bool_mask")
    ok = ~np.isnan(ref)
    assert np.max(np.abs(got[ok] - ref[ok])) <= 1e-12 * np.max(np.abs(np.nan_to_num(v)))


@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("name,q_shape,kv_shape", [
    ("B=0", (0, 2, 5, 8), (0, 2, 7, 8)),
    ("H=0", (2, 0, 5, 8), (2, 0, 7, 8)),
    ("Hq=0,Hkv=1", (2, 0, 5, 8), (2, 1, 7, 8)),
    ("L=0", (2, 2, 0, 8), (2, 1, 7, 8)),
    ("L=0,2d", (0, 8), (7, 8)),
    ("nd,B=0", (3, 0, 2, 5, 8), (3, 0, 2, 7, 8)),
])
def test_empty_outputs(isa, name, q_shape, kv_shape, dtype):
    q, k = np.ones(q_shape, dtype), np.ones(kv_shape, dtype)
    v = np.ones(kv_shape[:-1] + (3,), dtype)
    got, lse = fastattn.attention(q, k, v, return_lse=True, causal=True)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, causal=True)
    assert got.shape == ref.shape and got.size == 0 and got.dtype == dtype
    assert lse.shape == ref_lse.shape and lse.dtype == dtype


@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(causal="top_left", window=(1, 1)),
                                dict(kv_lengths=0), dict(mask=np.zeros((5, 0)))], ids=str)
@pytest.mark.parametrize("dtype", [f32, f64])
def test_no_keys_gives_zeros(isa, dtype, kw):
    q = np.ones((2, 3, 5, 8), dtype)
    k, v = np.ones((2, 3, 0, 8), dtype), np.ones((2, 3, 0, 4), dtype)
    out = np.full((2, 3, 5, 4), np.nan, dtype)  # every element must be written
    got, lse = fastattn.attention(q, k, v, return_lse=True, out=out, **kw)
    assert got is out
    assert got.shape == (2, 3, 5, 4) and np.all(got == 0)
    assert lse.shape == (2, 3, 5) and np.all(np.isneginf(lse))


# --------------------------------------------------------------------------
# Exact properties (float64, tight)
# --------------------------------------------------------------------------

def test_single_key_returns_its_value(isa):
    rng = _rng("S=1")
    q, k, v = _inputs(rng, (2, 4, 130, 16), (2, 2, 1, 16), (2, 2, 1, 24), f64)
    got, lse = fastattn.attention(q, k, v, return_lse=True)
    want = np.broadcast_to(np.repeat(v, 2, axis=1), got.shape)
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    scores = np.einsum("bhle,bhe->bhl", q, np.repeat(k, 2, axis=1)[:, :, 0]) / 4
    np.testing.assert_allclose(lse, scores, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("with_mask", [False, True])
def test_permuting_keys_and_values_together(isa, with_mask):
    rng = _rng("perm", with_mask)
    L, S = 70, 150
    q, k, v = _inputs(rng, (2, 2, L, 16), (2, 2, S, 16), (2, 2, S, 8), f64)
    mask = rng.standard_normal((2, 1, L, S)) if with_mask else None
    perm = rng.permutation(S)
    got, lse = fastattn.attention(q, k, v, mask=mask, return_lse=True)
    pm = None if mask is None else mask[..., perm]
    got_p, lse_p = fastattn.attention(q, k[:, :, perm], v[:, :, perm], mask=pm, return_lse=True)
    np.testing.assert_allclose(got_p, got, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse_p, lse, rtol=0, atol=1e-12)


def test_linear_in_values(isa):
    rng = _rng("linear")
    q, k, v1 = _inputs(rng, (2, 4, 70, 16), (2, 2, 150, 16), (2, 2, 150, 8), f64)
    v2 = randn(rng, v1.shape, f64)
    a, b = 2.5, -0.75
    got = fastattn.attention(q, k, a * v1 + b * v2, causal=True)
    want = a * fastattn.attention(q, k, v1, causal=True) + b * fastattn.attention(q, k, v2, causal=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.max(np.abs(want)))


def test_constant_per_row_in_additive_mask_changes_nothing(isa):
    rng = _rng("row-constant")
    L, S = 70, 150
    q, k, v = _inputs(rng, (2, 2, L, 16), (2, 2, S, 16), (2, 2, S, 8), f64)
    mask = rng.standard_normal((2, 2, L, S))
    shift = rng.uniform(-50, 50, size=(2, 2, L, 1))
    got = fastattn.attention(q, k, v, mask=mask)
    shifted, lse_shifted = fastattn.attention(q, k, v, mask=mask + shift, return_lse=True)
    np.testing.assert_allclose(shifted, got, rtol=0, atol=1e-12)
    _, lse = fastattn.attention(q, k, v, mask=mask, return_lse=True)
    np.testing.assert_allclose(lse_shifted, lse + shift[..., 0], rtol=0, atol=1e-12)


# --------------------------------------------------------------------------
# Input forms and layouts: each against the reference
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("q_shape,k_shape,v_shape", [
    ((7, 8), (9, 8), (9, 5)),  # 2-D: one head, no batch
    ((3, 7, 8), (3, 9, 8), (3, 9, 5)),  # 3-D: heads, no batch
    ((4, 7, 8), (2, 9, 8), (2, 9, 5)),  # 3-D GQA
    ((4, 7, 8), (9, 8), (9, 5)),  # 2-D k, v shared by every head
    ((7, 8), (2, 1, 9, 8), (2, 1, 9, 5)),  # 2-D q broadcast over the batch
    ((2, 3, 4, 7, 8), (2, 3, 2, 9, 8), (2, 3, 2, 9, 5)),  # N-D batch
    ((1, 4, 70, 8), (3, 4, 66, 8), (3, 4, 66, 5)),  # q batch 1 vs k batch 3
    ((2, 1, 4, 70, 8), (1, 3, 1, 66, 8), (3, 1, 66, 5)),  # every batch axis broadcast
    ((3, 1, 2, 7, 8), (3, 5, 2, 9, 8), (5, 2, 9, 5)),
], ids=str)
def test_input_ranks_and_broadcast_batch(isa, q_shape, k_shape, v_shape, dtype):
    rng = _rng("ranks", q_shape, k_shape, v_shape, dtype)
    q, k, v = _inputs(rng, q_shape, k_shape, v_shape, dtype)
    got, lse = check(q, k, v, causal=True)
    batch = np.broadcast_shapes(q_shape[:-3], k_shape[:-3], v_shape[:-3])
    heads = (q_shape[-3],) if len(q_shape) >= 3 else (1,) if max(len(k_shape), len(v_shape)) >= 3 else ()
    assert got.shape == batch + heads + (q_shape[-2], v_shape[-1])


def test_lists_are_accepted(isa):
    rng = _rng("lists")
    q, k, v = _inputs(rng, (3, 4), (5, 4), (5, 2), f64)
    got = fastattn.attention(q.tolist(), k.tolist(), v.tolist())
    assert got.dtype == f64
    np.testing.assert_allclose(got, reference.attention(q, k, v), rtol=0, atol=1e-12)


def _misaligned(a):
    """A copy of a whose data starts one byte past an aligned address."""
    buf = bytearray(a.nbytes + 1)
    m = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    m[...] = a
    assert not m.flags.aligned
    return m


def _layout(rng, layout, B, H, L, S, D, dtype):
    """q, k, v of shape (B, H, ·, D) in the given memory layout."""
    if layout == "fused_projection":  # (B, L, 3, H, D) as a QKV linear layer writes it
        x = randn(rng, (B, L, 3, H, D), dtype)
        return tuple(x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    q, k, v = _inputs(rng, (B, H, L, D), (B, H, S, D), (B, H, S, D), dtype)
    if layout == "last_axis_strided":
        return tuple(np.repeat(a, 2, axis=-1)[..., ::2] for a in (q, k, v))
    if layout == "negative_strides":
        return tuple(np.ascontiguousarray(a[::-1, ::-1, ::-1])[::-1, ::-1, ::-1] for a in (q, k, v))
    if layout == "byteswapped":
        return tuple(a.astype(a.dtype.newbyteorder(">")) for a in (q, k, v))
    if layout == "byteswapped_q_only":
        return q.astype(q.dtype.newbyteorder(">")), k, v
    if layout == "misaligned":
        return tuple(_misaligned(a) for a in (q, k, v))
    if layout == "fortran_order":
        return tuple(np.asfortranarray(a) for a in (q, k, v))
    raise AssertionError(layout)


LAYOUTS = ["fused_projection", "last_axis_strided", "negative_strides", "byteswapped",
           "byteswapped_q_only", "misaligned", "fortran_order"]


@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_memory_layouts(isa, layout, dtype):
    rng = _rng("layout", layout, dtype)
    q, k, v = _layout(rng, layout, 2, 3, 67, 67, 16, dtype)
    if layout == "last_axis_strided":
        assert q.strides[-1] == 2 * q.itemsize
    got, _ = check(q, k, v, causal=True)
    assert got.dtype == np.dtype(dtype)
    assert got.dtype.isnative
