"""The libraries the benchmark times fastattn against, one small adapter each.

An adapter imports its library only when asked, says whether it is installed,
and builds a ready-to-time callable for one problem: the model, session or
tensors are made once, outside the timing loop, and the thread count is set
there. A score modifier (softcap, ALiBi, sinks) is passed as fastattn's
keyword; an adapter lists in ``modifiers`` those its library can express and
refuses the others, and in ``dtypes`` the storage dtypes (fastattn.bench.dtypes)
it takes as they are stored: the others are n/a. It does no timing and no
checking: fastattn.bench.run and .checks do.
"""
import functools
import importlib
import importlib.metadata
import importlib.util
import math

import numpy as np


# a score modifier (a Shape's ``modifier``) → its keyword in fastattn.attention and prepare()
MODIFIER_KEYWORDS = {"softcap": "softcap", "alibi": "alibi_slopes", "sinks": "sinks"}


class Peer:
    """One attention implementation: ``prepare`` returns a zero-argument callable
    whose result ``np.asarray`` turns into the (B, Hq, L, Ev) output."""

    name = ""      # what --peers takes
    title = ""     # what the table shows
    module = ""    # what must be importable
    dists = ()     # distributions whose versions the header prints
    kinds = None   # the Shape kinds it runs on ("full", "decode"); None: every shape
    modifiers = ()  # the score modifiers it runs ("softcap", "alibi", "sinks"); others are n/a
    dtypes = ("float32", "float64")  # the --dtype storages it runs; others are n/a

    def installed(self):
        return importlib.util.find_spec(self.module) is not None

    def versions(self):
        found = []
        for dist in self.dists:
            try:
                found.append(f"{dist} {importlib.metadata.version(dist)}")
            except importlib.metadata.PackageNotFoundError:
                pass
        return ", ".join(found)

    def load(self):
        """Import the library now (so the header's thread-pool list sees it)."""
        return importlib.import_module(self.module)

    def has(self, modifier):
        """Whether it runs shapes with this modifier ("" = the plain call)."""
        return not modifier or modifier in self.modifiers

    def has_dtype(self, name):
        """Whether it takes inputs stored in this --dtype (a Storage name)."""
        return name in self.dtypes

    def refuse_others(self, mods):
        """Raise for a modifier keyword this adapter does not apply: never time
        a call that silently leaves it out."""
        known = {MODIFIER_KEYWORDS[m] for m in self.modifiers}
        unknown = [name for name, value in mods.items() if value is not None and name not in known]
        if unknown:
            raise NotImplementedError(f"{self.title} has no {', '.join(unknown)}")

    def prepare(self, q, k, v, causal, threads, **mods):
        """``mods``: fastattn's modifier keywords (softcap=, alibi_slopes=, sinks=).
        A peer defines this or prepare_copies (each default calls the other)."""
        return self.prepare_copies(q, [(k, v)], causal, threads, **mods)[0]

    def prepare_copies(self, q, kvs, causal, threads, **mods):
        """One call per (k, v) of ``kvs``, copies of the same K and V that a
        decode row's calls read in turn (fastattn.bench.run.Rotation). A peer
        whose calls run in a session with its own thread pool defines this
        and builds one session for all the copies: idle sessions' threads spin
        against the running one's (ONNX Runtime's GroupQueryAttention on 2
        threads took 17.6 ms with 4 sessions against 5.4 with one)."""
        if type(self).prepare is Peer.prepare:
            raise NotImplementedError(f"{type(self).__name__} defines neither prepare")
        return [self.prepare(q, k, v, causal, threads, **mods) for k, v in kvs]


class FastAttn(Peer):
    name, title, module, dists = "fastattn", "fastattn", "fastattn", ("fastattn",)
    modifiers = tuple(MODIFIER_KEYWORDS)
    dtypes = ("float32", "float64", "float16", "bfloat16", "int8")

    def prepare(self, q, k, v, causal, threads, **mods):
        from fastattn import attention
        if not mods:  # the plain call as a user writes it (the binding's fast path)
            return lambda: attention(q, k, v, causal=causal, num_threads=threads)
        return lambda: attention(q, k, v, causal=causal, num_threads=threads, **mods)


