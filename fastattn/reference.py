"""The NumPy reference for fastattn: the specification the C kernel must match.

This module *defines* what ``fastattn.attention`` computes.  It is written to
be read, like the lecture it comes from, one named step at a time::

    K, V     = values · scales [· c] (int8)       dequantize()
    scores   = Q · Kᵀ                             scores()
    scaled   = scores · scale                     scale_scores()
    capped   = c · tanh(scaled / c)   (softcap)   cap_scores()
    biased   = capped − slope·|j − d(i)|  (ALiBi) alibi_bias()
    masked   = biased + mask, -inf where hidden   visibility(), apply_mask()
    weights  = softmax(masked [, sink])           append_sink(), softmax()  (row by row, stable)
    output   = weights · V                        weighted_sum()
    lse      = log (Σ exp(masked) [+ exp(sink)])  logsumexp()    (per query row)

The steps in brackets are off unless asked for; with them off, ``capped`` and
``biased`` are ``scaled``.  This is the order of operations for the kernel too.
``dequantize`` applies only to keys and values stored as int8.

It is pure NumPy, materialises the full L×S score matrix and is slow on
purpose: every number can be printed and checked by hand.  It imports nothing
from the rest of the package, so it can serve as the test oracle on its own.

Conventions (B, Hq, Hkv, L, S, E, Ev as in the PyTorch docs):

* ``q`` is (..., L, E), ``k`` is (..., S, E), ``v`` is (..., S, Ev); the output
  is (..., L, Ev).  A 2-D input is one head.  For 3-D and higher inputs the
  head axis is axis -3 and the axes before it are batch axes, which broadcast
  as in NumPy among q, k and v.
* Storage dtypes: ``q``, ``k`` and ``v`` may be float16, bfloat16
  (ml_dtypes, recognised by its dtype name, never imported here), float32 or
  float64; ``k`` and ``v`` may instead both be int8 pairs ``(values,
  scales)``: int8 ``values`` (..., S, E) and floating ``scales`` of shape
  ``values.shape[:-1]``, one per row, standing for ``values · scales[...,
  None]``; ``k`` may be a triple ``(values, scales, channels)`` with
  per-channel factors (..., E), standing for ``values · scales[..., None] ·
  channels[..., None, :]``.  Every input is converted exactly to float64 (int8 pairs are
  dequantized exactly: 8 × 24 bits fit in 53) and the computation runs in
  float64: the reference computes from the same rounded inputs as the kernel
  and keeps every digit.  With ``dtype=np.float32`` it is "textbook float32
  NumPy" on those same inputs (each dequantized value rounded once to float32).
* Grouped-query attention: with Hq query heads and Hkv key/value heads
  (Hq % Hkv == 0), query head h reads key/value head h // (Hq // Hkv).
* Positions: query row ``i`` sits on key index ``d(i)``, its diagonal, which
  causal, window and ALiBi all use.  By default ``d(i) = i + S_b - L``
  (bottom-right: the queries are the last L of the S_b valid keys) or
  ``d(i) = i`` with ``causal="top_left"``; explicit global positions
  ``q_start`` and ``k_start`` give ``d(i) = q_start + i - k_start`` instead,
  so that a shard of a long cache gets exactly its part of the full call.
* Restrictions (``mask``, ``causal``, ``window``, ``kv_lengths``) combine with
  logical AND.  A query row that sees no key gets weights 0, output 0 and
  lse -inf (lse = its sink logit with ``sinks``), never NaN.  NaN in the
  inputs propagates to the rows it reaches.

Note on NaN in ``v``: the weighted sum is a plain matrix product, so a NaN
value at a key whose weight is 0 still reaches the row (0 · NaN = NaN).  The
kernel may skip keys it can prove invisible, so comparisons of NaN behaviour
should only put NaN where it is visible.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import NamedTuple

import numpy as np

__all__ = [
    "AttentionSteps",
    "alibi_bias",
    "append_sink",
    "apply_mask",
    "attention",
    "attention_steps",
    "cap_scores",
    "dequantize",
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
        ``biased`` plus the additive mask, -inf at every hidden key.
    weights : ndarray, shape (..., L, S)
        Row-wise softmax of ``masked``, with the sink logit in the denominator
        if there is one (rows with no visible key are 0).
    output : ndarray, shape (..., L, Ev)
        ``weights · V``.
    lse : ndarray, shape (..., L)
        Natural log of each row's softmax denominator, ``log (Σ exp(masked) +
        exp(sink))``: -inf if nothing is visible and there is no sink.
    capped : ndarray, shape (..., L, S)
        ``softcap · tanh(scaled / softcap)``; ``scaled`` itself without softcap.
    biased : ndarray, shape (..., L, S)
        ``capped`` plus the ALiBi bias; ``capped`` itself without ALiBi.

    ``capped`` and ``biased`` come between ``scaled`` and ``masked`` in the
    computation; they are the last fields so that unpacking the first six
    by position keeps working.
    """

    scores: np.ndarray
    scaled: np.ndarray
    masked: np.ndarray
    weights: np.ndarray
    output: np.ndarray
    lse: np.ndarray
    capped: np.ndarray
    biased: np.ndarray


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


