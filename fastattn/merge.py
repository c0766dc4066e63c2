"""merge_attention: exact attention over a union of disjoint key sets.

This file owns the log-sum-exp combination of partial results, each computed
by `fastattn.attention(..., return_lse=True)` over its own keys (another
thread, process or machine holding part of a long cache), and the attention
sink, which belongs to no part and is applied once, here. It is plain NumPy
on (..., L, Ev) outputs; it does not compute attention itself.
"""
import numpy as np

__all__ = ["merge_attention"]


def merge_attention(outs, lses, sinks=None):
    """Combine attention results over disjoint key sets into the full result.

    If part i attended to keys K_i (disjoint from the others) and returned
    ``out_i`` and ``lse_i = log Σ_{j ∈ K_i} exp(s_j)``, then over all keys::

        lse = log (Σ_i exp(lse_i) + exp(sink))    (computed with the row max subtracted)
        out = Σ_i exp(lse_i - lse) · out_i

    which is exactly attention over the union, with the sink (if any)
    applied once: the parts must have been computed *without* ``sinks``,
    and their positions (``k_start``) must place each part's keys where
    they sit in the whole. A row that sees no key in any part (every
    ``lse_i`` is -inf) gets zeros and lse -inf (lse = its sink, with
    ``sinks``), as :func:`fastattn.attention` gives for such a row; a part
    whose row is empty (-inf) contributes nothing, whatever its output holds.

    Parameters
    ----------
    outs : sequence of array_like, each (..., L, Ev)
        Partial outputs, all the same shape: float16, bfloat16 (ml_dtypes),
        float32 or float64.
    lses : sequence of array_like, each (..., L)
        Their log-sum-exps (``return_lse=True``; float32 for 16-bit calls),
        one per output, with the outputs' shape less the last axis.
    sinks : array_like of float, shape (Hq,), optional
        One sink logit per query head, as ``sinks=`` of
        :func:`fastattn.attention`: broadcast against the lses'
        (..., Hq, L) as ``sinks[:, None]`` (1-D lses, from 2-D calls, have
        Hq = 1). -inf means no sink for that head; NaN and +inf are errors.

    Returns
    -------
    out : ndarray, (..., L, Ev)
        The merged output. The arithmetic is float64 if any output or lse
        is float64, float32 otherwise (16-bit outputs are widened exactly);
        ``out`` is in that dtype, except that outputs all of one 16-bit
        dtype give that dtype back (rounded once, to nearest even).
    lse : ndarray, (..., L)
        The merged log-sum-exp, in the arithmetic dtype (float32 for 16-bit
        outputs with float32 lses).

    Raises
    ------
    ValueError
        If there are no parts, a different number of outputs and lses,
        shapes that differ or do not match, or a sink that is NaN or +inf.
    TypeError
        If an input is not floating point, or ``sinks`` not real numbers.

    Examples
    --------
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 1, 4, 8)) for _ in range(3))
    >>> parts = [fastattn.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True)
    ...          for a, b in [(0, 1), (1, 4)]]
    >>> out, lse = merge_attention(*zip(*parts))
    >>> bool(np.allclose(out, fastattn.attention(q, k, v)))
    True
    >>> sinks = np.array([0.5])
    >>> out, lse = merge_attention(*zip(*parts), sinks=sinks)
    >>> bool(np.allclose(out, fastattn.reference.attention(q, k, v, sinks=sinks)))
    True
    """
    outs = [np.asarray(o) for o in outs]
    lses = [np.asarray(s) for s in lses]
    if not outs:
        raise ValueError("merge_attention needs at least one part; got no outputs")
    if len(outs) != len(lses):
        raise ValueError(
            f"outs and lses must have one entry per part; got {len(outs)} outputs and {len(lses)} lses")
    shape = outs[0].shape
    for i, (o, s) in enumerate(zip(outs, lses)):
        for name, a in (("outs", o), ("lses", s)):
            if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
                raise TypeError(f"{name}[{i}] must be floating point; got {a.dtype}")
        if o.ndim < 1 or o.shape != shape:
            raise ValueError(
                f"every output must have the same shape (..., L, Ev); outs[0] has {shape}, "
                f"outs[{i}] has {o.shape}")
        if s.shape != shape[:-1]:
            raise ValueError(
                f"lses[{i}] must have the outputs' shape without the last axis, {shape[:-1]}; "
                f"got {s.shape}")
    # float32 arithmetic unless something is float64; 16-bit parts widen exactly
    dtype = np.dtype(np.float64 if any(a.dtype.itemsize > 4 for a in outs + lses) else np.float32)
    out_dtype = outs[0].dtype if (len({o.dtype for o in outs}) == 1
                                  and outs[0].dtype.itemsize == 2) else dtype
    if sinks is not None:
        sinks = _sink_logits(sinks, shape[:-1])


    # The weights are computed in float64 whatever the dtype: lse values of a
    # few thousand (large logits) lose all their fraction bits in float32.
    lse64 = [s.astype(np.float64) for s in lses]
    # The sink is one more term of the sum, a part with no value.
    terms = lse64 if sinks is None else [*lse64, np.broadcast_to(sinks, shape[:-1])]
    m = np.maximum.reduce(terms) if len(terms) > 1 else terms[0].copy()
    # Rows empty in every part have m = -inf; shifting by 0 there keeps
    # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
    shift = np.where(m == -np.inf, 0.0, m)
    total = np.zeros_like(shift)
    for s in terms:
        total += np.exp(s - shift)  # Σ exp(lse_i - m), each term ≤ 1: no overflow
    with np.errstate(divide="ignore"):
        lse = shift + np.log(total)  # log 0 = -inf for the empty rows

    out = np.zeros(shape, dtype)
    for o, s in zip(outs, lse64):
        # exp(lse_i - lse): this part's share of the softmax mass.
        w = np.exp(s - shift) / np.where(total == 0, 1.0, total)
        live = w != 0
        # A part that saw nothing (w = 0) is skipped rather than multiplied,
        # so whatever its output holds (zeros, or NaN from a caller) stays out.
        out += np.where(live[..., None], w[..., None].astype(dtype) * o.astype(dtype), 0)
    return out.astype(out_dtype, copy=False), lse.astype(dtype)


def _sink_logits(sinks, lse_shape):
    """``sinks`` (Hq,) as float64 shaped to broadcast against (..., Hq, L)."""
    a = np.asarray(sinks)
    if a.dtype.kind not in "iuf":
        raise TypeError(f"sinks must hold real numbers; got dtype {a.dtype}")
    Hq = lse_shape[-2] if len(lse_shape) >= 2 else 1  # 1-D lses: one head
    if a.shape != (Hq,):
        raise ValueError(
            f"sinks must have shape (Hq,) = ({Hq},), one logit per query head (axis -2 of "
            f"the lses, shape {lse_shape}); got shape {a.shape}")
    bad = np.isnan(a) | (a == np.inf)
    if bad.any():
        h = int(np.flatnonzero(bad)[0])
        raise ValueError(f"sinks must not be NaN or +inf (-inf means no sink); got {a[h]} for head {h}")
    a = a.astype(np.float64)
    return a[:, None] if len(lse_shape) >= 2 else a.reshape(())
