"""The public entry points: validation, broadcasting and strides, then the binding.

No arithmetic happens here. Every input is checked, and every bad one raises
a TypeError or ValueError naming the argument, what it got and what it needs,
before anything is written. The arrays then reach the C kernel as 4-D
(batch, head, row, column) views: broadcast axes get stride 0 and strided
views (q, k, v sliced out of a fused projection) are passed as they are; only
an input whose last axis is not contiguous, or whose data is misaligned or
byte-swapped, is copied.
"""
import math
import numbers
import operator

import numpy as np

from fastattn import _kernel

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_CAUSAL = {False: (0, 0), None: (0, 0), True: (1, 0), "bottom_right": (1, 0), "top_left": (1, 1)}


def _shape(x):
    return tuple(int(n) for n in x.shape)


def _is_bf16(dtype):
    """ml_dtypes' bfloat16, recognised without importing ml_dtypes."""
    return dtype.name == "bfloat16" and dtype.itemsize == 2


def _float_kind(dtype):
    """'float16', 'bfloat16', 'float32', 'float64', or None for any other dtype."""
    if _is_bf16(dtype):
        return "bfloat16"
    if dtype.kind == "f" and dtype.itemsize in (2, 4, 8):
        return f"float{8 * dtype.itemsize}"
    return None


def _as_input(x, name):
    """np.asarray, then the dtype and rank checks every tensor input shares."""
    a = np.asarray(x)
    if a.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (..., rows, head_dim); got shape {_shape(a)}")
    if _float_kind(a.dtype) is None:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64"
                        f"{' (or an int8 pair (values, scales))' if name in ('k', 'v') else ''}; "
                        f"got {a.dtype}")
    return a


def _as_kv(x, name):
    """k or v: a float array, or int8 storage: the pair (values, scales) with
    one float32 scale per row (scales.shape == values.shape[:-1]), and for k
    optionally the triple (values, scales, channels) with per-channel factors
    of shape values.shape[:-2] + (E,) (one E-vector per head: the key is
    values · scales · channels). Returns (array, scales or None, channels or None)."""
    if isinstance(x, tuple):
        sizes = (2, 3) if name == "k" else (2,)
        if len(x) not in sizes:
            raise TypeError(
                f"{name} as a tuple must be an int8 pair (values, scales)"
                f"{' or triple (values, scales, channels)' if name == 'k' else ''}; got {len(x)} items"
                f"{' (per-channel factors are for keys only)' if name == 'v' and len(x) == 3 else ''}")
        values, scales = np.asarray(x[0]), np.asarray(x[1])
        if values.dtype != np.int8:
            raise TypeError(f"{name}'s values in an int8 pair must be int8; got {values.dtype}")
        if values.ndim < 2:
            raise ValueError(f"{name}'s values must have at least 2 dimensions (..., rows, head_dim); "
                             f"got shape {_shape(values)}")
        if scales.dtype.kind != "f":
            raise TypeError(f"{name}'s scales must be floating (stored as float32); got {scales.dtype}")
        if scales.shape != values.shape[:-1]:
            raise ValueError(f"{name}'s scales must have shape {_shape(values)[:-1]} (one per row of "
                             f"values {_shape(values)}); got {_shape(scales)}")
        channels = None if len(x) == 2 else _check_channels(np.asarray(x[2]), values.shape)
        return values, scales.astype(np.float32, copy=False), channels
    a = np.asarray(x)
    if a.dtype == np.int8:
        raise TypeError(f"{name} is int8: pass it with its scales, as the pair ({name}_values, {name}_scales)")
    return _as_input(a, name), None, None


def _check_channels(c, values_shape):
    """int8 keys' per-channel factors: finite floats, one E-vector per head."""
    want = values_shape[:-2] + values_shape[-1:]
    if c.dtype.kind != "f":
        raise TypeError(f"k's channel factors (k[2]) must be floating (stored as float32); got {c.dtype}")
    if c.shape != want:
        raise ValueError(f"k's channel factors (k[2]) must have shape {tuple(int(n) for n in want)} "
                         f"(values.shape[:-2] + (E,): one factor per head and channel); got {_shape(c)}")
    c = c.astype(np.float32, copy=False)
    if not np.isfinite(c).all():
        raise ValueError("k's channel factors (k[2]) must be finite; got NaN or inf")
    return c


