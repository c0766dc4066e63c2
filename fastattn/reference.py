"""The NumPy reference for fastattn: the specification the C kernel must match.

This module *defines* what ``fastattn.attention`` computes.  It is written to
be read, like the lecture it comes from, one named step at a time::

    scores   = Q · Kᵀ                         scores()
    scaled   = scores · scale                 scale_scores()
    masked   = scaled + mask, -inf where hidden   visibility(), apply_mask()
    weights  = softmax(masked)                softmax()      (row by row, stable)
    output   = weights · V                    weighted_sum()
    lse      = log Σ exp(masked)              logsumexp()    (per query row)

It is pure NumPy, materialises the full L×S score matrix and is slow on
purpose: every number can be printed and checked by hand.  It imports nothing
from the rest of the package, so it can serve as the test oracle on its own.

Conventions (B, Hq, Hkv, L, S, E, Ev as in the PyTorch docs):

* ``q`` is (..., L, E), ``k`` is (..., S, E), ``v`` is (..., S, Ev); the output
  is (..., L, Ev).  A 2-D input is one head.  For 3-D and higher inputs the
  head axis is axis -3 and the axes before it are batch axes, which broadcast
  as in NumPy among q, k and v.
* Grouped-query attention: with Hq query heads and Hkv key/value heads
  (Hq % Hkv == 0), query head h reads key/value head h // (Hq // Hkv).
* Restrictions (``mask``, ``causal``, ``window``, ``kv_lengths``) combine with
  logical AND.  A query row that sees no key gets weights 0, output 0 and
  lse -inf, never NaN.  NaN in the inputs propagates to the rows it reaches.

Note on NaN in ``v``: the weighted sum is a plain matrix product, so a NaN
value at a key whose weight is 0 still reaches the row (0 · NaN = NaN).  The
kernel may skip keys it can prove invisible, so comparisons of NaN behaviour
should only put NaN where it is visible.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import numpy as np

__all__ = [
    "AttentionSteps",
    "apply_mask",
    "attention",
    "attention_steps",
    "logsumexp",
    "scale_scores",
    "scores",
    "softmax",
    "visibility",
    "weighted_sum",
]


class AttentionSteps(NamedTuple):
    """Every intermediate of one attention call, in public shapes.

    Attributes
    ----------
    scores : ndarray, shape (..., L, S)
        Raw dot products Q · Kᵀ.
    scaled : ndarray, shape (..., L, S)
        ``scores * scale``.
    masked : ndarray, shape (..., L, S)
        ``scaled`` plus the additive mask, -inf at every hidden key.
    weights : ndarray, shape (..., L, S)
        Row-wise softmax of ``masked`` (rows with no visible key are 0).
    output : ndarray, shape (..., L, Ev)
        ``weights · V``.
    lse : ndarray, shape (..., L)
        Natural log-sum-exp of each row of ``masked`` (-inf if nothing visible).
    """

    scores: np.ndarray
    scaled: np.ndarray
    masked: np.ndarray
    weights: np.ndarray
    output: np.ndarray
    lse: np.ndarray


# --------------------------------------------------------------------------
# The steps
# --------------------------------------------------------------------------


def scores(q, k):
    """Step 1: raw attention scores, one dot product per (query, key) pair.

    Parameters
    ----------
    q : ndarray, shape (..., L, E)
    k : ndarray, shape (..., S, E)

    Returns
    -------
    ndarray, shape (..., L, S)
        ``scores[..., i, j] = q[..., i, :] · k[..., j, :]``.
    """
    return q @ np.swapaxes(k, -1, -2)


def scale_scores(s, scale):
    """Step 2: multiply the scores by ``scale`` (usually 1/sqrt(E)).

    Without it the dot products grow like sqrt(E) and the softmax saturates.

    Parameters
    ----------
    s : ndarray, shape (..., L, S)
    scale : scalar of the same dtype as ``s``

    Returns
    -------
    ndarray, shape (..., L, S)
    """
    return s * scale


def visibility(L, S, *, causal=False, window=None, kv_lengths=None, batch_shape=()):
    """Step 3a: which keys each query row may see, from causal/window/kv_lengths.

    The restrictions are all expressed through a diagonal ``d(i)`` per query
    row ``i``: top-left alignment puts row ``i`` at key position ``d(i) = i``;
    bottom-right alignment (the default, as in KV-cache decoding) makes the
    query rows the last L of the valid keys, ``d(i) = i + S_b - L`` with
    ``S_b`` the number of valid keys of the batch entry.

    * causal: key ``j`` visible iff ``j <= d(i)``;
    * window ``(left, right)``: visible iff ``d(i) - left <= j <= d(i) + right``
      (-1 means unbounded on that side);
    * kv_lengths: visible iff ``j < S_b``.

    Parameters
    ----------
    L, S : int
        Number of query rows and of keys.
    causal : {False, None, True, "bottom_right", "top_left"}
        ``True`` means ``"bottom_right"``.
    window : tuple of two ints, optional
        ``(left, right)``; uses the bottom-right diagonal unless
        ``causal == "top_left"``.
    kv_lengths : array_like of int, optional
        Valid keys per batch entry, broadcastable to ``batch_shape``.
    batch_shape : tuple of int
        The batch shape (leading shape without the head axis).

    Returns
    -------
    ndarray of bool or numpy.bool_
        Broadcastable to ``(*batch_shape, H, L, S)``; ``np.True_`` when nothing
        is restricted.
    """
    if causal is None or causal is False or (isinstance(causal, np.bool_) and not causal):
        causal_on, top_left = False, False
    elif causal is True or isinstance(causal, np.bool_) or causal == "bottom_right":
        causal_on, top_left = True, False
    elif causal == "top_left":
        causal_on, top_left = True, True
    else:
        raise ValueError(
            f"causal must be False, True, 'bottom_right' or 'top_left', got {causal!r}"
        )
    if window is not None:
        try:
            left, right = (operator.index(w) for w in window)
        except (TypeError, ValueError):
            raise TypeError(f"window must be None or a pair of ints (left, right), got {window!r}") from None
        if left < -1 or right < -1:
            raise ValueError(f"window sides must be >= -1 (-1: unbounded), got {window!r}")
        window = (left, right)
    if kv_lengths is None:
        S_b = S
    else:
        kv = np.asarray(kv_lengths)
        if kv.dtype.kind not in "iu":
            raise TypeError(f"kv_lengths must hold integers, got dtype {kv.dtype}")
        if kv.size and (kv.min() < 0 or kv.max() > S):
            raise ValueError(f"kv_lengths must lie in [0, S={S}], got {kv_lengths!r}")
        # one length per batch entry, lined up with (*batch, H, L, S); int64,
        # since unsigned lengths would wrap around in d(i) = i + S_b - L
        S_b = np.broadcast_to(kv.astype(np.int64), batch_shape).reshape(tuple(batch_shape) + (1, 1, 1))
    return _visible_from_indices(L, S, S_b, causal_on, top_left, window, kv_lengths is not None)


def _visible_from_indices(L, S, S_b, causal_on, top_left, window, limit_keys):
    """Visibility from row and key indices only; no mask is built by hand."""
    i = np.arange(L)[:, None]  # query row
    j = np.arange(S)[None, :]  # key position
    d = i if top_left else i + (S_b - L)  # the diagonal d(i)
    visible = np.True_
    if limit_keys:
        visible = visible & (j < S_b)  # padding keys past kv_lengths
    if causal_on:
        visible = visible & (j <= d)  # no look-ahead
    if window is not None:
        left, right = window
        if left >= 0:
            visible = visible & (j >= d - left)
        if right >= 0:
            visible = visible & (j <= d + right)
    return visible


def apply_mask(scaled, visible=np.True_, mask=None):
    """Step 3b: add the additive mask and hide invisible keys with -inf.

    Parameters
    ----------
    scaled : ndarray, shape (..., L, S)
    visible : array_like of bool
        Broadcastable to ``scaled``; False hides the key.
    mask : ndarray, optional
        Broadcastable to ``scaled``.  Bool: True = may attend.  Floating:
        added to the scores (-inf hides the key).

    Returns
    -------
    ndarray, same shape as ``scaled``
    """
    if mask is not None and mask.dtype == np.bool_:
        visible = visible & mask
    elif mask is not None:
        scaled = scaled + mask
    return np.where(visible, scaled, -np.inf)


def _safe_row_max(x):
    """Row max used as the softmax shift; 0 for rows that are all -inf.

    Shifting by the max keeps every exponent <= 0, so exp never overflows.  A
    row with no visible key has max -inf; shifting by it would give
    -inf - (-inf) = NaN, so those rows are shifted by 0 instead.  NaN in a row
    makes its max NaN, which propagates on purpose.
    """
    m = np.max(x, axis=-1, keepdims=True, initial=-np.inf)
    return np.where(np.isneginf(m), 0, m)


def softmax(x):
    """Step 4: numerically stable softmax over the last axis.

    ``softmax(x)_j = exp(x_j - m) / Σ_k exp(x_k - m)`` with ``m`` the row max.

    Parameters
    ----------
    x : ndarray, shape (..., L, S)
        Masked, scaled scores (-inf = hidden).

    Returns
    -------
    ndarray, shape (..., L, S)
        Rows sum to 1, except rows with no visible key, which are all 0.
    """
    with np.errstate(under="ignore"):  # exp(very negative) -> 0 is expected
        p = np.exp(x - _safe_row_max(x))
    l = np.sum(p, axis=-1, keepdims=True)  # l == 0 only when nothing is visible
    return p / np.where(l == 0, 1, l)


def logsumexp(x):
    """Natural log-sum-exp of each row, computed stably.

    ``lse = m + log Σ_j exp(x_j - m)``; it is the log of the softmax
    denominator, which lets partial results over key chunks be merged.

    Parameters
    ----------
    x : ndarray, shape (..., L, S)

    Returns
    -------
    ndarray, shape (..., L)
        -inf for rows with no visible key.
    """
    m = _safe_row_max(x)
    with np.errstate(under="ignore"):
        l = np.sum(np.exp(x - m), axis=-1, keepdims=True)
    lse = np.where(l == 0, -np.inf, m + np.log(np.where(l == 0, 1, l)))
    return lse[..., 0]


def weighted_sum(weights, v):
    """Step 5: each output row is the weights-weighted average of the values.

    Parameters
    ----------
    weights : ndarray, shape (..., L, S)
    v : ndarray, shape (..., S, Ev)

    Returns
    -------
    ndarray, shape (..., L, Ev)
    """
    return weights @ v


# --------------------------------------------------------------------------
# Putting the steps together
# --------------------------------------------------------------------------


def _as_heads(x, name, dtype):
    """Convert to ``dtype`` with a head axis at -3 (a 2-D input is one head)."""
    x = np.asarray(x, dtype=dtype)
    if x.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions, got shape {x.shape}")
    return x[None] if x.ndim == 2 else x


def attention_steps(q, k, v, *, mask=None, causal=False, window=None, kv_lengths=None,
                    scale=None, dtype=np.float64):
    """Scaled dot-product attention, returning every intermediate step.

    Parameters
    ----------
    q : array_like, shape (..., L, E)
    k : array_like, shape (..., S, E)
    v : array_like, shape (..., S, Ev)
        For 3-D and higher inputs axis -3 is the head axis (Hq for ``q``, Hkv
        for ``k`` and ``v``, with Hq % Hkv == 0) and the axes before it are
        broadcast batch axes.
    mask : array_like of bool or float, optional
        Broadcastable to (*out_leading, L, S).  True = may attend; a float
        mask is added to the scaled scores.
    causal : {False, None, True, "bottom_right", "top_left"}, optional
    window : tuple (left, right) of int, optional
        -1 = unbounded side.
    kv_lengths : array_like of int, optional
        Valid keys per batch entry, broadcastable to the batch shape.
    scale : float, optional
        Defaults to 1/sqrt(E).
    dtype : dtype, optional
        The dtype the whole computation is done in (float64 by default).

    Returns
    -------
    AttentionSteps
        See :func:`visibility` for the exact meaning of each restriction.
    """
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    headless = all(np.ndim(x) == 2 for x in (q, k, v))
    q, k, v = (_as_heads(x, n, dtype) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    (Hq, L, E), (Hkv, S, Ek), (Hv, Sv, Ev) = q.shape[-3:], k.shape[-3:], v.shape[-3:]
    if Ek != E:
        raise ValueError(f"q and k must share the last dimension E, got {E} and {Ek}")
    if Sv != S:
        raise ValueError(f"k and v must have the same length S, got {S} and {Sv}")
    if Hv != Hkv:
        raise ValueError(f"k and v must have the same number of heads, got {Hkv} and {Hv}")
    if (Hkv == 0 and Hq != 0) or (Hkv != 0 and Hq % Hkv != 0):
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])

    # grouped-query attention: query head h reads key/value head h // (Hq // Hkv)
    group = Hq // Hkv if Hkv else 1
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    q = np.broadcast_to(q, batch + (Hq, L, E))
    k = np.broadcast_to(k, batch + (Hq, S, E))
    v = np.broadcast_to(v, batch + (Hq, S, Ev))

    if scale is None:
        scale = 1.0 / math.sqrt(E) if E else 1.0
    scale = dtype.type(scale)

    out_leading = batch if headless else batch + (Hq,)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype.kind == "f":
            mask = mask.astype(dtype, copy=False)
        elif mask.dtype != np.bool_:
            raise TypeError(f"mask must be bool or floating, got dtype {mask.dtype}")
        mask = np.broadcast_to(mask, out_leading + (L, S)).reshape(batch + (Hq, L, S))

    s = scores(q, k)
    scaled = scale_scores(s, scale)
    visible = visibility(L, S, causal=causal, window=window, kv_lengths=kv_lengths,
                         batch_shape=batch)
    masked = apply_mask(scaled, visible, mask)
    weights = softmax(masked)
    output = weighted_sum(weights, v)
    lse = logsumexp(masked)

    def public(x, tail):  # drop the head axis that 2-D inputs were given
        return x.reshape(out_leading + tail)

    return AttentionSteps(
        scores=public(s, (L, S)),
        scaled=public(scaled, (L, S)),
        masked=public(masked, (L, S)),
        weights=public(weights, (L, S)),
        output=public(output, (L, Ev)),
        lse=public(lse, (L,)),
    )


def attention(q, k, v, *, mask=None, causal=False, window=None, kv_lengths=None,
              scale=None, return_lse=False, dtype=np.float64):
    """Scaled dot-product attention: ``softmax(Q Kᵀ · scale + mask) V``.

    Parameters
    ----------
    q, k, v, mask, causal, window, kv_lengths, scale, dtype
        As in :func:`attention_steps`.
    return_lse : bool, optional
        Also return the per-row log-sum-exp of the masked, scaled scores.

    Returns
    -------
    out : ndarray, shape (*out_leading, L, Ev)
        ``out_leading`` is the broadcast batch shape followed by Hq (nothing
        when all three inputs are 2-D).
    lse : ndarray, shape (*out_leading, L)
        Only if ``return_lse``; -inf for rows with no visible key.

    Examples
    --------
    >>> q = k = np.eye(2)
    >>> v = np.array([[10.0, 0.0], [0.0, 10.0]])
    >>> np.round(attention(q, k, v, causal=True, scale=np.log(3)), 6)
    array([[10. ,  0. ],
           [ 2.5,  7.5]])
    """
    steps = attention_steps(q, k, v, mask=mask, causal=causal, window=window,
                            kv_lengths=kv_lengths, scale=scale, dtype=dtype)
    return (steps.output, steps.lse) if return_lse else steps.output
