"""fastattn.distributed.ShardedKVCache on a local Ray cluster (2 CPUs, a small
object store, one module-scoped session; every test but the first is skipped
where Ray is not installed).

The oracles: a local mirror (one KVCache per shard, the same appends routed by
a plain per-entry loop, partials merged with merge_attention) must equal the
sharded result BITWISE; one KVCache over the whole cache and the float64
reference of what the shards hold must agree within the suite's tolerance.
Faults: killed and busy actors, refused and over-capacity appends.
"""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import fastattn
from fastattn import reference
from _helpers import bf16, randn, tolerance

STORAGE = ["float32", "float64", "float16", "bfloat16", "int8"]


def test_import_fastattn_does_not_import_ray(tmp_path):
    code = "import sys, fastattn; assert 'ray' not in sys.modules, 'import fastattn loaded ray'"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def fd(tmp_path_factory):
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        # Ray's workers put the driver's working directory on sys.path: from
        # the checkout they would import the un-built fastattn/ source folder.
        here = os.getcwd()
        os.chdir(tmp_path_factory.mktemp("ray"))
        try:
            ray.init(num_cpus=2, object_store_memory=2 * 10**8, include_dashboard=False, log_to_driver=False)
        finally:
            os.chdir(here)
    import fastattn.distributed
    yield fastattn.distributed
    if started:
        ray.shutdown()


def _bits(x):
    x = np.ascontiguousarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(_bits(a), _bits(b))


def _storage(name):
    return "bfloat16" if name == "bfloat16" else np.dtype(name)


def _query_dtype(name):
    """float64 for a float64 cache; the 16-bit dtype itself for 16-bit caches
    (so the widening and the output's rounding are exercised); else float32."""
    return {"float64": np.float64, "float16": np.float16, "bfloat16": bf16() if name == "bfloat16" else None
            }.get(name) or np.float32


class Mirror:
    """The sharded cache done locally and plainly: shard s is a KVCache of the
    positions [s·C, (s+1)·C); every row goes, entry by entry, to the shard
    owning its position; the partials are merged with merge_attention."""

    def __init__(self, num_shards, batch, hkv, cap, e, dtype, key_channels="prompt"):
        self.cap = cap
        self.shards = [fastattn.KVCache(batch, hkv, cap, e, dtype=dtype, key_channels=key_channels)
                       for _ in range(num_shards)]
        self.whole = fastattn.KVCache(batch, hkv, num_shards * cap, e, dtype=dtype, key_channels=key_channels)
        self.lengths = np.zeros(batch, np.int64)

    def append(self, k, v, lengths=None):
        B, n = k.shape[0], k.shape[2]
        counts = np.full(B, n) if lengths is None else np.broadcast_to(lengths, (B,))
        self.whole.append(k, v, lengths=counts)
        if self.whole.quantized and self.whole.key_channels is not None:
            # int8 factors from the prompt: each entry's first rows set them on every shard
            first = (self.lengths == 0) & (counts > 0)
            channels = np.ones((B,) + self.whole.key_channels.shape[1:], np.float32)
            for b in np.flatnonzero(first):
                channels[b] = fastattn.cache.key_channel_scales(k[b, :, :counts[b]])
            for shard in self.shards:
                try:
                    shard.fix_key_channels(channels, first)
                except ValueError:  # given factors: nothing to fix
                    break
        for s, shard in enumerate(self.shards):
            lo, hi = s * self.cap, (s + 1) * self.cap
            rows = [[t for t in range(int(counts[b])) if lo <= self.lengths[b] + t < hi] for b in range(B)]
            take = np.array([len(r) for r in rows])
            if not take.any():
                continue
            ks = np.zeros(k.shape[:2] + (take.max(), k.shape[3]), k.dtype)
            vs = np.zeros(v.shape[:2] + (take.max(), v.shape[3]), v.dtype)
            for b, r in enumerate(rows):
                ks[b, :, :len(r)], vs[b, :, :len(r)] = k[b][:, r], v[b][:, r]
            shard.append(ks, vs, lengths=take)
        self.lengths = self.lengths + counts

    def truncate(self, lengths):
        self.whole.truncate(lengths)
        for s, shard in enumerate(self.shards):
            shard.truncate(np.clip(np.asarray(lengths) - s * self.cap, 0, self.cap))
        self.lengths = np.broadcast_to(lengths, self.lengths.shape).astype(np.int64)

    def q_start(self, L, causal="bottom_right", q_start=None):
        if q_start is not None:
            return q_start
        return 0 if causal == "top_left" else self.lengths - L

    def part(self, s, q, q_start, **kw):
        wide = q.astype(np.float32) if q.dtype.itemsize == 2 else q
        return self.shards[s].attend(wide, q_start=q_start, k_start=s * self.cap, return_lse=True, **kw)

    def attend(self, q, causal=True, sinks=None, q_start=None, **kw):
        qs = self.q_start(q.shape[2], causal, q_start)
        parts = [self.part(s, q, qs, causal=causal, **kw) for s in range(len(self.shards))]
        out, lse = fastattn.merge_attention(*zip(*parts), sinks=sinks)
        return out.astype(q.dtype), lse

    def held(self):
        """What the shards stand for, (B, Hkv, max length, E) keys and values
        in float64 (int8 dequantised), each shard's rows at its positions."""
        B, H = self.lengths.shape[0], self.shards[0].num_kv_heads
        S, E = int(self.lengths.max()), self.shards[0].head_dim
        k, v = np.zeros((B, H, S, E)), np.zeros((B, H, S, E))
        for s, shard in enumerate(self.shards):
            sk, sv = shard.keys.astype(np.float64), shard.values.astype(np.float64)
            for b, n in enumerate(shard.lengths):
                k[b, :, s * self.cap:s * self.cap + n] = sk[b, :, :n]
                v[b, :, s * self.cap:s * self.cap + n] = sv[b, :, :n]
        return k, v