def _native(dtype):
    return dtype.newbyteorder("=")


def _kernel_ready(a, contiguous_last=True):
    """The array itself when C can read it in place, else the smallest copy
    that it can: aligned, native byte order, whole-element strides, and (for
    q, k, v; a mask may have any strides) a contiguous last axis."""
    if not a.dtype.isnative:
        a = a.astype(_native(a.dtype))
    if (contiguous_last and a.shape[-1] > 1 and a.strides[-1] != a.itemsize or not a.flags.aligned
            or any(s % a.itemsize for s in a.strides)):
        # np.array, not np.ascontiguousarray: that returns a contiguous but
        # misaligned array as it is, and C would read it misaligned.
        a = np.array(a, order="C")
    return a


def _heads(a):
    return a.shape[-3] if a.ndim >= 3 else 1


def _as_4d(a, batch):
    """(*batch, H, R, C) by broadcasting (stride 0), a head axis added to 2-D."""
    if a.ndim == 2:
        a = a[None]
    return np.broadcast_to(a, batch + a.shape[-3:])


def _merge_batch(a, nbatch):
    """(*batch, H, R, C) → (B, H, R, C) as a view, or None when the batch axes
    cannot share one stride (then the caller loops over the outer ones)."""
    if nbatch == 0:
        return a[None]
    if nbatch == 1:
        return a
    shape, strides = a.shape[:nbatch], a.strides[:nbatch]
    kept = [(n, s) for n, s in zip(shape, strides) if n != 1]
    for (n_outer, s_outer), (n_inner, s_inner) in zip(kept, kept[1:]):
        if s_outer != s_inner * n_inner:
            return None
    stride = kept[-1][1] if kept else 0
    return np.lib.stride_tricks.as_strided(
        a, (math.prod(shape),) + a.shape[nbatch:], (stride,) + a.strides[nbatch:],
        writeable=a.flags.writeable)


def _check_dtypes(q, k, v):
    """(out dtype, computation dtype): q's, and float64 for float64 calls,
    float32 for every other (16-bit and int8 storage compute in float32)."""
    kinds = {n: _float_kind(x.dtype) or "int8" for n, x in (("q", q), ("k", k), ("v", v))}
    if kinds["k"] != kinds["v"]:
        raise TypeError(f"k and v must have the same dtype; got k {kinds['k']}, v {kinds['v']}")
    if "float64" in kinds.values() and set(kinds.values()) != {"float64"}:
        raise TypeError(
            "float64 computes in float64: q, k and v must then all be float64 (16-bit, int8 and "
            f"float32 inputs compute in float32); got q {kinds['q']}, k {kinds['k']}, v {kinds['v']}")
    out_dtype = np.dtype(np.float64) if kinds["q"] == "float64" else _native(q.dtype)
    return out_dtype, np.dtype(np.float64 if kinds["q"] == "float64" else np.float32)


def _check_mask(mask, dtype, scores_shape):
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        m = m.view(np.uint8)
    elif m.dtype.kind == "f":
        if m.dtype.itemsize > dtype.itemsize:
            # A float64 mask on float32 inputs: finite values beyond float32's
            # range (a padding mask of finfo(float64).min) stay huge and
            # finite, as the reference treats them, instead of becoming ±inf.
            lim = np.finfo(dtype)
            m = np.where(np.isfinite(m), np.clip(m, lim.min, lim.max), m)
        m = m.astype(dtype, copy=False)
    else:
        raise TypeError(
            f"mask must be bool (True = may attend) or floating (added to the scores); got {m.dtype}")
    try:
        full = np.broadcast_shapes(m.shape, scores_shape)
    except ValueError:
        full = None
    if full != scores_shape:
        raise ValueError(
            f"mask of shape {_shape(m)} does not broadcast to the scores' shape "
            f"{scores_shape} (..., L, S)")
    return _kernel_ready(m, contiguous_last=False)


def _check_window(window):
    if window is None:
        return -1, -1
    try:
        left, right = (operator.index(w) for w in window)
    except (TypeError, ValueError):
        raise TypeError(f"window must be None or a pair of ints (left, right); got {window!r}") from None
    if left < -1 or right < -1:
        raise ValueError(
            f"window must be (left, right) with each >= -1 (-1: unbounded); got ({left}, {right})")
    return left, right


