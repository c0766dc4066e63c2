"""What the numbers were measured on: the machine header (versions, ISA,
CPU, threadpoolctl's pools, thread environment) and its text, the notes on
slow OpenBLAS settings, and OthersWatch, the /proc/stat monitor of how busy
other processes keep the CPUs during a loop.
"""
import os
import platform
import time

import numpy as np

import fastattn
from fastattn._info import cpu_model
from fastattn.bench.dtypes import storage
from fastattn.bench.peers import LIBRARIES

BUSY = 0.10             # other processes' CPU share above which the header warns
SLOW_BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_NUM_THREADS",
              "MKL_NUM_THREADS") + SLOW_BLAS_ENV


def threadpools():
    """threadpoolctl's view of the loaded BLAS and OpenMP pools, or None."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    return threadpool_info()


def header(libraries, status, threads_list, dtypes, kv_copies="auto"):
    """Everything needed to read (and reproduce) the numbers, as a dict.
    ``dtypes``: the --dtype names (or one name or NumPy dtype); ``kv_copies``:
    --kv-copies (the report's decode tables give each shape's count)."""
    if isinstance(dtypes, (str, np.dtype, type)):
        dtypes = [dtypes]
    storages = [storage(d) for d in dtypes]
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
        "dtypes": [st.name for st in storages],
        "dtype_notes": {st.name: st.about for st in storages if st.about},
        "kv_copies": kv_copies,
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
        f"threads timed: {', '.join(map(str, h['threads']))}; "
        f"dtype{'s' if len(h['dtypes']) > 1 else ''} {', '.join(h['dtypes'])}",
    ]
    lines += [f"  {name}: {about}" for name, about in h["dtype_notes"].items()]
    lines += ["versions: " + "; ".join(v for v in h["versions"].values() if v)]
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
