"""merge_attention: exact attention over a union of disjoint key sets.

This file owns the log-sum-exp combination of partial results, each computed
by `fastattn.attention(..., return_lse=True)` over its own keys (another
thread, process or machine holding part of a long cache). It is plain NumPy
on (..., L, Ev) outputs; it does not compute attention itself.
"""
import numpy as np

__all__ = ["merge_attention"]


def merge_attention(outs, lses):
    """Combine attention results over disjoint key sets into the full result.

    If part i attended to keys K_i (disjoint from the others) and returned
    ``out_i`` and ``lse_i = log Σ_{j ∈ K_i} exp(s_j)``, then over all keys::

        lse = log Σ_i exp(lse_i)                  (computed with the row max subtracted)
        out = Σ_i exp(lse_i - lse) · out_i

    which is exactly attention over the union. A row that sees no key in
    any part (every ``lse_i`` is -inf) gets zeros and lse -inf, as
    :func:`fastattn.attention` gives for such a row; a part whose row is
    empty (-inf) contributes nothing, whatever its output holds.

    Parameters
    ----------
    outs : sequence of array_like, each (..., L, Ev)
        Partial outputs, all the same shape, float32 or float64.
    lses : sequence of array_like, each (..., L)
        Their log-sum-exps (``return_lse=True``), one per output, with the
        outputs' shape less the last axis.

    Returns
    -------
    out : ndarray, (..., L, Ev)
        The merged output, in the outputs' common dtype.
    lse : ndarray, (..., L)
        The merged log-sum-exp, same dtype.

    Raises
    ------
    ValueError
        If there are no parts, a different number of outputs and lses, or
        shapes that differ or do not match.
    TypeError
        If an input is not floating point.

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
            if a.dtype.kind != "f":
                raise TypeError(f"{name}[{i}] must be floating point; got {a.dtype}")
        if o.ndim < 1 or o.shape != shape:
            raise ValueError(
                f"every output must have the same shape (..., L, Ev); outs[0] has {shape}, "
                f"outs[{i}] has {o.shape}")
        if s.shape != shape[:-1]:
            raise ValueError(
                f"lses[{i}] must have the outputs' shape without the last axis, {shape[:-1]}; "
                f"got {s.shape}")
    dtype = np.result_type(*outs, *lses)

    # The weights are computed in float64 whatever the dtype: lse values of a
    # few thousand (large logits) lose all their fraction bits in float32.
    lse64 = [s.astype(np.float64) for s in lses]
    m = np.maximum.reduce(lse64) if len(lse64) > 1 else lse64[0].copy()
    # Rows empty in every part have m = -inf; shifting by 0 there keeps
    # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
    shift = np.where(m == -np.inf, 0.0, m)
    total = np.zeros_like(shift)
    for s in lse64:
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
        out += np.where(live[..., None], w[..., None].astype(dtype) * o, 0)
    return out, lse.astype(dtype)
