"""`python -m fastattn` as a user runs it: a subprocess in a scratch directory
(never the repository root, whose source folder would shadow the build).
Checks what is printed and the exit status, not how fast anything is.
"""
import argparse
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import __main__ as cli


def run_cli(cwd, *args):
    return subprocess.run([sys.executable, "-m", "fastattn", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=180)


def test_no_arguments_walks_the_example_checks_and_times(tmp_path):
    p = run_cli(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert fastattn.info()["isa"] in out and fastattn.__version__ in out
    # the lecture's numbers: scores, weights, output
    for number in ("2.000", "0.500", "0.269", "0.731", "5.000", "2.689", "7.311"):
        assert number in out, number
    assert "max |fastattn - reference|" in out and "OK" in out
    assert re.search(r"NumPy textbook.*\d (µs|ms|s) ", out)
    assert re.search(r"fastattn\.attention\s+\d.* (µs|ms|s) ", out)
    assert re.search(r"ratio NumPy / fastattn: \d+\.\d\d×", out)
    assert re.search(r"\(\d+ threads?;", out)


def test_info_and_demo(tmp_path):
    p = run_cli(tmp_path, "info")
    assert p.returncode == 0 and "OpenMP" in p.stdout and "max threads" in p.stdout
    p = run_cli(tmp_path, "demo")
    assert p.returncode == 0 and "7.311" in p.stdout and "OK" in p.stdout
    # step 4 again, from the kernel's own lse (return_weights): the same numbers
    kernel = p.stdout.split("the same from the kernel", 1)[1].split("5. output", 1)[0]
    assert "lse = [1.693, 1.313]" in kernel
    for number in ("0.500", "0.269", "0.731"):
        assert number in kernel, number
    assert "ratio" not in p.stdout  # demo does not time


def test_help(tmp_path):
    p = run_cli(tmp_path, "--help")
    assert p.returncode == 0 and all(c in p.stdout for c in ("demo", "info", "bench"))
    p = run_cli(tmp_path, "bench", "--help")
    assert p.returncode == 0
    for option in ("--peers", "--threads", "--shapes", "--dtype", "--repeat", "--min-time",
                   "--json", "--plot", "gqa_causal"):
        assert option in p.stdout, option


def test_bench_json_and_unknown_peer(tmp_path):
    p = run_cli(tmp_path, "bench", "--shapes", "tiny", "--peers", "numpy,nosuchlib",
                "--repeat", "3", "--min-time", "0.05", "--json", "out.json")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((tmp_path / "out.json").read_text())
    results = {r["library"]: r for r in doc["results"]}
    assert set(results) == {"fastattn", "numpy"}
    for r in results.values():
        assert r["shape"] == "tiny" and r["status"] == "ok" and r["threads"] >= 1
        assert r["median_s"] > 0 and r["gflops"] > 0 and r["max_error"] <= r["tolerance"]
    assert results["numpy"]["ratio_to_fastattn"] > 0
    assert "unknown" in doc["header"]["libraries"]["nosuchlib"]
    assert "nosuchlib: unknown" in p.stdout
    assert "| tiny: 1×8×10×10×64 |" in p.stdout  # the Markdown table
    assert "matmul peak" in p.stdout and "[1/" in p.stderr  # progress goes to stderr


def test_bench_rejects_bad_options(tmp_path):
    p = run_cli(tmp_path, "bench", "--shapes", "tiny,huge")
    assert p.returncode == 2 and "unknown shape(s) huge" in p.stderr
    assert "decode" in p.stderr  # the groups are listed
    p = run_cli(tmp_path, "bench", "--threads", "0")
    assert p.returncode == 2 and "--threads" in p.stderr
    p = run_cli(tmp_path, "bench", "--dtype", "float16,float8")
    assert p.returncode == 2 and "unknown dtype(s) float8" in p.stderr
    assert "bfloat16" in p.stderr and "int8" in p.stderr  # the known ones are listed


def test_dtype_option_parses(monkeypatch):
    from fastattn import bench
    from fastattn.bench import dtypes
    assert cli._dtypes("float16, bfloat16,float16") == ["float16", "bfloat16"]
    assert cli._dtypes("float32,float64,int8") == ["float32", "float64", "int8"]
    assert cli.parser(bench).parse_args(["bench"]).dtype == ["float32"]  # the default
    assert cli.parser(bench).parse_args(["bench", "--dtype", "int8,float16"]).dtype == ["int8", "float16"]
    for bad in ("", "float8", "float16,half"):
        with pytest.raises(argparse.ArgumentTypeError, match="unknown dtype"):
            cli._dtypes(bad)
    monkeypatch.setattr(dtypes, "bfloat16", lambda: None)  # as without ml_dtypes
    with pytest.raises(argparse.ArgumentTypeError, match="bfloat16 needs ml_dtypes"):
        cli._dtypes("float16,bfloat16")
    assert cli._dtypes("float16") == ["float16"]


def test_kv_copies_option_parses():
    from fastattn import bench
    assert cli.parser(bench).parse_args(["bench"]).kv_copies == "auto"  # the default
    assert cli.parser(bench).parse_args(["bench", "--kv-copies", "3"]).kv_copies == 3
    assert cli._kv_copies("1") == 1
    for bad in ("0", "-2", "two", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=f"from 1, got {bad!r}"):
            cli._kv_copies(bad)


def test_failed_check_exits_1(monkeypatch, capsys):
    real = fastattn.attention

    def off_by_a_bit(q, k, v, **kw):
        got = real(q, k, v, **kw)
        if isinstance(got, tuple):  # the demo's return_weights call: left as it is
            return got
        return got + np.asarray(1e-3, got.dtype)

    monkeypatch.setattr(fastattn, "attention", off_by_a_bit)
    assert cli.main(["demo"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_shape_groups():
    from fastattn.bench.shapes import SHAPE_GROUPS, SHAPES
    assert cli._shapes("decode") == SHAPE_GROUPS["decode"]
    picked = cli._shapes("tiny,decode,dec4k")
    assert picked[0].name == "tiny" and len(picked) == 1 + len(SHAPE_GROUPS["decode"])
    assert [s.name for s in cli._shapes("full,decode")] == [s.name for s in SHAPES]


def test_info_and_parsing_do_not_import_the_bench(tmp_path):
    # `info` and every command's parsing but bench's leave fastattn.bench unloaded
    code = ("import sys; from fastattn import __main__ as cli; cli.main(['info']); "
            "cli.parser().parse_known_args(['demo']); "
            "assert not [m for m in sys.modules if m.startswith('fastattn.bench')]")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_unknown_arguments_are_rejected(tmp_path):
    p = run_cli(tmp_path, "info", "--shapes", "tiny")
    assert p.returncode == 2 and "unrecognized arguments: --shapes tiny" in p.stderr
