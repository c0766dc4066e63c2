"""KVCache: preallocated key/value buffers for decoding, filled in place.

This file owns the cache's storage (float32, float64, float16, bfloat16 or
int8 with a scale per row), its per-batch-entry lengths and the rules for
appending, where new keys and values are rounded or quantised once; attention
over it is one `fastattn.attention` call with ``kv_lengths`` (the kernel skips
the unfilled keys and converts as it loads, so nothing is copied). It knows
nothing of layers or models.
"""
import operator

import numpy as np

from fastattn._api import attention

__all__ = ["KVCache", "quantize_int8", "key_channel_scales"]

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _storage_dtype(dtype):
    """The buffers' dtype: float32, float64, float16, bfloat16 or int8."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError(
                "dtype='bfloat16' needs the ml_dtypes package (NumPy has no bfloat16): "
                "pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in _FLOATS + ("int8",):
        raise TypeError(
            "dtype must be float32, float64, float16, 'bfloat16' (ml_dtypes) or 'int8'; "
            f"got {dtype if dt is None else dt}")
    return dt.newbyteorder("=")


def _is_float(dtype):
    return dtype.kind == "f" or dtype.name == "bfloat16"


def _round(x, dtype):
    """``x`` rounded once to nearest (ties to even) in ``dtype``; inf past its range."""
    if x.dtype == dtype:
        return x
    if dtype.name == "bfloat16" and x.dtype.itemsize > 4:
        # ml_dtypes converts float64 through float32, rounding twice (1 + 2^-8
        # + 2^-30 becomes 1, not 1 + 2^-7). Truncating to float32 and setting
        # its last bit when inexact (round to odd) keeps the information a
        # second rounding needs: with 16 more bits than bfloat16, the final
        # round to nearest even is then the only one.
        x = x.astype(np.float64, copy=False)
        with np.errstate(over="ignore", invalid="ignore"):
            f = x.astype(np.float32)
            t = np.where(np.abs(f) > np.abs(x), np.nextafter(f, np.float32(0)), f)  # toward 0
            inexact = t.astype(np.float64) != x  # NaN stays NaN with its bit set
        x = (t.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)
    with np.errstate(over="ignore"):  # past the range: inf, as astype gives
        return x.astype(dtype)


def _quantize(x):
    """Per-row symmetric int8: (values, scales, finite); see quantize_int8.

    Rows holding NaN or inf, or too large for a float32 scale, get values 0,
    scale NaN and finite False: the caller decides what to do with them.
    """
    x64 = np.asarray(x).astype(np.float64)  # exact from every float dtype
    amax = np.max(np.abs(x64), axis=-1, initial=0.0)  # NaN if the row holds NaN
    with np.errstate(over="ignore", invalid="ignore"):
        scales = (amax / 127).astype(np.float32)  # one rounding
    finite = np.isfinite(scales)
    scales[~finite] = np.nan
    s64 = scales.astype(np.float64)[..., None]
    use = (s64 > 0) & finite[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(use, np.rint(x64 / np.where(use, s64, 1.0)), 0.0)  # rint: ties to even
    # |x| / scale <= 127 (1 + 2^-24): rint gives at most 127; clip for safety
    values = np.clip(q, -127, 127).astype(np.int8)
    return values, scales, finite


def quantize_int8(x):
    """Symmetric int8 quantisation with one scale per row, as KVCache stores it.

    For each row (the last axis, a head dimension) ``scale = max|x| / 127``
    rounded to float32, and ``values = rint(x / scale)`` (ties to even)
    clipped to [-127, 127]; a row of zeros gets scale 0 and values 0. The
    row stands for ``values * scale``: each element within ``scale / 2`` of
    ``x``, so the error is at most ``max|x| / 254`` per row.

    Parameters
    ----------
    x : array_like of float (float16, bfloat16, float32 or float64), (..., E)

    Returns
    -------
    values : ndarray of int8, (..., E)
    scales : ndarray of float32, (...)
        ``(values, scales)`` is the pair :func:`fastattn.attention` takes.

    Raises
    ------
    ValueError
        If ``x`` holds NaN or inf, or a row whose scale would overflow
        float32 (int8 cannot hold them).
    """
    a = np.asarray(x)
    if not _is_float(a.dtype):
        raise TypeError(f"x must be floating point (float16, bfloat16, float32 or float64); got {a.dtype}")
    if a.ndim < 1:
        raise ValueError("x must have at least 1 dimension (rows of E numbers); got a scalar")
    values, scales, finite = _quantize(a)
    if not finite.all():
        row = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(
            f"x row {row} holds NaN or inf, or values beyond float32's range; int8 "
            "quantisation needs finite values")
    return values, scales


def _positive(value, name, minimum=1):
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int; got {value!r}") from None
    if n < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {n}")
    return n


def key_channel_scales(k, axis=-2):
    """Per-channel factors for int8 keys: ``max |k|`` over ``axis`` (the
    tokens) for each channel, floored at the median channel's, in float32.

    Dividing keys by these factors before per-token quantisation stops one
    outlier channel (real LLM keys have a few, 10-100x the rest) from
    setting every row's scale and so coarsening every other channel's step;
    attention folds the factors back into the queries. The floor keeps a
    channel that happened to be small in the sample from being blown up for
    every later token (docs/int8.md measures both). A head whose keys are
    all zero gets factors 1.

    Parameters
    ----------
    k : array_like of float, (..., n, E)
        Sample keys, typically the prompt's.
    axis : int
        The token axis; default -2.

    Returns
    -------
    ndarray of float32, k's shape without ``axis``: (..., E)
    """
    a = np.asarray(k)
    if not _is_float(a.dtype):
        raise TypeError(f"k must be floating point (float16, bfloat16, float32 or float64); got {a.dtype}")
    if a.ndim < 2 or a.shape[axis] == 0:
        raise ValueError(f"k must have at least 2 dimensions and one token on axis {axis}; got shape "
                         f"{tuple(a.shape)}")
    amax = np.max(np.abs(a.astype(np.float64)), axis=axis)
    if not np.isfinite(amax).all():
        raise ValueError("k holds NaN or inf: channel factors need finite keys")
    c = np.maximum(amax, np.median(amax, axis=-1, keepdims=True))
    c[np.max(c, axis=-1) == 0] = 1.0
    return c.astype(np.float32)


def _prompt_channels(k, counts, first, channels):
    """A copy of ``channels`` (batch, Hkv, E) in which each batch entry b that
    ``first`` marks gets :func:`key_channel_scales` of its ``counts[b]`` new
    rows ``k[b, :, :counts[b]]`` (its prompt). ValueError on NaN or inf.
    KVCache's appends and the sharded cache's driver both fix factors so."""
    out = np.array(channels, np.float32)
    for b in np.flatnonzero(first):
        out[b] = key_channel_scales(k[b, :, :counts[b]])
    return out


class KVCache:
    """Key/value buffers of a fixed capacity for one attention layer.

    The buffers have shape (batch, num_kv_heads, capacity, head_dim[_v]) and
    are allocated once. :meth:`append` writes new keys and values in place
    after each batch entry's current length; :meth:`attend` runs
    :func:`fastattn.attention` over the whole buffers with
    ``kv_lengths=lengths``, so keys past each entry's length are never read
    and ``causal=True`` aligns the queries with the last filled keys (the new
    tokens of a decoder).

    Parameters
    ----------
    batch : int
        Number of independent sequences (batch entries).
    num_kv_heads : int
        Key/value heads (``Hkv``); queries may have any multiple of it
        (grouped-query attention).
    capacity : int
        The most keys each batch entry can hold.
    head_dim : int
        Key (and query) head dimension ``E``.
    head_dim_v : int, optional
        Value head dimension ``Ev``; default ``head_dim``.
    dtype : {np.float32, np.float64, np.float16, "bfloat16", "int8"}
        What the buffers store. ``"bfloat16"`` (or ``ml_dtypes.bfloat16``)
        needs the ml_dtypes package. ``"int8"`` stores int8 keys and values
        plus one float32 scale per (batch entry, head, token) row for each,
        in buffers of shape (batch, num_kv_heads, capacity); a row stands
        for ``values * scale`` (:func:`quantize_int8`). Appended keys and
        values may be any of float16, bfloat16, float32 and float64; they
        are rounded (to nearest, ties to even) or quantised on the way in.
    key_channels : {"prompt", None} or array_like, optional
        int8 caches only: per-channel key factors ``c`` (one E-vector per
        batch entry and head), so that a stored key is ``values * scale *
        c`` and an outlier channel does not coarsen the others
        (docs/int8.md). ``"prompt"`` (the default for int8): each entry's
        factors come from its first append (:func:`key_channel_scales` of
        those rows) and stay fixed until :meth:`reset`; give the prompt in
        one append, as factors from a single token are only as good as
        per-token scales. An array broadcastable to (batch, num_kv_heads,
        head_dim): fixed factors (from calibration). ``None``: per-token
        scales only.

    Notes
    -----
    Not thread-safe: one cache belongs to one decoding loop. Positions past a
    batch entry's length hold stale data (or zeros), which attention never
    reads.

    Queries: the output of :meth:`attend` has q's dtype; a float64 cache
    takes float64 queries only, and float64 queries need a float64 cache
    (as :func:`fastattn.attention` requires). Memory per key and value
    element: 8, 4, 2, 2 and 1 byte (plus 4 bytes per row for int8's scale),
    see :attr:`nbytes`.

    Examples
    --------
    >>> cache = KVCache(batch=1, num_kv_heads=2, capacity=16, head_dim=8)
    >>> rng = np.random.default_rng(0)
    >>> k = rng.standard_normal((1, 2, 5, 8), dtype=np.float32)
    >>> cache.append(k, k)                      # a 5-token prompt
    >>> cache.lengths
    array([5])
    >>> q = rng.standard_normal((1, 8, 1, 8), dtype=np.float32)  # 8 query heads
    >>> cache.attend(q).shape                   # one new token's attention
    (1, 8, 1, 8)
    """

    def __init__(self, batch, num_kv_heads, capacity, head_dim, head_dim_v=None, dtype=np.float32,
                 key_channels="prompt"):
        batch = _positive(batch, "batch")
        num_kv_heads = _positive(num_kv_heads, "num_kv_heads")
        capacity = _positive(capacity, "capacity")
        head_dim = _positive(head_dim, "head_dim")
        head_dim_v = head_dim if head_dim_v is None else _positive(head_dim_v, "head_dim_v")
        dt = _storage_dtype(dtype)
        # Zeros, not np.empty: unfilled positions are never read by attention,
        # but a user printing the buffers should not see garbage.
        self._k = np.zeros((batch, num_kv_heads, capacity, head_dim), dt)
        self._v = np.zeros((batch, num_kv_heads, capacity, head_dim_v), dt)
        # int8: one float32 scale per stored row; None for the float dtypes
        rows = (batch, num_kv_heads, capacity)
        self._k_scales = np.zeros(rows, np.float32) if dt == np.int8 else None
        self._v_scales = np.zeros(rows, np.float32) if dt == np.int8 else None
        self._lengths = np.zeros(batch, np.int64)
        # int8 keys' channel factors (batch, Hkv, E), and which entries have
        # theirs fixed (an unfixed entry holds no keys yet); None: per-token only
        self._k_channels, self._channels_from_prompt = self._init_channels(key_channels, dt)
        self._channels_fixed = np.full(batch, not self._channels_from_prompt)

    def _init_channels(self, key_channels, dt):
        if isinstance(key_channels, str) and key_channels == "prompt":
            if dt != np.int8:
                return None, False
            return np.ones(self._k.shape[:2] + self._k.shape[3:], np.float32), True
        if key_channels is None:
            return None, False
        if dt != np.int8:
            raise ValueError(f"key_channels applies to int8 caches only; this cache stores {dt.name}")
        return self._check_channels(key_channels), False

    # -- shape -------------------------------------------------------------

    @property
    def batch(self):
        """Number of batch entries."""
        return self._k.shape[0]

    @property
    def num_kv_heads(self):
        """Key/value heads (``Hkv``)."""
        return self._k.shape[1]

    @property
    def capacity(self):
        """The most keys each batch entry can hold."""
        return self._k.shape[2]

    @property
    def head_dim(self):
        """Key head dimension ``E``."""
        return self._k.shape[3]

    @property
    def head_dim_v(self):
        """Value head dimension ``Ev``."""
        return self._v.shape[3]

    @property
    def dtype(self):
        """Element type of the key and value buffers (int8 for an int8 cache)."""
        return self._k.dtype

    @property
    def quantized(self):
        """True for an int8 cache (values plus a scale per row)."""
        return self._k_scales is not None

    @property
    def key_channels(self):
        """int8 keys' per-channel factors, (batch, Hkv, E) float32, a
        read-only copy (ones for an entry whose prompt has not come yet);
        None when the cache uses none."""
        if self._k_channels is None:
            return None
        c = self._k_channels.copy()
        c.flags.writeable = False
        return c

    @property
    def nbytes(self):
        """Bytes held by the buffers, int8's scale buffers (and key channel factors) included."""
        scales = self._k_scales.nbytes + self._v_scales.nbytes if self.quantized else 0
        channels = 0 if self._k_channels is None else self._k_channels.nbytes
        return self._k.nbytes + self._v.nbytes + scales + channels

    # -- contents ----------------------------------------------------------

    @property
    def lengths(self):
        """Filled keys per batch entry, int64 (batch,); a read-only copy."""
        lengths = self._lengths.copy()
        lengths.flags.writeable = False
        return lengths

    @property
    def keys(self):
        """The filled keys, (batch, Hkv, max(lengths), E): a read-only view
        of the buffer in the cache's dtype; for an int8 cache a new float32
        array ``values * scales`` (times :attr:`key_channels`; each element
        rounded once to float32).

        When entries have different lengths, rows past an entry's own length
        are not part of it (see :attr:`lengths`).
        """
        return self._filled(self._k, self._k_scales, dequantize=True, channels=self._k_channels)

    @property
    def values(self):
        """The filled values, (batch, Hkv, max(lengths), Ev); as :attr:`keys`."""
        return self._filled(self._v, self._v_scales, dequantize=True)

    @property
    def key_buffer(self):
        """The whole key buffer, (batch, Hkv, capacity, E), as a read-only view;
        for an int8 cache the pair (values, scales) of read-only views, or
        the triple (values, scales, channel factors) when it has them (the
        factors a read-only view too, so factors fixed by a later prompt
        show through), as :func:`fastattn.attention` takes it."""
        return self._filled(self._k, self._k_scales, self.capacity, channels=self._k_channels)

    @property
    def value_buffer(self):
        """The whole value buffer, (batch, Hkv, capacity, Ev); as :attr:`key_buffer`."""
        return self._filled(self._v, self._v_scales, self.capacity)

    def _filled(self, buffer, scales, n=None, dequantize=False, channels=None):
        n = int(self._lengths.max()) if n is None else n
        view = buffer[:, :, :n]
        # Writes must go through append(), which keeps lengths consistent.
        view.flags.writeable = False
        if scales is None:
            return view
        s = scales[:, :, :n]
        s.flags.writeable = False
        if dequantize:
            x = view.astype(np.float64) * s[..., None]
            if channels is not None:
                x *= channels[:, :, None, :]
            out = x.astype(np.float32)
            out.flags.writeable = False
            return out
        if channels is None:
            return view, s
        c = channels.view()  # live: an entry's factors fixed later show through
        c.flags.writeable = False
        return view, s, c

    # -- operations --------------------------------------------------------

    def append(self, k, v, lengths=None):
        """Write new keys and values after each batch entry's current length.

        Parameters
        ----------
        k : array_like, (batch, Hkv, n, E)
            New keys: float16, bfloat16, float32 or float64, rounded once to
            the cache's dtype (to nearest, ties to even; past its range:
            inf, as ``astype`` gives), or for an int8 cache quantised with
            :func:`quantize_int8`. Strided views (for example a projection
            reshaped to (batch, n, Hkv, E) and transposed) are fine: they
            are copied once, into the buffer.
        v : array_like, (batch, Hkv, n, Ev)
            New values, as ``k``.
        lengths : array_like of int, optional
            How many of the n new rows are valid for each batch entry
            (broadcastable to (batch,), each in [0, n]); the rest are padding
            and are not stored. Default: all n, for every entry.

        Raises
        ------
        ValueError
            If a shape does not match the cache, an entry would grow past
            the capacity (the message names both), or, for an int8 cache, a
            row to be stored holds NaN or inf (int8 cannot hold them; a float
            cache stores them, and attention propagates them). The cache is
            then unchanged: every check comes before the first write.
        TypeError
            If k or v is not floating point.
        """
        k = self._check_new(k, "k", self.head_dim)
        v = self._check_new(v, "v", self.head_dim_v)
        n = k.shape[2]
        if v.shape[2] != n:
            raise ValueError(
                f"k and v must hold the same number of new rows; got k {k.shape[2]} and v {v.shape[2]}")
        counts = self._check_counts(lengths, n)
        new = self._lengths + counts
        over = np.flatnonzero(new > self.capacity)
        if over.size:
            b = int(over[0])
            raise ValueError(
                f"KVCache capacity {self.capacity} exceeded: batch entry {b} holds "
                f"{int(self._lengths[b])} keys and appending {int(counts[b])} needs length "
                f"{int(new[b])}; the cache is unchanged")
        # Rounded or quantised before anything is written, so that a refusal
        # (NaN into an int8 cache) leaves the cache as it was.
        channels, fixed = self._channels_after(k, counts)
        rows = [self._encode(x, name, counts, c) for x, name, c in ((k, "k", channels), (v, "v", None))]
        pairs = [(self._k, self._k_scales), (self._v, self._v_scales)]
        start = int(self._lengths[0])
        if (self._lengths == start).all() and (counts == n).all():
            # The common case (every entry at the same length, all rows valid):
            # one strided copy per buffer.
            for stored, given in zip(pairs, rows):
                for buf, x in zip(stored, given):
                    if buf is not None:
                        buf[:, :, start:start + n] = x
        else:
            for b in range(self.batch):
                lo, c = int(self._lengths[b]), int(counts[b])
                for stored, given in zip(pairs, rows):
                    for buf, x in zip(stored, given):
                        if buf is not None:
                            buf[b, :, lo:lo + c] = x[b, :, :c]
        self._lengths[:] = new
        if channels is not None:
            self._k_channels[...], self._channels_fixed[:] = channels, fixed

    def fix_key_channels(self, channels, entries=None):
        """Give the int8 keys of batch entries that have no channel factors yet
        these, as their prompt would have (``key_channels="prompt"`` caches).

        For a sequence whose keys are spread over several caches (the shards
        of :class:`fastattn.distributed.ShardedKVCache`): a cache that first
        sees the sequence in the middle would otherwise take its factors from
        whatever rows reach it first, often one decode token; this gives it
        the prompt's, so every part quantises alike.

        Parameters
        ----------
        channels : array_like of float
            Broadcastable to (batch, num_kv_heads, head_dim), finite and > 0
            (for example :func:`key_channel_scales` of the prompt's keys).
        entries : array_like of bool (batch,) or of int, optional
            Which batch entries; default all.

        Returns
        -------
        ndarray of bool, (batch,)
            The entries that took them: those asked for with no factors yet.
            The others keep theirs.
        """
        if not self._channels_from_prompt:
            raise ValueError("fix_key_channels is for int8 caches with key_channels='prompt'; this one "
                             + ("has given factors" if self._k_channels is not None else
                                f"stores {self.dtype.name} keys without channel factors"))
        c = self._check_channels(channels)
        asked = np.full(self.batch, entries is None)
        try:
            if entries is not None:
                asked[np.asarray(entries)] = True
        except (IndexError, TypeError, ValueError):
            raise ValueError(f"entries must be batch entry indices or a mask of {self.batch}; "
                             f"got {entries!r}") from None
        take = asked & ~self._channels_fixed
        self._k_channels[take] = c[take]
        self._channels_fixed |= take
        return take

    def _check_channels(self, key_channels):
        """Given factors as float32 (batch, Hkv, E): floating, finite, > 0."""
        c = np.asarray(key_channels)
        want = self._k.shape[:2] + self._k.shape[3:]
        if not (c.dtype.kind == "f" or c.dtype.name == "bfloat16"):
            raise TypeError(f"key_channels must be 'prompt', None or floating factors; got {c.dtype}")
        try:
            c = np.broadcast_to(c, want).astype(np.float32)
        except ValueError:
            raise ValueError(f"key_channels must broadcast to (batch, num_kv_heads, head_dim) = {want}; "
                             f"got shape {tuple(c.shape)}") from None
        if not (np.isfinite(c).all() and (c > 0).all()):
            raise ValueError("key_channels must be finite and > 0")
        return c

    def _channels_after(self, k, counts):
        """The key channel factors once this append is stored, and which
        entries then have theirs fixed: an entry's first non-empty append
        sets them from its rows (the prompt)."""
        if self._k_channels is None:
            return None, None
        first = ~self._channels_fixed & (counts > 0)
        if not first.any():
            return self._k_channels, self._channels_fixed
        try:
            channels = _prompt_channels(k, counts, first, self._k_channels)
        except ValueError:  # NaN or inf among the new keys: _encode words the refusal
            return self._k_channels, self._channels_fixed
        return channels, self._channels_fixed | first

    def _encode(self, x, name, counts, channels=None):
        """New rows as stored: (rounded, None), or (int8 values, scales) of
        x / channels (keys with channel factors)."""
        if not self.quantized:
            return _round(x, self.dtype), None
        if channels is not None:
            x = np.asarray(x, np.float64) / channels[:, :, None, :]
        values, scales, finite = _quantize(x)
        stored = np.arange(x.shape[2]) < counts[:, None, None]  # padding rows are not kept
        bad = np.argwhere(stored & ~finite)
        if bad.size:
            b, h, t = (int(i) for i in bad[0])
            raise ValueError(
                f"{name} holds NaN or inf (or a value past float32's range) at batch entry {b}, "
                f"head {h}, new row {t}; an int8 cache stores finite values only. The cache "
                "is unchanged")
        return values, scales

    def _check_new(self, x, name, dim):
        a = np.asarray(x)
        if not _is_float(a.dtype):
            raise TypeError(
                f"{name} must be floating point (float16, bfloat16, float32 or float64; it is "
                f"{'quantised' if self.quantized else 'rounded'} into the cache's "
                f"{self.dtype.name}); got {a.dtype}")
        want = (self.batch, self.num_kv_heads, dim)
        if a.ndim != 4 or (a.shape[0], a.shape[1], a.shape[3]) != want:
            raise ValueError(
                f"{name} must have shape (batch={want[0]}, num_kv_heads={want[1]}, n, {dim}) "
                f"to fit this cache; got {tuple(a.shape)}")
        return a

    def _per_entry(self, lengths):
        """lengths as int64 (batch,): integers, broadcast to one per entry."""
        c = np.asarray(lengths)
        if c.dtype.kind not in "iu":
            raise TypeError(f"lengths must be integers; got dtype {c.dtype}")
        try:
            return np.broadcast_to(c, (self.batch,)).astype(np.int64)
        except ValueError:
            raise ValueError(
                f"lengths of shape {tuple(c.shape)} does not broadcast to the batch ({self.batch},)"
            ) from None

    def _check_counts(self, lengths, n):
        if lengths is None:
            return np.full(self.batch, n, np.int64)
        c = self._per_entry(lengths)
        if c.size and (c.min() < 0 or c.max() > n):
            raise ValueError(
                f"lengths must lie in [0, n={n}] (the rows given); got values from "
                f"{c.min()} to {c.max()}")
        return c

    def attend(self, q, causal=True, **kwargs):
        """Attention of ``q`` over the filled part of the cache.

        Parameters
        ----------
        q : array_like, (batch, Hq, L, E)
            Queries (float16, bfloat16, float32; float64 for a float64
            cache), Hq a multiple of the cache's Hkv; the output has their
            dtype. An int8 cache passes ``(values, scales)`` pairs. With ``causal=True``
            query row i sits at key position ``lengths[b] - L + i``: the L
            queries are the last L tokens appended.
        causal : {True, False, "bottom_right", "top_left"}
            As in :func:`fastattn.attention`; default True (a decoder).
        **kwargs
            Any other argument of :func:`fastattn.attention` except
            ``kv_lengths`` (the cache supplies it): ``window`` for sliding
            windows, ``mask`` (its last axis is the capacity), ``out``,
            ``return_lse``, ``scale``, ``num_threads``.

        Returns
        -------
        ndarray or (ndarray, ndarray)
            As :func:`fastattn.attention` returns.
        """
        if "kv_lengths" in kwargs:
            raise TypeError("attend() takes no kv_lengths: the cache's own lengths are used")
        # The full buffers go in; kv_lengths hides every key past each length,
        # so the kernel neither reads nor copies the unfilled part.
        k = self._k if self._k_scales is None else (self._k, self._k_scales)
        if self._k_channels is not None:
            k = k + (self._k_channels,)
        v = self._v if self._v_scales is None else (self._v, self._v_scales)
        return attention(q, k, v, causal=causal, kv_lengths=self._lengths, **kwargs)

    def reset(self):
        """Empty every batch entry (the buffers are kept, not cleared). Key
        channel factors taken from a prompt are dropped with it: the next
        append sets new ones; given ones are kept."""
        self._lengths[:] = 0
        if self._channels_from_prompt:
            self._k_channels[...] = 1
            self._channels_fixed[:] = False

    def truncate(self, lengths):
        """Drop keys and values from the end: each batch entry keeps its first
        ``lengths[b]`` (a rollback, as when speculative decoding rejects draft
        tokens). Nothing is cleared or copied.

        Parameters
        ----------
        lengths : array_like of int
            Broadcastable to (batch,); each between 0 and the entry's current
            length.

        Raises
        ------
        ValueError
            If a length is negative or longer than what the entry holds (the
            message names the entry); the cache is then unchanged.
        """
        new = self._per_entry(lengths)
        bad = np.flatnonzero((new < 0) | (new > self._lengths))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"truncate: batch entry {b} holds {int(self._lengths[b])} keys; cannot keep "
                f"{int(new[b])} (a length must be between 0 and what the entry holds); "
                "the cache is unchanged")
        self._lengths[:] = new

    def __repr__(self):
        return (f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, "
                f"capacity={self.capacity}, head_dim={self.head_dim}, head_dim_v={self.head_dim_v}, "
                f"dtype={self.dtype.name}, lengths={self._lengths.tolist()})")