def cap_scores(s, softcap):
    """Step 2a (optional): squash the scores smoothly into (-softcap, softcap).

    ``capped = softcap · tanh(s / softcap)``, as in Gemma 2 and ONNX
    Attention's ``softcap``: close to ``s`` while ``|s|`` is well below
    ``softcap``, and never beyond it, so no single logit can dominate.

    Parameters
    ----------
    s : ndarray, shape (..., L, S)
        Scaled scores.
    softcap : scalar of the same dtype as ``s``, > 0

    Returns
    -------
    ndarray, shape (..., L, S)
    """
    return softcap * np.tanh(s / softcap)


def alibi_bias(L, S, slopes, *, causal=False, kv_lengths=None, q_start=None, k_start=None,
               batch_shape=()):
    """Step 2b (optional): the ALiBi bias ``-slope[h] · |j - d(i)|``.

    Each head penalises a key linearly in its distance from the query row's
    diagonal ``d(i)``, the same diagonal causal and window use (see
    :func:`visibility`).  On a causal row every visible key has ``j <= d(i)``,
    so the bias is ``slope · j - slope · d(i)``: BLOOM's ``slope · j`` plus a
    constant per row, which the softmax ignores (the row's lse shifts by it).

    Parameters
    ----------
    L, S : int
        Number of query rows and of keys.
    slopes : ndarray, shape (*batch_shape, H)
        One slope per head (and batch entry), in the dtype of the scores.
    causal, kv_lengths, q_start, k_start, batch_shape
        As in :func:`visibility`; they fix ``d(i)``.

    Returns
    -------
    ndarray, shape (*batch_shape, H, L, S)
    """
    off = _diagonal_offset(L, S, causal, kv_lengths, q_start, k_start, batch_shape)
    j_minus_i = np.arange(S)[None, :] - np.arange(L)[:, None]
    # |j - d(i)| = |(j - i) - off|, in float64: exact for distances below 2**53
    distance = np.abs(j_minus_i - off.astype(np.float64)).astype(slopes.dtype)
    return -slopes[..., None, None] * distance


