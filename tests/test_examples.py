"""The examples run as documented: examples/c/decode.c built by the one
command of examples/README.md (src_c/manifest.py's library, no Python in the
program) passes its own checks, and examples/transformer.py generates the same
tokens with fastattn and with NumPy attention, and exits 1 when they differ."""
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest
from _helpers import C_BUILD as BUILD, REPO, c_manifest

EXAMPLES = REPO / "examples"


def _run(cmd, **kw):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, **kw)


def test_readmes_show_the_build_command():
    assert BUILD in (EXAMPLES / "README.md").read_text()
    assert BUILD in (EXAMPLES / "c" / "decode.c").read_text().split("*/")[0]
    readme = (REPO / "README.md").read_text()
    manifest = c_manifest()
    assert BUILD.split(" --program")[0] in readme
    assert shlex.join([manifest.OPENMP, *manifest.LIBS]) in readme   # how to link against the library


@pytest.fixture(scope="module")
def decode_binary(c_library):
    """The program the READMEs' build command makes (conftest's c_library runs
    that command verbatim, into a temporary folder)."""
    return c_library / "decode"


@pytest.mark.parametrize("isa, threads", [(None, "2"), ("scalar", "1")])
def test_c_decode_example_passes(decode_binary, isa, threads):
    env = {k: v for k, v in os.environ.items() if k != "FASTATTN_ISA"}
    if isa:
        env["FASTATTN_ISA"] = isa
    # 1100 steps: the cache grows past the 1024 keys where split-KV starts.
    r = _run([str(decode_binary), "1100", threads], env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "passed" in r.stdout and "FAILED" not in r.stdout
    assert re.search(r"fa_attention: \d+ steps/s", r.stdout), r.stdout
    assert f"{threads} threads" in r.stdout
    if isa:
        assert f"isa {isa}" in r.stdout


def test_c_decode_example_rejects_bad_arguments(decode_binary):
    r = _run([str(decode_binary), "0"])
    assert r.returncode == 2 and "usage" in r.stderr


SMALL = ["--tokens", "8", "--layers", "2", "--prompt", "16", "--repeats", "1"]


def test_transformer_example_generates_the_same_tokens_both_ways():
    r = _run([sys.executable, str(EXAMPLES / "transformer.py"), *SMALL])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "same tokens with fastattn and numpy: yes" in r.stdout
    tokens = re.search(r"tokens \(fastattn\): ([\d ]+)", r.stdout)
    assert tokens and len(tokens.group(1).split()) == 8, r.stdout
    for row in ("fastattn ", "numpy ", "fastattn, BLAS 1 thread", "fastattn, num_threads=1"):
        assert re.search(rf"^{re.escape(row)}\s*[\d ]*\d+\s+\d+\.\d\s+\d+\.\d\d$", r.stdout, re.M), row
    assert "thread-pool contention" in r.stdout


def test_transformer_example_16bit_cache_keeps_the_first_32_tokens():
    """Greedy decoding over a float16 or bfloat16 cache gives float32's tokens
    for at least the first 32 (the issue's bar); int8 is reported, not held to it."""
    args = ["--tokens", "32", "--layers", "2", "--prompt", "32", "--repeats", "1", "--attention", "fastattn",
            "--cache-dtypes", "float16,bfloat16,int8"]
    r = _run([sys.executable, str(EXAMPLES / "transformer.py"), *args])
    assert r.returncode == 0, r.stdout + r.stderr
    for dt in ("float16", "bfloat16"):
        assert f"{dt} cache: the first 32 of 32 tokens are float32's" in r.stdout, r.stdout
    assert re.search(r"int8 cache: the first \d+ of 32 tokens", r.stdout), r.stdout


def test_transformer_example_help_and_single_mode():
    r = _run([sys.executable, str(EXAMPLES / "transformer.py"), "--help"])
    assert r.returncode == 0 and "--attention" in r.stdout and "--tokens" in r.stdout
    r = _run([sys.executable, str(EXAMPLES / "transformer.py"), *SMALL, "--attention", "numpy"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tokens (numpy):" in r.stdout and "fastattn," not in r.stdout


def test_transformer_example_exits_1_when_the_tokens_differ(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("transformer_example", EXAMPLES / "transformer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    textbook = example.numpy_attention
    # A NumPy attention with doubled scores: a different model, other tokens.
    monkeypatch.setattr(example, "numpy_attention", lambda q, k, v, causal: textbook(2 * q, k, v, causal))
    assert example.main(SMALL) == 1
    out = capsys.readouterr().out
    assert "same tokens with fastattn and numpy: NO" in out
    assert "tokens (numpy):" in out


# What the test appends to a README block: checks of what the block claims.
README_CHECKS = {
    "cache.truncate(": """
assert out.shape == (2, 8, 1, 64) and lse.shape == (2, 8, 1)
full, full_lse = fastattn.attention(q, k, k, return_lse=True)
np.testing.assert_allclose(out, full, rtol=1e-5, atol=1e-6)   # the merge is one call over all 100 keys
np.testing.assert_allclose(lse, full_lse, rtol=1e-5, atol=1e-5)
np.testing.assert_array_equal(cache.lengths, [100, 100])       # rolled back
assert y.shape == (1, 10, 512) and np.isfinite(y).all()
""",
}


def _readme_python_blocks():
    text = (REPO / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_python_blocks_run(tmp_path):
    """Every ```python block of the README runs as written (each in its own
    process: one calls fastattn.set_isa), with checks of what it claims."""
    blocks = _readme_python_blocks()
    assert len(blocks) >= 2
    checked = set()
    for block in blocks:
        # the torch and transformers block runs where they are installed (optional extras)
        if any(re.search(rf"^import .*\b{m}\b", block, re.M) and importlib.util.find_spec(m) is None
               for m in ("torch", "transformers")):
            continue
        code = block
        for marker, checks in README_CHECKS.items():
            if marker in block:
                code += checks
                checked.add(marker)
        # run outside the checkout: its fastattn/ source folder must not shadow the built package
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, f"README block failed:\n{block}\n{r.stderr}"
    assert checked == set(README_CHECKS)


def test_distributed_decode_example_runs_and_matches_the_local_cache():
    """examples/distributed_decode.py (needs Ray): every shard count's steps
    agree with one local KVCache, the overhead, bytes and model are reported."""
    pytest.importorskip("ray")
    args = ["--tokens", "512", "--steps", "20", "--shards", "1,2", "--bandwidth-tokens", "4096",
            "--bandwidth-repeats", "3"]
    r = subprocess.run([sys.executable, str(EXAMPLES / "distributed_decode.py"), *args], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = re.findall(r"^\s+(\d) (graph|plain)\s+\d+(?:\s+[\d.]+){5}\s+(\d+)\s+(\S+)$", r.stdout, re.M)
    assert [(n, path) for n, path, _, _ in rows] == [("1", "graph"), ("2", "graph"), ("1", "plain")], r.stdout
    for shards, _, nbytes, worst in rows:
        assert float(worst) <= 1e-3   # float16 cache, float32 queries: merged, not approximated
        assert int(nbytes) == int(shards) * int(rows[0][2])   # each shard: the same request and reply
    assert re.search(r"overhead of 1 shard \(graph\) over one local call: median -?[\d.]+ ms", r.stdout)
    model = re.findall(r"^\s+(1|2|4|8|16)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(reads|round trip \+ merge)$",
                       r.stdout, re.M)
    assert [m for m, _ in model] == ["1", "2", "4", "8", "16"], r.stdout


def test_hf_generate_example_gives_eager_tokens():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    r = _run([sys.executable, str(EXAMPLES / "hf_generate.py"), "--tokens", "6", "--prompt", "24",
              "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "200"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "same tokens with fastattn and eager: yes" in r.stdout
    for impl in ("eager", "sdpa", "fastattn"):
        assert re.search(rf"^{impl}\s+\d+\.\d\s+\d+\.\d\d$", r.stdout, re.M), impl
