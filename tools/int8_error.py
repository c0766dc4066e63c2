"""How much an int8 KV cache costs in accuracy: the study behind docs/int8.md.

    python tools/int8_error.py [--heads 32] [--seed 0] [--prompt 128] [--no-floor]

Decoding (L = 1) attention over an int8 cache against the same attention over
a float32 cache, both through fastattn.reference in float64, plus the kernel
over fastattn.KVCache(dtype="int8") itself, for
E in (64, 128) and S in (512, 4096), on three kinds of keys:

* normal:  q, K, V ~ N(0, 1);
* outlier: the same, with one K channel 20× the others, as real LLM keys have;
* wide:    normal K scaled uniformly so that the scores spread as much as the
           outlier keys' do (a control: a peakier softmax, no outlier).

Storage methods (V is quantised per token in every int8 method):

* per-token:   one scale per (head, token) row, KVCache(dtype="int8",
               key_channels=None): K ≈ k8 · t_j;
* channel+tok: per-channel K factors c_e (max |K| per channel over the first
               --prompt tokens, floored at their median: key_channel_scales),
               then per token: K ≈ c_e · k8 · t_j, what KVCache(dtype="int8")
               stores; the kernel folds c into the query:
               s_j = Σ_e (q_e · c_e) · k8_je · t_j;
* kernel cache: channel+tok through the real thing: a KVCache(dtype="int8")
               given the prompt, then the rest, and cache.attend (float32);
* group32:     one scale per (token, group of 32 channels) for K;
* float16 / bfloat16: the 16-bit caches, for scale.

Printed per row: the output's max and mean abs error relative to max|V|, the
weights' worst max|Δw| / max w over rows, and the worst Σ|Δw| over rows
(half of it is the mass moved between keys).
"""
import argparse

import numpy as np

from types import SimpleNamespace

from fastattn.cache import KVCache, key_channel_scales, quantize_int8
from fastattn.reference import attention_steps, dequantize

OUTLIER = 20.0


def make(kind, rng, H, S, E):
    """q (1, H, 1, E), K and V (1, H, S, E) as float32."""
    q = rng.standard_normal((1, H, 1, E)).astype(np.float32)
    k = rng.standard_normal((1, H, S, E)).astype(np.float32)
    v = rng.standard_normal((1, H, S, E)).astype(np.float32)
    if kind == "outlier":
        channel = rng.integers(E, size=H)  # one channel per head
        k[0, np.arange(H), :, channel] *= OUTLIER
    elif kind == "wide":
        k *= np.float32(np.sqrt((E - 1 + OUTLIER**2) / E))  # score spread as with the outlier
    return q, k, v


def per_token(x):
    return quantize_int8(x)


def grouped(x, G):
    """int8 with one scale per (row, group of G channels), dequantized (float64)."""
    shape = x.shape
    values, scales = quantize_int8(x.reshape(shape[:-1] + (shape[-1] // G, G)))
    return (values.astype(np.float64) * scales[..., None]).reshape(shape)


def methods(q, k, v, prompt, floor=True):
    """name -> (q, k, v) as the reference takes them (pairs for int8)."""
    v8 = per_token(v)
    # floored at the median channel's factor: a channel that was small in the
    # prompt must not be blown up later (from one prompt token, unfloored
    # factors make the error worse than per-token's)
    if floor:
        c = key_channel_scales(k[:, :, :prompt])  # (1, H, E)
    else:
        c = np.max(np.abs(k[:, :, :prompt].astype(np.float64)), axis=2)
        c = np.maximum(c, np.finfo(np.float32).tiny).astype(np.float32)
    out = {
        "per-token": (q, per_token(k), v8),
        # keys as (values, scales, channels): values · scales · c
        "channel+tok": (q, per_token(k / c[:, :, None, :]) + (c,), v8),
        # the reference takes int8 pairs for k and v together: V dequantized here
        "group32": (q, grouped(k, 32), dequantize(*v8)),
        "float16": (q, k.astype(np.float16), v.astype(np.float16)),
    }
    try:
        import ml_dtypes
        out["bfloat16"] = (q, k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16))
    except ImportError:
        pass
    return out


def kernel_cache(q, k, v, prompt):
    """The kernel over an int8 KVCache given the prompt, then the rest."""
    _, H, S, E = k.shape
    cache = KVCache(1, H, S, E, dtype="int8")
    cache.append(k[:, :, :prompt], v[:, :, :prompt])
    cache.append(k[:, :, prompt:], v[:, :, prompt:])
    out, weights = cache.attend(q, return_weights=True)
    return SimpleNamespace(output=out, weights=weights[..., :S])


def errors(base, got, vmax):
    dout = np.abs(got.output - base.output)
    dw = np.abs(got.weights - base.weights)
    return (dout.max() / vmax, dout.mean() / vmax,
            (dw.max(axis=-1) / base.weights.max(axis=-1)).max(), dw.sum(axis=-1).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=32, help="heads per shape (rows of statistics)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", type=int, default=128, help="tokens that set the per-channel factors")
    ap.add_argument("--no-floor", action="store_true", help="per-channel factors without the median floor")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    print(f"L = 1, {a.heads} heads per row, seed {a.seed}; errors against the float32 cache, "
          "in the float64 reference")
    print()
    print("| keys | E | S | storage | out max err / max abs V | out mean err / max abs V "
          "| weights max rel err | weights max L1 err |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("normal", "outlier", "wide"):
        for E in (64, 128):
            for S in (512, 4096):
                q, k, v = make(kind, rng, a.heads, S, E)
                base = attention_steps(q, k, v)
                vmax = float(np.max(np.abs(v)))
                runs = {name: attention_steps(*m) for name, m in methods(q, k, v, a.prompt, not a.no_floor).items()}
                if not a.no_floor:
                    runs["kernel cache"] = kernel_cache(q, k, v, a.prompt)
                for name, got in runs.items():
                    e = errors(base, got, vmax)
                    print(f"| {kind} | {E} | {S} | {name} | {e[0]:.2e} | {e[1]:.2e} | {e[2]:.2e} | {e[3]:.2e} |")


if __name__ == "__main__":
    main()
