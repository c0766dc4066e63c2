"""pytest-benchmark set-up: the same header as `python -m fastattn bench`, and
the thread count (--attn-threads) and the storage dtypes (--attn-dtype). Refuses the un-built source tree, like
tests/conftest.py: run `pytest benchmarks` against the installed package.
"""
import os
import pathlib

import pytest

import fastattn
from fastattn.bench import header, run
from fastattn.bench.dtypes import STORAGES
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
    parser.addoption("--attn-dtype", default="float32",
                     help="storage dtypes, comma-separated: float32, float64, float16, bfloat16, int8 "
                          "(as `python -m fastattn bench --dtype`)")


def pytest_generate_tests(metafunc):
    if "dtype" in metafunc.fixturenames:
        names = [d.strip() for d in metafunc.config.getoption("--attn-dtype").split(",") if d.strip()]
        unknown = [d for d in names if d not in STORAGES]
        if unknown:
            raise pytest.UsageError(f"--attn-dtype: unknown {unknown}; choose from {list(STORAGES)}")
        metafunc.parametrize("dtype", names)


@pytest.fixture(scope="session")
def threads(request):
    return request.config.getoption("--attn-threads") or fastattn.info()["max_threads"]


def pytest_report_header(config):
    threads = config.getoption("--attn-threads") or fastattn.info()["max_threads"]
    peers = [name for name in PEERS if LIBRARIES[name].installed()]
    status = run.library_status(peers)
    dtypes = config.getoption("--attn-dtype")
    return header.format_header(header.header(peers, status, [threads], dtypes.split(",")))
