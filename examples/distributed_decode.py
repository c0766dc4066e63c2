"""Decoding against a key/value cache split over Ray actors: what it costs, and a model of what it buys.

Measures on this machine, with a local Ray cluster: the latency of a decode
step (append one token, attend) with 1, 2 and 4 shards against one local
KVCache holding the same data, the bytes each step exchanges, the round trip
of an empty actor call, the read bandwidth of one shard and the cost of the
merge; then models decode tokens/s for a 1M-token cache on 1-16 machines.
Needs Ray (pip install "fastattn[distributed]"). See docs/distributed.md.
"""
import argparse
import math
import os
import pickle
import sys
import tempfile
import time

import numpy as np

import fastattn
from fastattn._info import cpu_model

# The model's shape (issue 14): 32 layers, 32 query heads over 8 K/V heads of
# 128, bfloat16 storage, 2**20 tokens: 128 GiB of keys and values.
MODEL = dict(layers=32, heads=32, kv_heads=8, head_dim=128, bytes_per_element=2, tokens=2**20)


def median_ms(times):
    return 1e3 * float(np.median(times))


def timed(fn):
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def start_ray(ray):
    # Ray's workers put the driver's working directory on sys.path; from a
    # fastattn checkout they would import its un-built source folder.
    here = os.getcwd()
    os.chdir(tempfile.gettempdir())
    try:
        ray.init(num_cpus=os.cpu_count(), object_store_memory=2 * 10**8, include_dashboard=False,
                 log_to_driver=False)
    finally:
        os.chdir(here)