def visibility(L, S, *, causal=False, window=None, kv_lengths=None, q_start=None,
               k_start=None, batch_shape=()):
    """Step 3a: which keys each query row may see, from causal/window/kv_lengths.

    The restrictions are all expressed through a diagonal ``d(i)`` per query
    row ``i``, the key index the row sits at: top-left alignment puts row
    ``i`` at ``d(i) = i``; bottom-right alignment (the default, as in KV-cache
    decoding) makes the query rows the last L of the valid keys,
    ``d(i) = i + S_b - L`` with ``S_b`` the number of valid keys of the batch
    entry.  Explicit positions override both: query row ``i`` is at global
    position ``q_start + i`` and key ``j`` at ``k_start + j``, so
    ``d(i) = q_start + i - k_start``.

    * causal: key ``j`` visible iff ``j <= d(i)``;
    * window ``(left, right)``: visible iff ``d(i) - left <= j <= d(i) + right``
      (-1 means unbounded on that side);
    * kv_lengths: visible iff ``j < S_b`` (with explicit positions too).

    Parameters
    ----------
    L, S : int
        Number of query rows and of keys.
    causal : {False, None, True, "bottom_right", "top_left"}
        ``True`` means ``"bottom_right"``.  With ``q_start`` or ``k_start``
        all three true values mean "key ``j`` visible iff
        ``k_start + j <= q_start + i``".
    window : tuple of two ints, optional
        ``(left, right)``; uses the bottom-right diagonal unless
        ``causal == "top_left"`` or positions are given.
    kv_lengths : array_like of int, optional
        Valid keys per batch entry, broadcastable to ``batch_shape``.
    q_start, k_start : int or array_like of int, optional
        Global position of query row 0 and of key 0, per batch entry
        (broadcastable to ``batch_shape``), each within ±2**60.  Giving
        either one (the other is then 0) replaces the alignment rule.
    batch_shape : tuple of int
        The batch shape (leading shape without the head axis).

    Returns
    -------
    ndarray of bool or numpy.bool_
        Broadcastable to ``(*batch_shape, H, L, S)``; ``np.True_`` when nothing
        is restricted.
    """
    causal_on = _causal_alignment(causal)[0]
    window = _window_sides(window)
    S_b = _valid_keys(kv_lengths, S, batch_shape)
    off = _diagonal_offset(L, S, causal, kv_lengths, q_start, k_start, batch_shape)
    j = np.arange(S)[None, :]  # key index
    j_minus_i = j - np.arange(L)[:, None]  # j <= d(i) = i + off  <=>  j - i <= off
    visible = np.True_
    if S_b is not None:
        visible = visible & (j < S_b)  # padding keys past kv_lengths
    if causal_on:
        visible = visible & (j_minus_i <= _bound(off))  # no look-ahead: j <= d(i)
    if window is not None:
        left, right = window
        if left >= 0:
            visible = visible & (j_minus_i >= _bound(off - left))  # j >= d(i) - left
        if right >= 0:
            visible = visible & (j_minus_i <= _bound(off + right))  # j <= d(i) + right
    return visible


_MAX_POSITION = 2**60  # bound on |q_start|, |k_start|, as the kernel's: d(i) and d(i) ± window fit in int64


def _causal_alignment(causal):
    """(causal_on, top_left) from the ``causal`` argument."""
    if causal is None or causal is False or (isinstance(causal, np.bool_) and not causal):
        return False, False
    if causal is True or isinstance(causal, np.bool_) or causal == "bottom_right":
        return True, False
    if causal == "top_left":
        return True, True
    raise ValueError(f"causal must be False, True, 'bottom_right' or 'top_left', got {causal!r}")


def _window_sides(window):
    """``(left, right)`` as ints, or None."""
    if window is None:
        return None
    try:
        left, right = (operator.index(w) for w in window)
    except (TypeError, ValueError):
        raise TypeError(f"window must be None or a pair of ints (left, right), got {window!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window sides must be >= -1 (-1: unbounded), got {window!r}")
    return left, right


def _valid_keys(kv_lengths, S, batch_shape):
    """``S_b`` as int64 shaped (*batch, 1, 1, 1), or None without kv_lengths."""
    if kv_lengths is None:
        return None
    kv = np.asarray(kv_lengths)
    if kv.dtype.kind not in "iu":
        raise TypeError(f"kv_lengths must hold integers, got dtype {kv.dtype}")
    if kv.size and (kv.min() < 0 or kv.max() > S):
        raise ValueError(f"kv_lengths must lie in [0, S={S}], got {kv_lengths!r}")
    # one length per batch entry, lined up with (*batch, H, L, S); int64,
    # since unsigned lengths would wrap around in d(i) = i + S_b - L
    return np.broadcast_to(kv.astype(np.int64), batch_shape).reshape(tuple(batch_shape) + (1, 1, 1))