def _batch_ints(x, name, batch, what="integers"):
    """Integers, one per batch entry: x broadcast to the batch shape."""
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be {what}; got {a.dtype}")
    try:
        return np.broadcast_to(a, batch)
    except ValueError:
        raise ValueError(f"{name} of shape {_shape(a)} does not broadcast to the batch shape {batch}") from None


def _check_kv_lengths(kv_lengths, batch, S):
    lens = _batch_ints(kv_lengths, "kv_lengths", batch)
    if lens.size and (lens.min() < 0 or lens.max() > S):
        raise ValueError(
            f"kv_lengths must lie in [0, S={S}]; got values from {lens.min()} to {lens.max()}")
    return np.ascontiguousarray(lens, dtype=np.int64)


def _check_out(out, shape, dtype, inputs):
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a NumPy array; got {type(out).__name__}")
    if _shape(out) != shape:
        raise ValueError(f"out must have shape {shape}; got {_shape(out)}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype} (q's); got {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out must be writeable; got a read-only array")
    if out.size and (not out.dtype.isnative or not out.flags.aligned or (
            shape[-1] > 1 and out.strides[-1] != out.itemsize)):
        raise ValueError(
            "out must be aligned, in native byte order, with a contiguous last axis; "
            f"got strides {out.strides}")
    for name, x in inputs:
        if x is not None and np.may_share_memory(out, x):
            raise ValueError(f"out must not overlap its inputs; it shares memory with {name}")


def _check_softcap(softcap):
    """0.0 (off) or the cap: a finite positive real."""
    if softcap is None:
        return 0.0
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, (bool, np.bool_)):
        raise TypeError(f"softcap must be None or a positive real number; got {softcap!r}")
    c = float(softcap)
    if not (c > 0 and math.isfinite(c)):
        raise ValueError(f"softcap must be a finite number > 0 (None: off); got {c}")
    return c


def _real_array(x, name):
    a = np.asarray(x)
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"{name} must hold real numbers; got dtype {a.dtype}")
    return a.astype(np.float64)


def _check_slopes(slopes, batch, Hq):
    """ALiBi slopes broadcast to batch + (Hq,), float64."""
    a = _real_array(slopes, "alibi_slopes")
    try:
        full = np.broadcast_shapes(a.shape, batch + (Hq,))
    except ValueError:
        full = None
    if full != batch + (Hq,):
        raise ValueError(
            f"alibi_slopes must have shape (Hq,) = ({Hq},) or broadcast to the batch and heads "
            f"{batch + (Hq,)}; got shape {_shape(a)}")
    if not np.isfinite(a).all():
        raise ValueError("alibi_slopes must be finite; got NaN or inf")
    return np.broadcast_to(a, batch + (Hq,))


def _check_sinks(sinks, Hq):
    """One sink logit per query head, float64, contiguous; -inf means none."""
    a = _real_array(sinks, "sinks")
    if a.shape != (Hq,):
        raise ValueError(f"sinks must have shape (Hq,) = ({Hq},), one logit per query head; "
                         f"got shape {_shape(a)}")
    if np.isnan(a).any() or (a == np.inf).any():
        raise ValueError("sinks must not be NaN or +inf (-inf: no sink for that head)")
    return np.ascontiguousarray(a)


_POSITION_LIMIT = 2**60


def _check_start(start, name, batch):
    """A global position per batch entry (int64, broadcast to the batch shape)."""
    if isinstance(start, numbers.Integral) and not isinstance(start, (bool, np.bool_)) and (
            abs(int(start)) > _POSITION_LIMIT):  # also Python ints past int64
        raise ValueError(f"{name} must lie within +-2**60; got {int(start)}")
    a = _batch_ints(start, name, batch, "an int or integers (one per batch entry)")
    if a.size and (int(a.max()) > _POSITION_LIMIT or int(a.min()) < -_POSITION_LIMIT):
        raise ValueError(f"{name} must lie within +-2**60; got values from {a.min()} to {a.max()}")
    return a.astype(np.int64)


def _scale(scale, E):
    if scale is None:
        return 1.0 / math.sqrt(E)
    if not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number; got {scale!r}")
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"scale must be finite; got {s}")
    return s