class NumPyTextbook(Peer):
    """``softmax(q kᵀ · scale) v`` as a NumPy user writes it, in the inputs' dtype.

    GQA repeats K/V heads inside the call: a NumPy model gets fresh K and V
    every call, so the copy is part of its cost. The causal mask depends on the
    shape only, so it is built once (with the ALiBi bias in it, when asked).
    NumPy's BLAS threads are the caller's to set (threadpoolctl); ``threads``
    is not used here.

    NumPy has no 16-bit or int8 matmul worth timing (float16 runs without
    BLAS), so 16-bit inputs are converted to float32 each call and int8 K/V
    pairs dequantized (values·scales) each call, as a NumPy user would; the
    result goes back to q's dtype. The conversions are part of its cost.
    """

    name, title, module, dists = "numpy", "NumPy", "numpy", ("numpy",)
    modifiers = tuple(MODIFIER_KEYWORDS)
    dtypes = ("float32", "float64", "float16", "bfloat16", "int8")

    def prepare(self, q, k, v, causal, threads, softcap=None, alibi_slopes=None, sinks=None):
        L, S = q.shape[-2], (k[0] if isinstance(k, tuple) else k).shape[-2]
        compute = np.float64 if q.dtype == np.float64 else np.float32
        if alibi_slopes is not None:
            mask = alibi_mask(alibi_slopes, L, S, causal, compute)
        else:
            mask = causal_mask(L, S, compute) if causal else None
        if sinks is not None:
            sinks = np.asarray(sinks, compute)[:, None, None]  # (Hq, 1, 1)
        if q.dtype == compute and not isinstance(k, tuple) and k.dtype == compute:
            return lambda: textbook_attention(q, k, v, mask, softcap, sinks)

        def widened(x):  # float32 from 16 bits, or int8 values times their row scales
            if isinstance(x, tuple):
                return x[0].astype(np.float32) * x[1][..., None]
            return x.astype(np.float32)

        return lambda: textbook_attention(widened(q), widened(k), widened(v), mask, softcap,
                                          sinks).astype(q.dtype)


def causal_mask(L, S, dtype):
    """Additive causal mask, bottom-right: row i sees keys j <= i + S - L
    (= top-left when L == S)."""
    return np.triu(np.full((L, S), -np.inf, dtype), k=S - L + 1)


def alibi_mask(slopes, L, S, causal, dtype):
    """ALiBi as an additive (Hq, L, S) mask: −slope[h]·|j − (i + S − L)|, the
    distance from the row's bottom-right diagonal, plus −inf above it when
    causal. On causal rows this is BLOOM's slope·j up to a per-row constant."""
    distance = np.abs(np.arange(S)[None, :] - np.arange(S - L, S)[:, None])
    bias = (-np.asarray(slopes, np.float64)[:, None, None] * distance).astype(dtype)
    return bias + causal_mask(L, S, dtype) if causal else bias