def _position(start, name, batch_shape):
    """``q_start`` or ``k_start`` as int64 broadcast to the batch shape (0 if None)."""
    if start is None:
        return np.zeros(batch_shape, np.int64)
    a = np.asarray(start)
    if a.dtype == object and all(isinstance(x, numbers.Integral) and not isinstance(x, bool)
                                 for x in a.flat):
        a_min, a_max = min(a.flat, default=0), max(a.flat, default=0)  # ints beyond 64 bits
    elif a.dtype.kind in "iu":
        a_min, a_max = (a.min(), a.max()) if a.size else (0, 0)
    else:
        raise TypeError(f"{name} must be an int or an array of integers, got {start!r}")
    if a_min < -_MAX_POSITION or a_max > _MAX_POSITION:
        raise ValueError(f"{name} must lie in [-2**60, 2**60], got {start!r}")
    try:
        return np.broadcast_to(a.astype(np.int64), batch_shape)
    except ValueError:
        raise ValueError(
            f"{name} must be an int or broadcast to the batch shape {tuple(batch_shape)}, "
            f"got shape {a.shape}") from None


def _diagonal_offset(L, S, causal, kv_lengths, q_start, k_start, batch_shape):
    """``off`` with ``d(i) = i + off``, as exact Python ints shaped (*batch, 1, 1, 1).

    With explicit positions ``off = q_start - k_start``, which can reach
    ±2**63 and so need not fit in int64; it is kept exact (object dtype)
    and only compared with ``j - i`` through :func:`_bound`.
    """
    if q_start is not None or k_start is not None:
        off = (_position(q_start, "q_start", batch_shape).astype(object)
               - _position(k_start, "k_start", batch_shape).astype(object))
    elif _causal_alignment(causal)[1]:  # top-left: d(i) = i
        off = np.zeros(batch_shape, object)
    else:  # bottom-right: d(i) = i + S_b - L
        S_b = _valid_keys(kv_lengths, S, batch_shape)
        off = np.broadcast_to(S if S_b is None else S_b[..., 0, 0, 0], batch_shape).astype(object) - L
    return np.asarray(off, dtype=object).reshape(tuple(batch_shape) + (1, 1, 1))


def _bound(x):
    """An exact integer bound on ``j - i`` as int64: |j - i| < 2**62, so
    clipping the bound to ±2**62 changes no comparison."""
    return np.clip(x, -_MAX_POSITION, _MAX_POSITION).astype(np.int64)