def _threads(num_threads):
    if num_threads is None:
        return 0
    try:
        n = operator.index(num_threads)
    except TypeError:
        raise TypeError(f"num_threads must be an int or None; got {num_threads!r}") from None
    if n < 1:
        raise ValueError(f"num_threads must be >= 1 (or None for the OpenMP default); got {n}")
    return min(n, 2**31 - 1)  # C takes an int; it caps the count to what the machine can use anyway


def attention(q, k, v, *, mask=None, causal=False, window=None, kv_lengths=None,
              scale=None, out=None, return_lse=False, num_threads=None, softcap=None,
              alibi_slopes=None, sinks=None, q_start=None, k_start=None, return_weights=False):
    """Scaled dot-product attention, ``softmax(q kᵀ · scale + mask) v``.

    Parameters
    ----------
    q : array_like, (..., Hq, L, E) or (L, E)
        Queries. The head axis is the third from last; axes before it are
        batch axes and broadcast as in NumPy. The output has q's dtype.
    k : array_like, (..., Hkv, S, E) or (S, E), or int8 storage
        Keys. ``Hq`` must be a multiple of ``Hkv``: query head
        ``h`` reads key/value head ``h // (Hq // Hkv)`` (grouped-query
        attention; ``Hkv == 1`` is multi-query). int8 keys come as the pair
        ``(values, scales)``, scales of shape ``values.shape[:-1]`` (the key
        is ``values * scales[..., None]``), or the triple ``(values, scales,
        channels)`` with per-channel factors of shape ``values.shape[:-2] +
        (E,)`` (the key is ``values * scales[..., None] * channels[..., None,
        :]``; see docs/int8.md and :class:`KVCache`).
    v : array_like, (..., Hkv, S, Ev) or (S, Ev), or an int8 pair
        Values, in k's dtype (an int8 pair ``(values, scales)`` with int8
        keys). q may be float16, bfloat16, float32 or float64, k and v
        16-bit, float32 or int8; float64 only with all three float64.
    mask : array_like, optional
        Broadcastable to (..., Hq, L, S). bool: True means the key may be
        attended; floating: added to the scaled scores (-inf hides a key).
    causal : {False, True, "bottom_right", "top_left"}
        ``True``/``"bottom_right"``: query row i is key position
        ``i + S_b - L`` (the last L of the valid keys, as when decoding with a
        KV cache) and sees keys up to it. ``"top_left"``: row i sees keys
        ``j <= i`` (PyTorch's ``is_causal``). Equal when L == S.
    window : (int, int), optional
        ``(left, right)``: key j is visible iff ``d - left <= j <= d + right``
        with ``d`` the row's diagonal in the causal alignment in use
        (bottom-right unless ``causal="top_left"``); -1 is unbounded.
    kv_lengths : array_like of int, optional
        Broadcastable to the batch shape: keys at positions ``>= kv_lengths[b]``
        are invisible for batch entry b (and bottom-right alignment counts from
        that length).
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(E)``.
    out : ndarray, optional
        Filled in place and returned; shape (..., Hq, L, Ev), the inputs' dtype.
        Untouched when an argument is rejected.
    return_lse : bool
        Also return the natural log-sum-exp of each row's scores, (..., Hq, L).
    num_threads : int, optional
        OpenMP threads; default ``omp_get_max_threads()`` (so
        ``OMP_NUM_THREADS`` and threadpoolctl apply). The result is bitwise the
        same for every value.
    softcap : float, optional
        Caps the scaled scores: ``s -> softcap * tanh(s / softcap)`` (Gemma 2),
        before ALiBi and the masks.
    alibi_slopes : array_like, (Hq,) or broadcastable to (..., Hq), optional
        Adds the ALiBi bias ``-slope[h] * |j - d(i)|``, ``d(i)`` the row's
        diagonal (as for causal and window). On causal rows this equals
        BLOOM's ``slope * j`` up to a per-row constant, which the softmax
        ignores.
    sinks : array_like, (Hq,), optional
        A logit per query head that joins the softmax denominator and adds no
        value (gpt-oss, StreamingLLM); a row whose keys are all hidden then
        gives zeros. The returned lse includes it. To split keys over calls,
        compute the parts without ``sinks`` and pass them to
        ``merge_attention(..., sinks=)``, which applies the sink once.
    q_start, k_start : int or array_like of int, optional
        Global positions of query row 0 and key 0 (broadcast to the batch
        shape; default 0 when the other is given). Then row i sits at
        ``q_start + i`` and key j at ``k_start + j`` for causal, window and
        ALiBi, overriding the alignment rule: a shard of a cache gets
        exactly its part of the full attention.
    return_weights : bool
        Also return the attention weights (..., Hq, L, S), computed from the
        kernel's own lse in a second pass (``exp(masked scores - lse)``).
        For inspecting and teaching: refused above 2**22 weights.

    Returns
    -------
    out : ndarray, (..., Hq, L, Ev)
        A row with no visible key is 0 (its lse is -inf, or the sink), never NaN.
    lse : ndarray, (..., Hq, L)
        Only with ``return_lse=True``.
    weights : ndarray, (..., Hq, L, S)
        Only with ``return_weights=True``; last.
    """
    if (mask is None and window is None and not return_lse and not return_weights
            and softcap is None and alibi_slopes is None and sinks is None
            and q_start is None and k_start is None
            and (causal is False or causal is True)
            and (scale is None or type(scale) is float and scale != 0 and math.isfinite(scale))
            and (num_threads is None or type(num_threads) is int and 0 < num_threads < 2**31)):
        # The common call, checked and run in the binding (microseconds count
        # for small calls); None when it is not that simple.
        result = _kernel.attention_fast(q, k, v, causal, kv_lengths, scale or 0.0, num_threads or 0,
                                         out)
        if result is not None:
            return result
    modifiers = dict(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, q_start=q_start,
                     k_start=k_start)
    if return_weights:
        return _with_weights(q, k, v, mask=mask, causal=causal, window=window, kv_lengths=kv_lengths,
                             scale=scale, out=out, return_lse=return_lse, num_threads=num_threads,
                             **modifiers)
    return _run(_prepare(q, k, v, mask=mask, causal=causal, window=window, kv_lengths=kv_lengths,
                         scale=scale, out=out, return_lse=return_lse, num_threads=num_threads,
                         **modifiers))


