"""The results as text: times and rates formatted, the Markdown tables
(times with ratios to fastattn, GFLOP/s, GB/s for decode shapes, tokens/s for
the block, each score modifier's cost over the plain call) and the JSON file.
It reads Result rows; it runs nothing.
"""
import dataclasses
import json

from fastattn.bench import block, timing
from fastattn.bench.header import BUSY
from fastattn.bench.peers import LIBRARIES

NOISY = 0.25            # a time is marked † when its interquartile range exceeds this share
MODIFIER_TARGET = 1.10  # issue 11: a score modifier costs at most 10 % over the plain call


def threads_text(n):
    return f"{n} thread" + ("" if n == 1 else "s")


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


def _cell_cost(r):
    """A modifier row: its time over the same library's plain call."""
    if r is None or r.status != "ok":
        return _cell_time(r) if r is not None else "—"
    return "—" if r.ratio_to_plain is None else f"{r.ratio_to_plain:.2f}×"


def _table(shapes, libraries, by_key, cell):
    """A row per shape, a column per library; n/a where the library lacks the
    shape's score modifier."""
    titles = [LIBRARIES[name].title for name in libraries]
    lines = ["| shape B×Hq×L×S×E | " + " | ".join(titles) + " |",
             "|---|" + "--:|" * len(titles)]
    for shape in shapes:
        cells = [cell(by_key.get((shape.name, name))) if LIBRARIES[name].has(shape.modifier)
                 else "n/a" for name in libraries]
        lines.append(f"| {shape.name}: {shape.label} | " + " | ".join(cells) + " |")
    return lines


def markdown(peaks, results, shapes, libraries, bandwidths=None):
    """One pair of tables per thread count and kind of shape: times (with each
    peer's time over fastattn's), then GFLOP/s with the share of the matmul
    peak (full shapes) or GB/s of K and V read with the share of the read
    bandwidth (decode shapes: bound by memory, not by the FPU). Score
    modifier rows sit in those tables under their own names, and get one more
    table: each one's time over the same library's plain call."""
    bandwidths = bandwidths or {}
    lines = []
    modified = [sh for sh in shapes if sh.modifier]
    na = "; n/a: the library has no such score modifier" if modified else ""
    for threads, peak in peaks.items():
        by_key = {(r.shape, r.library): r for r in results if r.threads == threads}
        bw = bandwidths.get(threads)
        bw_text = (f"; read bandwidth {bw:.1f} GB/s (BLAS dot of a "
                   f"{timing.BANDWIDTH_BYTES >> 20} MiB array with itself, one stream a thread)"
                   ) if bw else ""
        lines += [f"### {threads_text(threads)}: matmul peak {peak:.0f} GFLOP/s "
                  f"(NumPy {timing.PEAK_N}×{timing.PEAK_N} matmul){bw_text}", "",
                  "Median time per call; in brackets, the time over fastattn's "
                  f"(above 1: fastattn is faster); † noisy: interquartile range over "
                  f"{100 * NOISY:.0f} % of the median; ‡ other processes used over "
                  f"{100 * BUSY:.0f} % of the CPUs during the loop; — not run{na}.", ""]
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
            libs = [n for n in libraries if n in block.ATTENTIONS]
            lines += ["Transformer block (fastattn.bench.block: RMSNorm, projections and SiLU MLP as "
                      "NumPy matmuls on NumPy's BLAS threads; attention by the column's library "
                      "over the same KV cache). B×Hq×new tokens×S×E:", ""]
            lines += _table(blocks, libs, by_key, _cell_time)
            lines += ["", "Tokens per second through the block (B·new tokens per call):", ""]
            lines += _table(blocks, libs, by_key, _cell_tokens)
            lines.append("")
        if modified:
            kinds = {sh.kind for sh in modified}
            libs = [n for n in libraries if LIBRARIES[n].kinds is None or kinds & set(LIBRARIES[n].kinds)]
            lines += ["Score modifiers: each row's median time over the same library's plain call "
                      "of the shape it modifies (the row named without the suffix), both in this "
                      f"run; issue 11's target for fastattn: at most {MODIFIER_TARGET:.2f}×.", ""]
            lines += _table(modified, libs, by_key, _cell_cost)
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
