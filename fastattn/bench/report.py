"""The results as text: times and rates formatted, the Markdown tables
(times with ratios to fastattn, GFLOP/s, GB/s for decode shapes, tokens/s for
the block, each score modifier's cost over the plain call, each storage
dtype's speed-up over float32) and the JSON file. It reads Result rows; it
runs nothing.
"""
import dataclasses
import json

from fastattn.bench import block, timing
from fastattn.bench.dtypes import REDUCED, storage
from fastattn.bench.header import BUSY
from fastattn.bench.peers import LIBRARIES

NOISY = 0.25            # a time is marked † when its interquartile range exceeds this share
MODIFIER_TARGET = 1.10  # issue 11: a score modifier costs at most 10 % over the plain call
# issue 10: fastattn's speed-up over its own float32 row, per (kind, storage) ...
SPEEDUP_TARGETS = {("decode", "16-bit"): 1.8, ("decode", "int8"): 3.0, ("full", "16-bit"): 0.9}
BANDWIDTH_TARGET = 0.80  # ... decode reading at least this share of the read bandwidth
# ... and, in the same dtype, decoding at least 1.5× the fastest peer, full shapes ahead of it (over 1×)
PEER_TARGETS = {"decode": 1.5, "full": 1.0}


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


def _table(shapes, libraries, by_key, cell, dtype="float32"):
    """A row per shape, a column per library; n/a where the library lacks the
    shape's score modifier or the storage dtype."""
    titles = [LIBRARIES[name].title for name in libraries]
    lines = ["| shape B×Hq×L×S×E | " + " | ".join(titles) + " |",
             "|---|" + "--:|" * len(titles)]
    for shape in shapes:
        cells = [cell(by_key.get((shape.name, name)))
                 if LIBRARIES[name].has(shape.modifier) and LIBRARIES[name].has_dtype(dtype)
                 else "n/a" for name in libraries]
        lines.append(f"| {shape.name}: {shape.label} | " + " | ".join(cells) + " |")
    return lines


def _peaks_text(peak):
    """{"float32": GFLOP/s, ...} as the heading says it."""
    size = f"{timing.PEAK_N}×{timing.PEAK_N}"
    return ", ".join(f"{p:.0f} GFLOP/s (NumPy {size} {c} matmul)" for c, p in peak.items())


def markdown(peaks, results, shapes, libraries, bandwidths=None, dtypes=None):
    """Per thread count, per storage dtype (``dtypes``; default: those in
    ``results``, else float32), one pair of tables per kind of shape: times
    (with each peer's time over fastattn's), then GFLOP/s with the share of
    the matmul peak (full shapes) or GB/s of K and V stored with the share of
    the read bandwidth (decode shapes: bound by memory, not by the FPU). Score
    modifier rows sit in those tables under their own names, and get one more
    table: each one's time over the same library's plain call. With 16-bit or
    int8 rows next to float32 ones, a last table per thread count compares
    fastattn's rows with its float32 row and the fastest peer (issue 10)."""
    bandwidths = bandwidths or {}
    dtypes = [storage(d) for d in (dtypes or dict.fromkeys(r.dtype for r in results)
                                   or ["float32"])]
    lines = []
    modified = [sh for sh in shapes if sh.modifier]
    lacks = [what for what, yes in (("score modifier", modified),
                                    ("dtype", any(d.name != "float32" for d in dtypes))) if yes]
    na = f"; n/a: the library has no such {' or '.join(lacks)}" if lacks else ""
    for threads, peak in peaks.items():
        bw = bandwidths.get(threads)
        bw_text = (f"; read bandwidth {bw:.1f} GB/s (BLAS dot of a "
                   f"{timing.BANDWIDTH_BYTES >> 20} MiB array with itself, one stream a thread)"
                   ) if bw else ""
        lines += [f"### {threads_text(threads)}: matmul peak {_peaks_text(peak)}{bw_text}", "",
                  "Median time per call; in brackets, the time over fastattn's "
                  f"(above 1: fastattn is faster); † noisy: interquartile range over "
                  f"{100 * NOISY:.0f} % of the median; ‡ other processes used over "
                  f"{100 * BUSY:.0f} % of the CPUs during the loop; — not run{na}.", ""]
        for st in dtypes:
            by_key = {(r.shape, r.library): r for r in results
                      if r.threads == threads and r.dtype == st.name}
            mine = [sh for sh in shapes if sh.kind in st.kinds]
            if not mine:
                continue
            if len(dtypes) > 1 or st.name != "float32":
                about = f": {st.about}" if st.about else ""
                lines += [f"#### {st.name}, {threads_text(threads)}{about}", ""]
            lines += _sections(st, mine, libraries, by_key, threads, bw, modified)
        by_key = {(r.shape, r.library, r.dtype): r for r in results if r.threads == threads}
        lines += _comparison(shapes, dtypes, libraries, by_key, threads, bw)
    problems = [r for r in results if r.status != "ok"]
    if problems:
        lines.append("Not timed:")
        lines += [f"- {r.shape}, {r.dtype}, {threads_text(r.threads)}, {LIBRARIES[r.library].title}: "
                  f"{r.status}: {r.detail}" for r in problems]
    return "\n".join(lines).rstrip() + "\n"