WEIGHTS_LIMIT = 2**22


def _with_weights(q, k, v, *, return_lse, **kw):
    """attention(..., return_weights=True): the call with its lse, then the
    weights exp(masked scores − lse) in a second pass, in the inputs' dtype.
    The masked scores come from the reference's own steps (the definition),
    the normaliser from the kernel."""
    from fastattn import reference
    p = _prepare(q, k, v, return_lse=True, **kw)
    S = np.shape(_arrays(k)[0] if isinstance(k, tuple) else k)[-2]
    n = math.prod(p.out.shape[:-1]) * S
    if n > WEIGHTS_LIMIT:
        raise ValueError(
            f"return_weights would build {n} weights (..., L, S); at most {WEIGHTS_LIMIT} (2**22) are "
            "allowed: it is for inspecting small calls")
    out, lse = _run(p)
    ref_kw = {n: x for n, x in kw.items() if n not in ("out", "num_threads")}
    masked = reference.attention_steps(_arrays(q), _arrays(k), _arrays(v), dtype=p.out.dtype,
                                       **ref_kw).masked
    with np.errstate(invalid="ignore"):
        weights = np.exp(masked - lse[..., None])
    weights[np.isneginf(masked)] = 0  # hidden keys, and rows with none visible (−inf − −inf)
    return (out, lse, weights) if return_lse else (out, weights)


def _arrays(x):
    """An input as arrays: int8 storage stays a tuple (values, scales[, channels])."""
    return tuple(np.asarray(a) for a in x) if isinstance(x, tuple) else np.asarray(x)


def attention_with(q, k, v, strategy, **kwargs):
    """``attention(q, k, v, **kwargs)`` with parts of the driver's strategy
    forced (tests only): ``strategy`` is a dict of any of ``layout``
    ("lanes" or "rows"), ``rows_per_item``, ``chunk_keys`` and ``threads``.
    Forcing changes which work items run where, never a row's math."""
    return _run(_prepare(q, k, v, **kwargs), strategy)


def plan(q, k, v, strategy=None, **kwargs):
    """What the driver decides for ``attention(q, k, v, **kwargs)`` (tests
    only): one dict per kernel call (layout, rows_per_item, chunk_keys,
    threads, row_blocks, key_chunks, items, serial, key_block, lane_block).
    Runs nothing."""
    p = _prepare(q, k, v, **kwargs)
    return [_kernel.plan(c["q"], c["k"], c["v"], c["out"], c["lse"], c["mask"], *p.flags, c["lens"],
                         *p.scale_threads, force=strategy, mods=p.modifiers(c)) for c in p.calls]


