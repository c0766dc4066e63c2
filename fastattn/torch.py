"""fastattn.torch: the C kernel on torch CPU tensors, by pointer and strides.

This module owns the torch boundary: checking torch tensors (every error names
the argument, what it got and what it needs), handing their data_ptr() and
element strides to the binding's raw entry (no copy, no NumPy round trip, so
bfloat16 needs no ml_dtypes), and the `fastattn::attention` custom op with its
fake implementation, so a torch.compile'd model calls it without a graph break.
Inference only. `import fastattn` never imports this module (nor torch).
"""
from typing import Optional

import numpy as np
import torch

from fastattn import _kernel
# the scalar arguments are checked as fastattn.attention checks them (the same messages)
from fastattn._api import _causal, _check_softcap, _check_window, _scale, _threads

__all__ = ["attention", "scaled_dot_product_attention"]

_CODES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
          torch.bfloat16: "bfloat16", torch.int8: "int8"}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _code(dtype):
    return _kernel.DTYPE_CODES[_CODES[dtype]]


# -- checks (Python, so that errors name the argument; C's fa_check is the backstop)

def _tensor(x, name, dtypes=_FLOATS, what="float16, bfloat16, float32 or float64"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU (fastattn is a CPU kernel); got device {x.device}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must be {what}; got {x.dtype}")
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            f"{name} requires grad: fastattn.torch is inference only (no backward). Run under "
            "torch.no_grad() or torch.inference_mode(), or pass a detached tensor")
    return x


def _as_4d(x, name):
    """(B, H, R, C) from (R, C), (H, R, C), (B, H, R, C) or (..., H, R, C) (leading axes merged)."""
    if x.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (..., rows, head_dim); "
                         f"got shape {tuple(x.shape)}")
    if x.dim() == 2:
        return x[None, None]
    if x.dim() == 3:
        return x[None]
    if x.dim() > 4:
        return x.reshape((-1,) + tuple(x.shape[-3:]))  # a view when the leading axes merge
    return x


def _kernel_ready(x):
    # C reads the last axis contiguously; anything else is copied once
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _kv(x, name):
    """k or v: a float tensor, or an int8 pair (values, scales), scales (..., rows)
    float32; k also the triple (values, scales, channels), channels (..., E)
    float32 (as fastattn.attention takes them). Returns (tensor, scales, channels)."""
    if isinstance(x, tuple):
        if len(x) not in ((2, 3) if name == "k" else (2,)):
            raise TypeError(f"{name} as a tuple must be an int8 pair (values, scales)"
                            f"{' or triple (values, scales, channels)' if name == 'k' else ''}; "
                            f"got {len(x)} items")
        values = _tensor(x[0], f"{name}'s values", (torch.int8,), "int8")
        scales = _tensor(x[1], f"{name}'s scales", (torch.float32,), "float32")
        if tuple(scales.shape) != tuple(values.shape[:-1]):
            raise ValueError(f"{name}'s scales must have shape {tuple(values.shape[:-1])} (one per row of "
                             f"values {tuple(values.shape)}); got {tuple(scales.shape)}")
        channels = None
        if len(x) == 3:
            channels = _tensor(x[2], "k's channel factors", (torch.float32,), "float32")
            want = tuple(values.shape[:-2]) + tuple(values.shape[-1:])
            if tuple(channels.shape) != want:
                raise ValueError(f"k's channel factors must have shape {want} (values.shape[:-2] + (E,)); "
                                 f"got {tuple(channels.shape)}")
        return values, scales, channels
    return _tensor(x, name, _FLOATS, "float16, bfloat16, float32 or float64 (or an int8 pair "
                                     "(values, scales))"), None, None


