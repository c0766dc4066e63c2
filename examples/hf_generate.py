"""Hugging Face transformers generating with fastattn's attention and cache.

A Llama built from a config (random weights, nothing downloaded) generates
greedily three ways: transformers' "eager" attention, its "sdpa", and
"fastattn" (fastattn.transformers.register(), with a fastattn.transformers.Cache
preallocated for prompt + new tokens). It prints tokens/s for each and
whether fastattn's tokens are eager's; exit status 1 if they are not.

    python examples/hf_generate.py                      # 2 layers, d_model 256, prompt 128
    python examples/hf_generate.py --layers 8 --d-model 1024 --prompt 4096 --tokens 32
    python examples/hf_generate.py --dtype bfloat16 --cache-dtype int8
"""
import argparse
import sys
import time

import torch
import transformers

import fastattn.transformers


def build(args):
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=int(2.75 * args.d_model),
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.tokens + 8)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.to(getattr(torch, args.dtype)).eval()


def generate(model, impl, ids, args):
    """(new tokens, prefill tokens/s, decode tokens/s) with one attention implementation."""
    model.set_attn_implementation(impl)
    kw = {}
    if impl == "fastattn":
        storage = {"model": None, "int8": "int8"}.get(args.cache_dtype, getattr(torch, args.cache_dtype, None))
        kw["cache"] = fastattn.transformers.Cache(max_cache_len=ids.shape[1] + args.tokens, dtype=storage)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(ids, logits_to_keep=1, **({"cache": fastattn.transformers.Cache(ids.shape[1])}
                                         if impl == "fastattn" else {}))
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                             pad_token_id=0, **kw)
        total = time.perf_counter() - t0
    # generate = one prefill + (tokens - 1) decoding steps
    decode = max(total - prefill, 1e-9) / max(args.tokens - 1, 1)
    return out[0, ids.shape[1]:].tolist(), ids.shape[1] / prefill, 1 / decode


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--cache-dtype", choices=["model", "float32", "bfloat16", "float16", "int8"], default="model",
                   help="fastattn's Cache storage (default: the model's dtype)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    fastattn.transformers.register()  # adds "fastattn" to transformers' attention interfaces
    model = build(args)
    ids = torch.randint(1, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed + 1))
    print(f"Llama {args.layers} layers, d_model {args.d_model}, {args.heads}/{args.kv_heads} heads, {args.dtype}; "
          f"prompt {args.prompt}, {args.tokens} new tokens; torch threads {torch.get_num_threads()}")
    print(f"{'attention':10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    tokens = {}
    for impl in ("eager", "sdpa", "fastattn"):
        tokens[impl], pre, dec = generate(model, impl, ids, args)
        print(f"{impl:10} {pre:14.1f} {dec:13.2f}")
    print(f"tokens (fastattn): {' '.join(map(str, tokens['fastattn']))}")
    same = tokens["fastattn"] == tokens["eager"]
    print(f"same tokens with fastattn and eager: {'yes' if same else 'no'}")
    return 0 if same or args.dtype != "float32" or args.cache_dtype not in ("model", "float32") else 1


if __name__ == "__main__":
    sys.exit(main())