def _sections(st, shapes, libraries, by_key, threads, bw, modified):
    """One storage dtype's tables at one thread count."""
    lines = []
    modified = [sh for sh in modified if sh in shapes]
    full = [sh for sh in shapes if sh.kind == "full"]
    decode = [sh for sh in shapes if sh.decode]
    blocks = [sh for sh in shapes if sh.kind == "block"]
    if full:
        libs = [n for n in libraries if LIBRARIES[n].kinds is None or "full" in LIBRARIES[n].kinds]
        lines += _table(full, libs, by_key, _cell_time, st.name)
        lines += ["", "GFLOP/s (4·B·Hq·L·S·E per call, half for causal) and, in brackets, "
                  f"the share of the {st.compute} matmul peak.", ""]
        lines += _table(full, libs, by_key, _cell_rate, st.name)
        lines.append("")
    if decode:
        libs = [n for n in libraries
                if LIBRARIES[n].kinds is None or "decode" in LIBRARIES[n].kinds]
        if full:
            lines += ["Decode shapes:", ""]
        lines += _table(decode, libs, by_key, _cell_time, st.name)
        share = (f"the share of the read bandwidth measured in this run "
                 f"({bw:.1f} GB/s, {threads_text(threads)})" if bw else
                 "the share of the read bandwidth")
        lines += ["", f"GB/s: bytes of K and V stored, so read, per call ({st.bytes_formula}) "
                  f"over the median time; in brackets, {share} (over 100 %: "
                  "the library reads faster than one plain stream per thread does). "
                  + _copies_text(decode, by_key), ""]
        lines += _table(decode, libs, by_key, _cell_bandwidth, st.name)
        lines.append("")
    if blocks:
        libs = [n for n in libraries if n in block.ATTENTIONS]
        lines += ["Transformer block (fastattn.bench.block: RMSNorm, projections and SiLU MLP as "
                  "NumPy matmuls on NumPy's BLAS threads; attention by the column's library "
                  "over the same KV cache). B×Hq×new tokens×S×E:", ""]
        lines += _table(blocks, libs, by_key, _cell_time, st.name)
        lines += ["", "Tokens per second through the block (B·new tokens per call):", ""]
        lines += _table(blocks, libs, by_key, _cell_tokens, st.name)
        lines.append("")
    if modified:
        kinds = {sh.kind for sh in modified}
        libs = [n for n in libraries if LIBRARIES[n].kinds is None or kinds & set(LIBRARIES[n].kinds)]
        lines += ["Score modifiers: each row's median time over the same library's plain call "
                  "of the shape it modifies (the row named without the suffix), both in this "
                  f"run; issue 11's target for fastattn: at most {MODIFIER_TARGET:.2f}×.", ""]
        lines += _table(modified, libs, by_key, _cell_cost, st.name)
        lines.append("")
    return lines


def _copies_text(decode, by_key):
    """Where the decode rows read K and V from: each shape's copies (--kv-copies)."""
    rows = {}
    for sh in decode:
        for (name, _), r in by_key.items():
            if name == sh.name and r.kv_copies:
                rows[name] = r
    if not rows:
        return ""
    if all(r.kv_copies == 1 for r in rows.values()):
        return ("Each call read the same copy of K and V (--kv-copies 1): it stays in the "
                "last-level cache wherever it fits, as no layer's cache does in a model.")
    listed = ", ".join(f"{name} {r.kv_copies} × {r.kv_bytes / 2**20:.3g} MiB"
                       for name, r in rows.items())
    return (f"Each call read the next of several copies of K and V ({listed}; --kv-copies), "
            "so they come from memory wherever the copies outgrow the last-level cache, "
            "as each layer's cache does in a model.")


