"""`python -m fastattn`: what this build is, the lecture's example, a check, a timing.

With no arguments it runs everything below; `demo`, `info` and `bench` run a
part. The numbers come from fastattn.reference (the definition) and the
kernel. The timings and the full benchmark live in fastattn.bench, imported
only by the commands that use it (the demo's check borrows its tolerance rule).
"""
import argparse
import math
import sys

import numpy as np

import fastattn
from fastattn import reference
from fastattn._info import cpu_model

LECTURE_Q = [[1, 0, 1, 0], [0, 1, 0, 1]]
LECTURE_K = [[1, 0, 1, 0], [1, 1, 1, 1]]
LECTURE_V = [[10, 0], [0, 10]]


# ---------------------------------------------------------------------------
# The parts
# ---------------------------------------------------------------------------

def show_info():
    i = fastattn.info()
    print(f"fastattn {i['version']}")
    print(f"  ISA in use     {i['isa']} (this CPU runs: {', '.join(i['isas'])})")
    print(f"  CPU features   {' '.join(i['cpu_features']) or 'baseline only'}")
    print(f"  OpenMP         {'yes' if i['openmp'] else 'no: this build runs on one thread'}")
    print(f"  max threads    {i['max_threads']} (num_threads=None; set OMP_NUM_THREADS to change)")
    print(f"  machine        {cpu_model()}, {i['machine']}")
    print(f"  Python {i['python']}, NumPy {i['numpy']}")


def _matrix(label, a, width=7):
    """`label` then the rows of ``a`` one under the other, 3 decimals."""
    rows = [" ".join(f"{x:{width}.3f}" for x in row) for row in np.asarray(a)]
    pad = " " * len(label)
    return "\n".join((label if n == 0 else pad) + f"[{r} ]" for n, r in enumerate(rows))


def walk_example():
    """The lecture's worked example, one step at a time, then the kernel's answer."""
    q, k, v = (np.array(x, dtype=np.float64) for x in (LECTURE_Q, LECTURE_K, LECTURE_V))
    d_k = q.shape[-1]
    steps = reference.attention_steps(q, k, v)
    print(f"The lecture's worked example (one head, d_k = {d_k}, no mask):")
    for name, x in (("Q", q), ("K", k), ("V", v)):
        print(_matrix(f"  {name} = ", x))
    print("  1. scores = Q·Kᵀ")
    print(_matrix("       ", steps.scores))
    print(f"  2. scaled = scores / √d_k = scores / {math.sqrt(d_k):g}")
    print(_matrix("       ", steps.scaled))
    print("  3. mask: none, every key visible (a hidden key would become -inf)")
    print(_matrix("       ", steps.masked))
    print("  4. weights = softmax of each row: exp(x) / Σ exp(x); each row sums to 1")
    print(_matrix("       ", steps.weights))
    _, lse, weights = fastattn.attention(q, k, v, return_lse=True, return_weights=True)
    print("     the same from the kernel, exp(x − lse) with its log-sum-exp lse = "
          f"[{', '.join(f'{x:.3f}' for x in lse)}]")
    print("     (fastattn.attention(Q, K, V, return_weights=True)):")
    print(_matrix("       ", weights))
    print("  5. output = weights·V: each row a weighted average of V's rows")
    print(_matrix("       ", steps.output))
    out = fastattn.attention(q, k, v)
    out32 = fastattn.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    print("  fastattn.attention(Q, K, V), float64 and float32:")
    print(_matrix("       ", out))
    err = max(np.abs(out - steps.output).max(), np.abs(out32 - steps.output).max())
    print(f"     max difference from step 5: {err:.1e}")


def check_kernel():
    """The kernel against the float64 reference on a small shape with the cases
    that differ between libraries; True if within the bench's tolerance."""
    from fastattn.bench.checks import max_error, reference_for
    from fastattn.bench.shapes import Shape
    s = Shape("check", 2, 4, 2, 100, 130, 64, causal=True,
              about="L != S, GQA, bottom-right causal: the cases that differ")
    q, k, v = s.inputs(np.float32)
    ref = reference_for(s, q, k, v)
    err = max_error(fastattn.attention(q, k, v, causal=s.causal), ref)
    ok = err <= ref.tolerance
    print(f"Check: fastattn against fastattn.reference (float64) on {s.label}, float32")
    print(f"  ({s.about})")
    print(f"  max |fastattn - reference| = {err:.2e}, tolerance {ref.tolerance:.2e} "
          "(2 × textbook float32 NumPy's error, at least 16 ulp of max|V|)")
    print("  OK" if ok else "  FAILED: the kernel is further from the reference than allowed")
    return ok


# ---------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------

def cmd_all(args):
    ok = cmd_demo(args) == 0
    print()
    from fastattn.bench import time_against_numpy
    time_against_numpy()
    return 0 if ok else 1


def cmd_demo(args):
    show_info()
    print()
    walk_example()
    print()
    return 0 if check_kernel() else 1


def cmd_info(args):
    show_info()
    return 0