def decode_rows(args, fd, rng):
    """Per-step medians: one local KVCache against 1, 2, 4 shards, same data."""
    H, Hkv, E, S = args.heads, args.kv_heads, args.head_dim, args.tokens
    cores = len(os.sched_getaffinity(0))
    prompt = rng.standard_normal((1, Hkv, S, E), dtype=np.float32)
    new = rng.standard_normal((args.steps, 1, Hkv, 1, E), dtype=np.float32)
    qs = rng.standard_normal((args.steps, 1, H, 1, E), dtype=np.float32)
    rows = []
    # every shard count through the compiled graph (the default), and 1 shard
    # also as plain actor calls, to show what the graph saves
    for shards, compiled in [(n, True) for n in args.shards] + [(1, False)]:
        capacity = S + args.steps
        local = fastattn.KVCache(1, Hkv, capacity, E, dtype=args.dtype)
        # one machine: the cores are shared out, as one shard per machine would own its own
        cache = fd.ShardedKVCache(num_shards=shards, batch=1, num_kv_heads=Hkv,
                                  capacity_per_shard=math.ceil(capacity / shards), head_dim=E,
                                  dtype=args.dtype, num_threads=max(1, cores // shards), compiled=compiled)
        for c in (local, cache):
            c.append(prompt, prompt)
        t = {"local attend": [], "sharded attend": [], "local append": [], "sharded append": [], "diff": []}
        worst = 0.0
        for step in range(args.steps):
            k = new[step]
            t["local append"].append(timed(lambda: local.append(k, k))[0])
            t["sharded append"].append(timed(lambda: cache.append(k, k))[0])
            t_local, want = timed(lambda: local.attend(qs[step]))
            t_shard, got = timed(lambda: cache.attend(qs[step]))
            t["local attend"].append(t_local)
            t["sharded attend"].append(t_shard)
            t["diff"].append(t_shard - t_local)
            worst = max(worst, float(np.max(np.abs(got.astype(np.float64) - want))))
        request, reply = step_bytes(cache, qs[0])
        rows.append(dict(shards=shards, path="graph" if compiled else "plain", threads=max(1, cores // shards), worst=worst,
                         request=request, reply=reply, asked=shards,
                         **{name: median_ms(v) for name, v in t.items()}))
        cache.close()
    return rows


def step_bytes(cache, q):
    """Serialised bytes of one attend call's request and reply, per shard
    (pickle protocol 5, as Ray serialises NumPy arrays), and the payload."""
    q_start = cache.lengths - q.shape[2]
    request = len(pickle.dumps((q, q_start, dict(causal=True, window=None)), protocol=5))
    out, lse = fastattn.KVCache(1, cache.num_kv_heads, 1, cache.head_dim).attend(q, return_lse=True)
    reply = len(pickle.dumps((out, lse), protocol=5))
    return request, reply


def round_trips(fd, ray, shards, steps):
    """Median seconds of a step over a one-token-per-shard cache (all round
    trip: the compiled graph, the tiny attention, the merge) with 1 shard and
    with `shards`; and of an empty plain actor call, for comparison."""
    one_token = np.ones((1, 1, 1, 8), np.float32)

    def step(n):
        cache = fd.ShardedKVCache(num_shards=n, batch=1, num_kv_heads=1, capacity_per_shard=1, head_dim=8)
        for _ in range(n):
            cache.append(one_token, one_token)
        cache.attend(one_token)  # compiles the graph
        graph = float(np.median([timed(lambda: cache.attend(one_token))[0] for _ in range(steps)]))
        actor = cache.actors[0]
        plain = float(np.median([timed(lambda: ray.get(actor.ready.remote()))[0] for _ in range(steps)]))
        cache.close()
        return graph, plain

    rtt, plain = step(1)
    rtt_n = step(shards)[0] if shards > 1 else rtt
    return rtt, plain, rtt_n


def bandwidth(args, rng):
    """GB/s of K/V one decode call reads from a cache of --bandwidth-tokens
    tokens (bfloat16 if ml_dtypes is there, as in the model), all cores."""
    try:
        import ml_dtypes  # noqa: F401
        dtype = "bfloat16"
    except ImportError:
        dtype = np.float16
    Hkv, E, S = args.kv_heads, args.head_dim, args.bandwidth_tokens
    cache = fastattn.KVCache(1, Hkv, S, E, dtype=dtype)
    chunk = 8192
    for lo in range(0, S, chunk):
        k = rng.standard_normal((1, Hkv, min(chunk, S - lo), E), dtype=np.float32)
        cache.append(k, k)
    q = rng.standard_normal((1, args.heads, 1, E), dtype=np.float32)
    cache.attend(q)
    t = float(np.median([timed(lambda: cache.attend(q))[0] for _ in range(args.bandwidth_repeats)]))
    return cache.nbytes / t / 1e9, t, cache.nbytes, str(dtype)


def merge_seconds(heads, head_dim, parts, rng, repeats=200):
    outs = [rng.standard_normal((1, heads, 1, head_dim), dtype=np.float32) for _ in range(parts)]
    lses = [rng.standard_normal((1, heads, 1), dtype=np.float32) for _ in range(parts)]
    return float(np.median([timed(lambda: fastattn.merge_attention(outs, lses))[0] for _ in range(repeats)]))


def model_rows(gbps, rtt, per_shard, merge, machines=(1, 2, 4, 8, 16)):
    """Decode tokens/s of the MODEL cache on M machines, each reading its
    1/M of every layer at the measured bandwidth; per layer, one round trip
    (the next layer's query needs this one's output), the driver's cost per
    extra shard, and the merge of M parts."""
    m = MODEL
    layer_bytes = 2 * m["tokens"] * m["kv_heads"] * m["head_dim"] * m["bytes_per_element"]
    rows = []
    for M in machines:
        read = layer_bytes / M / (gbps * 1e9)
        overhead = rtt + per_shard * (M - 1) + merge[M]
        rows.append(dict(machines=M, read=read, overhead=overhead,
                         tokens_s=1 / (m["layers"] * (read + overhead)),
                         gib_per_machine=m["layers"] * layer_bytes / M / 2**30))
    # where the exchange overtakes the reads: layer_bytes / (M gbps) = rtt + c (M - 1) (merge folded into c)
    return rows, layer_bytes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="cache length for the decode steps (4096)")
    p.add_argument("--steps", type=int, default=300, help="decode steps per shard count (300)")
    p.add_argument("--shards", default="1,2,4", help="shard counts (1,2,4)")
    p.add_argument("--dtype", default="float16", help="cache storage dtype (float16)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bandwidth-tokens", type=int, default=262144,
                   help="cache length for the bandwidth measurement (262144: 1 GiB in bfloat16)")
    p.add_argument("--bandwidth-repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.shards = [int(s) for s in args.shards.split(",")]
    try:
        import ray
        import fastattn.distributed as fd
    except ImportError:
        print("this example needs Ray: pip install 'fastattn[distributed]'", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    start_ray(ray)
    cores = len(os.sched_getaffinity(0))
    print(f"{cpu_model()}, {cores} cores, load average {os.getloadavg()[0]:.2f}; fastattn {fastattn.__version__} "
          f"({fastattn.info()['isa']}), Ray {ray.__version__}")
    print(f"decode: batch 1, {args.heads} query heads over {args.kv_heads} K/V heads of {args.head_dim}, "
          f"{args.tokens} tokens of {args.dtype}; medians over {args.steps} steps (each: append 1 token, attend)")

    rows = decode_rows(args, fd, rng)
    print(f"{'shards':>6} {'path':>5} {'threads/shard':>13} {'local attend ms':>15} {'sharded attend ms':>17} "
          f"{'overhead ms':>11} {'local append ms':>15} {'sharded append ms':>17} {'bytes/step':>10} "
          f"{'max |diff|':>10}")
    for r in rows:
        total = r["asked"] * (r["request"] + r["reply"])
        print(f"{r['shards']:>6} {r['path']:>5} {r['threads']:>13} {r['local attend']:>15.3f} {r['sharded attend']:>17.3f} "
              f"{r['diff']:>11.3f} {r['local append']:>15.3f} {r['sharded append']:>17.3f} {total:>10} "
              f"{r['worst']:>10.2e}")
    r0 = rows[0]
    print(f"bytes per shard and step: request {r0['request']} (q {args.heads * args.head_dim * 4} B + positions "
          f"+ options), reply {r0['reply']} (out {args.heads * args.head_dim * 4} B + lse {args.heads * 4} B)")
    for r in rows:
        if r["shards"] == 1:
            verdict = "met" if r["diff"] <= 1.0 else "NOT met"
            print(f"overhead of 1 shard ({r['path']}) over one local call: median {r['diff']:.3f} ms per step "
                  f"(target <= 1 ms: {verdict})")

    n = max(args.shards)
    rtt, plain, rtt_n = round_trips(fd, ray, n, args.steps)
    per_shard = (rtt_n - rtt) / max(n - 1, 1)
    print(f"round trip of a step over 1 token per shard: 1 shard {1e3 * rtt:.3f} ms, {n} shards "
          f"{1e3 * rtt_n:.3f} ms (+{1e3 * per_shard:.3f} ms per extra shard, on {cores} cores); "
          f"an empty plain actor call {1e3 * plain:.3f} ms")
    # Two shards can answer sooner than one on a noisy 2-core machine; one
    # more shard never costs less than nothing, so the model takes 0 then.
    if per_shard < 0:
        print(f"(the model takes 0 ms per extra shard, not the measured {1e3 * per_shard:.3f})")
        per_shard = 0.0
    gbps, t_bw, nbytes, bw_dtype = bandwidth(args, rng)
    print(f"one shard's read bandwidth: {gbps:.1f} GB/s ({nbytes / 2**20:.0f} MiB of {bw_dtype} K/V in "
          f"{1e3 * t_bw:.2f} ms, {cores} threads, median of {args.bandwidth_repeats})")
    merge = {M: merge_seconds(MODEL["heads"], MODEL["head_dim"], M, rng) for M in (1, 2, 4, 8, 16)}
    print("merge_attention of M parts (1, 32, 1, 128): " +
          ", ".join(f"M={M} {1e6 * t:.0f} us" for M, t in merge.items()))

    table, layer_bytes = model_rows(gbps, rtt, per_shard, merge)
    print(f"model: 1M-token cache, {MODEL['layers']} layers x {layer_bytes / 2**30:.0f} GiB of bfloat16 K/V; "
          f"per layer and token: read 1/M at {gbps:.1f} GB/s + one round trip + merge")
    print(f"{'machines':>8} {'GiB/machine':>11} {'read ms/layer':>13} {'exchange ms/layer':>17} {'tokens/s':>9}  "
          "dominated by")
    for r in table:
        print(f"{r['machines']:>8} {r['gib_per_machine']:>11.1f} {1e3 * r['read']:>13.3f} "
              f"{1e3 * r['overhead']:>17.3f} {r['tokens_s']:>9.3f}  "
              f"{'reads' if r['read'] >= r['overhead'] else 'round trip + merge'}")
    c = per_shard + max(merge[16] - merge[8], 0) / 8  # cost of one more shard, merge included
    # reads = exchange: layer_bytes / (M gbps) = rtt + c (M - 1), a quadratic in M
    a, b, k = c, rtt - c, -layer_bytes / (gbps * 1e9)
    cross = (-b + math.sqrt(b * b - 4 * a * k)) / (2 * a) if a > 0 else -k / b
    print(f"the round trip and merge overtake the reads at about M = {cross:.0f} machines "
          f"(per extra shard {1e3 * c:.3f} ms)")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
