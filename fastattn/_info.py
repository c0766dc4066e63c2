"""What this build of fastattn is and runs on: version, ISA, OpenMP, threads."""
import platform

import numpy as np

from fastattn import _kernel
from fastattn._version import __version__


def info():
    """Describe the build and the running machine.

    Returns
    -------
    dict
        ``version``, ``isa`` (the micro-kernel set in use), ``isas`` (those
        this CPU runs, best first), ``cpu_features`` (the extensions dispatch
        found: F16C and AVX-512 convert float16 K/V in one instruction), ``openmp`` (built with OpenMP),
        ``max_threads`` (what ``num_threads=None`` uses), ``machine``,
        ``python`` and ``numpy`` versions.
    """
    return {
        "version": __version__,
        "isa": _kernel.isa(),
        "isas": _kernel.available_isas(),
        "cpu_features": _kernel.cpu_features(),
        "openmp": _kernel.openmp(),
        "max_threads": _kernel.max_threads(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def cpu_model():
    """The CPU's model name (Linux /proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def set_isa(name=None):
    """Force a micro-kernel set for the whole process.

    Parameters
    ----------
    name : str or None
        One of :func:`available_isas`, or None / ``"auto"`` for the best this
        CPU supports. The environment variable ``FASTATTN_ISA`` sets the
        choice at import.

    Raises
    ------
    ValueError
        If the set is unknown or this CPU cannot run it.
    """
    _kernel.set_isa(name)


def available_isas():
    """The micro-kernel sets compiled in that this CPU runs, best first."""
    return _kernel.available_isas()
