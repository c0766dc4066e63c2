"""fastattn.transformers in real transformers models built from configs (random
weights, nothing downloaded, 2 layers, d_model 64): the same greedy tokens as
"eager" in float32 (and the first 16 in bfloat16), logits within a stated
tolerance, left-padded batches, the mask description instead of a 4-D mask,
the fallback for patterns it cannot map, and the fastattn-backed Cache.
Skipped without torch or transformers.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ft = pytest.importorskip("fastattn.transformers")
from transformers import masking_utils  # noqa: E402

ft.register()

# Logits of fastattn against eager at real (non-padding) positions, float32:
# both compute in float32 but sum in different orders (eager: matmul then
# softmax; fastattn: online softmax in blocks), so they differ by float32
# rounding, amplified through 2 layers; measured ≤ 6.4e-6 on these models.
LOGITS_ATOL_F32 = 1e-4
# bfloat16: eager rounds scores and weights to bfloat16, fastattn keeps them in
# float32 and rounds only its output; measured ≤ 0.11 here (logits of a few units).
LOGITS_ATOL_BF16 = 0.25

WINDOW = 5  # sliding window shorter than the prompt, so it matters


def _config(name):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2)  # larger than default: peaky attention, a mistake shows
    if name == "llama":
        return transformers.LlamaConfig(**common)
    if name == "qwen2":
        return transformers.Qwen2Config(**common)
    if name == "mistral":
        return transformers.MistralConfig(sliding_window=WINDOW, **common)
    if name == "gemma2":
        return transformers.Gemma2Config(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                         query_pre_attn_scalar=16, final_logit_softcapping=None, **common)
    if name == "gpt_oss":
        return transformers.GptOssConfig(head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                                         num_experts_per_tok=2, **common)
    raise ValueError(name)


MODELS = [n for n, cls in (("llama", "LlamaConfig"), ("qwen2", "Qwen2Config"), ("mistral", "MistralConfig"),
                           ("gemma2", "Gemma2Config"), ("gpt_oss", "GptOssConfig"))
          if hasattr(transformers, cls)]
_CACHE = {}


def _model(name, dtype=torch.float32):
    key = (name, dtype)
    if key not in _CACHE:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(name), attn_implementation="eager")
        if name == "gpt_oss":
            with torch.no_grad():  # sinks start at zero: make them matter
                for layer in model.model.layers:
                    layer.self_attn.sinks.normal_(0, 2)
        _CACHE[key] = model.to(dtype).eval()
    return _CACHE[key]


def _generate(model, impl, ids, mask=None, n=20, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                              pad_token_id=0, **kw)[:, ids.shape[1]:]


def _logits(model, impl, ids, mask=None):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits.float()


def _prompt(B=1, L=11, seed=1):
    return torch.randint(1, 96, (B, L), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_and_logits_float32(name):
    model, ids = _model(name), _prompt()
    assert torch.equal(_generate(model, "fastattn", ids), _generate(model, "eager", ids))
    err = (_logits(model, "fastattn", ids) - _logits(model, "eager", ids)).abs().max().item()
    assert err <= LOGITS_ATOL_F32


@pytest.mark.parametrize("name", MODELS)
def test_left_padded_batch_float32(name):
    model, ids = _model(name), _prompt(B=3, L=12, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding of 4 and 7; the third row has none
    mask[1, :7] = 0
    ids = ids * mask
    assert torch.equal(_generate(model, "fastattn", ids, mask, n=12), _generate(model, "eager", ids, mask, n=12))
    real = mask.bool()
    err = (_logits(model, "fastattn", ids, mask) - _logits(model, "eager", ids, mask))[real].abs().max().item()
    assert err <= LOGITS_ATOL_F32


@pytest.mark.parametrize("name", MODELS)
def test_right_padded_forward_float32(name):
    # right padding (a training-style batch): kv_lengths, no mask
    model, ids = _model(name), _prompt(B=2, L=10, seed=3)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    real = mask.bool()
    err = (_logits(model, "fastattn", ids, mask) - _logits(model, "eager", ids, mask))[real].abs().max().item()
    assert err <= LOGITS_ATOL_F32


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_first_16_tokens(name):
    """eager's 16 greedy tokens, step by step: given eager's prefix, fastattn's
    next token is eager's at every step, except where eager's own two best
    logits are the same bfloat16 number. There the pick is made by index
    order, not arithmetic, and any of the tied tokens is right (on AMD Zen 4,
    Mistral's step 6 ties in eager bfloat16; the float32 model picks the
    token fastattn picks). Free-running, the tokens are eager's up to its first tie."""
    model, ids = _model(name, torch.bfloat16), _prompt(seed=4)
    want = _generate(model, "eager", ids, n=16)
    seq, L = torch.cat([ids, want], 1), ids.shape[1]
    eager, ours = (_logits(model, impl, seq)[0, L - 1:-1] for impl in ("eager", "fastattn"))
    best = eager.max(-1, keepdim=True).values
    tied = (eager == best).sum(-1) > 1
    for step in range(16):
        pick = ours[step].argmax().item()
        assert eager[step, pick] == best[step] if tied[step] else pick == want[0, step].item(), step
    first_tie = int(tied.nonzero()[0]) if tied.any() else 16
    assert torch.equal(_generate(model, "fastattn", ids, n=16)[:, :first_tie], want[:, :first_tie])
    err = (_logits(model, "fastattn", ids) - _logits(model, "eager", ids)).abs().max().item()
    assert err <= LOGITS_ATOL_BF16