def textbook_attention(q, k, v, mask=None, softcap=None, sinks=None):
    """softmax(q kᵀ/√E + mask) v as a NumPy user writes it: K/V heads repeated
    per group (a copy each call), scores, max-subtracted exp, row sums. With
    softcap, the scaled scores become c·tanh(s/c) before the mask; with sinks
    ((Hq, 1, 1) logits), each head's sink joins the row max and the sum."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    s = q @ k.swapaxes(-1, -2)
    s *= q.dtype.type(1 / math.sqrt(q.shape[-1]))
    if softcap is not None:
        c = q.dtype.type(softcap)
        s /= c
        np.tanh(s, out=s)
        s *= c  # c·tanh(s/c)
    if mask is not None:
        s += mask
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks)
    s -= m  # stable: every exponent <= 0
    np.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total += np.exp(sinks - m)  # the sink: in the denominator, no value
    s /= total
    return s @ v


class Torch(Peer):
    """``torch.nn.functional.scaled_dot_product_attention`` on tensors that share
    the NumPy inputs' memory (bfloat16 through an int16 view: torch.from_numpy
    does not know ml_dtypes). ``is_causal`` is top-left; the bench shapes have
    L == S, where both alignments agree."""

    name, title, module, dists = "torch", "PyTorch", "torch", ("torch",)
    # SDPA has no softcap and no sinks; ALiBi goes in as an additive float
    # mask (the causal −inf folded in: SDPA takes attn_mask or is_causal)
    modifiers = ("alibi",)
    dtypes = ("float32", "float64", "float16", "bfloat16")

    def prepare(self, q, k, v, causal, threads, **mods):
        self.refuse_others(mods)
        torch = self.load()
        torch.set_num_threads(threads)  # global in torch; set right before its own loop
        bf16 = q.dtype.name == "bfloat16"

        def tensor(x):
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if bf16 else torch.from_numpy(x)

        tq, tk, tv = (tensor(x) for x in (q, k, v))
        gqa = q.shape[-3] != k.shape[-3]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        # NumPy cannot take a bfloat16 tensor: the checker reads its bits, after the timed call
        wrap = (lambda t: _TorchBfloat16(t, q.dtype)) if bf16 else (lambda t: t)
        if mods.get("alibi_slopes") is not None:
            mask = tensor(alibi_mask(mods["alibi_slopes"], q.shape[-2], k.shape[-2], causal,
                                     np.float64).astype(q.dtype))

            def call():
                with torch.inference_mode():
                    return wrap(sdpa(tq, tk, tv, attn_mask=mask, enable_gqa=gqa))

            return call

        def call():
            with torch.inference_mode():
                return wrap(sdpa(tq, tk, tv, is_causal=bool(causal), enable_gqa=gqa))

        return call


class _TorchBfloat16:
    """A bfloat16 tensor that np.asarray turns into an ml_dtypes array (no copy)."""

    def __init__(self, t, dtype):
        self.t, self.dtype = t, dtype

    def __array__(self, dtype=None, copy=None):
        import torch
        a = self.t.contiguous().view(torch.int16).numpy().view(self.dtype)
        return a if dtype is None else a.astype(dtype)


class OnnxRuntime(Peer):
    """A one-node ONNX model with the standard ``Attention`` operator (opset 23):
    (B, H, L, E) inputs, GQA from K/V having fewer heads, ``is_causal`` top-left.
    Softcap is the operator's ``softcap`` attribute (opset 23; ONNX Runtime's
    CPU kernel applies it, 1.32 checked), ALiBi an additive float ``attn_mask``
    input added after the cap, with ``is_causal`` still on. No sinks input.
    float16 runs (ONNX Runtime 1.32's CPU kernel); bfloat16 does not (no CPU
    kernel for the graph's Expand in bfloat16)."""

    name, title, module, dists = "onnxruntime", "ONNX Runtime", "onnxruntime", ("onnxruntime", "onnx")
    modifiers = ("softcap", "alibi")
    dtypes = ("float32", "float64", "float16")

    def installed(self):
        return super().installed() and importlib.util.find_spec("onnx") is not None

    def prepare_copies(self, q, kvs, causal, threads, **mods):
        self.refuse_others(mods)
        from onnx import helper
        k, v = kvs[0]
        elem = helper.np_dtype_to_tensor_dtype(q.dtype)
        extra = {}
        attrs = {"is_causal": int(bool(causal))}
        if mods.get("softcap") is not None:
            attrs["softcap"] = float(mods["softcap"])
        if mods.get("alibi_slopes") is not None:
            bias = alibi_mask(mods["alibi_slopes"], q.shape[-2], k.shape[-2], False, q.dtype)
            extra["attn_mask"] = bias[None]  # (1, Hq, L, S)
        shapes = {"Q": q.shape, "K": k.shape, "V": v.shape, **{n: x.shape for n, x in extra.items()}}
        inputs = [helper.make_tensor_value_info(n, elem, list(sh)) for n, sh in shapes.items()]
        output = helper.make_tensor_value_info("Y", elem, None)
        node = helper.make_node("Attention", list(shapes), ["Y"], **attrs)
        opset = [helper.make_opsetid("", 23)]
        graph = helper.make_graph([node], "attention", inputs, [output])
        session = self._session(helper.make_model(graph, opset_imports=opset,
                                ir_version=helper.find_min_ir_version_for(opset)), threads)
        return [functools.partial(_ort_run, session, {"Q": q, "K": k, "V": v, **extra})
                for k, v in kvs]

    def _session(self, model, threads):
        """One CPU session of ``model`` on ``threads`` threads."""
        ort = self.load()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads  # counts the calling thread
        options.inter_op_num_threads = 1
        return ort.InferenceSession(model.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])


def _ort_run(session, feeds):
    return session.run(None, feeds)[0]


