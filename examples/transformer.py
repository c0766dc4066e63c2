#!/usr/bin/env python3
"""A small decoder-only transformer in NumPy that generates with fastattn.

Owns a toy model (seeded random weights, 64-token vocabulary, RMSNorm, grouped-
query attention, SiLU MLP, sinusoidal positions) and greedy decoding over one
fastattn.KVCache per layer, with attention by fastattn or by textbook NumPy
over the same cache: both timed in one run, and they must give the same tokens.

    python examples/transformer.py [--help]
"""
import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import NamedTuple, Optional

import numpy as np

import fastattn

try:
    from threadpoolctl import threadpool_info, threadpool_limits
except ImportError:  # optional: only the contention measurement needs it
    threadpool_limits = threadpool_info = None


def rms_norm(x, gain, eps=1e-6):
    # x / rms(x) · g, per token
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def silu(x):
    return x / (1 + np.exp(-x))


def sinusoidal_positions(n, d):
    """The original transformer's fixed position code: sin/cos at geometric frequencies."""
    pos = np.arange(n)[:, None]
    freq = 10000.0 ** (-np.arange(0, d, 2) / d)
    table = np.zeros((n, d))
    table[:, 0::2], table[:, 1::2] = np.sin(pos * freq), np.cos(pos * freq)
    return table.astype(np.float32)


def numpy_attention(q, k, v, causal):
    """Textbook attention over the cache: repeat K/V per group, scores, mask, softmax, sum.

    q (B, Hq, L, d), k and v (B, Hkv, S, d); causal is bottom-right (the L
    queries are the last L keys).
    """
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scores = q @ k.swapaxes(-1, -2) / np.float32(np.sqrt(q.shape[-1]))
    L, S = scores.shape[-2:]
    if causal and L > 1:
        visible = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
        scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ v


class Block:
    """One pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, d_model, heads, kv_heads, rng):
        self.attn = fastattn.MultiHeadAttention(d_model, heads, kv_heads, rng=rng)
        self.norm1 = np.ones(d_model, np.float32)
        self.norm2 = np.ones(d_model, np.float32)
        d_ff = 4 * d_model
        self.W_1 = (rng.standard_normal((d_model, d_ff)) / np.sqrt(d_model)).astype(np.float32)
        self.W_2 = (rng.standard_normal((d_ff, d_model)) / np.sqrt(d_ff)).astype(np.float32)

    def attention(self, h, cache, run):
        if run.attention == "fastattn":
            return self.attn(h, causal=True, cache=cache, num_threads=run.threads)
        # The same projections and cache, then textbook attention over the
        # filled part (a copy per step, as a NumPy decoder has to make).
        q, k, v = self.attn.project(h)
        cache.append(k, v)
        o = numpy_attention(q, cache.keys, cache.values, causal=True)
        B, H, L, d = o.shape
        return o.swapaxes(1, 2).reshape(B, L, H * d) @ self.attn.W_O

    def __call__(self, x, cache, run):
        x = x + self.attention(rms_norm(x, self.norm1), cache, run)
        return x + silu(rms_norm(x, self.norm2) @ self.W_1) @ self.W_2


class Model:
    """Token embedding + sinusoidal positions, blocks, final norm, output head.

    The head is its own matrix, not the embedding transposed: with random
    tied weights each token's own embedding dominates its logits, and greedy
    decoding repeats the first token forever.
    """

    def __init__(self, vocab, d_model, layers, heads, kv_heads, max_len, seed):
        rng = np.random.default_rng(seed)
        self.embed = rng.standard_normal((vocab, d_model)).astype(np.float32)
        self.positions = sinusoidal_positions(max_len, d_model)
        self.blocks = [Block(d_model, heads, kv_heads, rng) for _ in range(layers)]
        self.norm = np.ones(d_model, np.float32)
        self.head = (rng.standard_normal((d_model, vocab)) / np.sqrt(d_model)).astype(np.float32)

    def new_caches(self, batch, capacity, dtype=None):
        return [b.attn.new_cache(batch, capacity, dtype=dtype) for b in self.blocks]

    def logits(self, tokens, caches, run):
        """Next-token logits after feeding tokens (B, T) at the caches' current position."""
        start = int(caches[0].lengths[0])
        x = self.embed[tokens] + self.positions[start:start + tokens.shape[1]]
        for block, cache in zip(self.blocks, caches):
            x = block(x, cache, run)
        return rms_norm(x[:, -1], self.norm) @ self.head


class Run(NamedTuple):
    """One timed setting: which attention, and the threads around it."""

    attention: str              # "fastattn" or "numpy"
    blas_one_thread: bool = False
    threads: Optional[int] = None  # fastattn's num_threads (None: OpenMP's default)

    def __str__(self):
        return ", ".join([self.attention] + ["BLAS 1 thread"] * self.blas_one_thread
                         + [f"num_threads={self.threads}"] * (self.threads is not None))