def _names(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def _thread_counts(text):
    try:
        counts = [int(t) for t in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads takes counts like 1,2; got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--threads counts must be >= 1; got {text!r}")
    return counts


def _shapes(text):
    """Shape names and group names (decode, full), in order, each shape once;
    or "hf", the transformers group (fastattn.bench.hf), which runs alone."""
    from fastattn.bench.shapes import SHAPE_GROUPS, SHAPES_BY_NAME
    if text == "hf":
        return "hf"
    known = {**SHAPE_GROUPS, **{n: [s] for n, s in SHAPES_BY_NAME.items()}}
    unknown = [n for n in _names(text) if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown shape(s) {', '.join(unknown)}; known: groups "
            f"{', '.join(SHAPE_GROUPS)}; shapes {', '.join(SHAPES_BY_NAME)}")
    picked = [s for n in _names(text) for s in known[n]]
    return list(dict.fromkeys(picked))


def _dtypes(text):
    """Storage dtype names (fastattn.bench.dtypes), in order, each once."""
    from fastattn.bench.dtypes import STORAGES
    names = list(dict.fromkeys(_names(text)))
    unknown = [n for n in names if n not in STORAGES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown dtype(s) {', '.join(unknown) or repr(text)}; known: {', '.join(STORAGES)}")
    missing = [n for n in names if not STORAGES[n].available()]
    if missing:
        raise argparse.ArgumentTypeError(
            f"{', '.join(missing)} needs ml_dtypes (pip install ml_dtypes)")
    return names


def _kv_copies(text):
    """--kv-copies: "auto" or a count from 1."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"needs auto or a whole number from 1, got {text!r}")
    return n


def cmd_bench(args):
    if args.shapes == "hf":
        from fastattn.bench import hf
        return hf.main(args)
    from fastattn import bench
    return bench.main(args)


def parser(bench=None):
    """The command line. The bench command's options list the suite's shapes and
    peers, so they are added only when ``bench`` (the fastattn.bench package)
    is given; without it `bench` takes any arguments and main() parses again."""
    p = argparse.ArgumentParser(
        prog="python -m fastattn",
        description="fastattn: fused scaled dot-product attention on the CPU. Without a "
                    "command: build info, the lecture's worked example step by step, a check "
                    "against the reference (exit status 1 if it fails) and a timing against "
                    "textbook NumPy.")
    sub = p.add_subparsers(dest="command", metavar="{demo,info,bench}")
    sub.add_parser("demo", help="info, the worked example and the check (no timing)")
    sub.add_parser("info", help="version, ISA, OpenMP and threads of this build")
    b = sub.add_parser(
        "bench", help="time fastattn against NumPy and other libraries (see bench --help)",
        add_help=bench is not None,
        description="Time fastattn against textbook NumPy and the installed peer libraries, "
                    "each in its own loop, after checking each against fastattn.reference. "
                    "Prints a header (versions, CPU, thread pools) and Markdown tables of "
                    "median times, GFLOP/s and the share of NumPy's matmul peak; GB/s for "
                    "decoding; tokens/s for a NumPy transformer block. For NumPy's "
                    "real speed unset OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE if they are set.")
    if bench is None:
        return p
    shapes = bench.shapes
    b.add_argument("--peers", type=_names, metavar="LIST",
                   help=f"comma-separated, from {','.join(bench.peers.ALL_PEERS)} "
                        "(default: numpy plus those installed)")
    b.add_argument("--threads", type=_thread_counts, metavar="LIST",
                   help="thread counts, e.g. 1,2 (default: fastattn's max threads)")
    b.add_argument("--shapes", type=_shapes, default=list(shapes.SHAPES_BY_NAME.values()),
                   metavar="LIST",
                   help="shape or group names, comma-separated (default all); groups: "
                        + ", ".join(shapes.SHAPE_GROUPS) + "; or hf alone (a transformers model with "
                        "sdpa, eager and fastattn attention; needs torch and transformers); shapes: " + ", ".join(
                       f"{s.name} ({s.label})" for s in shapes.SHAPES_BY_NAME.values()))
    b.add_argument("--dtype", type=_dtypes, default=["float32"], metavar="LIST",
                   help="storage dtypes, comma-separated (default float32): float32, float64; "
                        "float16, bfloat16 (q, k, v and out stored so, computed in float32; "
                        "bfloat16 needs ml_dtypes); int8 (an int8 KV cache: float32 q and "
                        "out, K/V int8 with a float32 scale per row; decode shapes only). "
                        "16-bit and int8 rows next to float32 ones get a table of their "
                        "speed-up over float32")
    b.add_argument("--kv-copies", type=_kv_copies, default="auto", metavar="N|auto",
                   help="decode shapes: copies of K and V each library's calls read in turn, "
                        "as a model's layers each read their own cache. auto (default): "
                        "enough to fill the 512 MiB the read bandwidth is measured on (at "
                        "most 32), so K and V come from memory; 1: one copy, read from the "
                        "cache wherever it fits")
    b.add_argument("--repeat", type=int, default=10, metavar="N",
                   help="at least N timing samples per library and shape (default 10)")
    b.add_argument("--min-time", type=float, default=0.5, metavar="SECONDS",
                   help="and keep sampling for at least this long (default 0.5)")
    b.add_argument("--json", metavar="FILE", help="also write every result to FILE as JSON")
    b.add_argument("--plot", metavar="FILE.png", help="also draw GFLOP/s bars (needs matplotlib)")
    return p


COMMANDS = {None: cmd_all, "demo": cmd_demo, "info": cmd_info, "bench": cmd_bench}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args, rest = p.parse_known_args(argv)
    if args.command == "bench":
        from fastattn import bench
        args = parser(bench).parse_args(argv)
    elif rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