def _check_dtypes(q, k, v):
    if k.dtype != v.dtype:
        raise TypeError(f"k and v must have the same dtype; got k {k.dtype}, v {v.dtype}")
    if torch.float64 in (q.dtype, k.dtype) and not q.dtype == k.dtype == torch.float64:
        raise TypeError("float64 computes in float64: q, k and v must then all be float64 (16-bit, int8 "
                        f"and float32 inputs compute in float32); got q {q.dtype}, k {k.dtype}, v {v.dtype}")


def _broadcast_batch(tensors, names):
    """The common batch size; each tensor's batch axis must be it or 1."""
    sizes = {n: t.shape[0] for n, t in zip(names, tensors)}
    B = max(sizes.values())
    bad = {n: b for n, b in sizes.items() if b not in (1, B)}
    if bad:
        raise ValueError(f"the batch sizes of {', '.join(f'{n} {b}' for n, b in sizes.items())} "
                         "do not broadcast (each must be the largest or 1)")
    return B


def _strides(x, B):
    # element strides of batch, head, row; a batch of 1 broadcast has stride 0
    return (0 if x.shape[0] == 1 and B != 1 else x.stride(0), x.stride(1), x.stride(2))


def _per_batch(x, name, B, dtype=torch.int64):
    """An int per batch entry as a contiguous int64 tensor of shape (B,)."""
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be integers; got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU; got device {t.device}")
    try:
        return t.to(dtype).broadcast_to((B,)).contiguous()
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to the batch ({B},)") from None


def _check_sinks(sinks, Hq):
    t = sinks if isinstance(sinks, torch.Tensor) else torch.as_tensor(np.asarray(sinks))
    if not t.dtype.is_floating_point and t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"sinks must hold real numbers; got {t.dtype}")
    if tuple(t.shape) != (Hq,):
        raise ValueError(f"sinks must have shape (Hq,) = ({Hq},), one logit per query head; "
                         f"got shape {tuple(t.shape)}")
    return t.detach().to(torch.float64).contiguous()


def _check_mask(mask, compute, shape):
    """A bool or floating mask broadcast to (B, Hq, L, S) as a strided view (stride 0
    where broadcast). A floating mask is rounded to the computation type (a
    bfloat16 or float16 mask becomes float32 exactly)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor; got {type(mask).__name__}")
    if mask.device.type != "cpu":
        raise ValueError(f"mask must be on the CPU; got device {mask.device}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"mask must be bool (True = may attend) or floating (added to the scores); "
                        f"got {mask.dtype}")
    try:
        full = torch.broadcast_shapes(mask.shape, shape)
    except RuntimeError:
        full = None
    if full is None or tuple(full) != tuple(shape):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
                         f"{tuple(shape)} (B, Hq, L, S)")
    if mask.dtype.is_floating_point and mask.dtype != compute:
        if compute == torch.float32 and mask.dtype == torch.float64:
            # finite values beyond float32 stay huge and finite, not ±inf
            lim = torch.finfo(torch.float32)
            mask = torch.where(mask.isfinite(), mask.clamp(lim.min, lim.max), mask)
        mask = mask.to(compute)
    return mask.expand(shape)


def _extent(t):
    """[lo, hi) of the bytes a tensor's elements span."""
    if t.numel() == 0:
        return 0, 0
    lo = t.data_ptr()
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return lo, lo + (span + 1) * t.element_size()


def _check_out(out, shape, dtype, inputs):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor; got {type(out).__name__}")
    if out.device.type != "cpu":
        raise ValueError(f"out must be on the CPU; got device {out.device}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}; got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype} (q's); got {out.dtype}")
    if out.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("out requires grad: fastattn.torch is inference only")
    if out.numel() and shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"out must have a contiguous last axis; got strides {tuple(out.stride())}")
    lo, hi = _extent(out)
    for name, x in inputs:
        if x is not None and x.numel() and lo < hi:
            a, b = _extent(x)
            if lo < b and a < hi:
                raise ValueError(f"out must not overlap its inputs; it shares memory with {name}")


class _Call:
    """A checked call: 4-D tensors plus the flags the op takes."""


