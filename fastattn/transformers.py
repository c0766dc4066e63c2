"""fastattn.transformers: fastattn as a Hugging Face transformers attention backend.

This module owns the mapping from what a transformers model knows (the mask
factory it asked for, its offsets, the 2-D padding mask, the module's sliding
window, softcap and sinks) to fastattn's arguments, so the 4-D mask is never
built when the pattern is one fastattn computes from indices; anything it
cannot map is materialised by transformers' own sdpa_mask and used as the
mask (never a wrong answer). It also owns `Cache`, a transformers cache
backed by fastattn.KVCache. `register()` adds "fastattn" to transformers.
"""
import functools
import inspect
import warnings

import numpy as np
import torch
import transformers
from transformers import cache_utils, masking_utils
from transformers.modeling_utils import AttentionInterface

from fastattn import torch as fat
from fastattn.cache import KVCache

__all__ = ["register", "attention", "mask", "MaskSpec", "Cache", "CacheLayer", "generate", "NAME"]

NAME = "fastattn"


# -- the mask: a description instead of a (B, 1, L, S) tensor --------------------

class MaskSpec:
    """What transformers' mask stands for, as fastattn's arguments.

    Query row i sits at absolute position ``q_offset + i`` and key j at
    ``kv_offset + j``. ``pattern`` is "causal" (key position <= query
    position), "sliding" (and > query position - window) or "full";
    ``kv_lengths`` (B,) int64 when the padding is on the right only, else
    ``padding`` a (B, 1, 1, S) bool view (True = real token) for left or
    mixed padding; both None without padding.
    """

    def __init__(self, pattern, window, q_offset, kv_offset, kv_length, kv_lengths=None, padding=None):
        self.pattern, self.window = pattern, window
        self.q_offset, self.kv_offset, self.kv_length = q_offset, kv_offset, kv_length
        self.kv_lengths, self.padding = kv_lengths, padding

    def __repr__(self):
        return (f"MaskSpec({self.pattern}, window={self.window}, q_offset={self.q_offset}, "
                f"kv_offset={self.kv_offset}, kv_length={self.kv_length}, "
                f"padding={'right' if self.kv_lengths is not None else None if self.padding is None else 'left'})")


def _closure(fn):
    try:
        return inspect.getclosurevars(fn).nonlocals
    except (TypeError, ValueError):
        return {}


def _pattern(mask_function, local_size):
    """("causal", None), ("sliding", w), ("full", None), or None when the mask
    function is not one of transformers' plain factories."""
    if mask_function is masking_utils.causal_mask_function:
        return "causal", None
    if mask_function is masking_utils.bidirectional_mask_function:
        return "full", None
    if getattr(mask_function, "__qualname__", "") == "and_masks.<locals>.and_mask":
        parts = _closure(mask_function).get("mask_functions", ())
        if (len(parts) == 2 and parts[1] is masking_utils.causal_mask_function
                and getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask"):
            w = _closure(parts[0]).get("sliding_window")
            # kv > q - w: the w keys ending at the query's own position
            if isinstance(w, int) and w >= 1 and (local_size is None or local_size == w):
                return "sliding", w
    return None


def _padding(attention_mask, kv_length, kv_offset):
    """(kv_lengths, padding) from transformers' 2-D bool padding mask."""
    if attention_mask is None:
        return None, None
    pad = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    pad = pad[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    if bool(pad.all()):
        return None, None
    lengths = pad.sum(dim=1)
    # right padding only: row b is lengths[b] Trues then Falses
    prefix = torch.arange(pad.shape[1])[None, :] < lengths[:, None]
    if torch.equal(prefix, pad):
        return lengths.to(torch.int64).contiguous(), None
    return None, pad[:, None, None, :]


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
         attention_mask=None, local_size=None, **kwargs):
    """transformers' mask interface for "fastattn": a MaskSpec when the
    pattern is causal, sliding-window causal or full (with any 2-D padding),
    else the 4-D bool mask transformers' sdpa_mask builds."""
    mask_function = mask_function or masking_utils.causal_mask_function
    pattern = _pattern(mask_function, local_size)
    if pattern is None or not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        kwargs.pop("allow_is_causal_skip", None)
        return masking_utils.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                       mask_function=mask_function, attention_mask=attention_mask,
                                       local_size=local_size, allow_is_causal_skip=False, **kwargs)
    kv_lengths, padding = _padding(attention_mask, kv_length, kv_offset)
    return MaskSpec(pattern[0], pattern[1], q_offset, kv_offset, kv_length, kv_lengths, padding)


# -- the attention function --------------------------------------------------------