def apply_mask(scaled, visible=np.True_, mask=None):
    """Step 3b: add the additive mask and hide invisible keys with -inf.

    Parameters
    ----------
    scaled : ndarray, shape (..., L, S)
        The scores after scale, softcap and ALiBi.
    visible : array_like of bool
        Broadcastable to ``scaled``; False hides the key.
    mask : ndarray, optional
        Broadcastable to ``scaled``.  Bool: True = may attend.  Floating:
        added to the scores (-inf hides the key; a huge finite value such as
        ``np.finfo(dtype).min`` does not hide it, it only makes it unlikely).

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


def append_sink(x, sink):
    """Step 4a (optional): the attention sink, one more logit in every row.

    A sink is a key that every query of a head sees, with logit ``sink_h``
    and a value vector of zeros: it takes its share of the softmax mass and
    gives nothing back, so a row may put less than all of its weight on the
    real keys.  Appended as a last column, the ordinary softmax then gives
    ``weights_j = exp(x_j) / (Σ_k exp(x_k) + exp(sink))`` (drop the last
    column), and the ordinary log-sum-exp includes ``exp(sink)``.  A row
    with no visible key puts all its weight on the sink: weights and output
    0, lse = sink.  ``sink = -inf`` is the same as no sink.

    Parameters
    ----------
    x : ndarray, shape (..., L, S)
        Masked scores.
    sink : ndarray
        One logit per row, broadcastable to ``x.shape[:-1]`` (in attention:
        one per query head, shape (H, 1)), in the dtype of ``x``.

    Returns
    -------
    ndarray, shape (..., L, S + 1)
    """
    sink_column = np.broadcast_to(sink, x.shape[:-1])[..., None]
    return np.concatenate([x, sink_column], axis=-1)


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
    # exp(very negative) -> 0 is expected, and so is x - m overflowing to
    # -inf when a row holds both finfo.min and finfo.max (exp gives 0)
    with np.errstate(under="ignore", over="ignore"):
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
    with np.errstate(under="ignore", over="ignore"):  # as in softmax
        l = np.sum(np.exp(x - m), axis=-1, keepdims=True)
    lse = np.where(l == 0, -np.inf, m + np.log(np.where(l == 0, 1, l)))
    return lse[..., 0]


def dequantize(values, scales, channels=None):
    """Step 0 (int8 keys or values only): ``values · scales``, row by row.

    An int8 cache stores each (batch entry, head, token) row of E numbers as
    int8 ``values`` and one ``scale``; the row it stands for is
    ``values * scale``. Keys may also have per-channel factors ``c`` (one
    E-vector per head), and then stand for ``values * scale * c``.

    Parameters
    ----------
    values : ndarray of int8, shape (..., S, E)
    scales : ndarray of float, shape (..., S)
    channels : ndarray of float, shape (..., E), optional

    Returns
    -------
    ndarray of float64, shape (..., S, E)
        ``values * scales`` is exact (8 + 24 bits fit in float64's 53); the
        channel factor adds one float64 rounding (2^-53 relative).
    """
    x = values.astype(np.float64) * scales.astype(np.float64)[..., None]
    if channels is not None:
        x *= channels.astype(np.float64)[..., None, :]
    return x


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
    x = np.asarray(x)
    if x.dtype == np.int8:
        raise TypeError(
            f"{name} is int8: int8 keys and values are passed as a pair (values, scales), "
            f"scales floating of shape values.shape[:-1]" if name != "q" else
            "q must not be int8: int8 storage is for k and v, as (values, scales) pairs")
    x = x.astype(dtype, copy=False)  # exact from float16, bfloat16 and int8 pairs (float64)
    if x.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions, got shape {x.shape}")
    return x[None] if x.ndim == 2 else x


def _is_pair(x):
    return isinstance(x, tuple)


def _int8_pair(pair, name):
    """An int8 ``(values, scales)`` pair (for k also ``(values, scales,
    channels)``), checked and dequantized (float64)."""
    if len(pair) not in ((2, 3) if name == "k" else (2,)):
        raise TypeError(
            f"{name} must be an array or an int8 pair (values, scales)"
            f"{' or triple (values, scales, channels)' if name == 'k' else ''}; got a tuple of {len(pair)}")
    values, scales = np.asarray(pair[0]), np.asarray(pair[1])
    if values.dtype != np.int8:
        raise TypeError(f"{name}'s values ({name}[0]) must be int8; got {values.dtype}")
    if values.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions, got shape {values.shape}")
    if not (scales.dtype.kind == "f" or scales.dtype.name == "bfloat16"):
        raise TypeError(f"{name}'s scales ({name}[1]) must be floating point; got {scales.dtype}")
    if scales.shape != values.shape[:-1]:
        raise ValueError(
            f"{name}'s scales ({name}[1]) must have shape values.shape[:-1] = "
            f"{values.shape[:-1]}, one per row; got {scales.shape}")
    channels = None
    if len(pair) == 3:
        channels = np.asarray(pair[2])
        if not (channels.dtype.kind == "f" or channels.dtype.name == "bfloat16"):
            raise TypeError(f"{name}'s channel factors ({name}[2]) must be floating point; got {channels.dtype}")
        if channels.shape != values.shape[:-2] + values.shape[-1:]:
            raise ValueError(
                f"{name}'s channel factors ({name}[2]) must have shape values.shape[:-2] + (E,) = "
                f"{values.shape[:-2] + values.shape[-1:]}; got {channels.shape}")
    return dequantize(values, scales, channels)


def _kv_arrays(k, v):
    """k and v as arrays: both int8 pairs (dequantized) or both as given."""
    if _is_pair(k) != _is_pair(v):
        pair, other = ("k", "v") if _is_pair(k) else ("v", "k")
        raise TypeError(
            f"k and v must both be int8 (values, scales) pairs or both arrays; got {pair} a pair "
            f"and {other} an array of {np.asarray(v if pair == 'k' else k).dtype}")
    if _is_pair(k):
        return _int8_pair(k, "k"), _int8_pair(v, "v")
    return k, v


def _softcap_value(softcap):
    """``softcap`` as a float after checking it is a finite real number > 0."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be None or a real number, got {softcap!r}")
    value = float(softcap)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softcap must be a finite number > 0, got {softcap!r}")
    return value


