"""fastattn — fused scaled dot-product attention on the CPU.

    out = softmax(Q Kᵀ · scale + mask) V

in one tiled, multi-threaded C kernel that never stores the L×S scores.
``fastattn.reference`` is the step-by-step NumPy definition it is tested against.
"""
from fastattn._version import __version__
from fastattn._api import attention, scaled_dot_product_attention
from fastattn._info import info, set_isa, available_isas
from fastattn import reference
from fastattn.cache import KVCache
from fastattn.merge import merge_attention
from fastattn.layers import MultiHeadAttention

__all__ = [
    "__version__",
    "attention",
    "scaled_dot_product_attention",
    "info",
    "set_isa",
    "available_isas",
    "reference",
    "KVCache",
    "merge_attention",
    "MultiHeadAttention",
]