def test_mask_is_described_not_built():
    kw = dict(batch_size=2, q_length=3, kv_length=8, q_offset=5, kv_offset=0)
    spec = ft.mask(mask_function=masking_utils.causal_mask_function, **kw)
    assert isinstance(spec, ft.MaskSpec) and spec.pattern == "causal" and spec.q_offset == 5
    spec = ft.mask(mask_function=masking_utils.sliding_window_causal_mask_function(4), local_size=4, **kw)
    assert (spec.pattern, spec.window) == ("sliding", 4)
    right = torch.tensor([[1] * 6 + [0] * 2, [1] * 8]).bool()
    spec = ft.mask(mask_function=masking_utils.causal_mask_function, attention_mask=right, **kw)
    assert spec.kv_lengths.tolist() == [6, 8] and spec.padding is None
    left = torch.tensor([[0] * 2 + [1] * 6, [1] * 8]).bool()
    spec = ft.mask(mask_function=masking_utils.causal_mask_function, attention_mask=left, **kw)
    assert spec.kv_lengths is None and spec.padding.shape == (2, 1, 1, 8)
    assert spec.padding[0, 0, 0].tolist() == left[0].tolist()


def test_unknown_pattern_falls_back_to_the_mask():
    # a chunked pattern: fastattn has no such restriction, so transformers builds the mask
    fn = masking_utils.and_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: kv % 2 == 0)
    m = ft.mask(2, 3, 8, 5, 0, mask_function=fn)
    assert isinstance(m, torch.Tensor) and m.shape == (2, 1, 3, 8) and m.dtype == torch.bool

    class Module(torch.nn.Module):
        is_causal = True

    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 8, 8, generator=g), \
        torch.randn(2, 2, 8, 8, generator=g)
    out, _ = ft.attention(Module(), q, k, v, m, scaling=0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.5, enable_gqa=True)
    assert torch.allclose(out, want.transpose(1, 2), atol=1e-6)


def test_dropout_is_refused():
    q = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ValueError, match="dropout must be 0"):
        ft.attention(torch.nn.Module(), q, q, q, None, dropout=0.1)


# -- the fastattn-backed Cache ---------------------------------------------------

# int8 storage: each key and value row is off by up to max|row|/254, so the
# logits move; measured ≤ 0.14 on these models (logits up to ~10).
LOGITS_ATOL_INT8 = 0.25


@pytest.mark.parametrize("name", MODELS)
def test_cache_same_tokens_as_eager_float32(name):
    model, ids = _model(name), _prompt(B=2, seed=7)
    cache = ft.Cache(max_cache_len=40)
    assert torch.equal(_generate(model, "fastattn", ids, n=16, cache=cache), _generate(model, "eager", ids, n=16))
    assert cache.get_seq_length() == 11 + 16 - 1  # the last token is never fed back
    assert all(isinstance(layer, ft.CacheLayer) for layer in cache.layers)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_cache_bfloat16_storage(name):
    pytest.importorskip("ml_dtypes")
    model, ids = _model(name, torch.bfloat16), _prompt(seed=4)
    cache = ft.Cache(max_cache_len=40)
    assert torch.equal(_generate(model, "fastattn", ids, n=16, cache=cache), _generate(model, "eager", ids, n=16))
    assert cache.layers[0].keys.dtype == torch.bfloat16


@pytest.mark.parametrize("name", MODELS)
def test_cache_int8_logits(name):
    model, ids = _model(name), _prompt(B=2, seed=7)
    model.set_attn_implementation("fastattn")
    with torch.no_grad():
        int8 = model(ids, cache=ft.Cache(32, "int8")).logits
        full = model(ids, cache=ft.Cache(32)).logits
    assert (int8 - full).abs().max().item() <= LOGITS_ATOL_INT8
    assert _generate(model, "fastattn", ids, n=6, cache=ft.Cache(32, "int8")).shape == (2, 6)


def test_cache_appends_in_place_without_copies():
    model, ids = _model("llama"), _prompt(seed=8)
    cache = ft.Cache(max_cache_len=30)
    _generate(model, "fastattn", ids, n=3, cache=cache)
    layer = cache.layers[1]
    buffer = layer.cache.key_buffer
    # the keys attention read are a view of the preallocated buffer, not a copy
    assert layer.keys.data_ptr() == buffer.__array_interface__["data"][0]
    assert layer.keys.shape[2] == 13 and layer.cache.lengths.tolist() == [13]  # 11 + 3 - 1
    step = torch.randn(1, 2, 1, 16)
    keys, _ = layer.update(step, step)
    assert keys.data_ptr() == buffer.__array_interface__["data"][0]
    assert torch.equal(keys[:, :, -1:], step)


