"""pytest-benchmark set-up: the same header as `python -m fastattn bench`, and
the thread count (--attn-threads). Refuses the un-built source tree, like
tests/conftest.py: run `pytest benchmarks` against the installed package.
"""
import os
import pathlib

import pytest

import fastattn
from fastattn.bench import header, run
from fastattn.bench.peers import LIBRARIES, PEERS

_REPO = pathlib.Path(__file__).resolve().parents[1]

if (pathlib.Path(fastattn.__file__).resolve().parents[1] == _REPO
        and os.environ.get("FASTATTN_TEST_INPLACE") != "1"):
    raise pytest.UsageError(
        f"fastattn was imported from the source tree ({fastattn.__file__}), not from the "
        "installed build. Install it (pip install '.[bench]') and run `pytest benchmarks`.")


def pytest_addoption(parser):
    parser.addoption("--attn-threads", type=int, default=None,
                     help="threads for every library (default: fastattn's max threads)")


@pytest.fixture(scope="session")
def threads(request):
    return request.config.getoption("--attn-threads") or fastattn.info()["max_threads"]


def pytest_report_header(config):
    threads = config.getoption("--attn-threads") or fastattn.info()["max_threads"]
    peers = [name for name in PEERS if LIBRARIES[name].installed()]
    status = run.library_status(peers)
    return header.format_header(header.header(peers, status, [threads], "float32"))