def _fill(rng, caches, steps, batch, hkv, e, dtype):
    """Ragged appends (entry 1 keeps fewer rows) into every cache given."""
    kd = np.float64 if dtype == "float64" else np.float32
    for n in steps:
        k, v = randn(rng, (batch, hkv, n, e), kd), randn(rng, (batch, hkv, n, e), kd)
        lengths = [n, max(n - 2, 0)] if batch == 2 else None
        for c in caches:
            c.append(k, v, lengths=lengths)


# Every option of attend: alignment, windows, sinks (one head without),
# softcap with ALiBi, explicit query positions, decode (L = 1) and L = 3.
OPTIONS = [
    dict(L=1),
    dict(L=3),
    dict(L=1, sinks=[0.5, -np.inf, 2.0, -1.0]),
    dict(L=3, causal=False, sinks=[1.0, 0.0, -np.inf, 3.0]),
    dict(L=2, causal="top_left"),
    dict(L=1, window=(17, 0)),
    dict(L=3, causal=False, window=(30, 4)),
    dict(L=2, softcap=5.0, alibi_slopes=[0.5, 0.25, 0.125, 0.0625], sinks=[0.0] * 4),
    dict(L=2, q_start=[40, 7], window=(25, -1)),
]


# float32 on 1-4 shards, every other storage dtype on 2 (each dtype on 1
# shard: test_one_shard_is_the_local_call_bitwise): the merge of the parts
# does not depend on the storage. A cache costs a Ray worker process per
# shard, about a second of CPU each on 2 cores.
LAYOUTS = [("float32", n) for n in (1, 2, 3, 4)] + [(d, 2) for d in STORAGE[1:]]


