"""The benchmark: shapes, the timing loop, the correctness check, the report.

`python -m fastattn bench` and benchmarks/ (pytest-benchmark) share the shape
table and the check. Every library is timed in its own loop after a warm-up,
never interleaved with another, and a pause separates loops: NumPy's OpenBLAS
threads (and torch's, ONNX Runtime's) spin after a call and slow whichever
thread team starts next. The library adapters live in fastattn._peers.
"""
import dataclasses
import gc
import json
import math
import os
import platform
import sys
import time
import zlib
from contextlib import nullcontext

import numpy as np

import fastattn
from fastattn import _block, reference
from fastattn._peers import ALL_PEERS, LIBRARIES

PAUSE_S = 0.2          # lets spinning BLAS/OpenMP workers fall asleep between loops
SAMPLE_S = 2e-3        # a sample repeats a call until it lasts this long (µs calls)
WARMUP_S = 0.1
CHECK_ELEMENTS = 2**21  # the reference materialises (B, Hq, rows, S) several times
PEAK_N = 2048
BANDWIDTH_BYTES = 512 * 2**20  # the array the read-bandwidth loop sums: far above any cache
BUSY = 0.10             # other processes' CPU share above which the header warns
NOISY = 0.25            # a time is marked † when its interquartile range exceeds this share
SLOW_BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_NUM_THREADS",
              "MKL_NUM_THREADS") + SLOW_BLAS_ENV


# ---------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------

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
        return kind + self.dims

    @property
    def flops(self):
        """4·B·Hq·L·S·E (Q·Kᵀ and P·V, a multiply-add each); half is visible
        when causal with L == S."""
        f = 4 * self.B * self.Hq * self.L * self.S * self.E
        return f // 2 if self.causal and self.L == self.S else f

    def inputs(self, dtype=np.float32):
        """q, k, v drawn from N(0, 1), the same every run (seeded by the name)."""
        rng = np.random.default_rng(zlib.crc32(self.name.encode()))
        kv = (self.B, self.Hkv, self.S, self.E)
        q = rng.standard_normal((self.B, self.Hq, self.L, self.E), dtype=np.float32)
        k = rng.standard_normal(kv, dtype=np.float32)
        v = rng.standard_normal(kv, dtype=np.float32)
        return tuple(x.astype(dtype, copy=False) for x in (q, k, v))


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
# A NumPy transformer block (fastattn._block), run with fastattn's attention
# and with NumPy's: the end-to-end effect, projections and MLP included.
BLOCK_SHAPES = _block.BLOCK_SHAPES
SHAPES_BY_NAME = {s.name: s for s in SHAPES + BLOCK_SHAPES}
# what --shapes takes besides a shape's name
SHAPE_GROUPS = {kind: [s for s in SHAPES + BLOCK_SHAPES if s.kind == kind]
                for kind in ("full", "decode", "block")}


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# Checking against the reference
# ---------------------------------------------------------------------------

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
    rows against all keys are exactly those rows of the full problem."""
    rows = check_rows(shape)
    qs = q[..., q.shape[-2] - rows:, :]
    expected = reference.attention(qs, k, v, causal=shape.causal)
    if q.dtype == np.float64:
        tol = 1e-12 * max(float(np.abs(v).max()), 1.0)
    else:
        textbook = reference.attention(qs, k, v, causal=shape.causal, dtype=q.dtype)
        tol = tolerance(float(np.abs(textbook - expected).max()), float(np.abs(v).max()))
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


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------

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


def threads_text(n):
    return f"{n} thread" + ("" if n == 1 else "s")


def run(shapes, libraries, threads_list, dtype=np.float32, repeat=10, min_time=0.5,
        progress=None):
    """Time every library on every shape and thread count.

    The peaks come first (and the read bandwidth when a decode shape is
    asked for); then shape by shape, so a shape's inputs and reference are
    made once and its thread counts run close in time. A library whose
    ``kinds`` leaves a shape's kind out is not run on it.
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
            time.sleep(PAUSE_S)
            progress.show(f"read bandwidth, {threads_text(threads)}")
            bandwidths[threads] = read_bandwidth(threads, repeat, min_time)
            progress.step(f"read bandwidth, {threads_text(threads)}: "
                          f"{bandwidths[threads]:.1f} GB/s")
    for shape in shapes:
        progress.show(f"{shape.name}: the reference")
        if shape.kind == "block":
            problem = _block.BlockProblem(shape, dtype)
            ref = block_reference(problem)
            prepare = problem.prepare
        else:
            q, k, v = shape.inputs(dtype)
            ref = reference_for(shape, q, k, v)

            def prepare(name, threads, q=q, k=k, v=v, causal=shape.causal):
                return LIBRARIES[name].prepare(q, k, v, causal, threads)
        for threads in threads_list:
            base = None
            for lib in libs:
                if not _runs_on(lib, shape):
                    continue
                time.sleep(PAUSE_S)
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
    return peaks, results, bandwidths