def _prepare(q, k, v, mask, causal, window, kv_lengths, scale, softcap, sinks, q_start, k_start,
             num_threads, out):
    q = _tensor(q, "q")
    k, k_scale, k_channel = _kv(k, "k")
    v, v_scale, _ = _kv(v, "v")
    if (k_scale is None) != (v_scale is None):
        raise TypeError("k and v must both be int8 pairs or both float tensors")
    _check_dtypes(q, k, v)
    nd = max(q.dim(), k.dim(), v.dim())
    q4, k4, v4 = _as_4d(q, "q"), _as_4d(k, "k"), _as_4d(v, "v")
    (B_, Hq, L, E), (_, Hkv, S, E_k), (_, Hv, S_v, Ev) = q4.shape, k4.shape, v4.shape
    if E_k != E:
        raise ValueError(f"k's last axis must equal q's (E): q has E={E}, k has {E_k}")
    if S_v != S:
        raise ValueError(f"v must have as many rows as k (S): k has S={S}, v has {S_v}")
    if Hv != Hkv:
        raise ValueError(f"k and v must have the same number of heads; got {Hkv} and {Hv}")
    if E < 1 or Ev < 1:
        raise ValueError(f"head dims must be at least 1; got E={E}, Ev={Ev}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q's heads (Hq={Hq}) must be a multiple of k's and v's heads (Hkv={Hkv}) "
                         "for grouped-query attention")
    if nd > 4 and not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
        raise ValueError(f"above 4 dimensions the leading axes of q {tuple(q.shape[:-3])}, k "
                         f"{tuple(k.shape[:-3])} and v {tuple(v.shape[:-3])} must be equal")
    B = _broadcast_batch((q4, k4, v4), ("q", "k", "v"))
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    c = _Call()
    c.q, c.k, c.v = _kernel_ready(q4), _kernel_ready(k4), _kernel_ready(v4)
    c.k_scale = None if k_scale is None else _as_4d(k_scale[..., None], "k's scales")
    c.v_scale = None if v_scale is None else _as_4d(v_scale[..., None], "v's scales")
    c.k_channel = None if k_channel is None else _kernel_ready(_as_4d(k_channel[..., None, :], "k's channel factors"))
    c.B, c.dims = B, (B, Hq, Hkv, L, S, E, Ev)
    c.causal, c.align = _causal(causal)
    c.window = _check_window(window)
    c.scale = _scale(scale, E)
    c.softcap = _check_softcap(softcap)
    c.threads = _threads(num_threads)
    c.mask = None if mask is None else _check_mask(mask, compute, (B, Hq, L, S))
    c.kv_lengths = None if kv_lengths is None else _per_batch(kv_lengths, "kv_lengths", B)
    c.sinks = None if sinks is None else _check_sinks(sinks, Hq)
    c.q_start = None if q_start is None else _per_batch(q_start, "q_start", B)
    c.k_start = None if k_start is None else _per_batch(k_start, "k_start", B)
    # the result has the inputs' rank: (L, Ev), (Hq, L, Ev), (B, Hq, L, Ev) or (..., Hq, L, Ev)
    c.out_shape = ((B, Hq) if nd == 4 else (Hq,) if nd == 3 else tuple(q.shape[:-3]) + (Hq,) if nd > 4
                   else ()) + (L, Ev)
    if out is not None:
        _check_out(out, c.out_shape, q.dtype, (("q", q), ("k", k), ("v", v), ("mask", mask)))
    return c


def _flags(c):
    """The op's arguments after q, k, v (see _attention_op)."""
    return (c.k_scale, c.v_scale, c.k_channel, c.mask, c.causal, c.align, c.window[0], c.window[1], c.kv_lengths,
            c.scale, c.softcap, c.sinks, c.q_start, c.k_start, c.threads)


# -- the kernel call on checked tensors (what the custom op runs) -------------

