"""MultiHeadAttention: a NumPy attention layer that runs on fastattn.

This file owns the layer's weights (W_Q, W_K, W_V, W_O, optional biases) and
the data movement around the kernel: one matmul per projection, heads as
transposed views (no copies), the output written straight into the
concatenated-heads layout, and an optional KVCache for decoding. The
attention itself is `fastattn.attention` or `KVCache.attend`.
"""
import operator

import numpy as np

from fastattn._api import attention
from fastattn.cache import KVCache

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention:
    """Multi-head (and grouped-query) attention with NumPy weights.

    ``y = concat_h(attention(X W_Q^h, C W_K^g(h), C W_V^g(h))) W_O`` with
    ``C = X`` (self-attention) or the context (cross-attention), and query
    head h reading key/value head ``g(h) = h // (num_heads // num_kv_heads)``.

    Parameters
    ----------
    d_model : int
        Width of the input and output vectors.
    num_heads : int
        Query heads ``Hq``; must divide ``d_model``. Each head has
        ``d_k = d_model // num_heads`` dimensions.
    num_kv_heads : int, optional
        Key/value heads ``Hkv``, a divisor of ``num_heads``; default
        ``num_heads`` (plain multi-head attention). 1 is multi-query.
    rng : numpy.random.Generator or int, optional
        Source (or seed) of the initial weights, drawn from
        N(0, 1/fan_in); the same seed gives the same weights.
    dtype : {np.float32, np.float64}
        Dtype of the weights, the inputs and the output.
    bias : bool
        Whether the four projections have biases (initialised to zero).

    Attributes
    ----------
    W_Q : ndarray, (d_model, Hq·d_k)
    W_K, W_V : ndarray, (d_model, Hkv·d_k)
    W_O : ndarray, (Hq·d_k, d_model)
    b_Q, b_K, b_V, b_O : ndarray or None
        Biases of widths Hq·d_k, Hkv·d_k, Hkv·d_k and d_model. All eight may
        be replaced by arrays of the same shape and dtype (to load weights).

    Examples
    --------
    The lecture's shapes: d_model 512, 8 heads of d_k 64, 10 tokens.

    >>> mha = MultiHeadAttention(512, 8, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((10, 512), dtype=np.float32)
    >>> q, k, v = mha.project(x)          # per head (10, 64)
    >>> q.shape
    (1, 8, 10, 64)
    >>> mha(x).shape                      # concat (10, 512) @ W_O (512, 512)
    (10, 512)
    """

    def __init__(self, d_model, num_heads, num_kv_heads=None, *, rng=None, dtype=np.float32,
                 bias=False):
        d_model = _count(d_model, "d_model")
        num_heads = _count(num_heads, "num_heads")
        num_kv_heads = num_heads if num_kv_heads is None else _count(num_kv_heads, "num_kv_heads")
        if d_model % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}) "
                "for grouped-query attention")
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"dtype must be float32 or float64; got {dt}")
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.d_k = d_model // num_heads
        self.dtype = dt
        gen = np.random.default_rng(rng)
        dq, dkv = num_heads * self.d_k, num_kv_heads * self.d_k

        def init(fan_in, fan_out):
            # N(0, 1/fan_in) keeps activations O(1) through the layer.
            return (gen.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(dt)

        self.W_Q, self.W_K, self.W_V = init(d_model, dq), init(d_model, dkv), init(d_model, dkv)
        self.W_O = init(dq, d_model)
        zeros = (lambda n: np.zeros(n, dt)) if bias else (lambda n: None)
        self.b_Q, self.b_K, self.b_V, self.b_O = zeros(dq), zeros(dkv), zeros(dkv), zeros(d_model)

    def new_cache(self, batch, capacity, dtype=None):
        """A :class:`KVCache` that fits this layer: (batch, Hkv, capacity, d_k).

        ``dtype`` is what the cache stores (see :class:`KVCache`): the
        layer's dtype by default; a float32 layer may keep float16,
        ``"bfloat16"`` or ``"int8"`` keys and values (its projections are
        rounded or quantised as they are appended, and attention reads them
        as stored). A float64 layer needs a float64 cache.
        """
        cache = KVCache(batch, self.num_kv_heads, capacity, self.d_k,
                        dtype=self.dtype if dtype is None else dtype)
        if self.dtype == np.float64 and cache.dtype != np.float64:
            raise TypeError(
                f"a float64 layer needs a float64 cache (float64 attention is float64 "
                f"throughout); got dtype {cache.dtype.name}")
        return cache

    def _input(self, x, name):
        a = np.asarray(x)
        if a.dtype.kind == "f" and a.dtype != self.dtype:
            raise TypeError(
                f"{name} must have the layer's dtype {self.dtype}; got {a.dtype} "
                f"(convert it with .astype(np.{self.dtype.name}))")
        a = a.astype(self.dtype, copy=False)
        if a.ndim not in (2, 3) or a.shape[-1] != self.d_model:
            raise ValueError(
                f"{name} must have shape (batch, length, d_model={self.d_model}) or "
                f"(length, d_model); got {a.shape}")
        return a

    def _heads(self, x, W, b, H):
        """x (B, L, d_model) → (B, H, L, d_k) as a transposed view of one matmul."""
        y = x @ W
        if b is not None:
            y += b
        B, L = x.shape[:2]
        # (B, L, H·d_k) → (B, L, H, d_k) is free; swapping L and H is a view:
        # fastattn reads the strided heads in place.
        return y.reshape(B, L, H, self.d_k).swapaxes(1, 2)

    def project(self, x, context=None):
        """The per-head queries, keys and values, before attention.

        Parameters
        ----------
        x : array_like, (B, L, d_model) or (L, d_model)
        context : array_like, (B, S, d_model) or (S, d_model), optional
            Source of keys and values; default ``x``.

        Returns
        -------
        q : ndarray, (B, Hq, L, d_k)
        k, v : ndarray, (B, Hkv, S, d_k)
            Transposed views of (B, L, H, d_k) projections (B is 1 for 2-D
            inputs).
        """
        x = self._input(x, "x")
        c = x if context is None else self._input(context, "context")
        if x.ndim == 2:
            x = x[None]
        if c.ndim == 2:
            c = c[None]
        if c.shape[0] != x.shape[0]:
            raise ValueError(
                f"context must have the batch size of x ({x.shape[0]}); got {c.shape[0]}")
        q = self._heads(x, self.W_Q, self.b_Q, self.num_heads)
        k = self._heads(c, self.W_K, self.b_K, self.num_kv_heads)
        v = self._heads(c, self.W_V, self.b_V, self.num_kv_heads)
        return q, k, v

    def __call__(self, x, context=None, *, causal=False, cache=None, mask=None, num_threads=None):
        """Apply the layer.

        Parameters
        ----------
        x : array_like, (B, L, d_model) or (L, d_model)
            The queries' tokens.
        context : array_like, (B, S, d_model) or (S, d_model), optional
            Keys' and values' tokens (cross-attention); default ``x``.
        causal : {False, True, "bottom_right", "top_left"}
            As in :func:`fastattn.attention`. With a cache, ``True`` places
            the L queries at the last L positions filled (a decoder).
        cache : KVCache, optional
            This call's keys and values are appended to it (rounded or
            quantised to its dtype), then the queries attend over everything
            it holds. Build it with :meth:`new_cache`.
        mask : array_like, optional
            As in :func:`fastattn.attention`, broadcastable to (B, Hq, L, S),
            where S is the cache's capacity when a cache is given.
        num_threads : int, optional
            Threads for the attention kernel.

        Returns
        -------
        ndarray, (B, L, d_model), or (L, d_model) for a 2-D x
        """
        squeeze = np.ndim(x) == 2
        q, k, v = self.project(x, context)
        B, _, L, _ = q.shape
        # The kernel writes each head's rows straight into the concatenated
        # (B, L, Hq, d_k) layout through a transposed view: no transpose copy.
        heads = np.empty((B, L, self.num_heads, self.d_k), self.dtype)
        kw = {"mask": mask, "causal": causal, "out": heads.swapaxes(1, 2), "num_threads": num_threads}
        if cache is None:
            attention(q, k, v, **kw)
        else:
            before = cache._lengths.copy()
            cache.append(k, v)
            try:
                cache.attend(q, **kw)
            except Exception:
                # A rejected call (say, a bad mask) must not leave this step's
                # keys behind: restoring the lengths undoes the append.
                cache._lengths[:] = before
                raise
        y = heads.reshape(B, L, self.num_heads * self.d_k) @ self.W_O
        if self.b_O is not None:
            y += self.b_O
        return y[0] if squeeze else y

    def __repr__(self):
        return (f"MultiHeadAttention(d_model={self.d_model}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, dtype={self.dtype.name}, "
                f"bias={self.b_Q is not None})")


def _count(value, name):
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int; got {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be >= 1; got {n}")
    return n
