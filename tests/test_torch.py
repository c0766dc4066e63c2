"""fastattn.torch against the float64 reference: every dtype, GQA, masks,
causal, window, modifiers, strided tensors, out=, torch.compile without a
graph break, and the errors (each names its argument). Skipped without torch.
Also: `import fastattn` imports neither torch nor transformers.
"""
import subprocess
import sys

import numpy as np
import pytest

from _helpers import tolerance

torch = pytest.importorskip("torch")
fat = pytest.importorskip("fastattn.torch")
import fastattn  # noqa: E402
from fastattn import reference  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _np(t):
    """A tensor's exact value as float64 NumPy (bfloat16 included, no ml_dtypes)."""
    return t.detach().to(torch.float64).numpy()


def _check(got, q, k, v, **kw):
    """got within the shared tolerance of the float64 reference, on the rounded inputs."""
    q64, k64, v64 = _np(q), _np(k), _np(v)
    ref = reference.attention(q64, k64, v64, **kw)
    # tolerance() reads the output dtype from q: float32 inputs give float32's
    # rule; 16-bit dtypes add half an ulp of the output at max|out|
    qt = q64.astype(np.float32) if q.dtype != torch.float64 else q64
    tol = tolerance(qt, k64.astype(qt.dtype), v64.astype(qt.dtype), **kw)
    if q.dtype in (torch.float16, torch.bfloat16):
        tol += (2.0**-11 if q.dtype == torch.float16 else 2.0**-8) * float(np.abs(ref).max())
    assert got.dtype == q.dtype
    assert tuple(got.shape) == ref.shape
    err = float(np.max(np.abs(_np(got) - ref))) if ref.size else 0.0
    assert err <= tol, f"error {err:.3g} > tolerance {tol:.3g}"


def _qkv(dtype, B=2, Hq=4, Hkv=2, L=7, S=13, E=16, Ev=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, L, E, generator=g).to(dtype), torch.randn(B, Hkv, S, E, generator=g).to(dtype),
            torch.randn(B, Hkv, S, Ev, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True, "top_left"])