class OrtGroupQueryAttention(OnnxRuntime):
    """ONNX Runtime's ``GroupQueryAttention`` (com.microsoft contrib op) the way
    a decoder runs it (onnxruntime-genai's past-present shared buffer): the new
    token(s) come in as query (B, L, Hq·E) and key/value (B, L, Hkv·E); the KV
    cache is a (B, Hkv, S, E) buffer bound as both past_key/past_value and
    present_key/present_value, so the op appends the new rows in place instead
    of copying the cache every call; seqlens_k = S − 1 and
    total_sequence_length = S say how much of it is valid. The layout changes
    (query to BSNH, the output back to BNSH) happen once, outside the timed call.

    The op is causal by construction: L new rows see the cache and the new rows
    up to themselves. So it runs decode shapes only, and only where that is the
    problem asked: L == 1, or causal (bottom-right).

    Modifiers: its ``softcap`` attribute, its ``head_sink`` input (one logit
    per query head in the softmax denominator: sinks) and ALiBi as its
    additive ``attention_bias`` input (B or 1, Hq, L, S). float32 and float16
    (every tensor in it, the cache included)."""

    name, title = "ort_gqa", "ORT GroupQueryAttention"
    dists = ("onnxruntime",)
    kinds = ("decode",)
    modifiers = ("softcap", "alibi", "sinks")
    dtypes = ("float32", "float16")

    def prepare_copies(self, q, kvs, causal, threads, **mods):
        self.refuse_others(mods)
        from onnx import TensorProto, helper
        k, v = kvs[0]
        B, Hq, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[-1]
        if L > 1 and not causal:
            raise NotImplementedError(
                f"GroupQueryAttention is causal: its {L} new rows cannot all see every key")
        if q.dtype not in (np.float32, np.float16) or k.dtype != q.dtype or Ev != E:
            raise NotImplementedError("GroupQueryAttention on the CPU: float32 or float16, Ev == E only")
        elem, i32 = helper.np_dtype_to_tensor_dtype(q.dtype), TensorProto.INT32
        inputs = [helper.make_tensor_value_info("query", elem, [B, L, Hq * E]),
                  helper.make_tensor_value_info("key", elem, [B, L, Hkv * E]),
                  helper.make_tensor_value_info("value", elem, [B, L, Hkv * E]),
                  helper.make_tensor_value_info("past_key", elem, [B, Hkv, S, E]),
                  helper.make_tensor_value_info("past_value", elem, [B, Hkv, S, E]),
                  helper.make_tensor_value_info("seqlens_k", i32, [B]),
                  helper.make_tensor_value_info("total_sequence_length", i32, [])]
        outputs = [helper.make_tensor_value_info(n, elem, None)
                   for n in ("output", "present_key", "present_value")]
        names = [i.name for i in inputs]
        extra, attrs = {}, {}
        if mods.get("softcap") is not None:
            attrs["softcap"] = float(mods["softcap"])
        if mods.get("alibi_slopes") is not None:
            extra["attention_bias"] = alibi_mask(mods["alibi_slopes"], L, S, False, q.dtype)[None]
        if mods.get("sinks") is not None:
            extra["head_sink"] = np.asarray(mods["sinks"], q.dtype)
        if extra:  # optional inputs are positional: "" skips one
            order = ["cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink"]
            used = order[:max(order.index(n) for n in extra) + 1]
            names += [n if n in extra else "" for n in used]
            inputs += [helper.make_tensor_value_info(n, elem, list(x.shape)) for n, x in extra.items()]
        node = helper.make_node("GroupQueryAttention", names,
                                [o.name for o in outputs], domain="com.microsoft",
                                num_heads=Hq, kv_num_heads=Hkv, scale=1 / math.sqrt(E), **attrs)
        opset = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
        model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                                  opset_imports=opset, ir_version=10)
        session = self._session(model, threads)
        return [self._bound(session, q, k, v, extra) for k, v in kvs]

    def _bound(self, session, q, k, v, extra):
        """A call of ``session`` on one copy of the cache, every input bound once."""
        ort = self.load()
        B, Hq, L, E = q.shape
        S = k.shape[2]

        def bsnh(x):  # (B, H, L, E) → (B, L, H·E)
            return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(B, L, -1))

        # the cache: all S rows of K and V; the op rewrites the last L with the same values
        cache_k = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(k))
        cache_v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v))
        out = np.empty((B, L, Hq * E), q.dtype)
        binding = session.io_binding()
        binding.bind_cpu_input("query", bsnh(q))
        binding.bind_cpu_input("key", bsnh(k[:, :, S - L:]))
        binding.bind_cpu_input("value", bsnh(v[:, :, S - L:]))
        binding.bind_ortvalue_input("past_key", cache_k)
        binding.bind_ortvalue_input("past_value", cache_v)
        binding.bind_cpu_input("seqlens_k", np.full((B,), S - 1, np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(S, np.int32))
        for n, x in extra.items():
            binding.bind_cpu_input(n, np.ascontiguousarray(x))
        binding.bind_ortvalue_output("output", ort.OrtValue.ortvalue_from_numpy(out))
        binding.bind_ortvalue_output("present_key", cache_k)
        binding.bind_ortvalue_output("present_value", cache_v)
        result = out.reshape(B, L, Hq, E).transpose(0, 2, 1, 3)  # a view: no copy per call

        def call():
            session.run_with_iobinding(binding)
            return result

        return call


class OpenVINO(Peer):
    """``opset13.scaled_dot_product_attention`` compiled for the CPU with the
    inference precision hint f32 (it runs in bfloat16 on CPUs that have it
    unless told f32). SDPA needs equal head counts, so GQA broadcasts K/V heads
    inside the graph, as exported models do; the CPU plugin fuses that pattern.
    float16 and bfloat16 inputs are f16 and bf16 parameters (bfloat16 passed
    as its bits: OpenVINO's Python does not know ml_dtypes). With bf16 inputs
    the output is the same for the hints f32 and bf16 (OpenVINO 2026.4)."""

    name, title, module, dists = "openvino", "OpenVINO", "openvino", ("openvino",)
    dtypes = ("float32", "float64", "float16", "bfloat16")

    def prepare_copies(self, q, kvs, causal, threads, **mods):
        self.refuse_others(mods)  # none yet: its attn_mask could carry ALiBi (untried)
        ov = self.load()
        k, v = kvs[0]
        ops = importlib.import_module("openvino.opset13")
        bf16 = q.dtype.name == "bfloat16"
        element = ov.Type.bf16 if bf16 else None
        pq, pk, pv = (ops.parameter(list(x.shape), element or x.dtype) for x in (q, k, v))
        key, value = pk, pv
        if q.shape[-3] != k.shape[-3]:
            key, value = (_ov_repeat_heads(ops, p, q.shape, x.shape) for p, x in ((pk, k), (pv, v)))
        sdpa = ops.scaled_dot_product_attention(pq, key, value, causal=bool(causal))
        model = ov.Model([sdpa], [pq, pk, pv])
        config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads,
                  "NUM_STREAMS": 1}
        compiled = ov.Core().compile_model(model, "CPU", config)
        return [self._request(compiled, q, k, v, element) for k, v in kvs]

    def _request(self, compiled, q, k, v, element):
        """A call on one copy of K and V: its own infer request of the one compiled model."""
        ov = self.load()
        request = compiled.create_infer_request()
        feeds = {0: q, 1: k, 2: v}
        if element is not None:  # bfloat16: tensors on the same memory, typed bf16
            feeds = {i: ov.Tensor(x.view(np.uint16), list(x.shape), element) for i, x in feeds.items()}
            # its bf16 output comes back as float16-typed bits: a view, no copy
            return lambda: request.infer(feeds, share_inputs=True,
                                         share_outputs=True)[0].view(np.uint16).view(q.dtype)
        # shared in and out: no copies inside the timed call
        return lambda: request.infer(feeds, share_inputs=True, share_outputs=True)[0]


