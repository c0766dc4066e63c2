"""KVCache: preallocated key/value buffers for decoding, filled in place.

This file owns the cache's storage, its per-batch-entry lengths and the rules
for appending; attention over it is one `fastattn.attention` call with
``kv_lengths`` (the kernel skips the unfilled keys, so nothing is copied). It
holds no arithmetic and knows nothing of layers or models.
"""
import operator

import numpy as np

from fastattn._api import attention

__all__ = ["KVCache"]


def _positive(value, name, minimum=1):
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int; got {value!r}") from None
    if n < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {n}")
    return n


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
    dtype : {np.float32, np.float64}
        Element type of the buffers; appended keys and values must have it.

    Notes
    -----
    Not thread-safe: one cache belongs to one decoding loop. Positions past a
    batch entry's length hold stale data (or zeros), which attention never
    reads.

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

    def __init__(self, batch, num_kv_heads, capacity, head_dim, head_dim_v=None, dtype=np.float32):
        batch = _positive(batch, "batch")
        num_kv_heads = _positive(num_kv_heads, "num_kv_heads")
        capacity = _positive(capacity, "capacity")
        head_dim = _positive(head_dim, "head_dim")
        head_dim_v = head_dim if head_dim_v is None else _positive(head_dim_v, "head_dim_v")
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"dtype must be float32 or float64; got {dt}")
        # Zeros, not np.empty: unfilled positions are never read by attention,
        # but a user printing the buffers should not see garbage.
        self._k = np.zeros((batch, num_kv_heads, capacity, head_dim), dt)
        self._v = np.zeros((batch, num_kv_heads, capacity, head_dim_v), dt)
        self._lengths = np.zeros(batch, np.int64)

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
        """Element type of the buffers."""
        return self._k.dtype

    @property
    def nbytes(self):
        """Bytes held by the two buffers."""
        return self._k.nbytes + self._v.nbytes

    # -- contents ----------------------------------------------------------

    @property
    def lengths(self):
        """Filled keys per batch entry, int64 (batch,); a read-only copy."""
        lengths = self._lengths.copy()
        lengths.flags.writeable = False
        return lengths

    @property
    def keys(self):
        """Read-only view of the filled keys, (batch, Hkv, max(lengths), E).

        When entries have different lengths, rows past an entry's own length
        are not part of it (see :attr:`lengths`).
        """
        return self._filled(self._k)

    @property
    def values(self):
        """Read-only view of the filled values, (batch, Hkv, max(lengths), Ev)."""
        return self._filled(self._v)

    @property
    def key_buffer(self):
        """Read-only view of the whole key buffer, (batch, Hkv, capacity, E)."""
        return self._filled(self._k, self.capacity)

    @property
    def value_buffer(self):
        """Read-only view of the whole value buffer, (batch, Hkv, capacity, Ev)."""
        return self._filled(self._v, self.capacity)

    def _filled(self, buffer, n=None):
        n = int(self._lengths.max()) if n is None else n
        view = buffer[:, :, :n]
        # Writes must go through append(), which keeps lengths consistent.
        view.flags.writeable = False
        return view

    # -- operations --------------------------------------------------------

    def append(self, k, v, lengths=None):
        """Write new keys and values after each batch entry's current length.

        Parameters
        ----------
        k : array_like, (batch, Hkv, n, E)
            New keys, the cache's dtype. Strided views (for example a
            projection reshaped to (batch, n, Hkv, E) and transposed) are fine:
            they are copied once, into the buffer.
        v : array_like, (batch, Hkv, n, Ev)
            New values, the cache's dtype.
        lengths : array_like of int, optional
            How many of the n new rows are valid for each batch entry
            (broadcastable to (batch,), each in [0, n]); the rest are padding
            and are not stored. Default: all n, for every entry.

        Raises
        ------
        ValueError
            If a shape does not match the cache, or an entry would grow past
            the capacity (the message names both); the cache is then unchanged.
        TypeError
            If k or v does not have the cache's dtype.
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
        start = int(self._lengths[0])
        if (self._lengths == start).all() and (counts == n).all():
            # The common case (every entry at the same length, all rows valid):
            # one strided copy per buffer.
            self._k[:, :, start:start + n] = k
            self._v[:, :, start:start + n] = v
        else:
            for b in range(self.batch):
                lo, c = int(self._lengths[b]), int(counts[b])
                self._k[b, :, lo:lo + c] = k[b, :, :c]
                self._v[b, :, lo:lo + c] = v[b, :, :c]
        self._lengths[:] = new

    def _check_new(self, x, name, dim):
        a = np.asarray(x)
        if a.dtype != self.dtype:
            raise TypeError(
                f"{name} must have the cache's dtype {self.dtype}; got {a.dtype} "
                f"(convert it with .astype(np.{self.dtype.name}))")
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
            Queries; Hq a multiple of the cache's Hkv. With ``causal=True``
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
        return attention(q, self._k, self._v, causal=causal, kv_lengths=self._lengths, **kwargs)

    def reset(self):
        """Empty every batch entry (the buffers are kept, not cleared)."""
        self._lengths[:] = 0

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
