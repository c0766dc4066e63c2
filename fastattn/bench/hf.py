"""The `--shapes hf` group: a transformers Llama (random weights from a config,
8 layers, d_model 1024, 16/4 heads, vocab 32000) timed end to end with the
"sdpa", "eager" and "fastattn" attention, each in its own process: tokens/s of
a prefill and of decoding steps at contexts 512, 4096 and 16384, float32 and
bfloat16. Two diagnostic rows attribute the time (attention replaced by a
no-op, with transformers' DynamicCache and with fastattn's Cache).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4)
CONTEXTS = (512, 4096, 16384)
IMPLS = ("sdpa", "eager", "fastattn", "noop", "noop-kvcache")
ABOUT = {
    "sdpa": "transformers' sdpa (torch SDPA) with its DynamicCache",
    "eager": "transformers' eager (matmul, softmax, matmul) with its DynamicCache",
    "fastattn": "fastattn.transformers: the fastattn attention with fastattn's Cache",
    "noop": "attention replaced by a no-op, DynamicCache: weights, MLP and the cache's concatenation",
    "noop-kvcache": "attention replaced by a no-op, fastattn's Cache: weights, MLP and the in-place append",
}
DECODE_STEPS, DECODE_WARMUP = 10, 2
# Each case runs in ROUNDS processes, the implementations alternating within a
# round, so a change in the machine's load falls on all of them; the table
# takes the median over rounds. A prefill at the longest context runs once.
ROUNDS = 3
EAGER_LIMIT = 4096  # eager stores Hq·L·S float scores per layer: 17 GB at 16384, past this machine's memory


def prefill_repeats(context):
    return 3 if context <= 512 else 1


def phases(impl, context, round_):
    """What a round's process of ``impl`` times: the no-op with transformers'
    cache differs from the other no-op only in decoding; the longest
    prefill, and eager's (slow: it stores the scores), run in the first round only."""
    p = ["decode"]
    if impl != "noop" and not skip_reason(impl, context, "prefill") and (
            round_ == 0 or context < max(CONTEXTS) and impl != "eager"):
        p.insert(0, "prefill")
    return p


def skip_reason(impl, context, phase):
    if impl == "eager" and context > EAGER_LIMIT and phase == "prefill":
        return (f"eager materialises 16 heads × {context}² float scores per layer "
                f"({16 * context * context * 4 / 2**30:.0f} GiB in float32): past this machine's memory")
    return None


# -- the child: one implementation, one dtype, one context ---------------------------

def _noop(module, query, key, value, attention_mask, **kwargs):
    B, H, L, _ = query.shape
    return query.new_zeros(B, L, H, value.shape[-1]), None


def _model(impl, dtype, context):
    import torch
    import transformers
    import fastattn.transformers as ft
    ft.register()
    transformers.AttentionInterface.register("noop", _noop)
    transformers.masking_utils.AttentionMaskInterface.register("noop", ft.mask)
    cfg = transformers.LlamaConfig(max_position_embeddings=context + 64, **MODEL)
    torch.manual_seed(0)
    attn = {"noop-kvcache": "noop"}.get(impl, impl)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.to(getattr(torch, dtype)).eval()


def _cache(impl, capacity):
    import transformers
    import fastattn.transformers as ft
    return ft.Cache(capacity) if impl in ("fastattn", "noop-kvcache") else transformers.DynamicCache()


