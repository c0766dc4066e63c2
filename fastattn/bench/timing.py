"""The timing loop and the machine's yardsticks: time_call (warm-up, then
samples of back-to-back calls, the median), NumPy's BLAS thread limit, the
matmul peak and the read bandwidth that results are reported against.
No library adapters, no checking, no printing.
"""
import dataclasses
import gc
import math
import time
from contextlib import nullcontext

import numpy as np

PAUSE_S = 0.2          # lets spinning BLAS/OpenMP workers fall asleep between loops
SAMPLE_S = 2e-3        # a sample repeats a call until it lasts this long (µs calls)
WARMUP_S = 0.1
PEAK_N = 2048
BANDWIDTH_BYTES = 512 * 2**20  # the array the read-bandwidth loop sums: far above any cache
MAX_KV_COPIES = 32  # decode shapes: at most this many copies of K and V read in turn


@dataclasses.dataclass
class Timing:
    median_s: float
    samples: int
    number: int    # calls per sample
    min_s: float
    spread: float  # interquartile range / median: how noisy the machine was


def time_call(fn, repeat=10, min_time=0.5):
    """Median seconds per call of ``fn()``.

    Warm up for WARMUP_S (first calls allocate, compile, start threads), then
    take samples of ``number`` back-to-back calls, ``number`` chosen so a
    sample lasts SAMPLE_S (the clock's overhead vanishes for µs calls), until
    there are ``repeat`` samples and ``min_time`` seconds have passed.
    """
    start, warm = time.perf_counter(), 0
    while warm < 2 or time.perf_counter() - start < WARMUP_S:
        fn()
        warm += 1
    per_call = (time.perf_counter() - start) / warm
    number = max(1, math.ceil(SAMPLE_S / max(per_call, 1e-9)))
    times = []
    gc_was_on = gc.isenabled()
    gc.disable()  # a collection inside a sample is noise, not the library's cost
    try:
        begin = time.perf_counter()
        while len(times) < repeat or time.perf_counter() - begin < min_time:
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            times.append((time.perf_counter() - t0) / number)
    finally:
        if gc_was_on:
            gc.enable()
    q1, median, q3 = np.percentile(times, [25, 50, 75])
    return Timing(float(median), len(times), number, float(min(times)), float((q3 - q1) / median))


def blas_threads(n):
    """NumPy's BLAS limited to ``n`` threads (a no-op without threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


def matmul_peak(threads, dtype=np.float32, repeat=10, min_time=0.5):
    """The practical peak: GFLOP/s of NumPy's PEAK_N² matmul on ``threads`` BLAS threads."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((PEAK_N, PEAK_N), dtype=np.float32).astype(dtype)
    b = rng.standard_normal((PEAK_N, PEAK_N), dtype=np.float32).astype(dtype)
    with blas_threads(threads):
        t = time_call(lambda: a @ b, repeat, min_time)
    return 2 * PEAK_N**3 / t.median_s / 1e9


def kv_copies(kv_bytes, asked="auto"):
    """How many copies of a decode shape's K and V its timed calls read in turn.

    A model's layers each read their own cache once per token, so a decode
    call finds K and V in memory, not in cache. One copy read over and over
    stays in the last-level cache wherever it fits (a 4096-key float32 cache
    of 8 heads is 32 MiB; some L3s hold hundreds of MiB). "auto": enough
    copies to fill BANDWIDTH_BYTES, the array the read bandwidth is measured
    on, so a decode row and its yardstick read from the same level; at most
    MAX_KV_COPIES. An int: that many (1: one copy, cache-resident where it fits).
    """
    if asked == "auto":
        return max(1, min(MAX_KV_COPIES, math.ceil(BANDWIDTH_BYTES / kv_bytes)))
    return int(asked)


def _self_dot(x):
    return np.dot(x, x)


def read_bandwidth(threads, repeat=10, min_time=0.5):
    """A practical read bandwidth in GB/s: ``threads`` Python threads each read
    an equal slice of a BANDWIDTH_BYTES float32 array once, as BLAS's dot of the
    slice with itself on one BLAS thread (NumPy releases the GIL there, so the
    slices are read in parallel). Nothing of fastattn is used; decode shapes
    are reported against this. Not np.sum: its pairwise loop is bound by the
    adds, not by memory, on one core (about 60 % of this on an EPYC)."""
    from concurrent.futures import ThreadPoolExecutor
    a = np.ones(BANDWIDTH_BYTES // 4, np.float32)  # written once: every page is mapped
    chunks = np.array_split(a, threads)
    with blas_threads(1), ThreadPoolExecutor(threads) as pool:
        if threads == 1:
            t = time_call(lambda: _self_dot(a), repeat, min_time)
        else:
            t = time_call(lambda: list(pool.map(_self_dot, chunks)), repeat, min_time)
    return a.nbytes / t.median_s / 1e9
