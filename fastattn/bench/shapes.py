"""The benchmark's problems: the Shape of one attention call, the table of
shapes `python -m fastattn bench` and benchmarks/ time, the score-modifier
rows (a plain shape plus softcap, ALiBi or sinks) and the groups --shapes
takes (full, decode, block, modifiers). The transformer block's own shapes
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
    modifier: str = ""  # "softcap", "alibi" or "sinks": the plain shape `base` with that modifier
    base: str = ""

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
        return kind + self.dims + (f" + {MODIFIER_TITLES[self.modifier]}" if self.modifier else "")

    @property
    def flops(self):
        """4·B·Hq·L·S·E (Q·Kᵀ and P·V, a multiply-add each); half is visible
        when causal with L == S. A modifier's few operations per score are not
        counted: its GFLOP/s compare with the plain shape's on the same count."""
        f = 4 * self.B * self.Hq * self.L * self.S * self.E
        return f // 2 if self.causal and self.L == self.S else f

    def inputs(self, dtype=np.float32):
        """q, k, v drawn from N(0, 1), the same every run (seeded by the name;
        a modifier row gets its plain shape's). With softcap, q is multiplied
        by the cap: the scaled scores are then N(0, c²), so s/c reaches tanh's
        curved region instead of its linear middle."""
        rng = np.random.default_rng(zlib.crc32((self.base or self.name).encode()))
        kv = (self.B, self.Hkv, self.S, self.E)
        q = rng.standard_normal((self.B, self.Hq, self.L, self.E), dtype=np.float32)
        if self.modifier == "softcap":
            q *= SOFTCAP
        k = rng.standard_normal(kv, dtype=np.float32)
        v = rng.standard_normal(kv, dtype=np.float32)
        return tuple(x.astype(dtype, copy=False) for x in (q, k, v))

    def modifier_args(self):
        """The modifier's keyword arguments of fastattn.attention (and of the
        reference and the peers' adapters): {} for a plain shape."""
        if self.modifier == "softcap":
            return {"softcap": SOFTCAP}
        if self.modifier == "alibi":
            return {"alibi_slopes": bloom_slopes(self.Hq)}
        if self.modifier == "sinks":
            # log S + N(0, 1): a sink about as heavy as all S keys together
            # (each weighs e^0.5 on average), so it takes a real share of
            # every row and a dropped sink fails the check
            rng = np.random.default_rng(zlib.crc32(self.name.encode()))
            return {"sinks": np.log(self.S) + rng.standard_normal(self.Hq)}
        return {}


SOFTCAP = 50.0  # Gemma 2's attention softcap
MODIFIER_TITLES = {"softcap": f"softcap {SOFTCAP:g}", "alibi": "ALiBi", "sinks": "sinks"}


def bloom_slopes(H):
    """BLOOM's ALiBi slopes 2^(−8h/H), h = 1 … H (H a power of two)."""
    return 2.0 ** (-8 * np.arange(1, H + 1) / H)


def with_modifier(shape, modifier):
    """The plain ``shape`` with one score modifier: named ``<shape>_<modifier>``."""
    return dataclasses.replace(shape, name=f"{shape.name}_{modifier}", modifier=modifier,
                               base=shape.name, about=f"{shape.about}, {MODIFIER_TITLES[modifier]}")


def with_plain(shapes):
    """``shapes`` with each modifier row's plain shape put before it when
    missing: a modifier's cost is its time over the plain call of the same run."""
    names, picked = {s.name for s in shapes}, []
    for s in shapes:
        if getattr(s, "base", "") and s.base not in names and s.base in SHAPES_BY_NAME:
            picked.append(SHAPES_BY_NAME[s.base])
            names.add(s.base)
        picked.append(s)
    return picked


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
_PLAIN = {s.name: s for s in SHAPES}
# The score modifiers' cost (issue 11: each at most 10 % over the plain call):
# causal prefill and GQA decode, plain then each modifier.
MODIFIER_BASES = [_PLAIN["causal2048"], _PLAIN["dec8k_gqa"]]
MODIFIER_SHAPES = [with_modifier(s, m) for s in MODIFIER_BASES for m in MODIFIER_TITLES]
SHAPES_BY_NAME = {s.name: s for s in SHAPES + BLOCK_SHAPES + MODIFIER_SHAPES}
# what --shapes takes besides a shape's name
SHAPE_GROUPS = {kind: [s for s in SHAPES + BLOCK_SHAPES if s.kind == kind]
                for kind in ("full", "decode", "block")}
SHAPE_GROUPS["modifiers"] = with_plain(MODIFIER_SHAPES)