def _runs_on(lib, shape):
    if shape.kind == "block":  # the same block, attention by each of these
        return lib.name in _block.ATTENTIONS
    kinds = getattr(lib, "kinds", None)
    return kinds is None or shape.kind in kinds


# ---------------------------------------------------------------------------
# Header
# ---------------------------------------------------------------------------

def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def threadpools():
    """threadpoolctl's view of the loaded BLAS and OpenMP pools, or None."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    return threadpool_info()


def header(libraries, status, threads_list, dtype):
    """Everything needed to read (and reproduce) the numbers, as a dict."""
    info = fastattn.info()
    versions = {name: LIBRARIES[name].versions() for name in libraries
                if name in LIBRARIES and status.get(name) == "ok"}
    return {
        "fastattn": info["version"],
        "isa": info["isa"],
        "isas": info["isas"],
        "openmp": info["openmp"],
        "max_threads": info["max_threads"],
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "platform": f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
        "threads": list(threads_list),
        "dtype": np.dtype(dtype).name,
        "versions": versions,
        "libraries": status,
        "threadpools": threadpools(),
        "env": {name: os.environ[name] for name in THREAD_ENV if name in os.environ},
        "cpu_busy_before": cpu_busy(),
    }


class OthersWatch:
    """How much of all CPUs other processes used between start() and share():
    the machine's busy ticks (Linux /proc/stat) minus this process's CPU time.
    share() is None where /proc/stat is missing."""

    def start(self):
        self.begin = self._now()
        return self

    @staticmethod
    def _now():
        try:
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:]]
            hz = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, AttributeError):
            return None
        # total, idle + iowait, and our own CPU time (all threads) in the same ticks
        return sum(ticks[:8]), ticks[3] + ticks[4], time.process_time() * hz

    def share(self):
        end = self._now()
        if self.begin is None or end is None or end[0] <= self.begin[0]:
            return None
        total, idle, own = (e - b for e, b in zip(end, self.begin))
        return min(1.0, max(0.0, 1 - (idle + own) / total))


def cpu_busy(seconds=0.5):
    """Share of all CPUs that other processes used while this one slept for
    ``seconds``. The load average would lag by a minute; this sees what the
    timing loops are about to compete with."""
    watch = OthersWatch().start()
    time.sleep(seconds)
    return watch.share()


def busy_note(busy):
    """A warning when other processes keep the CPUs busy, else None."""
    if busy is None or busy < BUSY:
        return None
    return (f"warning: other processes kept the CPUs {100 * busy:.0f} % busy; they compete "
            "with the timing loops, and multi-threaded timings suffer most")


def _pool_line(p):
    parts = [f"{p.get('user_api')}: {p.get('internal_api')} {p.get('version') or ''}".rstrip(),
             f"{p.get('num_threads')} threads"]
    parts += [str(p[key]) for key in ("threading_layer", "architecture") if p.get(key)]
    return f"{', '.join(parts)} ({os.path.basename(p.get('filepath', ''))})"


def slow_blas_note():
    """A line when the env pins OpenBLAS to old kernels, else None."""
    found = [f"{name}={os.environ[name]}" for name in SLOW_BLAS_ENV if name in os.environ]
    if not found:
        return None
    return (f"note: {' '.join(found)} set; these pin OpenBLAS to older kernels and slow NumPy. "
            f"For NumPy's real speed: env -u {' -u '.join(SLOW_BLAS_ENV)} python -m fastattn bench")


def format_header(h):
    openmp = "yes" if h["openmp"] else "no (serial build)"
    lines = [
        f"fastattn {h['fastattn']}: ISA {h['isa']} (this CPU runs {', '.join(h['isas'])}), "
        f"OpenMP {openmp}, max threads {h['max_threads']}",
        f"CPU: {h['cpu']}, {h['cpus']} logical CPUs; {h['platform']}",
        f"threads timed: {', '.join(map(str, h['threads']))}; dtype {h['dtype']}",
        "versions: " + "; ".join(v for v in h["versions"].values() if v),
    ]
    missing = {n: s for n, s in h["libraries"].items() if s != "ok"}
    lines += [f"skipped: {name}: {why}" for name, why in missing.items()]
    if h["threadpools"] is None:
        lines.append("thread pools: threadpoolctl not installed (NumPy's BLAS threads not set)")
    else:
        lines.append("thread pools (threadpoolctl):")
        lines += [f"  {_pool_line(p)}" for p in h["threadpools"]]
    if h["env"]:
        lines.append("environment: " + " ".join(f"{k}={v}" for k, v in h["env"].items()))
    if h["cpu_busy_before"] is not None:
        lines.append(f"CPUs busy with other processes just before the run: "
                     f"{100 * h['cpu_busy_before']:.0f} %")
    notes = (slow_blas_note(), busy_note(h["cpu_busy_before"]))
    return lines + [note for note in notes if note]


# ---------------------------------------------------------------------------
# Output: Markdown table, JSON, plot
# ---------------------------------------------------------------------------

def _sig3(x):
    return f"{x:#.3g}".rstrip(".")  # 12.0, 9.05, 123: three digits, no trailing dot


def format_time(seconds):
    if seconds < 1e-3:
        return f"{_sig3(seconds * 1e6)} µs"
    if seconds < 1:
        return f"{_sig3(seconds * 1e3)} ms"
    return f"{_sig3(seconds)} s"


def _cell_time(r):
    if r is None:
        return "—"
    if r.status != "ok":
        return "✗ check" if r.status == "failed check" else "error"
    noisy = " †" if r.spread is not None and r.spread > NOISY else ""
    noisy += " ‡" if r.others_busy is not None and r.others_busy > BUSY else ""
    if r.library == "fastattn" or r.ratio_to_fastattn is None:
        return format_time(r.median_s) + noisy
    return f"{format_time(r.median_s)} ({r.ratio_to_fastattn:.2f}×){noisy}"


def _cell_rate(r):
    if r is None or r.status != "ok":
        return "—"
    share = f" ({100 * r.peak_share:.0f} %)" if r.peak_share is not None else ""
    return f"{_sig3(r.gflops)}{share}"


def _cell_bandwidth(r):
    if r is None or r.status != "ok" or r.gbps is None:
        return "—"
    share = f" ({100 * r.bandwidth_share:.0f} %)" if r.bandwidth_share is not None else ""
    return f"{_sig3(r.gbps)}{share}"


def _cell_tokens(r):
    if r is None or r.status != "ok" or r.tokens_per_s is None:
        return "—"
    return f"{r.tokens_per_s:,.0f}" if r.tokens_per_s >= 100 else _sig3(r.tokens_per_s)


def _table(shapes, libraries, by_key, cell):
    titles = [LIBRARIES[name].title for name in libraries]
    lines = ["| shape B×Hq×L×S×E | " + " | ".join(titles) + " |",
             "|---|" + "--:|" * len(titles)]
    for shape in shapes:
        cells = [cell(by_key.get((shape.name, name))) for name in libraries]
        lines.append(f"| {shape.name}: {shape.label} | " + " | ".join(cells) + " |")
    return lines


def markdown(peaks, results, shapes, libraries, bandwidths=None):
    """One pair of tables per thread count and kind of shape: times (with each
    peer's time over fastattn's), then GFLOP/s with the share of the matmul
    peak (full shapes) or GB/s of K and V read with the share of the read
    bandwidth (decode shapes: bound by memory, not by the FPU)."""
    bandwidths = bandwidths or {}
    lines = []
    for threads, peak in peaks.items():
        by_key = {(r.shape, r.library): r for r in results if r.threads == threads}
        bw = bandwidths.get(threads)
        bw_text = (f"; read bandwidth {bw:.1f} GB/s (BLAS dot of a {BANDWIDTH_BYTES >> 20} MiB "
                   "array with itself, one stream a thread)") if bw else ""
        lines += [f"### {threads_text(threads)}: matmul peak {peak:.0f} GFLOP/s "
                  f"(NumPy {PEAK_N}×{PEAK_N} matmul){bw_text}", "",
                  "Median time per call; in brackets, the time over fastattn's "
                  f"(above 1: fastattn is faster); † noisy: interquartile range over "
                  f"{100 * NOISY:.0f} % of the median; ‡ other processes used over "
                  f"{100 * BUSY:.0f} % of the CPUs during the loop; — not run.", ""]
        full = [sh for sh in shapes if sh.kind == "full"]
        decode = [sh for sh in shapes if sh.decode]
        blocks = [sh for sh in shapes if sh.kind == "block"]
        if full:
            libs = [n for n in libraries if LIBRARIES[n].kinds is None or "full" in LIBRARIES[n].kinds]
            lines += _table(full, libs, by_key, _cell_time)
            lines += ["", "GFLOP/s (4·B·Hq·L·S·E per call, half for causal) and, in brackets, "
                      "the share of the matmul peak.", ""]
            lines += _table(full, libs, by_key, _cell_rate)
            lines.append("")
        if decode:
            libs = [n for n in libraries
                    if LIBRARIES[n].kinds is None or "decode" in LIBRARIES[n].kinds]
            if full:
                lines += ["Decode shapes:", ""]
            lines += _table(decode, libs, by_key, _cell_time)
            share = (f"the share of the read bandwidth measured in this run "
                     f"({bw:.1f} GB/s, {threads_text(threads)})" if bw else
                     "the share of the read bandwidth")
            lines += ["", "GB/s: bytes of K and V read per call (2·B·Hkv·S·E·4 in float32) "
                      f"over the median time; in brackets, {share} (over 100 %: "
                      "the library reads faster than one plain stream per thread does).", ""]
            lines += _table(decode, libs, by_key, _cell_bandwidth)
            lines.append("")
        if blocks:
            libs = [n for n in libraries if n in _block.ATTENTIONS]
            lines += ["Transformer block (fastattn._block: RMSNorm, projections and SiLU MLP as "
                      "NumPy matmuls on NumPy's BLAS threads; attention by the column's library "
                      "over the same KV cache). B×Hq×new tokens×S×E:", ""]
            lines += _table(blocks, libs, by_key, _cell_time)
            lines += ["", "Tokens per second through the block (B·new tokens per call):", ""]
            lines += _table(blocks, libs, by_key, _cell_tokens)
            lines.append("")
    problems = [r for r in results if r.status != "ok"]
    if problems:
        lines.append("Not timed:")
        lines += [f"- {r.shape}, {threads_text(r.threads)}, {LIBRARIES[r.library].title}: "
                  f"{r.status}: {r.detail}" for r in problems]
    return "\n".join(lines).rstrip() + "\n"


def to_json(path, head, peaks, results, bandwidths=None):
    doc = {"header": head, "matmul_peak_gflops": {str(t): p for t, p in peaks.items()},
           "read_bandwidth_gbps": {str(t): b for t, b in (bandwidths or {}).items()},
           "results": [dataclasses.asdict(r) for r in results]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)


def plot(path, peaks, results, shapes, libraries):
    """GFLOP/s per attention shape, one bar per library, one panel per thread
    count, the matmul peak as a dashed line. Needs matplotlib. False (and no
    file) when no attention shape was run."""
    import matplotlib
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    shapes = [s for s in shapes if s.kind != "block"]  # attention only: the peers' bars
    if not shapes:
        return False
    fig, axes = plt.subplots(len(peaks), 1, figsize=(1.6 * len(shapes) + 1, 3.8 * len(peaks)),
                             squeeze=False)
    width = 0.8 / len(libraries)
    for ax, (threads, peak) in zip(axes[:, 0], peaks.items()):
        by_key = {(r.shape, r.library): r for r in results if r.threads == threads}
        for i, name in enumerate(libraries):
            rates = [getattr(by_key.get((s.name, name)), "gflops", None) or 0 for s in shapes]
            ax.bar(np.arange(len(shapes)) + (i - (len(libraries) - 1) / 2) * width, rates,
                   width, label=LIBRARIES[name].title)
        ax.axhline(peak, color="k", linestyle="--", linewidth=1, label="matmul peak")
        ax.set_xticks(np.arange(len(shapes)), [f"{s.name}\n{s.dims}" for s in shapes], fontsize=7)
        ax.set_ylabel("GFLOP/s")
        ax.set_title(f"{threads_text(threads)}: matmul peak {peak:.0f} GFLOP/s", fontsize=9)
    # one legend above the panels, where it cannot hide a bar
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="upper center",
               ncol=len(libraries) + 1, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
