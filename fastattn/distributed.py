"""fastattn.distributed: a key/value cache split by position over Ray actors.

This file owns the sharded cache: which shard holds which positions, routing
appends to them, sending a query to the shards that hold visible keys, and
merging their partial (out, lse) pairs in shard order. Each shard is one Ray
actor owning a plain `fastattn.KVCache`; the attention is the kernel's and the
merge is `merge_attention`'s. Ray is imported here only (`import fastattn`
never loads it); install it with ``pip install "fastattn[distributed]"``.
"""
import math
import numbers
import os
import time

import numpy as np

try:
    import ray
    import ray.exceptions
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError(
        "fastattn.distributed needs Ray: pip install 'fastattn[distributed]' (or pip install ray)"
    ) from None

from fastattn._api import _check_window
from fastattn.cache import KVCache, _positive, _prompt_channels
from fastattn.merge import merge_attention

__all__ = ["ShardedKVCache", "ShardError"]

# attention() arguments a shard passes through as they are; the cache supplies
# kv_lengths, k_start and return_lse, and the driver handles the others.
_PASSED = ("scale", "softcap", "alibi_slopes", "num_threads")

# The driver sleeps this share of the fastest of the last _GRAPH_HISTORY
# graph calls before it waits (spinning) for the next one's result, when
# that share is at least _GRAPH_SLEEP_MIN seconds: a sleep may overrun by
# tenths of a millisecond, which only a longer call hides (0.8 instead of
# 0.6 overran: 1.65 ms overhead instead of 0.89, docs/distributed.md).
# What a call took is only known when the result came after the sleep: one
# that was already waiting (ray.get then took a tenth of the sleep or less)
# took at most the sleep, and is recorded as half of it. Recording the whole
# sleep instead shrank a too-long sleep by only 0.6 a call: after a 3.6 s
# first call, the next twelve calls of a 1-2 ms graph took 9 s in all. The
# first call after compiling is not recorded at all (Ray warms the graph up
# then: 2-4 s on 2 cores).
_GRAPH_SLEEP, _GRAPH_HISTORY, _GRAPH_SLEEP_MIN = 0.6, 8, 5e-4
# One execution in flight, as the driver never has more: Ray (2.60) keeps
# shared-memory buffers for as many as it allows (default 10), and does not
# free a compiled graph's buffers when it is torn down (ray-project/ray#43836).
# Each closed cache of 2 shards left 29 MB in the object store with the
# default, 6 MB with 1; after seven or so the store (200 MB in the tests) was
# full and every new graph's first call took 5-7 s instead of 1.5-2.5.
_GRAPH_COMPILE = {"_max_inflight_executions": 1}
_REFUSED = {
    "mask": "its last axis would have to be split over the shards",
    "out": "the result is assembled by the merge, not written by one call",
    "kv_lengths": "the cache's own lengths are used",
    "k_start": "each shard's keys sit at the positions it owns",
    "return_weights": "the weights would span the shards",
}
_CAUSAL = (False, True, "bottom_right", "top_left")


def _graph_step(nap, waited, took):
    """The seconds to record for a graph call that slept nap seconds (0: it
    did not sleep), then waited `waited` in ray.get, `took` in all. Waiting a
    tenth of the sleep or less is only ray.get's own cost (about a
    millisecond): the result was there before the driver woke, so the call
    took at most the sleep, and half of it is recorded."""
    return nap / 2 if nap > 0 and waited <= nap / 10 else took


class ShardError(RuntimeError):
    """A shard's actor died, timed out or failed; ``shard`` is its index.

    Raised instead of a result: nothing is merged from the shards that did
    answer, and their caches are left as they were (see
    :meth:`ShardedKVCache.append` for what a failed append undoes).
    """

    def __init__(self, shard, num_shards, what):
        super().__init__(f"shard {shard} of {num_shards}: {what}")
        self.shard = shard