class _Prepared:
    """A validated call: the kernel calls that cover it and their shared flags."""

    def __init__(self, calls, flags, scale_threads, out, lse, mods):
        self.calls, self.flags, self.scale_threads, self.out, self.lse = calls, flags, scale_threads, out, lse
        self.mods = mods

    def modifiers(self, c):
        """The binding's mods dict for kernel call c, or None when none is on."""
        m = dict(self.mods, **{n: c[n] for n in _PER_BATCH[1:]}, k_scale=c["k_scale"], v_scale=c["v_scale"],
                 k_channel=c["k_channel"])
        return m if any(x is not None for x in m.values()) else None


def _run(p, force=None):
    # Check every call before running any, so an error leaves out untouched.
    for check_only in (True, False):
        for c in p.calls:
            _kernel.attention(c["q"], c["k"], c["v"], c["out"], c["lse"], c["mask"], *p.flags, c["lens"],
                              *p.scale_threads, check_only, force, p.modifiers(c))
    return p.out if p.lse is None else (p.out, p.lse)


def _prepare(q, k, v, *, mask=None, causal=False, window=None, kv_lengths=None, scale=None, out=None,
             return_lse=False, num_threads=None, softcap=None, alibi_slopes=None, sinks=None,
             q_start=None, k_start=None):
    """Every check of ``attention``'s arguments, then the 4-D views C reads."""
    q = _as_input(q, "q")
    k, k_scale, k_channel = _as_kv(k, "k")
    v, v_scale, _ = _as_kv(v, "v")
    dtype, compute = _check_dtypes(q, k, v)
    L, E = q.shape[-2:]
    S, E_k = k.shape[-2:]
    S_v, Ev = v.shape[-2:]
    if E_k != E:
        raise ValueError(f"k's last axis must equal q's (E): q has E={E}, k has {E_k}")
    if S_v != S:
        raise ValueError(f"v must have as many rows as k (S): k has S={S}, v has {S_v}")
    if E < 1 or Ev < 1:
        raise ValueError(f"head dims must be at least 1; got E={E}, Ev={Ev}")
    Hq, Hkv = _heads(q), _heads(k)
    if _heads(v) != Hkv:
        raise ValueError(f"k and v must have the same number of heads; got {Hkv} and {_heads(v)}")
    if (Hkv == 0 and Hq != 0) or (Hkv and Hq % Hkv):
        raise ValueError(
            f"q's heads (Hq={Hq}) must be a multiple of k's and v's heads (Hkv={Hkv}) "
            "for grouped-query attention")
    try:
        batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except ValueError:
        raise ValueError(
            f"the leading (batch) shapes of q {_shape(q)[:-3]}, k {_shape(k)[:-3]} and "
            f"v {_shape(v)[:-3]} do not broadcast") from None
    has_heads = max(q.ndim, k.ndim, v.ndim) >= 3
    lead = batch + (Hq,) if has_heads else ()
    out_shape = lead + (L, Ev)

    causal_flag, align = _causal(causal)
    wl, wr = _check_window(window)
    s = _scale(scale, E)
    nt = _threads(num_threads)
    m = None if mask is None else _check_mask(mask, compute, lead + (L, S))
    lens = None if kv_lengths is None else _check_kv_lengths(kv_lengths, batch, S)
    cap = _check_softcap(softcap)
    slopes = None if alibi_slopes is None else _check_slopes(alibi_slopes, batch, Hq)
    sink_logits = None if sinks is None else _check_sinks(sinks, Hq)
    q_start = None if q_start is None else _check_start(q_start, "q_start", batch)
    k_start = None if k_start is None else _check_start(k_start, "k_start", batch)
    if out is not None:
        _check_out(out, out_shape, dtype, (("q", q), ("k", k), ("v", v), ("mask", mask),
                                          ("kv_lengths", kv_lengths)))
    else:
        out = np.empty(out_shape, dtype)
    lse = np.empty(lead + (L,), compute) if return_lse else None

    q, k, v = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    per_batch = {"lens": lens, "alibi_slopes": slopes, "q_start": q_start, "k_start": k_start}
    scales = None if k_scale is None else (_kernel_ready(k_scale[..., None]), _kernel_ready(v_scale[..., None]),
                                           None if k_channel is None else _kernel_ready(k_channel[..., None, :]))
    calls = _calls(batch, q, k, v, out, lse, m, per_batch, Hq, L, S, scales)
    return _Prepared(calls, (causal_flag, align, wl, wr), (s, nt), out, lse,
                     {"softcap": cap, "sinks": sink_logits})