def generate(model, prompt, n_tokens, run, cache_dtype=None):
    """Greedy decoding: returns the tokens, the prefill time and the decode time."""
    # (b): OpenBLAS limited to one thread around the matmuls, so no BLAS
    # thread is left spinning on the core fastattn's worker wants.
    with threadpool_limits(1, "blas") if run.blas_one_thread else contextlib.nullcontext():
        caches = model.new_caches(prompt.shape[0], prompt.shape[1] + n_tokens, cache_dtype)
        t0 = time.perf_counter()
        token = model.logits(prompt, caches, run).argmax(-1)[:, None]
        t1 = time.perf_counter()
        out = [token]
        for _ in range(n_tokens - 1):
            token = model.logits(token, caches, run).argmax(-1)[:, None]
            out.append(token)
        t2 = time.perf_counter()
    return np.concatenate(out, axis=1), t1 - t0, t2 - t1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Exit status 1 if the runs produce different tokens.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--attention", choices=["both", "fastattn", "numpy"], default="both",
                   help="which attention to run; 'both' times both and compares their tokens")
    p.add_argument("--tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--prompt", type=int, default=512, help="prompt length (random tokens)")
    p.add_argument("--batch", type=int, default=1, help="sequences generated together")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="runs per setting; medians are printed")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt")
    p.add_argument("--cache-dtypes", default="",
                   help="also generate with fastattn over caches stored in these dtypes (comma-separated: "
                        "float16, bfloat16, int8) and say where their tokens part from float32's")
    a = p.parse_args(argv)
    if a.tokens < 2 or a.prompt < 1 or a.repeats < 1:
        p.error("--tokens must be >= 2, --prompt and --repeats >= 1")

    model = Model(a.vocab, a.d_model, a.layers, a.heads, a.kv_heads, a.prompt + a.tokens, a.seed)
    prompt = np.random.default_rng(a.seed + 1).integers(0, a.vocab, size=(a.batch, a.prompt))
    modes = ["fastattn", "numpy"] if a.attention == "both" else [a.attention]
    print(f"model: {a.layers} layers, d_model {a.d_model}, {a.heads} heads / {a.kv_heads} kv heads, "
          f"vocab {a.vocab}; prompt {a.prompt} tokens, generating {a.tokens}, batch {a.batch}")
    info = fastattn.info()
    blas = ([f"{i['internal_api']} {i['num_threads']} threads" for i in threadpool_info()
             if i["user_api"] == "blas"] if threadpool_info else ["threadpoolctl not installed"])
    print(f"fastattn {info['version']} ({info['isa']}, {info['max_threads']} threads); "
          f"numpy {np.__version__} ({', '.join(blas) or 'BLAS unknown'}); medians of {a.repeats} runs")

    runs = [Run(m) for m in modes]
    if threadpool_limits is not None:
        runs += [Run(m, blas_one_thread=True) for m in modes]
    if "fastattn" in modes:
        runs.append(Run("fastattn", threads=1))
    times = {run: [] for run in runs}
    tokens = {}
    # Settings take turns within each repeat, so a change in the machine's
    # load (other processes) reaches all of them alike.
    for _ in range(a.repeats):
        for run in runs:
            tokens[run], prefill, decode = generate(model, prompt, a.tokens, run)
            times[run].append((prefill, decode))

    print(f"\n{'attention':<36}{'prefill tok/s':>14}{'decode tok/s':>14}{'ms/step':>10}")
    rate, prefill_rate = {}, {}
    for run, ts in times.items():
        prefill = statistics.median(t[0] for t in ts)
        decode = statistics.median(t[1] for t in ts)
        rate[run] = a.batch * (a.tokens - 1) / decode
        prefill_rate[run] = a.batch * a.prompt / prefill
        print(f"{str(run):<36}{prefill_rate[run]:>14.0f}{rate[run]:>14.1f}"
              f"{1e3 * decode / (a.tokens - 1):>10.2f}")
    if Run("fastattn", True) in rate:
        print("\nthread-pool contention, fastattn tok/s (prefill / decode), against (a) as is:")
        base = Run("fastattn")
        for run, what in ((Run("fastattn", True), "(b) threadpool_limits(1, 'blas') around the matmuls"),
                          (Run("fastattn", threads=1), "(c) num_threads=1")):
            print(f"  {what}: {prefill_rate[run]:.0f} / {rate[run]:.1f} "
                  f"({prefill_rate[run] / prefill_rate[base]:.2f}x / {rate[run] / rate[base]:.2f}x)")
        print("process-wide equivalents: OPENBLAS_NUM_THREADS=1, OMP_NUM_THREADS=1")
    if hasattr(os, "getloadavg"):  # not on Windows
        print(f"machine load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs "
              "(other processes make every timing slower and noisier)")

    first = tokens[runs[0]]
    print(f"\ntokens ({runs[0]}): {' '.join(map(str, first[0]))}")
    for dt in filter(None, a.cache_dtypes.split(",")):
        # The same greedy decoding over a 16-bit or int8 cache: keys and
        # values rounded (or quantised) once as they are appended.
        t, _, decode = generate(model, prompt, a.tokens, Run("fastattn"), cache_dtype=dt)
        agree = int(np.argmin(np.all(t == first, axis=0))) if not np.array_equal(t, first) else a.tokens
        print(f"{dt} cache: the first {agree} of {a.tokens} tokens are float32's"
              + ("" if agree == a.tokens else f" (part at token {agree})")
              + f"; decode {a.batch * (a.tokens - 1) / decode:.1f} tok/s")
    same = all(np.array_equal(first, t) for t in tokens.values())
    if len(modes) > 1:
        print(f"same tokens with fastattn and numpy: {'yes' if same else 'NO'}")
    if not same:
        for run, t in tokens.items():
            print(f"tokens ({run}): {' '.join(map(str, t[0]))}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