class _Shard:
    """The actor: one KVCache holding global positions [k_start, k_start + capacity)."""

    def __init__(self, index, batch, num_kv_heads, capacity, head_dim, head_dim_v, dtype, key_channels,
                 num_threads):
        self._cache = KVCache(batch, num_kv_heads, capacity, head_dim, head_dim_v, dtype, key_channels)
        self._index, self._k_start = index, index * capacity
        # Ray sets OMP_NUM_THREADS=1 in its workers; a shard is meant to own
        # its machine, so by default it uses every core it may run on.
        self._threads = num_threads or len(os.sched_getaffinity(0))

    def ready(self):
        return True

    def append(self, k, v, lengths):
        self._cache.append(k, v, lengths=lengths)

    def truncate(self, lengths):
        self._cache.truncate(lengths)

    def reset(self):
        self._cache.reset()

    def fix_key_channels(self, channels, entries):
        self._cache.fix_key_channels(channels, entries)

    def lengths(self):
        return self._cache.lengths

    def attend(self, q, q_start, kwargs):
        # Explicit global positions: row i at q_start + i, key j at k_start + j,
        # so this shard computes exactly its part of the whole call; no sinks
        # here (merge_attention applies them once).
        kwargs = dict(kwargs)
        kwargs.setdefault("num_threads", self._threads)
        return self._cache.attend(q, q_start=q_start, k_start=self._k_start, return_lse=True, **kwargs)

    def graph_attend(self, request):
        """The compiled graph's step: every shard gets the request, the shards
        not asked answer None."""
        q, q_start, kwargs, asked = request
        return self.attend(q, q_start, kwargs) if self._index in asked else None


_ShardActor = ray.remote(_Shard)