def _real_array(x, name):
    a = np.asarray(x)
    if a.dtype.kind not in "iuf":
        raise TypeError(f"{name} must hold real numbers, got dtype {a.dtype}")
    return a


def _alibi_slopes(slopes, Hq, batch, dtype):
    """``alibi_slopes`` broadcast to (*batch, Hq) in ``dtype``."""
    a = _real_array(slopes, "alibi_slopes")
    try:
        a = np.broadcast_to(a, batch + (Hq,))
    except ValueError:
        raise ValueError(
            f"alibi_slopes must have shape (Hq,) = ({Hq},) or broadcast to (*batch, Hq) = "
            f"{batch + (Hq,)}, got shape {a.shape}") from None
    if not np.isfinite(a).all():
        raise ValueError(f"alibi_slopes must be finite, got {a[~np.isfinite(a)][0]}")
    return a.astype(dtype)


def _sinks(sinks, Hq, dtype):
    """``sinks`` as (Hq,) in ``dtype``; -inf (no sink) allowed, NaN and +inf not."""
    a = _real_array(sinks, "sinks")
    if a.shape != (Hq,):
        raise ValueError(
            f"sinks must have shape (Hq,) = ({Hq},), one logit per query head, got shape {a.shape}")
    bad = np.isnan(a) | (a == np.inf)
    if bad.any():
        h = int(np.flatnonzero(bad)[0])
        raise ValueError(f"sinks must not be NaN or +inf (-inf means no sink), got {a[h]} for head {h}")
    return a.astype(dtype)