def _kv(t):
    """A key or value tensor as fastattn.torch takes it: an int8 Cache's layer
    hands over its (values, scales) pair (keys: (values, scales, channel
    factors)), anything else is the tensor."""
    pair = getattr(t, "_fastattn_int8", None)
    return t if pair is None else pair


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' AttentionInterface signature: query (B, Hq, L, E), key and
    value (B, Hkv, S, E) read in place (grouped heads included, no repeat_kv).
    Returns (output (B, L, Hq, Ev) written by the kernel in that layout, None)."""
    if dropout:
        raise ValueError(f"fastattn is inference only: dropout must be 0 (is the model in eval()?); "
                         f"got {dropout}")
    B, Hq, L, _ = query.shape
    Ev = value.shape[-1] if not isinstance(_kv(value), tuple) else _kv(value)[0].shape[-1]
    out = torch.empty((B, L, Hq, Ev), dtype=query.dtype)
    kw = {"scale": scaling}
    softcap = kwargs.get("softcap")
    if softcap is None:
        softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap:
        kw["softcap"] = float(softcap)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    if sinks is not None:
        kw["sinks"] = sinks.detach()
    sliding = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    spec = attention_mask
    if isinstance(spec, MaskSpec):
        S = key.shape[-2]  # an int8 Cache hands over its values tensor: the same rows
        if not (spec.kv_offset == 0 and spec.q_offset == S - L and spec.kv_lengths is None
                and spec.padding is None):
            kw["q_start"], kw["k_start"] = spec.q_offset, spec.kv_offset
        # else the queries are the last L of the S keys: the kernel's bottom-right
        # default, and no per-call position arrays to build (decoding's case)
        kw["causal"] = spec.pattern != "full"
        if spec.pattern == "sliding":
            kw["window"] = (spec.window - 1, 0)  # keys d-w+1 … d (transformers: kv > q - w)
        if spec.kv_lengths is not None:
            kw["kv_lengths"] = spec.kv_lengths
        if spec.padding is not None:
            kw["mask"] = spec.padding
    elif attention_mask is None:
        # no mask from transformers: a decoder's L queries are the last L of
        # the S keys (bottom-right), within the module's sliding window if any
        kw["causal"] = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        if kw["causal"] and isinstance(sliding, int) and sliding > 0:
            kw["window"] = (sliding - 1, 0)
    else:
        kw["mask"] = attention_mask
    fat.attention(query, _kv(key), _kv(value), out=out.transpose(1, 2), **kw)
    return out, None


def register():
    """Adds "fastattn" to transformers' AttentionInterface and its mask interface,
    so ``attn_implementation="fastattn"`` (or ``model.set_attn_implementation``)
    selects it. Idempotent."""
    AttentionInterface.register(NAME, attention)
    masking_utils.AttentionMaskInterface.register(NAME, mask)


# -- the cache: transformers' Cache over fastattn.KVCache ---------------------------

_STORAGE = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
            torch.bfloat16: "bfloat16", "float32": np.float32, "float64": np.float64,
            "float16": np.float16, "bfloat16": "bfloat16", "int8": "int8"}


def _to_numpy(t):
    """A CPU tensor as a NumPy view of the same memory (bfloat16 through
    ml_dtypes, which a bfloat16 KVCache needs anyway)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _to_torch(a):
    """A read-only NumPy buffer view as a torch tensor over the same memory
    (nothing ever writes through it: KVCache.append is the only writer)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is not writable
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)


class CacheLayer(cache_utils.CacheLayerMixin):
    """One attention layer's keys and values in a fastattn.KVCache, allocated
    on the first update (batch, heads and head dims come from the first keys)
    with ``capacity`` rows per batch entry, appended in place.

    update() returns torch views of the filled rows: the kernel reads them
    where they are. For a 16- or 32-bit float storage they are ordinary tensors
    of that dtype; for int8 they are the int8 values, carrying the
    (values, scales) pair that only the "fastattn" attention reads.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, capacity, dtype=None, **kwargs):
        super().__init__()
        self.capacity, self.storage = capacity, dtype
        self.cache, self._length = None, 0

    def lazy_initialization(self, key_states, value_states):
        B, Hkv, _, E = key_states.shape
        storage = _STORAGE[self.storage if self.storage is not None else key_states.dtype]
        self.device = key_states.device
        self.cache = KVCache(B, Hkv, self.capacity, E, value_states.shape[-1], dtype=storage)
        self._k, self._v = (self._views(x) for x in (self.cache.key_buffer, self.cache.value_buffer))
        self.is_initialized = True

    @staticmethod
    def _views(buffer):
        if isinstance(buffer, tuple):  # int8: (values, scales), keys also their channel factors
            return tuple(_to_torch(x) for x in buffer)
        return _to_torch(buffer)

    def _filled(self, views, n):
        if isinstance(views, tuple):
            values, scales = views[0][:, :, :n], views[1][:, :, :n]
            values._fastattn_int8 = (values, scales) + tuple(views[2:])  # channel factors: live views
            return values
        return views[:, :, :n]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.device.type != "cpu":
            raise ValueError(f"fastattn.transformers.Cache holds CPU tensors; got keys on {key_states.device}")
        # the one copy of a step: the new rows, rounded or quantised into the buffers
        self.cache.append(_to_numpy(key_states), _to_numpy(value_states))
        self._length += key_states.shape[2]  # append wrote them all (or raised, writing nothing)
        n = self._length
        self.keys, self.values = self._filled(self._k, n), self._filled(self._v, n)
        return self.keys, self.values

    def get_seq_length(self):
        return self._length

    def get_mask_sizes(self, query_length):
        return self.get_seq_length() + query_length, 0

    def get_max_length(self):
        return self.capacity

    def reset(self):
        if self.cache is not None:
            self.cache.reset()
        self._length = 0

    def crop(self, tokens_to_remove):
        if tokens_to_remove > 0:  # transformers' legacy meaning: the length to keep
            tokens_to_remove = tokens_to_remove - self.get_seq_length()
        if self.cache is not None and tokens_to_remove < 0:
            self._length = max(0, self._length + tokens_to_remove)
            self.cache.truncate(self._length)

    def _unsupported(self, *args):
        raise NotImplementedError("fastattn.transformers.Cache keeps one batch as allocated: beam search and "
                                  "batch reordering are not supported (use greedy or sampling)")

    reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