class ShardedKVCache:
    """A key/value cache whose positions are split over Ray actors, one per shard.

    Shard ``s`` owns the global positions ``[s·C, (s+1)·C)`` of every batch
    entry (``C = capacity_per_shard``) in a :class:`fastattn.KVCache` on its
    actor. :meth:`append` sends each new row to the shard that owns its
    position; :meth:`attend` sends the queries to every shard that holds keys
    they may see, each computes its partial result with explicit global
    positions (``q_start``, ``k_start``, ``return_lse=True``), and the driver
    merges them in shard order with :func:`fastattn.merge_attention`, which
    also applies ``sinks`` once. The result is exact (as one call over the
    concatenated cache, up to rounding) and, for a given layout, bitwise the
    same whatever the timing: it equals ``merge_attention`` of the same
    shards computed locally.

    Parameters
    ----------
    num_shards : int
        Number of shards (Ray actors).
    batch, num_kv_heads, head_dim, head_dim_v, dtype, key_channels
        As for :class:`fastattn.KVCache` (storage float32, float64, float16,
        ``"bfloat16"`` or ``"int8"``); every shard has them. For int8 keys,
        ``key_channels="prompt"`` (the default) takes each entry's channel
        factors from its first append, on the driver, and gives them to
        every shard (:meth:`fastattn.KVCache.fix_key_channels`), so the
        shards quantise as one cache would; given factors are shared as
        they are.
    capacity_per_shard : int
        Positions per shard; the cache holds ``num_shards * capacity_per_shard``
        keys per batch entry.
    timeout : float or None, optional
        Seconds to wait for the shards in each operation (default 60); None
        waits for ever. A shard that does not answer in time raises
        :class:`ShardError` naming it.
    num_threads : int, optional
        Kernel threads on each shard; default the number of cores the
        shard's process may run on (Ray's workers get ``OMP_NUM_THREADS=1``,
        which would make every shard serial). ``attend(num_threads=)``
        overrides it for one call.
    compiled : bool
        Run :meth:`attend` through a Ray Compiled Graph over all the shards
        (default True): compiled on the first call, it passes the request and
        the partial results through shared-memory channels, which measured a
        fraction of a plain actor call's overhead (docs/distributed.md). Any
        error on that path (a dead shard, a refused argument, a timeout) tears
        the graph down and reruns the call as plain actor calls, which name
        the failing shard; if the graph cannot be compiled, plain calls are
        used from then on. False: plain actor calls only. Appends, truncation
        and lengths always use plain calls.
    actor_options : dict or sequence of dicts, optional
        ``.options()`` for the actors (one dict for all, or one per shard),
        e.g. ``{"scheduling_strategy": "SPREAD"}`` for one shard per node.
        ``max_concurrency`` is always 1: a shard runs its calls one at a time
        and in the order the driver sent them, which is what makes a failed
        append's rollback safe.

    Notes
    -----
    Call ``ray.init()`` (or ``ray.init(address="auto")`` on a cluster) first;
    otherwise Ray starts a local one. The actors live as long as this object
    (or until :meth:`close`). Like KVCache it is not thread-safe.

    16-bit queries are widened exactly to float32 for the shards (the kernel
    computes in float32 anyway), so the partial results and the merge stay in
    float32 and the output is rounded once to the queries' dtype.
    """

    def __init__(self, num_shards, batch, num_kv_heads, capacity_per_shard, head_dim, head_dim_v=None,
                 dtype=np.float32, key_channels="prompt", *, timeout=60.0, num_threads=None,
                 actor_options=None, compiled=True):
        self._num_shards = _positive(num_shards, "num_shards")
        self._cap = _positive(capacity_per_shard, "capacity_per_shard")
        # The shards' KVCache arguments, checked by KVCache itself (with a
        # capacity of 1) before any actor starts.
        one = KVCache(batch, num_kv_heads, 1, head_dim, head_dim_v, dtype, key_channels)
        self._batch, self._hkv, self._e, self._ev = one.batch, one.num_kv_heads, one.head_dim, one.head_dim_v
        self._dtype = one.dtype
        self._timeout = _check_timeout(timeout)
        threads = None if num_threads is None else _positive(num_threads, "num_threads")
        options = _actor_options(actor_options, self._num_shards)
        if not isinstance(compiled, (bool, np.bool_)):
            raise TypeError(f"compiled must be True or False; got {compiled!r}")
        self._actors = [
            _ShardActor.options(**opts, max_concurrency=1).remote(
                s, self._batch, self._hkv, self._cap, self._e, self._ev, self._dtype.name, key_channels,
                threads)
            for s, opts in enumerate(options)]
        self._lengths = np.zeros(self._batch, np.int64)
        # int8 keys with factors from the prompt: the driver takes them from
        # each entry's first append and gives them to every shard, so that a
        # shard that first sees the entry at a later position quantises as
        # shard 0 does (its own first rows may be a single decode token).
        self._prompt_channels = one.quantized and one.key_channels is not None and (
            isinstance(key_channels, str) and key_channels == "prompt")
        self._channels_fixed = np.zeros(self._batch, bool)
        self._graph = None if compiled else False  # None: compile on the first attend
        self._graph_steps = []  # the last few graph calls' seconds (see _graph_attend)
        self._graph_warm = False  # the graph has had its first (warm-up) call
        # Construction errors (ml_dtypes missing on a node, no room) surface here.
        self._gather([a.ready.remote() for a in self._actors], range(self._num_shards), "start")

    # -- shape -------------------------------------------------------------

    @property
    def num_shards(self):
        return self._num_shards

    @property
    def batch(self):
        return self._batch

    @property
    def num_kv_heads(self):
        return self._hkv

    @property
    def capacity_per_shard(self):
        return self._cap

    @property
    def capacity(self):
        """The most keys each batch entry can hold, over all shards."""
        return self._num_shards * self._cap

    @property
    def head_dim(self):
        return self._e

    @property
    def head_dim_v(self):
        return self._ev

    @property
    def dtype(self):
        """Storage dtype of every shard (int8 for an int8 cache)."""
        return self._dtype

    @property
    def lengths(self):
        """Filled keys per batch entry (global), int64 (batch,); a read-only copy."""
        lengths = self._lengths.copy()
        lengths.flags.writeable = False
        return lengths

    @property
    def actors(self):
        """The shards' Ray actor handles, in shard order (a copy of the list)."""
        return list(self._actors)

    def shard_lengths(self):
        """Each shard's own lengths, asked from the actors: int64 (num_shards, batch).

        Shard s holds ``clip(lengths - s·C, 0, C)``; this asks rather than
        computes, to check that the shards agree with the driver.
        """
        refs = [a.lengths.remote() for a in self._actors]
        return np.stack(self._gather(refs, range(self._num_shards), "lengths"))

    def _local(self, lengths):
        """(num_shards, batch): what each shard holds when the entries hold ``lengths``."""
        lo = np.arange(self._num_shards, dtype=np.int64)[:, None] * self._cap
        return np.clip(lengths[None, :] - lo, 0, self._cap)

    # -- operations --------------------------------------------------------

    def append(self, k, v, lengths=None):
        """Write new keys and values after each batch entry's current length,
        each row to the shard that owns its position.

        Parameters
        ----------
        k, v, lengths
            As for :meth:`fastattn.KVCache.append`: (batch, Hkv, n, E) and
            (batch, Hkv, n, Ev), floating point; ``lengths`` (broadcast to
            (batch,)) says how many of the n rows each entry keeps.

        Raises
        ------
        ValueError, TypeError
            For a bad shape or dtype, or rows past the total capacity (the
            message names the entry), before anything is sent; or when a
            shard refuses its rows (an int8 shard given NaN), re-raised with
            the shard named.
        ShardError
            If a shard's actor died or timed out.

        In every failing case the driver's lengths stay as they were, and the
        shards that took their rows are truncated back to their old lengths
        (the rows stay in their buffers past the length, where nothing reads
        them). A shard that timed out gets the same truncation, queued after
        its append.
        """
        k, v = self._check_rows(k, "k", self._e), self._check_rows(v, "v", self._ev)
        n = k.shape[2]
        if v.shape[2] != n:
            raise ValueError(
                f"k and v must hold the same number of new rows; got k {k.shape[2]} and v {v.shape[2]}")
        counts = _counts(lengths, n, self._batch)
        new = self._lengths + counts
        over = np.flatnonzero(new > self.capacity)
        if over.size:
            b = int(over[0])
            raise ValueError(
                f"ShardedKVCache capacity {self.capacity} ({self._num_shards} shards of "
                f"{self._cap}) exceeded: batch entry {b} holds {int(self._lengths[b])} keys and "
                f"appending {int(counts[b])} needs length {int(new[b])}; nothing was written")
        old_local = self._local(self._lengths)
        new_local = self._local(new)
        sent = self._send_prompt_channels(k, counts)
        for s in np.flatnonzero((new_local != old_local).any(axis=1)):
            s = int(s)
            # Entry b's new rows t = 0..n-1 sit at global positions lengths[b] + t;
            # shard s takes rows [first[b], first[b] + take[b]).
            take = new_local[s] - old_local[s]
            first = old_local[s] + s * self._cap - self._lengths
            ks, vs, ls = _rows_for(k, first, take), _rows_for(v, first, take), None
            if ks is None:  # ragged: rows gathered per entry, padded, with lengths
                ks, vs, ls = _gathered(k, first, take), _gathered(v, first, take), take
            sent.append((s, self._actors[s].append.remote(ks, vs, ls)))
        try:
            self._gather([r for _, r in sent], [s for s, _ in sent], "append")
        except BaseException:
            self._roll_back([s for s, _ in sent], old_local)
            raise
        self._lengths = new

    def _send_prompt_channels(self, k, counts):
        """For entries whose first rows these are: their channel factors, sent
        to every shard ahead of the rows (each actor runs its calls in order).
        Returns [(shard, ref)] of those calls. The driver counts the factors
        as fixed from here on, as the shards do, even if the append fails."""
        first = ~self._channels_fixed & (counts > 0) if self._prompt_channels else np.zeros(0, bool)
        if not first.any():
            return []
        # NaN or inf in those rows: ValueError here, before anything is sent
        channels = _prompt_channels(k, counts, first, np.ones((self._batch, self._hkv, self._e), np.float32))
        self._channels_fixed |= first
        return [(s, a.fix_key_channels.remote(channels, first)) for s, a in enumerate(self._actors)]

    def _roll_back(self, shards, old_local):
        """Truncate the shards that were sent rows back to their old lengths
        (best effort: a dead shard cannot be reached)."""
        refs = [self._actors[s].truncate.remote(old_local[s]) for s in sorted(set(shards))]
        ray.wait(refs, num_returns=len(refs), timeout=self._timeout)

    def _check_rows(self, x, name, dim):
        a = np.asarray(x)
        if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            raise TypeError(
                f"{name} must be floating point (float16, bfloat16, float32 or float64; it is "
                f"stored as {self._dtype.name}); got {a.dtype}")
        want = (self._batch, self._hkv, dim)
        if a.ndim != 4 or (a.shape[0], a.shape[1], a.shape[3]) != want:
            raise ValueError(
                f"{name} must have shape (batch={want[0]}, num_kv_heads={want[1]}, n, {dim}) "
                f"to fit this cache; got {tuple(a.shape)}")
        return a

    def attend(self, q, *, causal=True, window=None, sinks=None, q_start=None, return_lse=False,
               timeout=None, **kwargs):
        """Attention of ``q`` over every shard's filled keys, merged exactly.

        Parameters
        ----------
        q : array_like, (batch, Hq, L, E)
            Queries (float16, bfloat16, float32; float64 for a float64
            cache), Hq a multiple of Hkv; the output has their dtype.
        causal : {True, False, "bottom_right", "top_left"}
            As for :meth:`fastattn.KVCache.attend` (default True): with
            bottom-right alignment query row i sits at global position
            ``lengths[b] - L + i``, with top-left at ``i``.
        window : (int, int), optional
            ``(left, right)`` around each row's position, as in
            :func:`fastattn.attention`.
        sinks : array_like, (Hq,), optional
            A sink logit per query head, applied once, at the merge.
        q_start : int or array_like of int, optional
            Global position of query row 0 per batch entry, instead of the
            alignment rule.
        return_lse : bool
            Also return the merged log-sum-exp (sink included), (batch, Hq, L).
        timeout : float, optional
            Overrides the cache's timeout for this call.
        **kwargs
            ``scale``, ``softcap``, ``alibi_slopes``, ``num_threads``: passed
            to every shard's :func:`fastattn.attention`.

        Only shards holding a key that some query row may see are asked
        (causal and window bound the positions); the others' parts would be
        empty, and an empty part changes no bit of the merge.

        Raises
        ------
        ShardError
            If a shard's actor died, timed out or failed: nothing is merged.
        TypeError, ValueError
            For bad arguments (from the driver's checks or a shard's).
        """
        for name in kwargs:
            if name not in _PASSED:
                why = _REFUSED.get(name, "it is not an argument of attention()")
                raise TypeError(f"ShardedKVCache.attend() takes no {name}=: {why}")
        timeout = self._timeout if timeout is None else _check_timeout(timeout)
        q = self._check_query(q)
        B, Hq, L, _ = q.shape
        try:
            known = isinstance(causal, (bool, np.bool_, str)) and causal in _CAUSAL
        except TypeError:
            known = False
        if not known:
            raise ValueError(f"causal must be False, True, 'bottom_right' or 'top_left'; got {causal!r}")
        if q_start is None:
            # d(i) of KVCache.attend: bottom-right puts the L queries on the
            # last L filled positions; top-left on positions 0..L-1.
            q_start = np.zeros(B, np.int64) if causal == "top_left" else self._lengths - L
        else:
            q_start = _starts(q_start, B)
        needed = self._visible_shards(q_start, L, bool(causal), _check_window(window))
        # 16-bit queries widen exactly; the shards return float32 parts.
        wide = q if q.dtype.itemsize >= 4 else q.astype(np.float32)
        args = dict(kwargs, causal=causal, window=window)
        parts = self._graph_attend((wide, q_start, args, needed), timeout) if needed else None
        if parts is None:  # plain calls: no graph, or its call failed (then they say why)
            refs = [self._actors[s].attend.remote(wide, q_start, args) for s in needed]
            parts = self._gather(refs, needed, "attend", timeout)
        if not parts:  # no shard holds a visible key: the result of an empty part
            empty = np.zeros((B, Hq, L, self._ev), wide.dtype)
            parts = [(empty, np.full((B, Hq, L), -np.inf, wide.dtype))]
        out, lse = merge_attention([p[0] for p in parts], [p[1] for p in parts], sinks=sinks)
        out = out.astype(q.dtype, copy=False)  # 16-bit: the one rounding of the output
        return (out, lse) if return_lse else out

    def _graph_attend(self, request, timeout):
        """The partial results of the asked shards through the compiled graph,
        or None when there is none or its call failed (then it is torn down)."""
        if self._graph is None:
            try:
                from ray.dag import InputNode, MultiOutputNode
                with InputNode() as request_node:
                    dag = MultiOutputNode([a.graph_attend.bind(request_node) for a in self._actors])
                try:
                    self._graph = dag.experimental_compile(**_GRAPH_COMPILE)
                except TypeError:  # a Ray without these options
                    self._graph = dag.experimental_compile()
                self._graph_steps, self._graph_warm = [], False
            except Exception:  # an older Ray, a dead shard: plain calls from now on
                self._graph = False
        if self._graph is False:
            return None
        try:
            start = time.perf_counter()
            ref = self._graph.execute(request)
            # ray.get on a compiled graph's result spins on a core until it
            # comes (Ray 2.60): on a machine whose cores also run the shards,
            # that core is taken from their kernels. So sleep through most of
            # the time the fastest recent call took, then wait.
            # The nap and the wait share the call's one deadline: a slow first
            # call (CI saw one over 3 s) must not make a later nap outlast the
            # timeout and so take in an answer that came too late.
            nap = _GRAPH_SLEEP * min(self._graph_steps) if self._graph_steps else 0.0
            if timeout is not None:
                nap = min(nap, _GRAPH_SLEEP * timeout)
            napped = nap >= _GRAPH_SLEEP_MIN
            if napped:
                time.sleep(nap)
            woke = time.perf_counter()
            # -1: wait for ever (None would mean the graph's own 10 s default)
            left = -1 if timeout is None else max(timeout - (woke - start), 1e-3)
            results = ray.get(ref, timeout=left)
            end = time.perf_counter()
            step = _graph_step(nap if napped else 0.0, end - woke, end - start)
            if self._graph_warm:
                self._graph_steps = self._graph_steps[-(_GRAPH_HISTORY - 1):] + [step]
            self._graph_warm = True
        except Exception:
            self._drop_graph()
            return None
        return [results[s] for s in request[3]]

    def _drop_graph(self):
        graph, self._graph = self._graph, None
        if graph is not None and graph is not False:
            try:
                graph.teardown()
            except Exception:  # a dead shard's channel: nothing more to release
                pass

    def _check_query(self, q):
        a = np.asarray(q)
        if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            raise TypeError(f"q must be float16, bfloat16, float32 or float64; got {a.dtype}")
        if (a.dtype == np.float64) != (self._dtype == np.float64):
            raise TypeError(
                "float64 queries need a float64 cache and a float64 cache float64 queries; got q "
                f"{a.dtype} for a {self._dtype.name} cache")
        if a.ndim != 4 or a.shape[0] != self._batch or a.shape[3] != self._e or a.shape[1] % self._hkv:
            raise ValueError(
                f"q must have shape (batch={self._batch}, Hq, L, {self._e}) with Hq a multiple of "
                f"num_kv_heads={self._hkv}; got {tuple(a.shape)}")
        return a

    def _visible_shards(self, q_start, L, causal, window):
        """The shards holding a key some query row may see, in shard order.

        Entry b's row i sits at position p_i = q_start[b] + i, i < L. A key at
        position j is visible to some row iff j < lengths[b] and
        p_0 - left <= j (window left), j <= p_{L-1} (causal), and
        j <= p_{L-1} + right (window right); -1 means unbounded.
        """
        if L == 0:
            return []
        left, right = window
        last = q_start + (L - 1)
        lo = np.full(self._batch, -math.inf) if left < 0 else (q_start - left).astype(np.float64)
        hi = (self._lengths - 1).astype(np.float64)  # floats: ±inf bounds, positions < 2**53
        if causal:
            hi = np.minimum(hi, last)
        if right >= 0:
            hi = np.minimum(hi, last + right)
        needed = []
        for s in range(self._num_shards):
            a, b = s * self._cap, (s + 1) * self._cap - 1
            if (np.maximum(lo, a) <= np.minimum(hi, b)).any():
                needed.append(s)
        return needed

    def truncate(self, lengths):
        """Keep the first ``lengths[b]`` keys of each entry (a rollback), on every shard.

        Raises ValueError (nothing changed) for a length that is negative or
        longer than what the entry holds. If a shard fails, ShardError names
        it; the driver then takes the new lengths anyway, since every live
        shard has truncated or will (a shard runs its calls in order).
        """
        new = _counts(lengths, None, self._batch, "truncate lengths")
        bad = np.flatnonzero(new > self._lengths)
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"truncate: batch entry {b} holds {int(self._lengths[b])} keys; cannot keep "
                f"{int(new[b])} (between 0 and what the entry holds); nothing changed")
        self._set_lengths(new, "truncate")

    def reset(self):
        """Empty every batch entry on every shard (buffers kept); int8 key
        channel factors taken from a prompt go with it, as in KVCache.reset."""
        refs = [a.reset.remote() for a in self._actors]
        self._lengths = np.zeros(self._batch, np.int64)
        self._channels_fixed[:] = False
        self._gather(refs, range(self._num_shards), "reset")

    def _set_lengths(self, new, what):
        old_local, new_local = self._local(self._lengths), self._local(new)
        shards = [int(s) for s in np.flatnonzero((new_local != old_local).any(axis=1))]
        refs = [self._actors[s].truncate.remote(new_local[s]) for s in shards]
        self._lengths = new
        self._gather(refs, shards, what)

    def close(self):
        """Stop the actors (their caches are gone); the object is unusable after."""
        self._drop_graph()
        for a in self._actors:
            ray.kill(a)
        self._actors = []

    def _gather(self, refs, shards, what, timeout=None):
        """ray.get of one call per shard, or the first failing shard's error.

        The fast path is one ray.get; only when it raises are the calls looked
        at one by one, in shard order, to name the first shard that failed.
        """
        timeout = self._timeout if timeout is None else timeout
        shards = list(shards)
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            pass
        except ray.exceptions.RayError:
            # One failed first; let the others finish, so that the error names
            # the first failing shard in shard order, whatever the timing.
            ray.wait(refs, num_returns=len(refs), timeout=timeout)
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
        pending = set(pending)
        for s, ref in zip(shards, refs):
            if ref in pending:
                raise ShardError(s, self._num_shards, f"{what} did not answer within {timeout} s") from None
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as e:
                raise ShardError(s, self._num_shards, f"{what} failed: its actor is dead or unreachable "
                                 f"({type(e).__name__})") from None
            except ray.exceptions.RayTaskError as e:
                cause = e.cause
                if isinstance(cause, (TypeError, ValueError)):
                    raise type(cause)(f"shard {s} of {self._num_shards} refused {what}: {cause}") from None
                raise ShardError(s, self._num_shards, f"{what} raised {type(cause).__name__}: {cause}") from e
            except ray.exceptions.RayError as e:
                raise ShardError(s, self._num_shards, f"{what} failed: {type(e).__name__}: {e}") from None
        raise RuntimeError(f"{what}: ray.get failed but no shard reports an error")  # pragma: no cover

    def __repr__(self):
        return (f"ShardedKVCache(num_shards={self._num_shards}, batch={self._batch}, "
                f"num_kv_heads={self._hkv}, capacity_per_shard={self._cap}, head_dim={self._e}, "
                f"head_dim_v={self._ev}, dtype={self._dtype.name}, lengths={self._lengths.tolist()})")