def attention_steps(q, k, v, *, mask=None, causal=False, window=None, kv_lengths=None,
                    scale=None, softcap=None, alibi_slopes=None, sinks=None, q_start=None,
                    k_start=None, dtype=np.float64):
    """Scaled dot-product attention, returning every intermediate step.

    Parameters
    ----------
    q : array_like, shape (..., L, E)
    k : array_like, shape (..., S, E), or an int8 pair ``(values, scales)``
        or triple ``(values, scales, channels)``
    v : array_like, shape (..., S, Ev), or an int8 pair ``(values, scales)``
        For 3-D and higher inputs axis -3 is the head axis (Hq for ``q``, Hkv
        for ``k`` and ``v``, with Hq % Hkv == 0) and the axes before it are
        broadcast batch axes.  float16, bfloat16, float32 and float64 are
        converted exactly to ``dtype``'s precision (float64 by default).  An
        int8 pair (a tuple: ``k`` and ``v`` both or neither) is int8
        ``values`` and floating ``scales`` of shape ``values.shape[:-1]``;
        it stands for ``values * scales[..., None]`` (:func:`dequantize`).
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
    softcap : float, optional
        Cap the scaled scores smoothly: ``s -> softcap · tanh(s / softcap)``
        (:func:`cap_scores`), before ALiBi and the masks.  Finite, > 0.
    alibi_slopes : array_like of float, optional
        Shape (Hq,), or broadcastable to (*batch, Hq); Hq = 1 for 2-D
        inputs.  Adds ``-slope[h] · |j - d(i)|`` (:func:`alibi_bias`) after
        softcap, before the masks.  Finite.
    sinks : array_like of float, optional
        Shape (Hq,): one logit per query head that joins every row's softmax
        denominator and contributes no value (:func:`append_sink`).  In the
        units of the masked scores.  -inf means no sink for that head; NaN and
        +inf are errors.
    q_start, k_start : int or array_like of int, optional
        Global positions of query row 0 and key 0, per batch entry; with
        either given (the other defaults to 0) the diagonal of causal, window
        and ALiBi is ``d(i) = q_start + i - k_start`` whatever ``causal``'s
        alignment.  |value| <= 2**60.
    dtype : dtype, optional
        The dtype the whole computation is done in (float64 by default).
        ``np.float32`` is "textbook float32 NumPy" on the same rounded or
        dequantized inputs (each input value rounded once to float32).

    Returns
    -------
    AttentionSteps
        See :func:`visibility` for the exact meaning of each restriction.

    Raises
    ------
    TypeError
        A non-floating ``dtype``; an int8 ``q``, or int8 ``k`` or ``v`` that
        is not a pair; a pair that is not int8 values and floating scales;
        ``k`` a pair and ``v`` not (or the reverse); ``mask``, ``kv_lengths``, ``window``,
        ``alibi_slopes`` or ``sinks`` of the wrong kind of number; a
        ``softcap`` that is not a real number; ``q_start`` or ``k_start``
        that are not integers.
    ValueError
        Shapes that do not match, and values out of range (each message
        names the argument, what it got and what it needs).
    """
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    k, v = _kv_arrays(k, v)
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

    # grouped-query attention: query head h reads key/value head h // G. The
    # query heads are taken as (Hkv, G) for the two products (scores and
    # weighted_sum), where each K/V head meets its G query heads by
    # broadcasting, not as G copies of it.
    G = Hq // Hkv if Hkv else 1
    q = np.broadcast_to(q, batch + (Hq, L, E))
    k = np.broadcast_to(k, batch + (Hkv, S, E))
    v = np.broadcast_to(v, batch + (Hkv, S, Ev))

    def by_kv_head(x):  # (*batch, Hq, ...) -> (*batch, Hkv, G, ...)
        return x.reshape(batch + (Hkv, G) + x.shape[len(batch) + 1:])

    def by_q_head(x):  # the inverse
        return x.reshape(batch + (Hq,) + x.shape[len(batch) + 2:])

    if scale is None:
        scale = 1.0 / math.sqrt(E) if E else 1.0
    scale = dtype.type(scale)
    if softcap is not None:
        # a cap beyond the dtype's range is the identity either way; clip it
        # so that float32 does not turn it into inf (inf · tanh(0) = NaN)
        softcap = dtype.type(min(_softcap_value(softcap), np.finfo(dtype).max))
    if alibi_slopes is not None:
        alibi_slopes = _alibi_slopes(alibi_slopes, Hq, batch, dtype)
    if sinks is not None:
        sinks = _sinks(sinks, Hq, dtype)

    out_leading = batch if headless else batch + (Hq,)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype.kind == "f":
            if mask.dtype.itemsize > np.dtype(dtype).itemsize:
                # finite values past the computation dtype's range stay finite
                # (a float64 finfo.min padding mask on a float32 computation)
                lim = np.finfo(dtype)
                mask = np.where(np.isfinite(mask), np.clip(mask, lim.min, lim.max), mask)
            mask = mask.astype(dtype, copy=False)
        elif mask.dtype != np.bool_:
            raise TypeError(f"mask must be bool or floating, got dtype {mask.dtype}")
        mask = np.broadcast_to(mask, out_leading + (L, S)).reshape(batch + (Hq, L, S))

    where = dict(causal=causal, kv_lengths=kv_lengths, q_start=q_start, k_start=k_start,
                 batch_shape=batch)  # what fixes the diagonal d(i)
    s = by_q_head(scores(by_kv_head(q), k[..., None, :, :]))
    scaled = scale_scores(s, scale)
    capped = scaled if softcap is None else cap_scores(scaled, softcap)
    biased = capped if alibi_slopes is None else capped + alibi_bias(L, S, alibi_slopes, **where)
    visible = visibility(L, S, window=window, **where)
    masked = apply_mask(biased, visible, mask)
    logits = masked if sinks is None else append_sink(masked, sinks[:, None])
    weights = softmax(logits)[..., :S]  # the sink's column, if any, carries no value
    output = by_q_head(weighted_sum(by_kv_head(weights), v[..., None, :, :]))
    lse = logsumexp(logits)

    def public(x, tail):  # drop the head axis that 2-D inputs were given
        return x.reshape(out_leading + tail)

    return AttentionSteps(
        scores=public(s, (L, S)),
        scaled=public(scaled, (L, S)),
        masked=public(masked, (L, S)),
        weights=public(weights, (L, S)),
        output=public(output, (L, Ev)),
        lse=public(lse, (L,)),
        capped=public(capped, (L, S)),
        biased=public(biased, (L, S)),
    )


