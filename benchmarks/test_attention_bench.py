"""fastattn and every installed peer on the shapes of fastattn._bench.SHAPES.

Run: `pytest benchmarks` (add `--attn-threads 1`, `-k enc512`, pytest-benchmark's
`--benchmark-json FILE`, ...). Each case is built and checked against the
reference before it is timed; each library runs in its own loop, after a
pause that lets the previous library's spinning threads fall asleep.
"""
import functools
import time

import pytest

from fastattn import _bench, _peers

LIBRARIES = ["fastattn"] + [name for name in _peers.PEERS if _peers.LIBRARIES[name].installed()]


@functools.lru_cache(maxsize=1)  # cases run shape by shape, so one shape's arrays suffice
def case(shape):
    q, k, v = shape.inputs()
    return q, k, v, _bench.reference_for(shape, q, k, v)


# library inside shape: a shape's inputs and reference are made once for all libraries
@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("shape", _bench.SHAPES, ids=[s.name for s in _bench.SHAPES])
def test_attention(benchmark, shape, library, threads):
    lib = _peers.LIBRARIES[library]
    q, k, v, ref = case(shape)
    with _bench.blas_threads(threads):
        call = lib.prepare(q, k, v, shape.causal, threads)
        err = _bench.max_error(call(), ref)
        assert err <= ref.tolerance, f"{lib.title} is off the reference by {err:.2e}"
        benchmark.group = f"{shape.name}: {shape.label}"
        benchmark.extra_info.update(flops=shape.flops, threads=threads, max_error=err)
        time.sleep(_bench.PAUSE_S)
        benchmark(call)
    if benchmark.stats:  # None with --benchmark-disable
        benchmark.extra_info["gflops"] = shape.flops / benchmark.stats.stats.median / 1e9