def _rows_for(x, first, take):
    """Rows [first, first + take) of every entry as one slice, or None when
    the entries differ (then each entry's rows are gathered)."""
    if (first == first[0]).all() and (take == take[0]).all():
        a = int(first[0])
        return x if a == 0 and take[0] == x.shape[2] else x[:, :, a:a + int(take[0])]
    return None


def _gathered(x, first, take):
    """Entry b's rows [first[b], first[b] + take[b]) moved to the front of a
    zero-padded (batch, H, max(take), D) array; the shard keeps take[b] of them."""
    out = np.zeros(x.shape[:2] + (int(take.max()), x.shape[3]), x.dtype)
    for b, (a, c) in enumerate(zip(first.tolist(), take.tolist())):
        out[b, :, :c] = x[b, :, a:a + c]
    return out


def _counts(lengths, n, batch, name="lengths"):
    """Per-entry counts, int64 (batch,): ``n`` for each when None, else in [0, n]."""
    if lengths is None:
        return np.full(batch, n, np.int64)
    c = np.asarray(lengths)
    if c.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers; got dtype {c.dtype}")
    try:
        c = np.broadcast_to(c, (batch,)).astype(np.int64)
    except ValueError:
        raise ValueError(f"{name} of shape {c.shape} does not broadcast to the batch ({batch},)") from None
    if c.size and (c.min() < 0 or (n is not None and c.max() > n)):
        raise ValueError(f"{name} must lie in [0, {'n=' + str(n) if n is not None else 'inf'}]; "
                         f"got values from {c.min()} to {c.max()}")
    return c