def _ptr(t):
    return 0 if t is None else t.data_ptr()


def _run(q, k, v, out4, k_scale, v_scale, k_channel, mask, causal, align, wl, wr, kv_lengths, scale, softcap,
         sinks, q_start, k_start, threads):
    if kv_lengths is not None:
        S = k.shape[2]
        if kv_lengths.numel() and (int(kv_lengths.min()) < 0 or int(kv_lengths.max()) > S):
            raise ValueError(f"kv_lengths must lie in [0, S={S}]; got values from "
                             f"{int(kv_lengths.min())} to {int(kv_lengths.max())}")
    B = out4.shape[0]
    dims = (B, q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    mask_kind = 0 if mask is None else (1 if mask.dtype == torch.bool else 2)
    _kernel.attention_raw(
        _code(k.dtype), _code(q.dtype), _code(out4.dtype), dims,
        q.data_ptr(), _strides(q, B), k.data_ptr(), _strides(k, B), v.data_ptr(), _strides(v, B),
        out4.data_ptr(), _strides(out4, B), scale,
        causal=causal, align=align, window_left=wl, window_right=wr,
        mask_kind=mask_kind, mask=_ptr(mask), mask_stride=None if mask is None else tuple(mask.stride()),
        kv_len=_ptr(kv_lengths), softcap=softcap, sinks=_ptr(sinks),
        q_start=_ptr(q_start), k_start=_ptr(k_start),
        k_scale=_ptr(k_scale), k_scale_stride=None if k_scale is None else _strides(k_scale, B),
        v_scale=_ptr(v_scale), v_scale_stride=None if v_scale is None else _strides(v_scale, B),
        k_channel=_ptr(k_channel), k_channel_stride=None if k_channel is None else _strides(k_channel, B)[:2],
        num_threads=threads)


def _out_shape_4d(q, k):
    return (max(q.shape[0], k.shape[0]), q.shape[1], q.shape[2])


@torch.library.custom_op("fastattn::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: Optional[torch.Tensor],
                  v_scale: Optional[torch.Tensor], k_channel: Optional[torch.Tensor],
                  mask: Optional[torch.Tensor], causal: int, align: int,
                  wl: int, wr: int, kv_lengths: Optional[torch.Tensor], scale: float, softcap: float,
                  sinks: Optional[torch.Tensor], q_start: Optional[torch.Tensor], k_start: Optional[torch.Tensor],
                  threads: int) -> torch.Tensor:
    """(B, Hq, L, Ev) in q's dtype, for checked 4-D tensors."""
    out = q.new_empty(_out_shape_4d(q, k) + (v.shape[3],))
    _run(q, k, v, out, k_scale, v_scale, k_channel, mask, causal, align, wl, wr, kv_lengths, scale, softcap,
         sinks, q_start, k_start, threads)
    return out


@_attention_op.register_fake
def _(q, k, v, k_scale, v_scale, k_channel, mask, causal, align, wl, wr, kv_lengths, scale, softcap, sinks,
      q_start, k_start, threads):
    return q.new_empty(_out_shape_4d(q, k) + (v.shape[3],))


@torch.library.custom_op("fastattn::attention_out", mutates_args=("out",))
def _attention_out_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                      k_channel: Optional[torch.Tensor], mask: Optional[torch.Tensor], causal: int, align: int, wl: int, wr: int,
                      kv_lengths: Optional[torch.Tensor], scale: float, softcap: float,
                      sinks: Optional[torch.Tensor], q_start: Optional[torch.Tensor],
                      k_start: Optional[torch.Tensor], threads: int) -> None:
    """Writes into out, a (B, Hq, L, Ev) view (any strides, last axis contiguous)."""
    _run(q, k, v, out, k_scale, v_scale, k_channel, mask, causal, align, wl, wr, kv_lengths, scale, softcap,
         sinks, q_start, k_start, threads)


@_attention_out_op.register_fake
def _(*args):
    return None