@pytest.mark.parametrize("dtype, num_shards", LAYOUTS)
def test_sharded_equals_local_shards_bitwise_and_one_call_within_tolerance(fd, dtype, num_shards):
    rng = np.random.default_rng(10 * num_shards + STORAGE.index(dtype))
    B, Hkv, Hq, C, E = 2, 2, 4, 23, 16   # GQA: 2 query heads per K/V head
    cache = fd.ShardedKVCache(num_shards=num_shards, batch=B, num_kv_heads=Hkv, capacity_per_shard=C,
                              head_dim=E, dtype=_storage(dtype))
    mirror = Mirror(num_shards, B, Hkv, C, E, _storage(dtype))
    # entries end in the last shard (23·n - 8 and 23·n - 15 keys); 1 shard: 16 and 13
    steps = [9, 1, 5, 1] if num_shards == 1 else [19, 1, 23 * num_shards - 30, 1]
    _fill(rng, [cache, mirror], steps, B, Hkv, E, dtype)
    np.testing.assert_array_equal(cache.lengths, mirror.lengths)
    np.testing.assert_array_equal(cache.shard_lengths(), [s.lengths for s in mirror.shards])
    k_held, v_held = mirror.held()
    for opts in OPTIONS:
        kw = dict(opts)
        L = kw.pop("L")
        q = randn(rng, (B, Hq, L, E), _query_dtype(dtype))
        out, lse = cache.attend(q, return_lse=True, **kw)
        want, want_lse = mirror.attend(q, **kw)
        _same_bits(out, want)
        _same_bits(lse, want_lse)
        # the float64 reference of what the shards hold, aligned by its own rule
        ref_kw = dict(kw, causal=kw.get("causal", True), kv_lengths=mirror.lengths)
        ref = reference.attention(q, k_held, v_held, **ref_kw)
        tol = 2 * tolerance(q, k_held, v_held, **ref_kw)  # the merge rounds once more
        assert float(np.max(np.abs(out.astype(np.float64) - ref))) <= tol, (opts, tol)
        if dtype != "int8":  # an int8 shard's quantisation statistics need not match one cache's
            one = mirror.whole.attend(q, **kw)
            assert float(np.max(np.abs(out.astype(np.float64) - one.astype(np.float64)))) <= tol, opts
    cache.close()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int8"])
def test_one_shard_is_the_local_call_bitwise(fd, dtype):
    """With one shard and no sink the merge of one part is the part itself:
    the result is the local KVCache.attend's, bit for bit."""
    rng = np.random.default_rng(5)
    cache = fd.ShardedKVCache(num_shards=1, batch=2, num_kv_heads=2, capacity_per_shard=50, head_dim=8,
                              dtype=_storage(dtype))
    local = fastattn.KVCache(2, 2, 50, 8, dtype=_storage(dtype))
    _fill(rng, [cache, local], [30, 1], 2, 2, 8, dtype)
    q = randn(rng, (2, 4, 1, 8), _query_dtype(dtype))
    for kw in ({}, {"window": (7, 0)}, {"causal": False}):
        out, lse = cache.attend(q, return_lse=True, **kw)
        want, want_lse = local.attend(q, return_lse=True, **kw)
        _same_bits(out, want)
        _same_bits(lse, want_lse)
    cache.close()


def _slow_down(actor, seconds):
    """Make the shard's KVCache.attend sleep first (whichever thread runs it:
    the compiled graph's or the actor's own), until _restore."""
    def patch(shard):
        cache = shard._cache
        def attend(*args, **kwargs):
            time.sleep(seconds)
            return type(cache).attend(cache, *args, **kwargs)
        cache.attend = attend
    import ray
    ray.get(actor.__ray_call__.remote(patch))


def _kill(actor):
    """ray.kill, then wait until the actor answers no more: the kill is
    asynchronous, and a call sent right after it may still run (CI saw an
    append pass on a shard killed the line before)."""
    import ray
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.05)
    raise AssertionError("the actor still answers 30 s after ray.kill")


def _restore(actor):
    import ray
    ray.get(actor.__ray_call__.remote(lambda shard: shard._cache.__dict__.pop("attend", None)))


def test_int8_shards_share_fixed_key_channel_factors(fd):
    """key_channels given (as from a prompt's key_channel_scales): every shard
    uses them, and the result is the local shards' merge, bit for bit, and
    within tolerance of the reference of what the shards hold."""
    rng = np.random.default_rng(6)
    B, Hkv, C, E = 2, 2, 12, 16
    prompt = randn(rng, (B, Hkv, 30, E))
    prompt[..., 3] *= 20   # an outlier channel
    factors = fastattn.cache.key_channel_scales(prompt)
    cache = fd.ShardedKVCache(3, B, Hkv, C, E, dtype="int8", key_channels=factors)
    mirror = Mirror(3, B, Hkv, C, E, "int8", key_channels=factors)
    for c in (cache, mirror):
        c.append(prompt, prompt, lengths=[30, 25])
    _fill(rng, [cache, mirror], [1, 1, 2], B, Hkv, E, "int8")
    q = randn(rng, (B, 4, 1, E))
    out = cache.attend(q, sinks=[0.0, 1.0, -np.inf, 2.0])
    _same_bits(out, mirror.attend(q, sinks=[0.0, 1.0, -np.inf, 2.0])[0])
    k_held, v_held = mirror.held()
    kw = dict(causal=True, kv_lengths=mirror.lengths, sinks=[0.0, 1.0, -np.inf, 2.0])
    ref = reference.attention(q, k_held, v_held, **kw)
    assert float(np.max(np.abs(out - ref))) <= 2 * tolerance(q, k_held, v_held, **kw)
    cache.close()


