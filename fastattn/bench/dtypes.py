"""The storage dtypes --dtype takes: how a shape's inputs are stored in each,
the bytes of K and V one call reads, half an ulp of the output (the check's
extra tolerance) and the float64 copy of what is stored. float16 and
bfloat16 store q, k, v and out; int8 stores K/V as (values, per-row float32
scales) against float32 q and out. Both compute in float32. Nothing here
times, checks or prints.
"""
import dataclasses

import numpy as np

from fastattn import reference
from fastattn.cache import quantize_int8


def bfloat16():
    """ml_dtypes' bfloat16 as a NumPy dtype, or None without ml_dtypes."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def as_float64(x):
    """The exact float64 value of a stored q, k or v (an int8 pair dequantized)."""
    if isinstance(x, tuple):
        return reference.dequantize(*x)
    return np.asarray(x).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class Storage:
    """One --dtype: q's (and the output's) dtype and how K and V are stored."""

    name: str
    q: str               # q's and the output's dtype
    kv: str              # K's and V's dtype; "int8": (values, scales) pairs
    kinds: tuple         # the Shape kinds it runs ("full", "decode", "block")
    about: str = ""

    @property
    def compute(self):
        """What the kernel computes in: the matmul peak is taken in this dtype."""
        return "float64" if self.name == "float64" else "float32"

    @property
    def half_ulp(self):
        """Half an ulp of the output dtype at 1: rounding the float32 result once
        to a 16-bit output adds up to this times |out| (0 for float32/float64)."""
        return {"float16": 2.0**-11, "bfloat16": 2.0**-8}.get(self.q, 0.0)

    def available(self):
        return "bfloat16" not in (self.q, self.kv) or bfloat16() is not None

    def dtype(self, name=None):
        name = name or self.q
        return bfloat16() if name == "bfloat16" else np.dtype(name)

    @property
    def itemsize(self):
        return 1 if self.kv == "int8" else self.dtype(self.kv).itemsize

    def inputs(self, shape):
        """The shape's float32 q, k, v (the same draws in every dtype) stored in
        this dtype: rounded to 16 bits, or K/V quantized to int8 pairs."""
        if self.name == "float64":
            return shape.inputs(np.float64)
        q, k, v = shape.inputs(np.float32)
        if self.kv == "int8":
            return q, quantize_int8(k), quantize_int8(v)
        return q.astype(self.dtype(self.q)), k.astype(self.dtype(self.kv)), v.astype(self.dtype(self.kv))

    def kv_bytes(self, shape):
        """Bytes of K and V stored, so read by one call: 2·B·Hkv·S·E·itemsize,
        plus 2·B·Hkv·S·4 of float32 scales for int8."""
        scales = 2 * shape.B * shape.Hkv * shape.S * 4 if self.kv == "int8" else 0
        return 2 * shape.B * shape.Hkv * shape.S * shape.E * self.itemsize + scales

    @property
    def bytes_formula(self):
        if self.kv == "int8":
            return "2·B·Hkv·S·E·1 + 2·B·Hkv·S·4 (int8 values and their float32 scales)"
        return f"2·B·Hkv·S·E·{self.itemsize} in {self.kv}"


STORAGES = {s.name: s for s in (
    Storage("float32", "float32", "float32", ("full", "decode", "block")),
    Storage("float64", "float64", "float64", ("full", "decode", "block")),
    Storage("float16", "float16", "float16", ("full", "decode"),
            "q, k, v and out in float16, computed in float32"),
    Storage("bfloat16", "bfloat16", "bfloat16", ("full", "decode"),
            "q, k, v and out in bfloat16 (ml_dtypes), computed in float32 (exact bfloat16 "
            "products summed in float32: on the amx set Q·Kᵀ and P·V on AMX tiles, on the "
            "avx512bf16 set Q·Kᵀ with VDPBF16PS)"),
    Storage("int8", "float32", "int8", ("decode",),
            "int8 KV cache: float32 q and out, K/V int8 with one float32 scale per "
            "(batch, head, token) row; decode shapes only"),
)}
REDUCED = ("float16", "bfloat16", "int8")  # compared with fastattn's float32 row


def storage(x):
    """A Storage from its name, a NumPy dtype or a Storage."""
    if isinstance(x, Storage):
        return x
    name = x if isinstance(x, str) else np.dtype(x).name
    return STORAGES[name]
