"""The benchmark's transformer block: one pre-norm decoder block in NumPy,
timed with its attention done by fastattn and by textbook NumPy.

    x ← x + attn(rms(x)) W_O,     x ← x + silu(rms(x) W_1) W_2

Projections and the MLP are NumPy matmuls (whatever BLAS NumPy has, on its
default threads); only the attention differs between the two runs, and both
read and write the same KV cache. A step is a prefill (the prompt's tokens
into an empty cache) or a decode step (one new token per sequence against
``past`` cached ones). fastattn.bench.run times these and fastattn.bench.checks
checks them; this file owns the block, its inputs and its float64 reference.
"""
import dataclasses
import zlib

import numpy as np

from fastattn import reference
from fastattn.bench.peers import causal_mask, textbook_attention
from fastattn.layers import MultiHeadAttention

ATTENTIONS = ("fastattn", "numpy")  # the libraries a block row is timed with


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """One block step: B sequences, ``new`` tokens each (the prompt, or 1 when
    decoding), after ``past`` tokens already in the cache."""

    name: str
    B: int
    d_model: int
    Hq: int
    Hkv: int
    new: int
    past: int = 0
    about: str = ""
    kind = "block"
    causal = True
    decode = False  # not one of the bench's decode (bandwidth) rows
    modifier = base = ""  # no score modifier rows

    @property
    def E(self):
        return self.d_model // self.Hq

    @property
    def S(self):
        return self.past + self.new

    @property
    def step(self):
        return "prefill" if self.past == 0 else "decode"

    @property
    def dims(self):
        heads = f"{self.Hq}/{self.Hkv}" if self.Hkv != self.Hq else f"{self.Hq}"
        return f"{self.B}×{heads}×{self.new}×{self.S}×{self.E}"

    @property
    def label(self):
        return f"block {self.step} d_model {self.d_model}, {self.dims}"

    @property
    def tokens(self):
        return self.B * self.new

    @property
    def flops(self):
        """Matmul FLOPs of the step: projections 2·T·d·(Hq + 2·Hkv + Hq)·E, the
        MLP 2·T·d·4d twice (T = B·new tokens), and attention 4·B·Hq·new·S·E
        (half of the square when prefilling, causal)."""
        T, d, E = self.tokens, self.d_model, self.E
        proj = 2 * T * d * (2 * self.Hq + 2 * self.Hkv) * E
        mlp = 2 * 2 * T * d * 4 * d
        attn = 4 * self.B * self.Hq * self.new * self.S * E
        return proj + mlp + (attn // 2 if self.past == 0 else attn)


def rms_norm(x, eps=1e-6):
    # x / rms(x), per token (the gain is 1 in this block)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def silu(x):
    return x / (1 + np.exp(-x))


class Block:
    """The block's weights (seeded, N(0, 1/fan_in)) and its forward step."""

    def __init__(self, shape, dtype=np.float32, seed=0):
        rng = np.random.default_rng(seed)
        d = shape.d_model
        self.attn = MultiHeadAttention(d, shape.Hq, shape.Hkv, rng=rng, dtype=dtype)
        self.W_1 = (rng.standard_normal((d, 4 * d)) / np.sqrt(d)).astype(dtype)
        self.W_2 = (rng.standard_normal((4 * d, d)) / np.sqrt(4 * d)).astype(dtype)

    def as_dtype(self, dtype):
        """The same weights in another dtype (the float64 reference's block)."""
        other = object.__new__(Block)
        other.attn = MultiHeadAttention(self.attn.d_model, self.attn.num_heads,
                                        self.attn.num_kv_heads, dtype=dtype)
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            setattr(other.attn, name, getattr(self.attn, name).astype(dtype))
        other.W_1, other.W_2 = self.W_1.astype(dtype), self.W_2.astype(dtype)
        return other

    def forward(self, x, cache, attention, threads=None, mask=None):
        """x (B, new, d) → (B, new, d); appends the step's keys and values to
        cache. attention: "fastattn", or a function (q, keys, values, mask)
        over the filled cache (mask: the additive causal mask, or None)."""
        h = rms_norm(x)
        if attention == "fastattn":
            a = self.attn(h, causal=True, cache=cache, num_threads=threads)
        else:
            q, k, v = self.attn.project(h)
            cache.append(k, v)
            o = attention(q, cache.keys, cache.values, mask)
            B, H, L, E = o.shape
            a = o.swapaxes(1, 2).reshape(B, L, H * E) @ self.attn.W_O
        x = x + a
        return x + silu(rms_norm(x) @ self.W_1) @ self.W_2


class BlockProblem:
    """A block, its inputs and its cache for one BlockShape: ``prepare(name,
    threads)`` gives a callable that runs one step from the same state every
    time (the cache is rolled back to ``past`` first), ``reference()`` the
    float64 result of that step."""

    def __init__(self, shape, dtype=np.float32):
        self.shape, self.dtype = shape, np.dtype(dtype)
        rng = np.random.default_rng(zlib.crc32(shape.name.encode()))
        self.block = Block(shape, self.dtype, seed=zlib.crc32(shape.name.encode()))
        self.x = rng.standard_normal((shape.B, shape.new, shape.d_model)).astype(self.dtype)
        # The cached tokens' keys and values: the projections of random
        # normalised activations, as a real cache holds.
        past = rng.standard_normal((shape.B, shape.past, shape.d_model)).astype(self.dtype)
        _, self.past_k, self.past_v = self.block.attn.project(rms_norm(past))

    def _cache(self, block):
        cache = block.attn.new_cache(self.shape.B, self.shape.S)
        if self.shape.past:
            cache.append(self.past_k.astype(cache.dtype), self.past_v.astype(cache.dtype))
        return cache

    def prepare(self, name, threads):
        if name not in ATTENTIONS:
            raise ValueError(f"a block runs with attention by {' or '.join(ATTENTIONS)}; got {name!r}")
        s, cache = self.shape, self._cache(self.block)
        if name == "fastattn":
            attention, mask = "fastattn", None
        else:
            attention, mask = textbook_attention, causal_mask(s.new, s.S, self.dtype) if s.new > 1 else None

        def step():
            cache.truncate(s.past)
            return self.block.forward(self.x, cache, attention, threads, mask)

        return step

    def reference(self):
        """The step in float64, attention by fastattn.reference: (expected, scale), where
        scale is max |expected| (the tolerance's unit)."""
        block = self.block.as_dtype(np.float64)
        cache = self._cache(block)

        def exact(q, k, v, mask):
            return reference.attention(q, k, v, causal=True)

        out = block.forward(self.x.astype(np.float64), cache, exact)
        return out, float(np.abs(out).max())


BLOCK_SHAPES = [
    BlockShape("block_prefill", 1, 512, 8, 8, 1024,
               about="prefill of 1024 tokens, d_model 512, 8 heads (the lecture's widths)"),
    BlockShape("block_decode", 1, 512, 8, 8, 1, past=4095,
               about="one token against 4095 cached, d_model 512, 8 heads"),
    BlockShape("block_decode_gqa", 4, 2048, 32, 8, 1, past=2047,
               about="4 sequences, one token each against 2047 cached, d_model 2048, 32/8 heads"),
]