def _starts(q_start, batch):
    a = np.asarray(q_start)
    if a.dtype.kind not in "iu":
        raise TypeError(f"q_start must be an int or integers (one per batch entry); got dtype {a.dtype}")
    try:
        return np.broadcast_to(a, (batch,)).astype(np.int64)
    except ValueError:
        raise ValueError(f"q_start of shape {a.shape} does not broadcast to the batch ({batch},)") from None


def _check_timeout(timeout):
    if timeout is None:
        return None
    if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool):
        raise TypeError(f"timeout must be None or a number of seconds; got {timeout!r}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a finite number of seconds > 0 (None: wait for ever); got {timeout}")
    return float(timeout)


def _actor_options(actor_options, num_shards):
    if actor_options is None:
        return [{}] * num_shards
    if isinstance(actor_options, dict):
        options = [actor_options] * num_shards
    else:
        options = list(actor_options)
        if len(options) != num_shards or not all(isinstance(o, dict) for o in options):
            raise ValueError(
                f"actor_options must be a dict or one dict per shard ({num_shards}); got {actor_options!r}")
    for o in options:
        if "max_concurrency" in o:
            raise ValueError("actor_options may not set max_concurrency: a shard runs one call at a time, "
                             "in order (see ShardedKVCache)")
    return options
