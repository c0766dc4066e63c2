"""Checking a library's output against fastattn.reference before it is timed:
the float64 expected rows of a shape or a block step, the tolerance (the test
suite's float32 rule, plus half an ulp of a 16-bit output) and the error
measure. Nothing here times or prints.
"""
import dataclasses

import numpy as np

from fastattn import reference
from fastattn.bench.dtypes import as_float64, storage

CHECK_ELEMENTS = 2**21  # the reference materialises (B, Hq, rows, S) several times


@dataclasses.dataclass
class Reference:
    """The float64 reference on the last ``rows`` query rows of a shape (all of
    them unless the shape is large), and the tolerance there."""

    rows: int
    expected: np.ndarray
    tolerance: float


def check_rows(shape):
    return max(1, min(shape.L, CHECK_ELEMENTS // (shape.B * shape.Hq * shape.S)))


def tolerance(textbook_error, vmax):
    """The test suite's float32 rule: max(2 × textbook float32 NumPy's error,
    16·2⁻²⁴·max|V|), so a library passes if it is about as exact as NumPy."""
    return max(2 * textbook_error, 16 * 2.0**-24 * vmax)


def reference_for(shape, q, k, v):
    """The last rows only: with causal=True (bottom-right alignment) the last r
    rows against all keys are exactly those rows of the full problem (ALiBi's
    diagonal is bottom-right too). With the shape's score modifier, if any.

    16-bit and int8 inputs are checked on float64 copies of what is stored
    (the same rounded or quantized values every library gets), with the rule
    above plus half an ulp of the output dtype at max|out|: a 16-bit output is
    a float32 result rounded once."""
    rows = check_rows(shape)
    qs = q[..., q.shape[-2] - rows:, :]
    mods = shape.modifier_args()
    if q.dtype == np.float64:
        expected = reference.attention(qs, k, v, causal=shape.causal, **mods)
        return Reference(rows, expected, 1e-12 * max(float(np.abs(v).max()), 1.0))
    q64, k64, v64 = (as_float64(x) for x in (qs, k, v))
    expected = reference.attention(q64, k64, v64, causal=shape.causal, **mods)
    textbook = reference.attention(q64, k64, v64, causal=shape.causal, dtype=np.float32, **mods)
    tol = tolerance(float(np.abs(textbook - expected).max()), float(np.abs(v64).max()))
    tol += storage(q.dtype).half_ulp * float(np.abs(expected).max())
    return Reference(rows, expected, tol)


def block_reference(problem):
    """A block step's float64 result and the tolerance rule above, with the
    same block in float32 with textbook NumPy attention as the textbook."""
    expected, scale = problem.reference()
    textbook = problem.prepare("numpy", None)()
    err = float(np.abs(textbook.astype(np.float64) - expected).max())
    tol = 1e-12 * max(scale, 1.0) if problem.dtype == np.float64 else tolerance(err, scale)
    return Reference(problem.shape.new, expected, tol)


def max_error(output, ref):
    out = np.asarray(output)
    if out.shape[-2] != ref.expected.shape[-2]:
        out = out[..., out.shape[-2] - ref.rows:, :]
    return float(np.abs(out.astype(np.float64) - ref.expected).max())
