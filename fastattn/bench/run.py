"""The run: every library on every shape, storage dtype and thread count,
each in its own loop after a pause, each checked before it is timed; a Result
per case and a progress line on stderr. Timing, checks, dtypes, adapters and
the report are the other modules of fastattn.bench.
"""
import dataclasses
import sys
import time

import numpy as np

from fastattn.bench import block, timing
from fastattn.bench.checks import block_reference, max_error, reference_for
from fastattn.bench.dtypes import storage
from fastattn.bench.header import OthersWatch
from fastattn.bench.peers import ALL_PEERS, LIBRARIES
from fastattn.bench.report import format_time, threads_text
from fastattn.bench.timing import blas_threads, matmul_peak, read_bandwidth, time_call


@dataclasses.dataclass
class Result:
    shape: str
    dims: str
    threads: int
    library: str
    status: str                   # ok, failed check, error
    median_s: float = None
    gflops: float = None
    peak_share: float = None      # of the same run's matmul GFLOP/s
    gbps: float = None            # decode shapes: bytes of K and V stored (so read) per call / time
    bandwidth_share: float = None  # decode shapes: of the same run's read bandwidth
    tokens_per_s: float = None    # block shapes: tokens through the block per second
    ratio_to_fastattn: float = None  # this library's time / fastattn's
    ratio_to_plain: float = None  # modifier rows: this time / the same library's plain call's
    speedup_over_float32: float = None  # 16-bit and int8 rows: the library's float32 time / this
    max_error: float = None
    tolerance: float = None
    samples: int = None
    number: int = None
    min_s: float = None
    spread: float = None          # interquartile range / median
    others_busy: float = None     # share of the CPUs other processes used during the loop
    detail: str = ""
    dtype: str = "float32"        # the --dtype storage (fastattn.bench.dtypes)
    kv_bytes: int = None          # decode shapes: bytes of K and V stored, scales included
    kv_copies: int = None         # decode shapes: copies of K and V the timed calls read in turn


def library_status(requested):
    """{name: "ok" | "not installed ..." | "unknown ..."} for fastattn + the requested peers."""
    status = {"fastattn": "ok"}
    for name in requested:
        if name not in LIBRARIES:
            status[name] = f"unknown library (known: {', '.join(ALL_PEERS)})"
        elif not LIBRARIES[name].installed():
            status[name] = "not installed (pip install 'fastattn[peers]')"
        else:
            try:
                LIBRARIES[name].load()
                status[name] = "ok"
            except Exception as e:  # a broken install must not stop the others
                status[name] = f"import failed: {_first_line(e)}"
    return status


def _first_line(e):
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]


def run_one(lib, shape, prepare, ref, threads, peak, repeat, min_time, bandwidth=None,
            dtype="float32"):
    """Build (``prepare(library name, threads)``), check, then time one
    library on one shape stored in ``dtype`` (its own loop)."""
    st = storage(dtype)
    res = Result(shape.name, shape.label, threads, lib.name, "error", dtype=st.name)
    try:
        with blas_threads(threads):
            call = prepare(lib.name, threads)
            res.max_error, res.tolerance = checked_error(call, ref), ref.tolerance
            if not res.max_error <= ref.tolerance:  # NaN fails too
                res.status = "failed check"
                res.detail = f"max error {res.max_error:.2e} > tolerance {ref.tolerance:.2e}"
                return res
            watch = OthersWatch().start()
            t = time_call(call, repeat, min_time)
            res.others_busy = watch.share()
    except Exception as e:
        res.detail = _first_line(e)
        return res
    res.status, res.median_s, res.samples, res.number = "ok", t.median_s, t.samples, t.number
    res.min_s, res.spread = t.min_s, t.spread
    res.gflops = shape.flops / t.median_s / 1e9
    res.peak_share = res.gflops / peak if peak else None
    if shape.decode:
        res.kv_bytes = st.kv_bytes(shape)
        res.gbps = res.kv_bytes / t.median_s / 1e9
        res.bandwidth_share = res.gbps / bandwidth if bandwidth else None
        res.kv_copies = len(calls_in(call))
    if shape.kind == "block":
        res.tokens_per_s = shape.tokens / t.median_s
    return res