def test_int8_shards_take_the_prompt_s_key_channel_factors(fd):
    """key_channels="prompt": every shard quantises with the factors of each
    entry's first append, also shards whose first rows are decode tokens, so
    the shards hold exactly what one int8 cache holds; reset drops them."""
    rng = np.random.default_rng(16)
    B, Hkv, C, E = 2, 2, 10, 16
    prompt = randn(rng, (B, Hkv, 8, E))
    prompt[..., 5] *= 20
    cache = fd.ShardedKVCache(3, B, Hkv, C, E, dtype="int8")
    mirror = Mirror(3, B, Hkv, C, E, "int8")
    for c in (cache, mirror):
        c.append(prompt, prompt, lengths=[8, 6])
    _fill(rng, [cache, mirror], [3, 4, 1], B, Hkv, E, "int8")  # reaches shards 1 and 2 as decode rows
    whole = mirror.whole.key_channels
    for shard in mirror.shards:
        np.testing.assert_array_equal(shard.key_channels, whole)
    import ray
    for actor in cache.actors:
        got = ray.get(actor.__ray_call__.remote(lambda shard: shard._cache.key_channels))
        np.testing.assert_array_equal(got, whole)
    q = randn(rng, (B, 4, 1, E))
    _same_bits(cache.attend(q), mirror.attend(q)[0])
    cache.reset()
    later = randn(rng, (B, Hkv, 3, E)) * 7
    cache.append(later, later)
    want = fastattn.cache.key_channel_scales(later)
    for actor in cache.actors:
        got = ray.get(actor.__ray_call__.remote(lambda shard: shard._cache.key_channels))
        np.testing.assert_array_equal(got, want)
    cache.close()


@pytest.mark.parametrize("compiled", [True, False])
def test_same_bits_whatever_the_timing(fd, compiled):
    """Shard 0 made slow (0.3 s), then shard 2: the merge runs in shard
    order, so the result does not change."""
    rng = np.random.default_rng(7)
    cache = fd.ShardedKVCache(num_shards=3, batch=1, num_kv_heads=1, capacity_per_shard=40, head_dim=8,
                              compiled=compiled)
    _fill(rng, [cache], [100], 1, 1, 8, "float32")
    q = randn(rng, (1, 2, 1, 8))
    first = cache.attend(q)
    for s in (0, 2):
        _slow_down(cache.actors[s], 0.3)
        _same_bits(cache.attend(q), first)
        _restore(cache.actors[s])
    cache.close()


def test_only_shards_with_visible_keys_are_asked(fd):
    """A dead shard whose keys no row can see (empty, or outside the window)
    is not asked; one holding visible keys fails the call, named."""
    rng = np.random.default_rng(8)
    cache = fd.ShardedKVCache(num_shards=4, batch=2, num_kv_heads=1, capacity_per_shard=20, head_dim=8)
    mirror = Mirror(4, 2, 1, 20, 8, np.float32)
    _fill(rng, [cache, mirror], [50], 2, 1, 8, "float32")   # lengths 50 and 48: shards 0-2 filled
    import ray
    _kill(cache.actors[3])   # empty
    _kill(cache.actors[0])   # positions 0-19
    q = randn(rng, (2, 2, 1, 8))
    kw = dict(window=(20, 0), sinks=[0.5, -1.0])   # rows at 49 and 47 see from 29 and 27 on
    _same_bits(cache.attend(q, **kw), mirror.attend(q, **kw)[0])
    with pytest.raises(fd.ShardError, match="shard 0 of 4") as info:
        cache.attend(q, window=(30, 0))   # 47 - 30 = 17: reaches shard 0
    assert info.value.shard == 0