def attention(q, k, v, *, mask=None, causal=False, window=None, kv_lengths=None,
              scale=None, softcap=None, alibi_slopes=None, sinks=None, q_start=None,
              k_start=None, return_lse=False, dtype=np.float64):
    """Scaled dot-product attention: ``softmax(Q Kᵀ · scale + mask) V``.

    With the score modifiers, in this order: scale, softcap, ALiBi bias,
    masks (bool, additive, causal, window, kv_lengths), softmax with the sink
    logit in its denominator, weighted sum.

    Parameters
    ----------
    q, k, v, mask, causal, window, kv_lengths, scale, softcap, alibi_slopes, sinks, q_start, k_start, dtype
        As in :func:`attention_steps`.
    return_lse : bool, optional
        Also return the per-row log-sum-exp of the masked, scaled scores
        (and of the sink: ``log (Σ_j exp(x_j) + exp(sink))``).

    Returns
    -------
    out : ndarray, shape (*out_leading, L, Ev)
        ``out_leading`` is the broadcast batch shape followed by Hq (nothing
        when all three inputs are 2-D).
    lse : ndarray, shape (*out_leading, L)
        Only if ``return_lse``; -inf for rows with no visible key (the sink
        logit with ``sinks``).

    Examples
    --------
    >>> q = k = np.eye(2)
    >>> v = np.array([[10.0, 0.0], [0.0, 10.0]])
    >>> np.round(attention(q, k, v, causal=True, scale=np.log(3)), 6)
    array([[10. ,  0. ],
           [ 2.5,  7.5]])

    A sink with logit log(2) takes 2/(3 + 2) of row 0's mass and
    2/(1 + 3 + 2) of row 1's:

    >>> np.round(attention(q, k, v, causal=True, scale=np.log(3), sinks=[np.log(2)]), 6)
    array([[6.      , 0.      ],
           [1.666667, 5.      ]])
    """
    steps = attention_steps(q, k, v, mask=mask, causal=causal, window=window,
                            kv_lengths=kv_lengths, scale=scale, softcap=softcap,
                            alibi_slopes=alibi_slopes, sinks=sinks, q_start=q_start,
                            k_start=k_start, dtype=dtype)
    return (steps.output, steps.lse) if return_lse else steps.output
