"""The benchmark harness works (no timing is asserted: benchmarks are not tests).

The pytest-benchmark suite runs once with --benchmark-disable so it cannot rot;
each installed peer adapter matches the reference; a peer that fails its check
or raises is reported and not timed; the shape table's FLOP counts are right.
"""
import io
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from fastattn.bench import block, checks, peers, plot, report, run, timing
from fastattn.bench.shapes import BLOCK_SHAPES, SHAPE_GROUPS, SHAPES, SHAPES_BY_NAME, Shape

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_benchmark_suite_runs(tmp_path):
    pytest.importorskip("pytest_benchmark")
    p = subprocess.run(
        [sys.executable, "-m", "pytest", str(REPO / "benchmarks"), "--benchmark-disable",
         "-q", "-k", "tiny", "-p", "no:cacheprovider"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert " passed" in p.stdout


def test_the_core_package_does_not_import_the_bench(tmp_path):
    # fastattn.bench imports the core, never the other way round
    code = ("import sys, fastattn, fastattn.cache, fastattn.layers, fastattn.merge, "
            "fastattn.reference; "
            "bench = [m for m in sys.modules if m.startswith('fastattn.bench') "
            "or m in ('fastattn._bench', 'fastattn._peers', 'fastattn._block')]; "
            "assert not bench, bench")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("name", list(peers.LIBRARIES))
def test_peer_matches_reference(name):
    lib = peers.LIBRARIES[name]
    if not lib.installed():
        pytest.skip(f"{name} not installed")
    # GQA, causal, L != S would break a peer's alignment; the bench has L == S only
    shape = Shape("small", 2, 4, 2, 33, 33, 16, causal=True)
    q, k, v = shape.inputs()
    ref = checks.reference_for(shape, q, k, v)
    out = np.asarray(lib.prepare(q, k, v, shape.causal, 1)())
    assert out.shape == (2, 4, 33, 16)
    assert checks.max_error(out, ref) <= ref.tolerance


class Broken(peers.Peer):
    name, title, module = "broken", "Broken", "numpy"

    def prepare(self, q, k, v, causal, threads):
        return lambda: np.zeros((q.shape[0], q.shape[1], q.shape[2], v.shape[-1]), q.dtype)


class Raises(peers.Peer):
    name, title, module = "raises", "Raises", "numpy"

    def prepare(self, q, k, v, causal, threads):
        raise RuntimeError("operator not supported\nsecond line")


def test_failing_peers_are_reported_not_timed(monkeypatch):
    monkeypatch.setitem(peers.LIBRARIES, "broken", Broken())
    monkeypatch.setitem(peers.LIBRARIES, "raises", Raises())
    monkeypatch.setattr(timing, "PEAK_N", 128)
    monkeypatch.setattr(timing, "PAUSE_S", 0)
    shapes = [SHAPES_BY_NAME["tiny"]]
    libs = ["fastattn", "broken", "raises"]
    progress = run.Progress(1, stream=io.StringIO())
    peaks, results, bandwidths = run.run(shapes, libs, [1], repeat=2, min_time=0,
                                            progress=progress)
    assert bandwidths == {}  # no decode shape, no bandwidth loop
    by_lib = {r.library: r for r in results}
    assert by_lib["fastattn"].status == "ok" and by_lib["fastattn"].median_s > 0
    assert by_lib["broken"].status == "failed check" and by_lib["broken"].median_s is None
    assert by_lib["raises"].status == "error"
    assert by_lib["raises"].detail == "RuntimeError: operator not supported"
    table = report.markdown(peaks, results, shapes, libs)
    assert "✗ check" in table and "error" in table and "Not timed:" in table


def test_library_status(monkeypatch):
    monkeypatch.setattr(peers.Torch, "installed", lambda self: False)
    status = run.library_status(["numpy", "torch", "nosuchlib"])
    assert status["fastattn"] == status["numpy"] == "ok"
    assert status["torch"].startswith("not installed")
    assert status["nosuchlib"].startswith("unknown library")


def test_shape_table():
    names = [s.name for s in SHAPES]
    assert len(set(names)) == len(names)
    enc = SHAPES_BY_NAME["enc512"]
    assert enc.flops == 4 * 8 * 512 * 512 * 64 and enc.label == "1×8×512×512×64"
    gqa = SHAPES_BY_NAME["gqa_causal"]
    assert gqa.flops == 4 * 32 * 512 * 512 * 128 // 2
    assert gqa.label == "causal GQA 1×32/8×512×512×128"
    q, k, v = gqa.inputs()
    assert q.shape == (1, 32, 512, 128) and k.shape == v.shape == (1, 8, 512, 128)
    assert q.dtype == np.float32
    long = SHAPES_BY_NAME["long"]
    assert 1 <= checks.check_rows(long) < long.L  # the long shape is checked on a slice


def test_time_call_counts_samples():
    t = timing.time_call(lambda: None, repeat=5, min_time=0)
    assert t.samples >= 5 and t.number > 1 and 0 < t.min_s <= t.median_s


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    shapes = [SHAPES_BY_NAME["tiny"]]
    results = [run.Result("tiny", "1×8×10×10×64", 1, "fastattn", "ok", median_s=1e-5,
                             gflops=1.0, peak_share=0.01)]
    assert plot.plot(tmp_path / "bench.png", {1: 100.0}, results, shapes, ["fastattn", "numpy"])
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    # block rows are not attention shapes: alone, they draw nothing
    assert not plot.plot(tmp_path / "none.png", {1: 100.0}, [], BLOCK_SHAPES, ["fastattn"])
    assert not (tmp_path / "none.png").exists()


def test_decode_shapes():
    decode = SHAPE_GROUPS["decode"]
    assert {s.name for s in decode} >= {"dec4k", "dec8k_gqa", "dec32k_mqa", "dec4_gqa"}
    assert all(s.decode and not s.causal for s in decode)
    assert not any(s.decode for s in SHAPE_GROUPS["full"])
    mqa = SHAPES_BY_NAME["dec32k_mqa"]
    assert mqa.label == "decode MQA 1×8/1×1×32768×128"
    assert mqa.kv_bytes() == 2 * 1 * 1 * 32768 * 128 * 4
    assert SHAPES_BY_NAME["dec4_gqa"].L == 4


def test_decode_run_reports_bandwidth(monkeypatch):
    monkeypatch.setattr(timing, "PEAK_N", 128)
    monkeypatch.setattr(timing, "PAUSE_S", 0)
    monkeypatch.setattr(timing, "BANDWIDTH_BYTES", 2**22)
    shapes = [Shape("smalldec", 1, 4, 2, 1, 300, 16, kind="decode"),
              SHAPES_BY_NAME["tiny"]]
    libs = ["fastattn", "numpy"] + (["ort_gqa"] if peers.LIBRARIES["ort_gqa"].installed() else [])
    progress = run.Progress(1, stream=io.StringIO())
    peaks, results, bandwidths = run.run(shapes, libs, [1, 2], repeat=2, min_time=0,
                                            progress=progress)
    assert set(bandwidths) == {1, 2} and all(b > 0 for b in bandwidths.values())
    by_key = {(r.shape, r.library, r.threads): r for r in results}
    assert ("tiny", "ort_gqa", 1) not in by_key  # a decode-only peer skips full shapes
    for lib in libs:
        r = by_key[("smalldec", lib, 1)]
        assert r.status == "ok", r.detail
        assert r.gbps > 0 and r.bandwidth_share > 0
    assert by_key[("tiny", "fastattn", 1)].gbps is None
    table = report.markdown(peaks, results, shapes, libs, bandwidths)
    assert "read bandwidth" in table and "GB/s" in table and "Decode shapes:" in table


def test_ort_gqa_decode_matches_reference():
    lib = peers.LIBRARIES["ort_gqa"]
    if not lib.installed():
        pytest.skip("onnxruntime not installed")
    for shape in (Shape("g1", 2, 8, 2, 1, 257, 32, kind="decode"),
                  Shape("g4c", 1, 8, 2, 4, 100, 32, causal=True, kind="decode")):
        q, k, v = shape.inputs()
        ref = checks.reference_for(shape, q, k, v)
        call = lib.prepare(q, k, v, shape.causal, 1)
        for _ in range(3):  # the cache is updated in place; calls must stay right
            out = np.asarray(call())
        assert out.shape == q.shape
        assert checks.max_error(out, ref) <= ref.tolerance
    shape = Shape("g4", 1, 8, 2, 4, 100, 32, kind="decode")  # not causal: unsupported
    with pytest.raises(NotImplementedError):
        lib.prepare(*shape.inputs(), False, 1)


# --------------------------------------------------------------------------
# The transformer block (fastattn.bench.block)
# --------------------------------------------------------------------------

SMALL_BLOCKS = [block.BlockShape("bp", 2, 48, 4, 2, 37),              # prefill, GQA
                block.BlockShape("bd", 3, 32, 4, 4, 1, past=70)]      # decode


@pytest.mark.parametrize("shape", SMALL_BLOCKS, ids=lambda s: s.name)
def test_block_steps_match_the_float64_block_and_repeat(shape):
    problem = block.BlockProblem(shape)
    ref = checks.block_reference(problem)
    assert ref.expected.shape == (shape.B, shape.new, shape.d_model)
    fast, textbook = problem.prepare("fastattn", 1), problem.prepare("numpy", 1)
    first = fast()
    assert first.dtype == np.float32 and first.shape == ref.expected.shape
    assert checks.max_error(first, ref) <= ref.tolerance
    assert checks.max_error(textbook(), ref) <= ref.tolerance
    # Each call starts from the same cache (rolled back to `past`): same bits.
    np.testing.assert_array_equal(fast(), first)


def test_block_reference_catches_a_wrong_attention():
    shape = SMALL_BLOCKS[1]
    problem = block.BlockProblem(shape)
    ref = checks.block_reference(problem)
    # Attention that ignores the cached keys (only the new token): a real bug
    # a decoder can have; the check must see it.
    cache = problem._cache(problem.block)

    def new_keys_only(q, k, v, mask):
        return peers.textbook_attention(q, k[:, :, -1:], v[:, :, -1:])

    cache.truncate(shape.past)
    wrong = problem.block.forward(problem.x, cache, new_keys_only)
    assert checks.max_error(wrong, ref) > ref.tolerance


def test_block_shapes():
    names = [s.name for s in BLOCK_SHAPES]
    assert names == [s.name for s in SHAPE_GROUPS["block"]]
    assert not set(names) & {s.name for s in SHAPES}
    prefill = SHAPES_BY_NAME["block_prefill"]
    T, d, E = 1024, 512, 64
    assert prefill.step == "prefill" and prefill.E == E and prefill.S == T and prefill.tokens == T
    assert prefill.flops == 2 * T * d * 32 * E + 16 * T * d * d + 4 * 8 * T * T * E // 2
    dec = SHAPES_BY_NAME["block_decode_gqa"]
    assert dec.step == "decode" and dec.S == dec.past + 1 and dec.tokens == dec.B
    assert dec.label == "block decode d_model 2048, 4×32/8×1×2048×64"
    with pytest.raises(ValueError, match="a block runs with attention by fastattn or numpy; got 'torch'"):
        block.BlockProblem(SMALL_BLOCKS[1]).prepare("torch", 1)


def test_block_run_reports_tokens_per_second(monkeypatch):
    monkeypatch.setattr(timing, "PEAK_N", 128)
    monkeypatch.setattr(timing, "PAUSE_S", 0)
    shapes = SMALL_BLOCKS + [SHAPES_BY_NAME["tiny"]]
    libs = ["fastattn", "numpy"] + (["torch"] if peers.LIBRARIES["torch"].installed() else [])
    progress = run.Progress(1, stream=io.StringIO())
    peaks, results, _ = run.run(shapes, libs, [1], repeat=2, min_time=0, progress=progress)
    by_key = {(r.shape, r.library): r for r in results}
    for shape in SMALL_BLOCKS:
        assert ("bp", "torch") not in by_key  # a block is run with fastattn and NumPy only
        for lib in ("fastattn", "numpy"):
            r = by_key[(shape.name, lib)]
            assert r.status == "ok", r.detail
            assert r.tokens_per_s == pytest.approx(shape.tokens / r.median_s)
    assert by_key[("tiny", "fastattn")].tokens_per_s is None
    table = report.markdown(peaks, results, shapes, libs)
    assert "Transformer block" in table and "Tokens per second" in table
    assert f"| bd: {SMALL_BLOCKS[1].label} |" in table
