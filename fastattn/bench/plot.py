"""The GFLOP/s bar chart (--plot): one panel per thread count and storage
dtype, one bar per library and attention shape, the matmul peak as a line.
matplotlib is imported only when a chart is drawn.
"""
import numpy as np

from fastattn.bench.dtypes import storage
from fastattn.bench.peers import LIBRARIES
from fastattn.bench.report import threads_text


def plot(path, peaks, results, shapes, libraries):
    """GFLOP/s per attention shape, one bar per library, one panel per thread
    count and dtype (``peaks``: {threads: {compute dtype: GFLOP/s}}), the
    matmul peak as a dashed line. Needs matplotlib. False (and no file) when
    no attention shape was run."""
    import matplotlib
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    shapes = [s for s in shapes if s.kind != "block"]  # attention only: the peers' bars
    if not shapes:
        return False
    dtypes = list(dict.fromkeys(r.dtype for r in results)) or ["float32"]
    panels = [(t, d) for t in peaks for d in dtypes]
    fig, axes = plt.subplots(len(panels), 1, figsize=(1.6 * len(shapes) + 1, 3.8 * len(panels)),
                             squeeze=False)
    width = 0.8 / len(libraries)
    for ax, (threads, dtype) in zip(axes[:, 0], panels):
        peak = peaks[threads][storage(dtype).compute]
        by_key = {(r.shape, r.library): r for r in results
                  if r.threads == threads and r.dtype == dtype}
        for i, name in enumerate(libraries):
            rates = [getattr(by_key.get((s.name, name)), "gflops", None) or 0 for s in shapes]
            ax.bar(np.arange(len(shapes)) + (i - (len(libraries) - 1) / 2) * width, rates,
                   width, label=LIBRARIES[name].title)
        ax.axhline(peak, color="k", linestyle="--", linewidth=1, label="matmul peak")
        ax.set_xticks(np.arange(len(shapes)), [f"{s.name}\n{s.dims}" for s in shapes], fontsize=7)
        ax.set_ylabel("GFLOP/s")
        ax.set_title(f"{threads_text(threads)}, {dtype}: {storage(dtype).compute} matmul peak "
                     f"{peak:.0f} GFLOP/s", fontsize=9)
    # one legend above the panels, where it cannot hide a bar
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="upper center",
               ncol=len(libraries) + 1, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
