"""The benchmark's problems: the Shape of one attention call, the table of
shapes `python -m fastattn bench` and benchmarks/ time, and the groups
--shapes takes (full, decode, block). The transformer block's own shapes
live in fastattn.bench.block; this file only lists them with the others.
"""
import dataclasses
import zlib

import numpy as np

from fastattn.bench import block

@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention problem: q (B, Hq, L, E), k and v (B, Hkv, S, E)."""

    name: str
    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    E: int
    causal: bool = False
    about: str = ""
    kind: str = "full"  # "full": encoder or prefill (L == S); "decode": a few new rows, a long cache

    @property
    def decode(self):
        return self.kind == "decode"

    def kv_bytes(self, dtype=np.float32):
        """Bytes of K and V one call must read: 2·B·Hkv·S·E·itemsize. Decoding
        does ~1 FLOP per byte read, so it is bound by memory, not the FPU."""
        return 2 * self.B * self.Hkv * self.S * self.E * np.dtype(dtype).itemsize

    @property
    def dims(self):
        heads = f"{self.Hq}/{self.Hkv}" if self.Hkv != self.Hq else f"{self.Hq}"
        return f"{self.B}×{heads}×{self.L}×{self.S}×{self.E}"

    @property
    def label(self):
        heads = "" if self.Hkv == self.Hq else "MQA " if self.Hkv == 1 else "GQA "
        kind = ("decode " if self.decode else "") + ("causal " if self.causal else "") + heads
        return kind + self.dims

    @property
    def flops(self):
        """4·B·Hq·L·S·E (Q·Kᵀ and P·V, a multiply-add each); half is visible
        when causal with L == S."""
        f = 4 * self.B * self.Hq * self.L * self.S * self.E
        return f // 2 if self.causal and self.L == self.S else f

    def inputs(self, dtype=np.float32):
        """q, k, v drawn from N(0, 1), the same every run (seeded by the name)."""
        rng = np.random.default_rng(zlib.crc32(self.name.encode()))
        kv = (self.B, self.Hkv, self.S, self.E)
        q = rng.standard_normal((self.B, self.Hq, self.L, self.E), dtype=np.float32)
        k = rng.standard_normal(kv, dtype=np.float32)
        v = rng.standard_normal(kv, dtype=np.float32)
        return tuple(x.astype(dtype, copy=False) for x in (q, k, v))


SHAPES = [
    Shape("tiny", 1, 8, 8, 10, 10, 64, about="the lecture's sentence: 10 tokens, 8 heads"),
    Shape("enc512", 1, 8, 8, 512, 512, 64, about="encoder"),
    Shape("enc256b4", 4, 12, 12, 256, 256, 64, about="encoder, batch 4"),
    Shape("enc1024", 1, 12, 12, 1024, 1024, 64, about="encoder"),
    Shape("long", 1, 8, 8, 4096, 4096, 64, about="long context"),
    Shape("d128", 1, 8, 8, 1024, 1024, 128, about="head dim 128"),
    Shape("causal2048", 1, 8, 8, 2048, 2048, 64, causal=True, about="causal prefill"),
    Shape("gqa_causal", 1, 32, 8, 512, 512, 128, causal=True, about="causal GQA prefill"),
    # decoding: one new query row (four for dec4_gqa) against the whole KV cache
    Shape("dec4k", 1, 32, 32, 1, 4096, 128, kind="decode", about="MHA decode, 4k cache"),
    Shape("dec8k_gqa", 1, 32, 8, 1, 8192, 128, kind="decode", about="GQA decode, 8k cache"),
    Shape("dec32k_mqa", 1, 8, 1, 1, 32768, 128, kind="decode", about="MQA decode, 32k cache"),
    Shape("dec4_gqa", 1, 32, 8, 4, 4096, 128, kind="decode",
          about="GQA, 4 new rows (speculative decoding), each seeing all 4096 keys"),
]
# A NumPy transformer block (fastattn.bench.block), run with fastattn's attention
# and with NumPy's: the end-to-end effect, projections and MLP included.
BLOCK_SHAPES = block.BLOCK_SHAPES
SHAPES_BY_NAME = {s.name: s for s in SHAPES + BLOCK_SHAPES}
# what --shapes takes besides a shape's name
SHAPE_GROUPS = {kind: [s for s in SHAPES + BLOCK_SHAPES if s.kind == kind]
                for kind in ("full", "decode", "block")}