def calls_in(call):
    """What a prepared call runs: a Rotation's calls (one per copy of K and V), or itself."""
    return call.calls if isinstance(call, Rotation) else [call]


def checked_error(call, ref):
    """``call``'s error against the reference; for a Rotation, over each copy
    of K and V once: the first that fails the tolerance (NaN included), else
    the largest."""
    errors = [max_error(c(), ref) for c in calls_in(call)]
    return next((e for e in errors if not e <= ref.tolerance), max(errors))


class Progress:
    """One status line on stderr: rewritten in place on a terminal, a line per
    finished step otherwise (logs, CI)."""

    def __init__(self, total, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.tty = self.stream.isatty()

    def show(self, text):
        if self.tty:
            self.stream.write(f"\r\033[K[{self.done}/{self.total}] {text}")
            self.stream.flush()

    def step(self, text):
        self.done += 1
        if self.tty:
            self.show(text)
        else:
            print(f"[{self.done}/{self.total}] {text}", file=self.stream, flush=True)

    def close(self):
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def run(shapes, libraries, threads_list, dtypes=("float32",), repeat=10, min_time=0.5,
        progress=None, kv_copies="auto"):
    """Time every library on every shape, storage dtype and thread count.

    ``dtypes``: --dtype names (fastattn.bench.dtypes.STORAGES), or one name or
    NumPy dtype. The peaks come first (the matmul in each dtype the rows
    compute in, and the read bandwidth when a decode shape is asked for);
    then shape by shape, so a shape's inputs and references are made once and
    its dtypes and thread counts run close in time. A storage runs the kinds
    of shape it lists (int8: decode only); a library whose ``kinds`` leaves a
    shape's kind out, or that lacks a shape's score modifier or dtype, is not
    run on it. A modifier row's time is also taken over the same library's
    time on the plain shape (``base``) in this run, and a 16-bit or int8 row's
    speed-up over the same library's float32 row. A decode shape's calls read
    ``kv_copies`` copies of K and V in turn (timing.kv_copies: "auto" reads
    them from memory, as a model's layers do). Returns (peaks, results,
    bandwidths): {threads: {"float32" or "float64": matmul GFLOP/s}}, a list
    of Result, {threads: read GB/s} (empty without decode shapes).
    """
    if isinstance(dtypes, (str, np.dtype, type)):
        dtypes = [dtypes]
    storages = [storage(d) for d in dtypes]
    libs = [LIBRARIES[name] for name in libraries]
    cases = [(s, st) for s in shapes for st in storages if s.kind in st.kinds]
    any_decode = any(s.decode for s, _ in cases)
    computes = list(dict.fromkeys(st.compute for _, st in cases)) or [storages[0].compute]
    pairs = sum(1 for s, st in cases for lib in libs if _runs_on(lib, s, st))
    progress = progress or Progress(len(threads_list) * (len(computes) + any_decode + pairs))
    peaks, bandwidths, results = {}, {}, []
    for threads in threads_list:
        peaks[threads] = {}
        for compute in computes:
            what = f"{compute} matmul peak, {threads_text(threads)}"
            progress.show(what)
            peaks[threads][compute] = matmul_peak(threads, np.dtype(compute), repeat, min_time)
            progress.step(f"{what}: {peaks[threads][compute]:.0f} GFLOP/s")
        if any_decode:
            time.sleep(timing.PAUSE_S)
            progress.show(f"read bandwidth, {threads_text(threads)}")
            bandwidths[threads] = read_bandwidth(threads, repeat, min_time)
            progress.step(f"read bandwidth, {threads_text(threads)}: "
                          f"{bandwidths[threads]:.1f} GB/s")
    for shape in shapes:
        prepared = []  # (storage, reference, prepare) for each dtype the shape runs in
        for st in storages:
            if shape.kind not in st.kinds:
                continue
            progress.show(f"{shape.name}, {st.name}: the reference")
            prepared.append((st, *_problem(shape, st, kv_copies)))
        for threads in threads_list:
            for st, ref, prepare in prepared:
                base = None
                for lib in libs:
                    if not _runs_on(lib, shape, st):
                        continue
                    time.sleep(timing.PAUSE_S)
                    where = f"{shape.name}, {st.name}, {threads_text(threads)}: {lib.title}"
                    progress.show(where)
                    res = run_one(lib, shape, prepare, ref, threads, peaks[threads][st.compute],
                                  repeat, min_time, bandwidths.get(threads), st)
                    if lib.name == "fastattn" and res.status == "ok":
                        base = res.median_s
                    if base and res.median_s:
                        res.ratio_to_fastattn = res.median_s / base
                    results.append(res)
                    took = format_time(res.median_s) if res.median_s else res.status
                    progress.step(f"{where} {took}")
    progress.close()
    _ratios_to_plain(shapes, results)
    _speedups_over_float32(results)
    return peaks, results, bandwidths


def _problem(shape, st, kv_copies="auto"):
    """A shape's reference and its ``prepare(library name, threads)`` in one
    storage. A decode shape's prepare gives a Rotation over its copies of K
    and V when there are several (timing.kv_copies)."""
    if shape.kind == "block":
        problem = block.BlockProblem(shape, st.dtype())
        return block_reference(problem), problem.prepare
    q, k, v = st.inputs(shape)
    ref = reference_for(shape, q, k, v)
    copies = timing.kv_copies(st.kv_bytes(shape), kv_copies) if shape.decode else 1
    kvs = [(k, v)] + [(_fresh(k), _fresh(v)) for _ in range(copies - 1)]

    def prepare(name, threads, q=q, causal=shape.causal, mods=shape.modifier_args()):
        calls = LIBRARIES[name].prepare_copies(q, kvs, causal, threads, **mods)
        return calls[0] if len(calls) == 1 else Rotation(calls)

    return ref, prepare


def _fresh(x):
    """A copy of a stored K or V (an int8 pair: both parts) in its own memory."""
    return tuple(a.copy() for a in x) if isinstance(x, tuple) else x.copy()


class Rotation:
    """One timed callable over a library's calls on several copies of K and V:
    each call runs the next, so no copy is read again until all the others
    have been, and a cache that holds one copy holds none by then."""

    def __init__(self, calls):
        self.calls, self.next = calls, 0

    def __call__(self):
        call = self.calls[self.next]
        self.next = (self.next + 1) % len(self.calls)
        return call()


def _speedups_over_float32(results):
    """Each 16-bit or int8 row's speed-up: the same library's float32 time on
    the same shape and threads, in this run, over its time."""
    f32 = {(r.shape, r.library, r.threads): r.median_s for r in results
           if r.status == "ok" and r.dtype == "float32"}
    for r in results:
        t = f32.get((r.shape, r.library, r.threads))
        if r.status == "ok" and r.dtype not in ("float32", "float64") and t:
            r.speedup_over_float32 = t / r.median_s


def _ratios_to_plain(shapes, results):
    """Each modifier row's time over its plain shape's, same library and threads."""
    base = {s.name: s.base for s in shapes if s.modifier}
    plain = {(r.shape, r.library, r.threads, r.dtype): r.median_s for r in results
             if r.status == "ok"}
    for r in results:
        t = plain.get((base.get(r.shape), r.library, r.threads, r.dtype))
        if r.status == "ok" and t:
            r.ratio_to_plain = r.median_s / t


def _runs_on(lib, shape, st=None):
    """Whether ``lib`` runs ``shape`` stored as ``st`` (a Storage; None: float32)."""
    st = storage(st or "float32")
    if shape.kind not in st.kinds:
        return False
    if shape.kind == "block":  # the same block, attention by each of these
        return lib.name in block.ATTENTIONS
    kinds = getattr(lib, "kinds", None)
    return ((kinds is None or shape.kind in kinds) and lib.has(shape.modifier)
            and lib.has_dtype(st.name))
