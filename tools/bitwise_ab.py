"""A/B of results, bit for bit, between two builds of fastattn on one machine.

    python tools/bitwise_ab.py save FILE      # with build A installed
    python tools/bitwise_ab.py compare FILE   # with build B installed: exit 1 on any difference

Runs a fixed grid (every ISA this CPU runs, float32 and float64, both item
layouts, split-KV, GQA, masks, both causal alignments, windows, kv_lengths,
lse, 1 and 2 threads) and stores a SHA-256 of each output's bytes. The same
grid runs for the storage dtypes: float16 and bfloat16 K/V (bfloat16 where
ml_dtypes is installed) against q in their own dtype and in float32, and int8
pairs (quantize_int8) against float32 q. A refactor
that must not change results (issue 9) or a new dtype that must leave the old
ones alone is checked this way. Digests depend on the CPU's ISA, so a saved
file is only meaningful on the machine that wrote it: this is a tool, not a
test. Run it from outside the repository so it imports the installed build.
"""
import hashlib
import itertools
import json
import sys

import numpy as np

import fastattn

# (B, Hq, Hkv, L, S, E, Ev): lane layout, row layout (g·L small), split-KV
# (few row blocks, many keys), odd sizes off every block size.
SHAPES = [
    (1, 2, 2, 65, 130, 64, 64),
    (2, 4, 2, 7, 63, 33, 17),
    (1, 8, 2, 1, 1500, 64, 64),
    (1, 4, 1, 3, 2100, 40, 40),
    (1, 2, 2, 113, 97, 80, 80),
    (1, 32, 8, 2, 1030, 8, 8),
    (1, 4, 4, 1, 4000, 128, 128),
    (1, 8, 2, 1, 777, 136, 136),   # grouped rows of over 8 AVX2 vectors (P·V in parts)
    (1, 8, 1, 1, 900, 128, 128),   # multi-query: 8 rows to a K/V head
    (1, 2, 1, 40, 1250, 64, 64),   # lanes over 20 key blocks: folds; the amx set's P·V of two blocks at once
]

OPTIONS = [
    {},
    {"causal": True},
    {"causal": "top_left"},
    {"causal": True, "window": (37, 0)},
    {"window": (20, 5)},
    {"mask": "bool"},
    {"mask": "add", "causal": True},
    {"kv_lengths": True},
    {"kv_lengths": True, "causal": True, "return_lse": True},
    {"return_lse": True},
]


def _inputs(shape, dtype, seed):
    B, Hq, Hkv, L, S, E, Ev = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)
    return rng, q, k, v


def _kwargs(opts, rng, shape, dtype):
    B, Hq, Hkv, L, S, E, Ev = shape
    kw = dict(opts)
    if kw.get("mask") == "bool":
        kw["mask"] = rng.random((B, 1, L, S)) < 0.8
    elif kw.get("mask") == "add":
        m = rng.standard_normal((1, Hq, L, S)).astype(dtype)
        m[rng.random(m.shape) < 0.1] = -np.inf
        kw["mask"] = m
    if kw.get("kv_lengths"):
        kw["kv_lengths"] = rng.integers(S // 2, S + 1, size=B)
    return kw


def _storage_calls():
    """(name, q dtype, how K and V are stored) for each call dtype: the two
    float dtypes, then 16-bit K/V under 16-bit and float32 q, then int8 pairs."""
    calls = [("float32", np.float32, None), ("float64", np.float64, None)]
    halves = [np.dtype(np.float16)]
    try:
        import ml_dtypes
        halves.append(np.dtype(ml_dtypes.bfloat16))
    except ImportError:
        print("ml_dtypes is not installed: no bfloat16 cases")
    for h in halves:
        calls += [(h.name, h, h), (f"float32-q/{h.name}", np.float32, h)]
    calls.append(("float32-q/int8", np.float32, "int8"))
    return calls


def _stored(x, how):
    if how is None:
        return x
    if how == "int8":
        from fastattn.cache import quantize_int8
        return quantize_int8(x)
    return x.astype(how)


def digests():
    result, calls = {}, _storage_calls()
    for isa in fastattn.available_isas():
        fastattn.set_isa(isa)
        for (n, shape), (name, dtype, how), (o, opts), threads in itertools.product(
                enumerate(SHAPES), calls, enumerate(OPTIONS), (1, 2)):
            rng, q, k, v = _inputs(shape, np.float32 if how is not None else dtype, seed=n)
            kw = _kwargs(opts, rng, shape, np.float64 if dtype == np.float64 else np.float32)
            q, k, v = q.astype(dtype), _stored(k, how), _stored(v, how)
            got = fastattn.attention(q, k, v, num_threads=threads, **kw)
            parts = got if isinstance(got, tuple) else (got,)
            h = hashlib.sha256()
            for p in parts:
                h.update(np.ascontiguousarray(p).tobytes())
            result[f"{isa}/{name}/shape{n}/opt{o}/t{threads}"] = h.hexdigest()
    fastattn.set_isa(None)
    return result


def main(argv):
    if len(argv) != 3 or argv[1] not in ("save", "compare"):
        print(__doc__)
        return 2
    got = digests()
    if argv[1] == "save":
        with open(argv[2], "w") as f:
            json.dump(got, f, indent=0, sort_keys=True)
        print(f"saved {len(got)} digests to {argv[2]}")
        return 0
    with open(argv[2]) as f:
        want = json.load(f)
    missing = sorted(set(want) - set(got))
    differ = sorted(c for c in want if c in got and got[c] != want[c])
    print(f"{len(want)} cases saved, {len(got)} run: {len(differ)} differ, {len(missing)} not run")
    # saved by an older tool (float cases only): the new cases compare nothing
    extra = len(set(got) - set(want))
    if extra:
        print(f"   ({extra} cases run that the file does not hold)")
    for c in differ[:20] + missing[:20]:
        print("  ", c)
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