def test_killed_actor_raises_naming_the_shard_and_the_others_stay_intact(fd):
    import ray
    rng = np.random.default_rng(9)
    cache = fd.ShardedKVCache(num_shards=3, batch=2, num_kv_heads=1, capacity_per_shard=20, head_dim=8,
                              dtype=np.float16)
    mirror = Mirror(3, 2, 1, 20, 8, np.float16)
    _fill(rng, [cache, mirror], [30], 2, 1, 8, "float16")   # lengths 30, 28: shards 0 and 1
    _kill(cache.actors[2])
    # rows 30.. land on shard 1 (up to 39) and the dead shard 2: refused,
    # and shard 1 is truncated back
    k = randn(rng, (2, 1, 25, 8))
    with pytest.raises(fd.ShardError, match="shard 2 of 3.*append.*dead"):
        cache.append(k, k)
    np.testing.assert_array_equal(cache.lengths, [30, 28])
    assert ray.get(cache.actors[1].lengths.remote()).tolist() == [10, 8]
    q = randn(rng, (2, 2, 1, 8), np.float16)
    _same_bits(cache.attend(q), mirror.attend(q)[0])   # shard 2 holds nothing: not asked
    _kill(cache.actors[1])
    with pytest.raises(fd.ShardError, match="shard 1 of 3: attend failed: its actor is dead") as info:
        cache.attend(q)
    assert info.value.shard == 1
    # shard 0 kept its keys and computes the same part as the mirror's
    assert ray.get(cache.actors[0].lengths.remote()).tolist() == [20, 20]
    qs = mirror.q_start(1)
    got = ray.get(cache.actors[0].attend.remote(q.astype(np.float32), qs, dict(causal=True)))
    for a, b in zip(got, mirror.part(0, q, qs, causal=True)):
        _same_bits(a, b)


@pytest.mark.parametrize("compiled", [True, False])
def test_slow_shard_times_out_naming_it_then_answers(fd, compiled):
    rng = np.random.default_rng(11)
    cache = fd.ShardedKVCache(num_shards=2, batch=1, num_kv_heads=1, capacity_per_shard=10, head_dim=8,
                              compiled=compiled)
    _fill(rng, [cache], [15], 1, 1, 8, "float32")
    q = randn(rng, (1, 1, 1, 8))
    before = cache.attend(q)
    # As if the graph's recent calls had taken 10 s (CI saw a first one over
    # 3 s): the driver's nap before it waits must still end within the timeout.
    cache._graph_steps = [10.0]
    _slow_down(cache.actors[1], 2)
    with pytest.raises(fd.ShardError, match="shard 1 of 2: attend did not answer within 0.5 s"):
        cache.attend(q, timeout=0.5)
    _restore(cache.actors[1])   # once the late calls are done
    _same_bits(cache.attend(q), before)
    np.testing.assert_array_equal(cache.shard_lengths(), [[10], [5]])
    cache.close()


class _Clock:
    """Stands in for the time module inside fastattn.distributed: only sleep
    moves it on, by exactly what was asked. So every graph result is already
    there when the driver wakes, however loaded the machine is (CI once saw
    ray.get take 50-120 ms for a result that was ready, and a test on the real
    clock failed)."""

    def __init__(self):
        self.now, self.naps = 0.0, []

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.naps.append(seconds)
        self.now += seconds


def test_graph_step_is_half_the_sleep_only_when_the_result_was_waiting(fd):
    assert fd._graph_step(0.6, 0.001, 0.601) == 0.3
    assert fd._graph_step(0.6, 0.06, 0.66) == 0.3        # a tenth of the sleep: still waiting
    assert fd._graph_step(0.6, 0.0601, 0.6601) == 0.6601  # more: the call took all of it
    assert fd._graph_step(0.0, 0.0, 0.002) == 0.002      # no sleep: what the call took