def test_dtypes_gqa_causal(dtype, causal):
    q, k, v = _qkv(dtype, Ev=24)
    _check(fat.attention(q, k, v, causal=causal), q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masks_window_modifiers(dtype):
    q, k, v = _qkv(dtype, L=13, S=13)
    g = torch.Generator().manual_seed(1)
    bool_mask = torch.rand(2, 1, 13, 13, generator=g) > 0.3
    add_mask = torch.randn(1, 4, 13, 13, generator=g).to(dtype)
    for kw in ({"mask": bool_mask}, {"mask": add_mask}, {"window": (3, 0), "causal": True},
               {"window": (2, 2)}, {"kv_lengths": [5, 13], "causal": True}, {"softcap": 2.0},
               {"sinks": [0.5, -1.0, 2.0, 0.0]}, {"q_start": [3, 0], "k_start": [0, 0], "causal": True},
               {"scale": 0.3}):
        # a 16-bit additive mask becomes float32 exactly: the reference reads its float64 value
        ref_kw = {n: (x.numpy() if isinstance(x, torch.Tensor) and x.dtype == torch.bool else
                      _np(x) if isinstance(x, torch.Tensor) else np.asarray(x) if isinstance(x, list) else x)
                  for n, x in kw.items()}
        _check(fat.attention(q, k, v, **kw), q, k, v, **ref_kw)


def test_sdpa_matches_torch():
    q, k, v = _qkv(torch.float64, L=9, S=9)
    mask = torch.rand(2, 4, 9, 9, generator=torch.Generator().manual_seed(2)) > 0.4
    mask[..., 0] = True  # torch gives NaN for a row with no visible key; fastattn gives zeros
    F = torch.nn.functional.scaled_dot_product_attention
    for kw in ({"is_causal": True}, {"attn_mask": mask}, {"attn_mask": torch.randn(9, 9, dtype=torch.float64)},
               {"scale": 0.5}):
        got = fat.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        want = F(q, k, v, enable_gqa=True, **kw)
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_strided_views_are_read_in_place():
    # q, k, v sliced out of a fused (B, L, 3, H, E) projection: (B, H, L, E) views
    qkv = torch.randn(2, 11, 3, 4, 16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    _check(fat.attention(q, k, v, causal=True), q, k, v, causal=True)
    # a last axis that is not contiguous is copied once, then gives the same answer
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert torch.equal(fat.attention(q, k, v), fat.attention(q, kt.contiguous(), v))
    # a broadcast batch (stride 0) and a 3-D call
    q1 = torch.randn(3, 4, 5, 16)
    k1, v1 = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    _check(fat.attention(q1, k1, v1), q1, k1, v1)
    _check(fat.attention(q1[0], k1[0], v1[0]), q1[0], k1[0], v1[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_in_transformers_layout(dtype):
    q, k, v = _qkv(dtype)
    buf = torch.full((2, 7, 4, 16), 7.0, dtype=dtype)  # (B, L, H, Ev)
    got = fat.attention(q, k, v, causal=True, out=buf.transpose(1, 2))
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf.transpose(1, 2), fat.attention(q, k, v, causal=True))


def test_int8_pairs():
    q, k, v = _qkv(torch.float32)
    kq, ks = fastattn.cache.quantize_int8(k.numpy())
    vq, vs = fastattn.cache.quantize_int8(v.numpy())
    got = fat.attention(q, (torch.from_numpy(kq), torch.from_numpy(ks)),
                        (torch.from_numpy(vq), torch.from_numpy(vs)), causal=True)
    want = fastattn.attention(q.numpy(), (kq, ks), (vq, vs), causal=True)
    assert np.array_equal(got.numpy(), want)


def test_int8_keys_with_channel_factors():
    """(values, scales, channels) keys: the same bits as fastattn.attention on
    the same arrays, and channel factors of shape other than (..., E) refused."""
    q, k, v = _qkv(torch.float32)
    c = fastattn.cache.key_channel_scales(k.numpy())
    kq, ks = fastattn.cache.quantize_int8(k.numpy() / c[..., None, :])
    vq, vs = fastattn.cache.quantize_int8(v.numpy())
    kt = (torch.from_numpy(kq), torch.from_numpy(ks), torch.from_numpy(c))
    got = fat.attention(q, kt, (torch.from_numpy(vq), torch.from_numpy(vs)), causal=True)
    want = fastattn.attention(q.numpy(), (kq, ks, c), (vq, vs), causal=True)
    assert np.array_equal(got.numpy(), want)
    plain = fat.attention(q, kt[:2], (torch.from_numpy(vq), torch.from_numpy(vs)), causal=True)
    assert not torch.equal(got, plain)  # the factors are applied
    with pytest.raises(ValueError, match=r"k's channel factors must have shape"):
        fat.attention(q, kt[:2] + (kt[2][..., :-1],), (torch.from_numpy(vq), torch.from_numpy(vs)))
    with pytest.raises(TypeError, match=r"v as a tuple must be an int8 pair \(values, scales\); got 3"):
        fat.attention(q, kt, (torch.from_numpy(vq), torch.from_numpy(vs), kt[2]))


def test_compile_without_graph_break():
    torch._dynamo.reset()
    counts = []

    def backend(gm, example_inputs):  # counts the graphs dynamo hands over
        counts.append(gm)
        return gm.forward

    def f(q, k, v):
        return fat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sin() + 1

    q, k, v = _qkv(torch.float32)
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    assert torch.equal(compiled(q, k, v), f(q, k, v))
    assert len(counts) == 1
    # the fake (meta) implementation gives shape and dtype under AOT tracing
    aot = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(aot(q, k, v), f(q, k, v))
    torch._dynamo.reset()


def test_grad_is_refused():
    q, k, v = _qkv(torch.float32)
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="q requires grad: fastattn.torch is inference only"):
        fat.attention(q, k, v)
    with torch.no_grad():
        assert fat.attention(q, k, v).shape == (2, 4, 7, 16)


@pytest.mark.parametrize("call, error, message", [
    (lambda q, k, v: fat.attention(q.numpy(), k, v), TypeError, "q must be a torch.Tensor; got ndarray"),
    (lambda q, k, v: fat.attention(q.int(), k, v), TypeError, "q must be float16, bfloat16, float32 or "
                                                              "float64; got torch.int32"),
    (lambda q, k, v: fat.attention(q, k.half(), v), TypeError, "k and v must have the same dtype"),
    (lambda q, k, v: fat.attention(q.double(), k, v), TypeError, "float64 computes in float64"),
    (lambda q, k, v: fat.attention(q, k[..., :8], v), ValueError, "k's last axis must equal q's"),
    (lambda q, k, v: fat.attention(q, k, v[:, :, :5]), ValueError, "v must have as many rows as k"),
    (lambda q, k, v: fat.attention(q[:, :3], k, v), ValueError, r"q's heads \(Hq=3\) must be a multiple"),
    (lambda q, k, v: fat.attention(q, k, v, mask=torch.ones(3, 3, dtype=torch.bool)), ValueError,
     r"mask of shape \(3, 3\) does not broadcast"),
    (lambda q, k, v: fat.attention(q, k, v, mask=torch.ones(7, 13, dtype=torch.int32)), TypeError,
     "mask must be bool"),
    (lambda q, k, v: fat.attention(q, k, v, causal="yes"), ValueError, "causal must be False, True"),
    (lambda q, k, v: fat.attention(q, k, v, window=(-2, 0)), ValueError, "window must be"),
    (lambda q, k, v: fat.attention(q, k, v, kv_lengths=[3, 14]), ValueError,
     r"kv_lengths must lie in \[0, S=13\]"),
    (lambda q, k, v: fat.attention(q, k, v, kv_lengths=[3, 4, 5]), ValueError, "kv_lengths of shape"),
    (lambda q, k, v: fat.attention(q, k, v, sinks=[1.0]), ValueError, r"sinks must have shape \(Hq,\)"),
    (lambda q, k, v: fat.attention(q, k, v, softcap=-1.0), ValueError, "softcap must be a finite number"),
    (lambda q, k, v: fat.attention(q, k, v, scale=float("nan")), ValueError, "scale must be finite"),
    (lambda q, k, v: fat.attention(q, k, v, num_threads=0), ValueError, "num_threads must be >= 1"),
    (lambda q, k, v: fat.attention(q, k, v, out=torch.empty(2, 4, 7, 15)), ValueError,
     r"out must have shape \(2, 4, 7, 16\)"),
    (lambda q, k, v: fat.attention(q, k, v, out=torch.empty(2, 4, 7, 16, dtype=torch.float64)), TypeError,
     "out must have dtype torch.float32"),
    (lambda q, k, v: fat.attention(q, k, v, out=q), ValueError, "out must not overlap its inputs; it shares "
                                                                "memory with q"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v), ValueError, "enable_gqa=True"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, dropout_p=0.1, enable_gqa=True), ValueError,
     "dropout_p must be 0.0"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(7, 13, dtype=torch.bool),
                                                      is_causal=True, enable_gqa=True), ValueError,
     "cannot be combined"),
])
def test_errors_name_the_argument(call, error, message):
    q, k, v = _qkv(torch.float32)
    q = q[..., :16].clone()
    out_before = q.clone()
    with pytest.raises(error, match=message):
        call(q, k, v)
    assert torch.equal(q, out_before)  # nothing written (out=q is refused before the call)


def test_error_leaves_out_untouched():
    q, k, v = _qkv(torch.float32)
    out = torch.full((2, 4, 7, 16), 3.0)
    with pytest.raises(ValueError):
        fat.attention(q, k, v, kv_lengths=[2, 99], out=out)
    assert torch.all(out == 3.0)


def test_import_fastattn_imports_neither_torch_nor_transformers():
    code = ("import sys, fastattn; fastattn.attention([[1.0]], [[1.0]], [[1.0]]); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd="/")
    assert result.stdout.split() == ["False", "False"]