def _mark(value, target, strictly=False):
    met = value > target if strictly else value >= target
    return f"{value:.2f}× {'✓' if met else '✗'}"


def _comparison(shapes, dtypes, libraries, by_key, threads, bw):
    """fastattn's 16-bit and int8 rows against its float32 row of the same
    shape and threads, the read bandwidth and the fastest peer in the same
    dtype, each marked ✓ or ✗ against issue 10's target. Empty without a
    float32 row next to a reduced one."""
    reduced = [st for st in dtypes if st.name in REDUCED]
    if not reduced or "float32" not in [st.name for st in dtypes]:
        return []
    rows = []
    for shape in shapes:
        if shape.kind not in ("full", "decode"):
            continue
        f32 = by_key.get((shape.name, "fastattn", "float32"))
        for st in reduced:
            r = by_key.get((shape.name, "fastattn", st.name))
            if r is None:
                continue
            if r.status != "ok":
                rows.append(f"| {shape.name}: {shape.label} | {st.name} | {_cell_time(r)} | — | — | — | — |")
                continue
            target = SPEEDUP_TARGETS.get((shape.kind, "int8" if st.name == "int8" else "16-bit"))
            speedup = "—"
            if r.speedup_over_float32 is not None:
                speedup = (_mark(r.speedup_over_float32, target) if target
                           else f"{r.speedup_over_float32:.2f}×")
            elif f32 is not None:
                speedup = f"float32 {_cell_time(f32)}"
            read = "—"
            if r.gbps is not None:
                read = _sig3(r.gbps) + " GB/s"
                if r.bandwidth_share is not None:
                    read += (f" ({100 * r.bandwidth_share:.0f} % "
                             f"{'✓' if r.bandwidth_share >= BANDWIDTH_TARGET else '✗'})")
            peers = [by_key.get((shape.name, n, st.name)) for n in libraries if n != "fastattn"]
            timed = [p for p in peers if p is not None and p.status == "ok"]
            best, over = "—", "—"
            if timed:
                fastest = min(timed, key=lambda p: p.median_s)
                best = f"{LIBRARIES[fastest.library].title} {format_time(fastest.median_s)}"
                over = _mark(fastest.median_s / r.median_s, PEER_TARGETS[shape.kind],
                             strictly=shape.kind == "full")
            rows.append(f"| {shape.name}: {shape.label} | {st.name} | {format_time(r.median_s)} | "
                        f"{speedup} | {read} | {best} | {over} |")
    if not rows:
        return []
    decode16, decode8 = SPEEDUP_TARGETS[("decode", "16-bit")], SPEEDUP_TARGETS[("decode", "int8")]
    full16 = SPEEDUP_TARGETS[("full", "16-bit")]
    bw_text = f" ({bw:.1f} GB/s)" if bw else ""
    return [f"Storage dtypes against float32, {threads_text(threads)}: fastattn's 16-bit and int8 "
            "rows over its own float32 row of the same shape in this run (speed-up = float32 "
            f"time / this time); issue 10's targets, ✓ met, ✗ missed: decode 16-bit ≥ "
            f"{decode16:g}×, int8 ≥ {decode8:g}×, each reading ≥ {100 * BANDWIDTH_TARGET:.0f} % "
            f"of this run's read bandwidth{bw_text} in stored bytes; full shapes (prefill, "
            f"encoder) in 16-bit ≥ {full16:g}× float32's GFLOP/s; against the fastest peer "
            "that ran and passed its check in the same dtype, decoding ≥ "
            f"{PEER_TARGETS['decode']:g}× and full shapes ahead of it (NumPy converts 16-bit "
            "and int8 to float32 each call; — when none did).", "",
            "| shape B×Hq×L×S×E | dtype | fastattn | over float32 | stored GB/s (share) | "
            "fastest peer | fastattn over it |",
            "|---|---|--:|--:|--:|--:|--:|", *rows, ""]


def to_json(path, head, peaks, results, bandwidths=None):
    doc = {"header": head, "matmul_peak_gflops": {str(t): dict(p) for t, p in peaks.items()},
           "read_bandwidth_gbps": {str(t): b for t, b in (bandwidths or {}).items()},
           "results": [dataclasses.asdict(r) for r in results]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
