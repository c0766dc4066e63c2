"""The run: every library on every shape and thread count, each in its own
loop after a pause, each checked before it is timed; a Result per pair and a
progress line on stderr. Timing, checks, adapters and the report are the
other modules of fastattn.bench.
"""
import dataclasses
import sys
import time

import numpy as np

from fastattn.bench import block, timing
from fastattn.bench.checks import block_reference, max_error, reference_for
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
    gbps: float = None            # decode shapes: bytes of K and V read per call / time
    bandwidth_share: float = None  # decode shapes: of the same run's read bandwidth
    tokens_per_s: float = None    # block shapes: tokens through the block per second
    ratio_to_fastattn: float = None  # this library's time / fastattn's
    ratio_to_plain: float = None  # modifier rows: this time / the same library's plain call's
    max_error: float = None
    tolerance: float = None
    samples: int = None
    number: int = None
    min_s: float = None
    spread: float = None          # interquartile range / median
    others_busy: float = None     # share of the CPUs other processes used during the loop
    detail: str = ""


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
            dtype=np.float32):
    """Build (``prepare(library name, threads)``), check, then time one
    library on one shape (its own loop)."""
    res = Result(shape.name, shape.label, threads, lib.name, "error")
    try:
        with blas_threads(threads):
            call = prepare(lib.name, threads)
            res.max_error, res.tolerance = max_error(call(), ref), ref.tolerance
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
        res.gbps = shape.kv_bytes(dtype) / t.median_s / 1e9
        res.bandwidth_share = res.gbps / bandwidth if bandwidth else None
    if shape.kind == "block":
        res.tokens_per_s = shape.tokens / t.median_s
    return res


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


def run(shapes, libraries, threads_list, dtype=np.float32, repeat=10, min_time=0.5,
        progress=None):
    """Time every library on every shape and thread count.

    The peaks come first (and the read bandwidth when a decode shape is
    asked for); then shape by shape, so a shape's inputs and reference are
    made once and its thread counts run close in time. A library whose
    ``kinds`` leaves a shape's kind out, or that lacks a shape's score
    modifier, is not run on it. A modifier row's time is also taken over
    the same library's time on the plain shape (``base``) in this run.
    Returns (peaks, results, bandwidths): {threads: matmul GFLOP/s}, a list of
    Result, {threads: read GB/s} (empty without decode shapes).
    """
    libs = [LIBRARIES[name] for name in libraries]
    any_decode = any(s.decode for s in shapes)
    pairs = sum(1 for s in shapes for lib in libs if _runs_on(lib, s))
    progress = progress or Progress(len(threads_list) * (1 + any_decode + pairs))
    peaks, bandwidths, results = {}, {}, []
    for threads in threads_list:
        progress.show(f"matmul peak, {threads_text(threads)}")
        peaks[threads] = matmul_peak(threads, dtype, repeat, min_time)
        progress.step(f"matmul peak, {threads_text(threads)}: {peaks[threads]:.0f} GFLOP/s")
        if any_decode:
            time.sleep(timing.PAUSE_S)
            progress.show(f"read bandwidth, {threads_text(threads)}")
            bandwidths[threads] = read_bandwidth(threads, repeat, min_time)
            progress.step(f"read bandwidth, {threads_text(threads)}: "
                          f"{bandwidths[threads]:.1f} GB/s")
    for shape in shapes:
        progress.show(f"{shape.name}: the reference")
        if shape.kind == "block":
            problem = block.BlockProblem(shape, dtype)
            ref = block_reference(problem)
            prepare = problem.prepare
        else:
            q, k, v = shape.inputs(dtype)
            ref = reference_for(shape, q, k, v)

            def prepare(name, threads, q=q, k=k, v=v, causal=shape.causal,
                        mods=shape.modifier_args()):
                return LIBRARIES[name].prepare(q, k, v, causal, threads, **mods)
        for threads in threads_list:
            base = None
            for lib in libs:
                if not _runs_on(lib, shape):
                    continue
                time.sleep(timing.PAUSE_S)
                where = f"{shape.name}, {threads_text(threads)}: {lib.title}"
                progress.show(where)
                res = run_one(lib, shape, prepare, ref, threads, peaks[threads], repeat, min_time,
                              bandwidths.get(threads), dtype)
                if lib.name == "fastattn" and res.status == "ok":
                    base = res.median_s
                if base and res.median_s:
                    res.ratio_to_fastattn = res.median_s / base
                results.append(res)
                took = format_time(res.median_s) if res.median_s else res.status
                progress.step(f"{where} {took}")
    progress.close()
    _ratios_to_plain(shapes, results)
    return peaks, results, bandwidths


def _ratios_to_plain(shapes, results):
    """Each modifier row's time over its plain shape's, same library and threads."""
    base = {s.name: s.base for s in shapes if s.modifier}
    plain = {(r.shape, r.library, r.threads): r.median_s for r in results if r.status == "ok"}
    for r in results:
        t = plain.get((base.get(r.shape), r.library, r.threads))
        if r.status == "ok" and t:
            r.ratio_to_plain = r.median_s / t


def _runs_on(lib, shape):
    if shape.kind == "block":  # the same block, attention by each of these
        return lib.name in block.ATTENTIONS
    kinds = getattr(lib, "kinds", None)
    return (kinds is None or shape.kind in kinds) and lib.has(shape.modifier)