def attention(q, k, v, *, mask=None, causal=False, window=None, kv_lengths=None, scale=None,
              softcap=None, sinks=None, q_start=None, k_start=None, out=None, num_threads=None):
    """:func:`fastattn.attention` on torch CPU tensors, the same semantics.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev): float16,
    bfloat16, float32 or float64 (k and v the same dtype; float64 only with
    float64), or k and v int8 pairs (values, float32 scales of shape
    values.shape[:-1]). The batch axis (the one before the heads) broadcasts
    when it is 1. Strided tensors are read in place (a copy only when the last
    axis is not contiguous). mask: bool (True = may attend) or floating,
    broadcastable to (B, Hq, L, S). causal, window, kv_lengths, scale,
    softcap, sinks, q_start, k_start, num_threads: as fastattn.attention.
    out: a tensor of the result's shape and q's dtype, written in place (any
    strides with a contiguous last axis, such as a (B, L, H, Ev) buffer
    transposed to (B, H, L, Ev)) and returned.

    Returns a tensor of shape (..., Hq, L, Ev) in q's dtype. Inference only: a
    tensor that requires grad (with grad enabled) is refused.
    """
    c = _prepare(q, k, v, mask, causal, window, kv_lengths, scale, softcap, sinks, q_start, k_start,
                 num_threads, out)
    # Eager code calls the kernel straight away (the dispatcher's argument
    # handling costs about as much as a decoding step's kernel call); torch.compile
    # traces the custom ops instead, which it sees through their fake versions.
    compiling = torch.compiler.is_compiling()
    if out is None:
        if compiling:
            return _attention_op(c.q, c.k, c.v, *_flags(c)).reshape(c.out_shape)
        result = c.q.new_empty(_out_shape_4d(c.q, c.k) + (c.v.shape[3],))
        _run(c.q, c.k, c.v, result, *_flags(c))
        return result.reshape(c.out_shape)
    out4 = out[None, None] if out.dim() == 2 else out[None] if out.dim() == 3 else out
    if out4.dim() > 4:
        out4 = out4.view((-1,) + tuple(out4.shape[-3:]))  # a view, or a clear error
    (_attention_out_op if compiling else _run)(c.q, c.k, c.v, out4, *_flags(c))
    return out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, window=None, softcap=None,
                                 sinks=None, kv_lengths=None, out=None, num_threads=None):
    """``torch.nn.functional.scaled_dot_product_attention``'s signature and meaning,
    computed by fastattn.

    ``is_causal`` is the top-left triangle (row i sees keys j <= i); a bool
    ``attn_mask`` is True where a key may be attended, a float one is added to
    the scores; ``attn_mask`` and ``is_causal`` cannot be combined; different
    head counts need ``enable_gqa=True`` (query head h reads key/value head
    h // (Hq / Hkv), as torch does); a row with no visible key returns zeros.
    ``dropout_p`` must be 0 (inference only).

    fastattn's extras, keyword-only: ``window`` (left, right), ``softcap``,
    ``sinks`` (Hq,), ``kv_lengths`` (B,), ``out`` and ``num_threads``, as in
    :func:`attention`; a window is aligned top-left with ``is_causal`` and
    bottom-right without.
    """
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0.0: fastattn is an inference kernel with no dropout; "
                         f"got {dropout_p}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool; got {type(is_causal).__name__} {is_causal!r}")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True cannot be combined (as in PyTorch); pass one")
    if (not enable_gqa and isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
            and query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3]):
        raise ValueError(f"query has {query.shape[-3]} heads and key {key.shape[-3]}: different head "
                         "counts need enable_gqa=True")
    return attention(query, key, value, mask=attn_mask, causal="top_left" if is_causal else False,
                     window=window, kv_lengths=kv_lengths, scale=scale, softcap=softcap, sinks=sinks,
                     out=out, num_threads=num_threads)