def _ov_repeat_heads(ops, node, q_shape, kv_shape):
    """(B, Hkv, S, E) → (B, Hq, S, E), head h reading h // g: unsqueeze, broadcast, reshape."""
    B, Hkv, S, E = kv_shape
    group = q_shape[-3] // Hkv
    wide = ops.unsqueeze(node, ops.constant(np.array([2], np.int64)))
    wide = ops.broadcast(wide, ops.constant(np.array([B, Hkv, group, S, E], np.int64)))
    return ops.reshape(wide, ops.constant(np.array([B, Hkv * group, S, E], np.int64)), False)


# fastattn first: it is what every ratio is taken against.
LIBRARIES = {p.name: p for p in (FastAttn(), NumPyTextbook(), Torch(), OnnxRuntime(), OpenVINO(),
                                  OrtGroupQueryAttention())}
# peers that run every shape (the pytest-benchmark suite times these) ...
PEERS = [name for name in LIBRARIES if name != "fastattn" and LIBRARIES[name].kinds is None]
# ... and those that run some kinds only (the bench skips them elsewhere)
KIND_PEERS = [name for name in LIBRARIES if LIBRARIES[name].kinds is not None]
ALL_PEERS = PEERS + KIND_PEERS


def default_peers():
    """NumPy plus every other peer that is installed."""
    return [name for name in ALL_PEERS if name == "numpy" or LIBRARIES[name].installed()]
