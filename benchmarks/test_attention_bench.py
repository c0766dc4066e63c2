"""fastattn and every installed peer on the shapes of fastattn.bench.shapes.SHAPES.

Run: `pytest benchmarks` (add `--attn-threads 1`, `-k enc512`, pytest-benchmark's
`--benchmark-json FILE`, ...). Each case is built and checked against the
reference before it is timed; each library runs in its own loop, after a
pause that lets the previous library's spinning threads fall asleep.
"""
import functools
import time

import pytest

from fastattn.bench import checks, peers, timing
from fastattn.bench.shapes import SHAPES

LIBRARIES = ["fastattn"] + [name for name in peers.PEERS if peers.LIBRARIES[name].installed()]


@functools.lru_cache(maxsize=1)  # cases run shape by shape, so one shape's arrays suffice
def case(shape):
    q, k, v = shape.inputs()
    return q, k, v, checks.reference_for(shape, q, k, v)


# library inside shape: a shape's inputs and reference are made once for all libraries
@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_attention(benchmark, shape, library, threads):
    lib = peers.LIBRARIES[library]
    q, k, v, ref = case(shape)
    with timing.blas_threads(threads):
        call = lib.prepare(q, k, v, shape.causal, threads)
        err = checks.max_error(call(), ref)
        assert err <= ref.tolerance, f"{lib.title} is off the reference by {err:.2e}"
        benchmark.group = f"{shape.name}: {shape.label}"
        benchmark.extra_info.update(flops=shape.flops, threads=threads, max_error=err)
        time.sleep(timing.PAUSE_S)
        benchmark(call)
    if benchmark.stats:  # None with --benchmark-disable
        benchmark.extra_info["gflops"] = shape.flops / benchmark.stats.stats.median / 1e9