def test_graph_sleep_follows_the_calls_not_the_warm_up(fd, monkeypatch):
    """Before it waits (spinning) for the compiled graph, the driver sleeps
    0.6 of the fastest recent call. The first call after compiling is Ray's
    warm-up (seconds) and is not recorded; a call whose result was already
    there after the sleep is recorded as half the sleep, so a sleep grown too
    long shrinks within a few calls (recording the whole sleep shrank it by
    only 0.6 a call: twelve calls and 9 s after one slow call)."""
    clock = _Clock()
    monkeypatch.setattr(fd, "time", clock)
    rng = np.random.default_rng(13)
    cache = fd.ShardedKVCache(num_shards=2, batch=1, num_kv_heads=1, capacity_per_shard=10, head_dim=8)
    _fill(rng, [cache], [15], 1, 1, 8, "float32")
    q = randn(rng, (1, 1, 1, 8))
    first = cache.attend(q)
    if cache._graph is False:
        pytest.skip("this Ray compiles no graph: plain calls only")
    assert cache._graph_steps == [] and clock.naps == []
    cache._graph_steps = [1.0]   # as if the recent calls had taken a second
    for _ in range(4):
        _same_bits(cache.attend(q), first)
    assert clock.naps == pytest.approx([0.6, 0.18, 0.054, 0.0162])
    assert cache._graph_steps == pytest.approx([1.0, 0.3, 0.09, 0.027, 0.0081])
    cache.close()


def test_graph_keeps_one_execution_in_flight(fd):
    """The driver waits for each graph call before the next, so the graph is
    compiled for one execution in flight: Ray keeps buffers for as many as it
    allows and frees none at teardown (29 MB a closed 2-shard cache with its
    default of 10, 6 MB with 1)."""
    rng = np.random.default_rng(14)
    cache = fd.ShardedKVCache(num_shards=2, batch=1, num_kv_heads=1, capacity_per_shard=10, head_dim=8)
    _fill(rng, [cache], [15], 1, 1, 8, "float32")
    q = randn(rng, (1, 1, 1, 8))
    first = cache.attend(q)
    if cache._graph is False or not hasattr(cache._graph, "_max_inflight_executions"):
        pytest.skip("this Ray compiles no graph, or does not say its executions in flight")
    assert cache._graph._max_inflight_executions == 1
    for _ in range(3):
        _same_bits(cache.attend(q), first)
    cache.close()


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_refused_appends_change_nothing(fd, dtype):
    """Over capacity: refused by the driver before anything is sent. NaN into
    an int8 cache: refused by the shard that gets it (shard 1, named), and
    shard 0, which took its rows, is truncated back."""
    rng = np.random.default_rng(12)
    cache = fd.ShardedKVCache(num_shards=2, batch=2, num_kv_heads=1, capacity_per_shard=10, head_dim=8,
                              dtype=_storage(dtype))
    _fill(rng, [cache], [6], 2, 1, 8, dtype)   # lengths 6, 4
    q = randn(rng, (2, 2, 1, 8))
    before, held = cache.attend(q), cache.shard_lengths()
    k = randn(rng, (2, 1, 15, 8))
    with pytest.raises(ValueError, match="capacity 20 .*batch entry 0 holds 6 keys and appending 15 "
                                         "needs length 21; nothing was written"):
        cache.append(k, k)
    if dtype == "int8":
        k = k[:, :, :8].copy()
        k[1, 0, 7] = np.nan   # entry 1's row 7 sits at position 11: shard 1
        with pytest.raises(ValueError, match="shard 1 of 2 refused append: .*NaN"):
            cache.append(k, k)
    np.testing.assert_array_equal(cache.lengths, [6, 4])
    np.testing.assert_array_equal(cache.shard_lengths(), held)
    _same_bits(cache.attend(q), before)
    cache.close()


def test_truncate_and_reset_across_shards(fd):
    rng = np.random.default_rng(13)
    cache = fd.ShardedKVCache(num_shards=3, batch=2, num_kv_heads=1, capacity_per_shard=10, head_dim=8)
    mirror = Mirror(3, 2, 1, 10, 8, np.float32)
    _fill(rng, [cache, mirror], [25], 2, 1, 8, "float32")
    for c in (cache, mirror):
        c.truncate([8, 17])   # entry 0 back into shard 0, entry 1 into shard 1
    np.testing.assert_array_equal(cache.shard_lengths(), [[8, 10], [0, 7], [0, 0]])
    _fill(rng, [cache, mirror], [6, 1], 2, 1, 8, "float32")   # rewrites the dropped positions
    q = randn(rng, (2, 2, 2, 8))
    _same_bits(cache.attend(q, window=(9, 0)), mirror.attend(q, window=(9, 0))[0])
    with pytest.raises(ValueError, match="entry 0 holds 15 keys; cannot keep 16"):
        cache.truncate([16, 0])
    cache.reset()
    np.testing.assert_array_equal(cache.lengths, [0, 0])
    assert not cache.shard_lengths().any()
    out, lse = cache.attend(q, return_lse=True, sinks=[1.0, -np.inf])   # nothing to see: the sink's
    assert not out.any() and (lse[:, 0] == 1.0).all() and np.isneginf(lse[:, 1]).all()
    cache.close()