def test_cache_errors():
    with pytest.raises(ValueError, match="max_cache_len must be a positive int; got 0"):
        ft.Cache(0)
    with pytest.raises(TypeError, match="dtype must be None, torch.float32"):
        ft.Cache(8, dtype=torch.int32)
    model, ids = _model("llama"), _prompt(seed=9)
    with pytest.raises(ValueError, match="KVCache capacity 12 exceeded"):
        _generate(model, "fastattn", ids, n=4, cache=ft.Cache(12))


def _ft_generate(model, ids, n, mask=None, **kw):
    model.set_attn_implementation("fastattn")
    with torch.no_grad():
        return ft.generate(model, ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_generate_sizes_a_fastattn_cache_and_gives_eager_tokens(name):
    model, ids = _model(name), _prompt(B=2, seed=11)
    out = _ft_generate(model, ids, 12)
    cache = out.past_key_values
    assert isinstance(cache, ft.Cache), type(cache)
    assert cache.max_cache_len == ids.shape[1] + 12       # prompt plus the new tokens, no more
    assert cache.get_seq_length() == ids.shape[1] + 12 - 1
    assert torch.equal(out.sequences[:, ids.shape[1]:], _generate(model, "eager", ids, n=12))
    # a left-padded batch, and int8 storage, the same way
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    padded = _ft_generate(model, ids * mask, 6, mask)
    assert torch.equal(padded.sequences[:, ids.shape[1]:], _generate(model, "eager", ids * mask, mask, n=6))
    assert _ft_generate(model, ids, 4, cache_dtype="int8").past_key_values.layers[0].cache.dtype == np.int8


def test_generate_leaves_beam_search_and_a_given_cache_to_transformers():
    model, ids = _model("llama"), _prompt(seed=12)
    beams = _ft_generate(model, ids, 5, num_beams=2)
    assert not isinstance(beams.past_key_values, ft.Cache)   # beam search reorders the batch: transformers' cache
    model.set_attn_implementation("fastattn")
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0,
                              num_beams=2)
    assert torch.equal(beams.sequences, want)
    mine = ft.Cache(max_cache_len=64)
    assert _ft_generate(model, ids, 5, cache=mine).past_key_values is mine
    assert mine.get_seq_length() == ids.shape[1] + 4


def test_generate_errors():
    model, ids = _model("llama"), _prompt(seed=13)
    with pytest.raises(ValueError, match=r"input_ids must be a \(batch, prompt length\) tensor"):
        ft.generate(model, ids[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="generate needs max_new_tokens"):
        ft.generate(model, ids, max_length=ids.shape[1])


def test_hf_bench_group_table():
    from fastattn.__main__ import _shapes
    from fastattn.bench import hf
    assert _shapes("hf") == "hf"
    results = [
        {"impl": "sdpa", "dtype": "float32", "context": 4096, "prefill_tok_s": 500.0, "decode_tok_s": 20.0,
         "prefill_token": 7, "decode_tokens": [1, 2]},
        {"impl": "eager", "dtype": "float32", "context": 4096, "prefill_tok_s": 400.0, "decode_tok_s": 10.0,
         "prefill_token": 7, "decode_tokens": [1, 2]},
        {"impl": "fastattn", "dtype": "float32", "context": 4096, "prefill_tok_s": 600.0, "decode_tok_s": 30.0,
         "prefill_token": 7, "decode_tokens": [1, 3]},
    ]
    text = hf.table(results, ["float32"], [4096], ["sdpa", "eager", "fastattn"])
    assert "| float32 | 4096 | prefill | 500.0 | 400.0 | 600.0 | 1.20× | yes |" in text
    assert "| float32 | 4096 | decode | 20.0 | 10.0 | 30.0 | 1.50× | no |" in text
    assert "memory" in hf.skip_reason("eager", 16384, "prefill") and hf.skip_reason("sdpa", 16384, "prefill") is None


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_generate_never_builds_a_4d_mask(name, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a 4-D mask was built")

    monkeypatch.setattr(masking_utils, "sdpa_mask", refuse)
    model, ids = _model(name), _prompt(B=2, L=10, seed=10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    assert _generate(model, "fastattn", ids * mask, mask, n=5).shape == (2, 5)


def test_no_mask_uses_the_modules_causality_and_window():
    class Module(torch.nn.Module):
        is_causal, sliding_window = True, 3

    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g), \
        torch.randn(1, 2, 9, 8, generator=g)
    out, _ = ft.attention(Module(), q, k, v, None, scaling=0.5)
    # bottom-right: query i sits at key 7 + i and sees keys 5 + i .. 7 + i
    allowed = torch.zeros(2, 9, dtype=torch.bool)
    allowed[0, 5:8], allowed[1, 6:9] = True, True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.5, enable_gqa=True)
    assert torch.allclose(out, want.transpose(1, 2), atol=1e-6)