class Cache(cache_utils.Cache):
    """A transformers Cache whose layers are fastattn.KVCache buffers.

    Parameters
    ----------
    max_cache_len : int
        Rows allocated per layer and batch entry: prompt plus new tokens.
    dtype : {None, torch.float32, torch.float16, torch.bfloat16, torch.float64, "int8"}
        Storage; None: the model's key dtype. "bfloat16" and "int8" round or
        quantise each new row once on the way in (bfloat16 storage needs
        ml_dtypes). Any storage other than the model's own dtype (int8 in
        particular) is read by the "fastattn" attention only.

    Usage: ``model.generate(ids, past_key_values=Cache(max_cache_len=...))``
    with ``attn_implementation="fastattn"``. A decoding step appends one row
    per layer in place and attention reads the buffers where they are.
    """

    def __init__(self, max_cache_len, dtype=None):
        if not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int; got {max_cache_len!r}")
        if dtype is not None and dtype not in _STORAGE:
            raise TypeError("dtype must be None, torch.float32, torch.float64, torch.float16, torch.bfloat16 "
                            f"or 'int8'; got {dtype!r}")
        super().__init__(layer_class_to_replicate=functools.partial(CacheLayer, max_cache_len, dtype))
        self.max_cache_len = max_cache_len


# -- generate with the Cache sized for the call ---------------------------------------

def generate(model, input_ids, *, cache_dtype=None, **kwargs):
    """``model.generate(input_ids, **kwargs)`` with a :class:`Cache` of exactly
    the rows the call can need (prompt plus ``max_new_tokens``, or
    ``max_length``), so decoding appends in place instead of transformers'
    DynamicCache concatenating the whole cache every step.

    cache_dtype: the Cache's storage (see :class:`Cache`; None: the model's).
    A cache given by the caller (``cache=`` or ``past_key_values=``) is used as
    it is, and beam search (``num_beams`` > 1, which reorders the batch) runs
    with transformers' own cache: the result is always ``model.generate``'s.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a (batch, prompt length) tensor of token ids; got "
                         f"{type(input_ids).__name__} of shape {tuple(getattr(input_ids, 'shape', ()))}")
    config = kwargs.get("generation_config") or model.generation_config
    given = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1) or 1)
    if given or beams > 1 or kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
        return model.generate(input_ids, **kwargs)
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    total = (input_ids.shape[1] + new if new is not None
             else kwargs.get("max_length", getattr(config, "max_length", None)))
    if not isinstance(total, int) or total < input_ids.shape[1] + 1:
        raise ValueError("generate needs max_new_tokens (or a max_length past the prompt's "
                         f"{input_ids.shape[1]} tokens) to size the cache; got max_new_tokens={new!r}, "
                         f"max_length={kwargs.get('max_length', getattr(config, 'max_length', None))!r}")
    return model.generate(input_ids, cache=Cache(max_cache_len=total, dtype=cache_dtype), **kwargs)
