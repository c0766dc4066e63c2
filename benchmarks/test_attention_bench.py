"""fastattn and every installed peer on the shapes of fastattn.bench.shapes.SHAPES.

Run: `pytest benchmarks` (add `--attn-threads 1`, `--attn-dtype float32,float16,int8`,
`-k enc512`, pytest-benchmark's `--benchmark-json FILE`, ...). Each case is built and checked against the
reference before it is timed; each library runs in its own loop, after a
pause that lets the previous library's spinning threads fall asleep. A
decode case's calls read copies of K and V in turn, from memory, as
`python -m fastattn bench` does (fastattn.bench.timing.kv_copies).
"""
import functools
import time

import pytest

from fastattn.bench import peers, run, timing
from fastattn.bench.dtypes import storage
from fastattn.bench.shapes import SHAPES

LIBRARIES = ["fastattn"] + [name for name in peers.PEERS if peers.LIBRARIES[name].installed()]


@functools.lru_cache(maxsize=1)  # cases run shape by shape, so one shape's arrays suffice
def case(shape, dtype):
    """The shape's reference and prepare(library, threads) in that storage dtype."""
    return run._problem(shape, storage(dtype))


# library inside shape: a shape's inputs and reference are made once for all libraries
@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_attention(benchmark, shape, library, dtype, threads):
    lib, st = peers.LIBRARIES[library], storage(dtype)
    if not st.available():
        pytest.skip(f"{dtype} needs ml_dtypes")
    if not run._runs_on(lib, shape, st):
        pytest.skip(f"{lib.title} does not run {shape.name} in {dtype}")
    ref, prepare = case(shape, dtype)
    with timing.blas_threads(threads):
        call = prepare(library, threads)
        err = run.checked_error(call, ref)
        assert err <= ref.tolerance, f"{lib.title} is off the reference by {err:.2e}"
        benchmark.group = f"{shape.name} ({dtype}): {shape.label}"
        benchmark.extra_info.update(flops=shape.flops, threads=threads, max_error=err, dtype=dtype)
        time.sleep(timing.PAUSE_S)
        benchmark(call)
    if benchmark.stats:  # None with --benchmark-disable
        benchmark.extra_info["gflops"] = shape.flops / benchmark.stats.stats.median / 1e9
        if shape.kind == "decode":
            benchmark.extra_info["gb_per_s"] = st.kv_bytes(shape) / benchmark.stats.stats.median / 1e9
            benchmark.extra_info["kv_copies"] = len(run.calls_in(call))