def _causal(causal):
    try:
        return _CAUSAL[causal]
    except (KeyError, TypeError):
        raise ValueError(
            f"causal must be False, True, 'bottom_right' or 'top_left'; got {causal!r}") from None


# Arrays with one entry (or one row of Hq) per batch entry, contiguous for C:
# kv_lengths, and the modifiers alibi_slopes, q_start, k_start.
_PER_BATCH = ("lens", "alibi_slopes", "q_start", "k_start")


def _calls(batch, q, k, v, out, lse, mask, per_batch, Hq, L, S, scales=None):
    """The kernel calls that cover the batch: one when every tensor's batch
    axes merge into one strided axis, else one per index of the outer axes.
    per_batch holds the _PER_BATCH arrays (or None), each of the batch shape
    (alibi_slopes: batch + (Hq,)); each call gets its own part, contiguous."""
    nb = len(batch)
    out4 = out if out.ndim == nb + 3 else out[None]
    lse4 = None if lse is None else (lse if lse.ndim == nb + 2 else lse[None])
    full = {
        "q": _as_4d(q, batch), "k": _as_4d(k, batch), "v": _as_4d(v, batch), "out": out4,
        "lse": None if lse4 is None else lse4[..., None],
        "mask": None if mask is None else np.broadcast_to(mask, batch + (Hq, L, S)),
        # int8 K/V: one scale per row, as (..., Hkv, S, 1) tensors
        "k_scale": None if scales is None else _as_4d(scales[0], batch),
        "v_scale": None if scales is None else _as_4d(scales[1], batch),
        # and the keys' channel factors, as (..., Hkv, 1, E)
        "k_channel": None if scales is None or scales[2] is None else _as_4d(scales[2], batch),
    }
    merged = {n: (a if a is None else _merge_batch(a, nb)) for n, a in full.items()}
    if all(a is not None for n, a in merged.items() if full[n] is not None):
        calls = [merged]
        parts = {n: (None if a is None else a.reshape((-1,) + a.shape[nb:])) for n, a in per_batch.items()}
        calls[0].update(parts)
    else:
        calls = []
        for idx in np.ndindex(batch[:-1]):
            c = {n: (None if a is None else a[idx]) for n, a in full.items()}
            c.update({n: (None if a is None else a[idx]) for n, a in per_batch.items()})
            calls.append(c)
    for c in calls:
        if c["lse"] is not None:
            c["lse"] = c["lse"][..., 0]
        for n in _PER_BATCH:
            if c[n] is not None:
                c[n] = np.ascontiguousarray(c[n])
    return calls


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """PyTorch's ``torch.nn.functional.scaled_dot_product_attention`` on NumPy arrays.

    Same parameters and meaning: ``is_causal`` is the top-left triangle
    (row i sees keys ``j <= i``); a bool ``attn_mask`` is True where a key may
    be attended, a float one is added to the scores; ``attn_mask`` and
    ``is_causal`` cannot be combined; different head counts need
    ``enable_gqa=True``; a row with no visible key returns zeros (as PyTorch
    2.13 does on the CPU). This is an inference kernel, so ``dropout_p`` must
    be 0.

    Returns
    -------
    ndarray
        (..., Hq, L, Ev), the inputs' dtype.
    """
    if dropout_p != 0:
        raise ValueError(
            f"dropout_p must be 0.0: fastattn is an inference kernel with no dropout; got {dropout_p}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool; got {type(is_causal).__name__} {is_causal!r}")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True cannot be combined (as in PyTorch); pass one")
    q, k = np.asarray(query), np.asarray(key)
    if not enable_gqa and q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        raise ValueError(
            f"query has {q.shape[-3]} heads and key {k.shape[-3]}: different head counts need "
            "enable_gqa=True")
    return attention(q, k, value, mask=attn_mask, causal="top_left" if is_causal else False,
                     scale=scale)