def _filled_cache(impl, model, context, dtype):
    """A cache holding `context` random keys and values per layer (the same for
    every implementation), as if a prompt had been read."""
    import torch
    cfg = model.config
    cache = _cache(impl, context + DECODE_STEPS + DECODE_WARMUP + 1)
    g = torch.Generator().manual_seed(1)
    shape = (1, cfg.num_key_value_heads, context, cfg.hidden_size // cfg.num_attention_heads)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(shape, generator=g).to(getattr(torch, dtype))
        v = torch.randn(shape, generator=g).to(getattr(torch, dtype))
        cache.update(k, v, layer)
    return cache


def child(impl, dtype, context, phases):
    """Times one implementation; returns a dict of tokens/s and the greedy tokens."""
    import torch
    model = _model(impl, dtype, context)
    result = {"impl": impl, "dtype": dtype, "context": context, "threads": torch.get_num_threads()}
    with torch.inference_mode():
        if "prefill" in phases and not skip_reason(impl, context, "prefill"):
            ids = torch.randint(0, MODEL["vocab_size"], (1, context), generator=torch.Generator().manual_seed(2))
            times, cpu = [], []
            for _ in range(prefill_repeats(context)):
                cache = _cache(impl, context + 1)
                t0, c0 = time.perf_counter(), time.process_time()
                logits = model(ids, cache=cache, logits_to_keep=1).logits
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                del cache
            result["prefill_s"] = statistics.median(times)
            result["prefill_tok_s"] = context / result["prefill_s"]
            result["prefill_cpu_tok_s"] = context / statistics.median(cpu)
            result["prefill_token"] = int(logits[0, -1].argmax())
        if "decode" in phases:
            cache = _filled_cache(impl, model, context, dtype)
            token, tokens, times, cpu = torch.tensor([[1]]), [], [], []
            for step in range(DECODE_WARMUP + DECODE_STEPS):
                t0, c0 = time.perf_counter(), time.process_time()
                logits = model(token, cache=cache, logits_to_keep=1).logits
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                token = logits[:, -1:].argmax(-1)
                tokens.append(int(token))
                if step >= DECODE_WARMUP:
                    times.append(dt)
                    cpu.append(dc)
            result["decode_s"] = statistics.median(times)
            result["decode_tok_s"] = 1 / result["decode_s"]
            result["decode_cpu_tok_s"] = 1 / statistics.median(cpu)
            result["decode_tokens"] = tokens
    return result


# -- the parent: a process per case, then the table ----------------------------------

def run_case(impl, dtype, context, phases=("prefill", "decode"), threads=None, timeout=1800):
    """One child process; threads (torch's and fastattn's, through
    OMP_NUM_THREADS) or None for their defaults."""
    cmd = [sys.executable, "-m", "fastattn.bench.hf", "--child", impl, dtype, str(context), ",".join(phases)]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "dtype": dtype, "context": context, "error": f"timed out after {timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"impl": impl, "dtype": dtype, "context": context, "error": tail[:200]}
    return json.loads(lines[-1])


def table(results, dtypes, contexts, impls, clock=""):
    """Markdown: tokens/s per implementation, and fastattn's ratio to sdpa;
    clock "" for wall-clock tokens/s, "cpu_" for tokens per CPU-second."""
    by = {(r["impl"], r["dtype"], r["context"]): r for r in results}
    lines = ["| dtype | context | phase | " + " | ".join(impls) + " | fastattn / sdpa | same tokens as eager |",
             "|---|---:|---|" + "---:|" * len(impls) + "---:|---|"]
    for dtype in dtypes:
        for context in contexts:
            for phase in ("prefill", "decode"):
                cells = []
                for impl in impls:
                    r = by.get((impl, dtype, context), {})
                    v = r.get(f"{phase}_{clock}tok_s")
                    cells.append(f"{v:.1f}" if v else "skipped" if skip_reason(impl, context, phase)
                                 else r.get("error", "n/a")[:40])
                fa, sd = (by.get((i, dtype, context), {}).get(f"{phase}_{clock}tok_s") for i in ("fastattn", "sdpa"))
                ratio = f"{fa / sd:.2f}×" if fa and sd else "—"
                lines.append(f"| {dtype} | {context} | {phase} | " + " | ".join(cells) + f" | {ratio} | "
                             + _same_tokens(by, dtype, context, phase) + " |")
    return "\n".join(lines)


def _same_tokens(by, dtype, context, phase):
    key = "prefill_token" if phase == "prefill" else "decode_tokens"
    ref_impl = "eager" if by.get(("eager", dtype, context), {}).get(key) is not None else "sdpa"
    ref = by.get((ref_impl, dtype, context), {}).get(key)
    got = by.get(("fastattn", dtype, context), {}).get(key)
    if ref is None or got is None:
        return "—"
    return ("yes" if got == ref else "no") + ("" if ref_impl == "eager" else " (vs sdpa)")


def _median_over_rounds(rounds):
    """One result from a case's rounds: the median of each timing, the tokens of the first."""
    merged = dict(rounds[0])
    for key in ("prefill_tok_s", "decode_tok_s", "prefill_cpu_tok_s", "decode_cpu_tok_s"):
        values = [r[key] for r in rounds if key in r]
        if values:
            merged[key] = statistics.median(values)
            merged[key.replace("tok_s", "rounds")] = values
    for key in ("prefill_token", "decode_tokens"):
        merged.setdefault(key, next((r[key] for r in rounds if key in r), None))
    errors = [r["error"] for r in rounds if "error" in r]
    if errors and "decode_tok_s" not in merged:
        merged["error"] = errors[0]
    return merged


def main(args=None, contexts=CONTEXTS, impls=IMPLS, rounds=ROUNDS, out=sys.stdout):
    """`python -m fastattn bench --shapes hf [--dtype float32,bfloat16] [--json FILE]`."""
    dtypes = [d for d in (getattr(args, "dtype", None) or ["float32", "bfloat16"]) if d in ("float32", "bfloat16")]
    threads = (getattr(args, "threads", None) or [None])[0]
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"the hf group needs torch and transformers (pip install 'fastattn[transformers]'): {e}", file=out)
        return 1
    from fastattn._info import cpu_model
    print(f"# transformers Llama, {MODEL['num_hidden_layers']} layers, d_model {MODEL['hidden_size']}, "
          f"{MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']} heads, vocab {MODEL['vocab_size']}; "
          f"{cpu_model()}, {os.cpu_count()} CPUs; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; threads: {threads or 'the default (all CPUs)'}", file=out)
    print(f"# each implementation in its own process, {rounds} rounds alternating them, median over rounds; "
          f"prefill: a forward over `context` tokens (median of {prefill_repeats(512)} at 512; at "
          f"{max(contexts)} the first round only); decode: median of {DECODE_STEPS} steps after "
          f"{DECODE_WARMUP}, from a cache of `context` random keys", file=out)
    for impl in impls:
        print(f"#   {impl}: {ABOUT[impl]}", file=out)
    results = []
    for dtype in dtypes:
        for context in contexts:
            runs = {impl: [] for impl in impls}
            for round_ in range(rounds):
                for impl in impls:
                    r = run_case(impl, dtype, context, phases(impl, context, round_), threads)
                    runs[impl].append(r)
                    print(f"# {dtype} {context} round {round_} {impl}: " + ", ".join(
                        f"{k} {r[k]:.2f}" for k in ("prefill_tok_s", "decode_tok_s", "prefill_cpu_tok_s",
                                                    "decode_cpu_tok_s") if k in r)
                        + (f" error: {r['error']}" if "error" in r else ""), file=sys.stderr, flush=True)
            results += [_median_over_rounds(runs[impl]) for impl in impls]
    print("\n## tokens per second of wall-clock time\n", file=out)
    print(table(results, dtypes, contexts, impls), file=out)
    print("\n## tokens per CPU-second of the process (time.process_time: what a busy machine's other "
          "processes do not inflate; with one thread, the work itself)\n", file=out)
    print(table(results, dtypes, contexts, impls, "cpu_"), file=out)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _cli(argv):
    p = argparse.ArgumentParser(prog="python -m fastattn.bench.hf")
    p.add_argument("--child", nargs=4, metavar=("IMPL", "DTYPE", "CONTEXT", "PHASES"))
    p.add_argument("--dtype", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=list(CONTEXTS))
    p.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--threads", type=lambda s: [int(s)], help="torch's and fastattn's threads (OMP_NUM_THREADS)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.child:
        impl, dtype, context, phases = a.child
        print(json.dumps(child(impl, dtype, int(context), phases.split(","))))
        return 0
    return main(a, a.contexts, a.impls, a.rounds)


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