def test_bad_arguments_name_what_they_got(fd):
    with pytest.raises(ValueError, match="num_shards must be >= 1; got 0"):
        fd.ShardedKVCache(num_shards=0, batch=1, num_kv_heads=1, capacity_per_shard=4, head_dim=8)
    with pytest.raises(TypeError, match="dtype must be .*; got int32"):
        fd.ShardedKVCache(num_shards=1, batch=1, num_kv_heads=1, capacity_per_shard=4, head_dim=8,
                          dtype=np.int32)
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        fd.ShardedKVCache(num_shards=1, batch=1, num_kv_heads=1, capacity_per_shard=4, head_dim=8, timeout=-1)
    with pytest.raises(ValueError, match="key_channels applies to int8 caches only"):
        fd.ShardedKVCache(num_shards=1, batch=1, num_kv_heads=1, capacity_per_shard=4, head_dim=8,
                          key_channels=np.ones(8))
    with pytest.raises(ValueError, match="may not set max_concurrency"):
        fd.ShardedKVCache(num_shards=1, batch=1, num_kv_heads=1, capacity_per_shard=4, head_dim=8,
                          actor_options={"max_concurrency": 4})
    with pytest.raises(ValueError, match=r"one dict per shard \(2\)"):
        fd.ShardedKVCache(num_shards=2, batch=1, num_kv_heads=1, capacity_per_shard=4, head_dim=8,
                          actor_options=[{}])
    cache = fd.ShardedKVCache(num_shards=2, batch=1, num_kv_heads=2, capacity_per_shard=4, head_dim=8)
    k = np.zeros((1, 2, 3, 8), np.float32)
    cache.append(k, k)
    bad_appends = [
        ((np.zeros((1, 2, 3, 8), np.int32), k), TypeError, "k must be floating point .*; got int32"),
        ((k, k[:, :, :, :4]), ValueError, r"v must have shape \(batch=1, num_kv_heads=2, n, 8\) .*"
                                          r"got \(1, 2, 3, 4\)"),
        ((k, k[:, :, :2]), ValueError, "same number of new rows; got k 3 and v 2"),
    ]
    for args, exc, match in bad_appends:
        with pytest.raises(exc, match=match):
            cache.append(*args)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, n=3\]; got values from 4 to 4"):
        cache.append(k, k, lengths=[4])
    q = np.zeros((1, 2, 1, 8), np.float32)
    bad_attends = [
        (dict(q=q.astype(np.float64)), TypeError, "float64 queries need a float64 cache"),
        (dict(q=q[..., :4]), ValueError, r"q must have shape \(batch=1, Hq, L, 8\) .* got \(1, 2, 1, 4\)"),
        (dict(q=q[:, :1].repeat(3, 1)), ValueError, "multiple of num_kv_heads=2"),
        (dict(q=q, mask=np.ones((1, 2, 1, 8), bool)), TypeError, "takes no mask=: its last axis"),
        (dict(q=q, kv_lengths=[2]), TypeError, "takes no kv_lengths=: the cache's own lengths"),
        (dict(q=q, k_start=0), TypeError, "takes no k_start="),
        (dict(q=q, colour=1), TypeError, "takes no colour=: it is not an argument"),
        (dict(q=q, causal="left"), ValueError, "causal must be .*; got 'left'"),
        (dict(q=q, q_start=1.5), TypeError, "q_start must be an int"),
        (dict(q=q, window=(1,)), TypeError, "window must be None or a pair of ints"),
        (dict(q=q, scale=float("nan")), ValueError, "shard 0 of 2 refused attend: scale must be finite"),
        (dict(q=q, sinks=[1.0]), ValueError, r"sinks must have shape \(Hq,\) = \(2,\)"),
    ]
    for kw, exc, match in bad_attends:
        with pytest.raises(exc, match=match):
            cache.attend(**kw)
    np.testing.assert_array_equal(cache.lengths, [3])
    cache.close()
