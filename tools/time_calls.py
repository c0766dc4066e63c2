"""Time one attention shape as a whole process, for A/B runs between builds.

    python tools/time_calls.py B Hq Hkv L S E [--causal] [--threads N] [--calls N | --seconds T]

Builds float32 inputs of that shape, calls fastattn.attention N times (or
until about T seconds, default 1, have passed) and prints the median time
per call. With --calls the whole process's time measures the build. Meant
to be run from outside the repository with each build's interpreter, in
alternation, by a whole-process timer (for example `/usr/bin/time -v` or
hyperfine), so that two builds are compared under the same machine load.
"""
import argparse
import statistics
import time

import numpy as np

import fastattn


def main():
    ap = argparse.ArgumentParser()
    for n in ("B", "Hq", "Hkv", "L", "S", "E"):
        ap.add_argument(n, type=int)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--calls", type=int, default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((a.B, a.Hq, a.L, a.E)).astype(np.float32)
    k = rng.standard_normal((a.B, a.Hkv, a.S, a.E)).astype(np.float32)
    v = rng.standard_normal((a.B, a.Hkv, a.S, a.E)).astype(np.float32)
    out = np.empty_like(q)
    fastattn.attention(q, k, v, causal=a.causal, num_threads=a.threads, out=out)
    times, start = [], time.perf_counter()
    while (len(times) < a.calls if a.calls else time.perf_counter() - start < a.seconds or len(times) < 3):
        t0 = time.perf_counter()
        fastattn.attention(q, k, v, causal=a.causal, num_threads=a.threads, out=out)
        times.append(time.perf_counter() - t0)
    print(f"{statistics.median(times) * 1e6:.1f} us median over {len(times)} calls")


if __name__ == "__main__":
    main()
