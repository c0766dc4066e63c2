"""The benchmark suite: fastattn timed against NumPy and the installed peers.

`python -m fastattn` imports this package only to time something: `main` is
the `bench` command, `time_against_numpy` the default run's one timing. The
core package never imports it; it imports the core. Its modules: shapes,
dtypes, timing, checks, peers, block, run, header, report, plot.
"""
import importlib.util
import sys
import time

import numpy as np

import fastattn
from fastattn.bench import header, peers, plot, report, run, timing
from fastattn.bench.shapes import SHAPES_BY_NAME, with_plain

TIMING_SHAPE = SHAPES_BY_NAME["enc512"]


def time_against_numpy(repeat=10, min_time=0.3):
    """fastattn against textbook NumPy on TIMING_SHAPE, each in its own loop."""
    s = TIMING_SHAPE
    q, k, v = s.inputs(np.float32)
    threads = fastattn.info()["max_threads"]
    numpy_call = peers.LIBRARIES["numpy"].prepare(q, k, v, s.causal, threads)
    watch = header.OthersWatch().start()
    t_np = timing.time_call(numpy_call, repeat, min_time)
    time.sleep(timing.PAUSE_S)  # OpenBLAS workers spin after a matmul; let them sleep first
    t_fa = timing.time_call(lambda: fastattn.attention(q, k, v), repeat, min_time)
    busy = watch.share()
    print(f"Timing on {s.label} float32 ({report.threads_text(threads)}; "
          "NumPy's loop first, then a pause, then fastattn's):")
    print(f"  NumPy textbook softmax(q·kᵀ·scale)·v  {report.format_time(t_np.median_s):>10}"
          f"  (median of {t_np.samples})")
    print(f"  fastattn.attention                    {report.format_time(t_fa.median_s):>10}"
          f"  (median of {t_fa.samples})")
    ratio = t_np.median_s / t_fa.median_s
    verdict = "faster" if ratio >= 1 else "slower"
    print(f"  ratio NumPy / fastattn: {ratio:.2f}× (fastattn is {verdict})")
    for note in (header.slow_blas_note(), header.busy_note(busy)):
        if note:
            print("  " + note)


def main(args):
    """`python -m fastattn bench`, from its parsed arguments (fastattn.__main__
    parses them): header, the run, the tables, then --json and --plot."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # said before the run, not after minutes of timing
        print(f"--plot needs matplotlib (pip install matplotlib); {args.plot} will not be written",
              file=sys.stderr)
        args.plot = None
    requested = args.peers or peers.default_peers()
    status = run.library_status(requested)
    libraries = [name for name, s in status.items() if s == "ok"]
    threads = args.threads or [fastattn.info()["max_threads"]]
    args.shapes = with_plain(args.shapes)  # a modifier row is timed against its plain shape
    head = header.header(requested, status, threads, args.dtype, args.kv_copies)
    print("\n".join(header.format_header(head)), flush=True)
    peaks, results, bandwidths = run.run(args.shapes, libraries, threads, args.dtype,
                                         args.repeat, args.min_time, kv_copies=args.kv_copies)
    print()
    print(report.markdown(peaks, results, args.shapes, libraries, bandwidths, args.dtype))
    busy = header.cpu_busy()
    if busy is not None:
        print(f"CPUs busy with other processes just after the run: {100 * busy:.0f} %")
        if header.busy_note(busy):
            print(header.busy_note(busy))
    if args.json:
        report.to_json(args.json, head, peaks, results, bandwidths)
        print(f"wrote {args.json}")
    if args.plot:
        if plot.plot(args.plot, peaks, results, args.shapes, libraries):
            print(f"wrote {args.plot}")
        else:
            print(f"{args.plot} not written: the chart shows attention shapes, and none was run")
    return 0
