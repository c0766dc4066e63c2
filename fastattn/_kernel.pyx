# cython: language_level=3
"""Thin binding to the C kernel (src_c/fastattn.h).

Two ways in. `attention` takes arrays that fastattn._api has already
validated and laid out as 4-D (batch, head, row, column) views. `attention_fast`
takes the common call (plain arrays, no mask) straight from the user and checks
only what it needs to decide that the call is that simple, returning None
otherwise, so the general path words every error. Both fill one fa_args,
release the GIL for the call and turn an error code into an exception whose
sentence comes from C. No arithmetic here.
"""
cimport numpy as cnp
from libc.math cimport sqrt
from libc.stdint cimport int64_t

cnp.import_array()

cdef extern from "fastattn.h" nogil:
    ctypedef struct fa_args:
        int dtype
        int q_dtype, out_dtype
        int64_t B, Hq, Hkv, L, S, E, Ev
        const void *q
        const void *k
        const void *v
        void *out
        int64_t q_stride[3]
        int64_t k_stride[3]
        int64_t v_stride[3]
        int64_t out_stride[3]
        double scale
        int mask_kind
        const void *mask
        int64_t mask_stride[4]
        int causal
        int align
        int64_t window_left, window_right
        const int64_t *kv_len
        void *lse
        int64_t lse_stride[3]
        double softcap
        const double *alibi_slopes
        int64_t alibi_stride[2]
        const double *sinks
        const float *k_scale
        const float *v_scale
        int64_t k_scale_stride[3]
        int64_t v_scale_stride[3]
        const float *k_channel
        int64_t k_channel_stride[2]
        const int64_t *q_start
        const int64_t *k_start
        int num_threads
    int FA_F32, FA_F64, FA_F16, FA_BF16, FA_I8, FA_MASK_NONE, FA_MASK_BOOL, FA_MASK_ADD, FA_ERR_NOMEM
    void fa_args_init(fa_args *args)
    int fa_attention(const fa_args *args)
    int fa_check(const fa_args *args)
    const char *fa_strerror(int code)
    const char *fa_isa()
    const char *fa_cpu_features()
    int fa_set_isa(const char *name)
    int fa_isa_supported(const char *name)
    int fa_openmp()
    int fa_max_threads()

cdef extern from "internal.h" nogil:
    int fa_test_exp2(const char *isa, int dtype, const void *x, void *y, int64_t n)
    int fa_test_softcap(const char *isa, int dtype, const void *x, void *y, int64_t n, double c)
    ctypedef struct fa_strategy:
        int layout
        int64_t rows_per_item, chunk_keys
        int threads
        int64_t row_blocks, key_chunks, items
        int serial
        int64_t key_block, lane_block
    int FA_LAYOUT_AUTO, FA_LAYOUT_LANES, FA_LAYOUT_ROWS
    int fa_attention_with(const fa_args *args, const fa_strategy *force)
    int fa_plan_call(const fa_args *args, const fa_strategy *force, fa_strategy *decided)

LAYOUTS = {"auto": 0, "lanes": 1, "rows": 2}

ISAS = ("amx", "avx512bf16", "avx512", "avx2", "sse2", "neon", "scalar")


cdef void _strides(cnp.ndarray x, int64_t *dst, int n):
    # element strides of the first n axes (the last axis is contiguous)
    cdef int i
    for i in range(n):
        dst[i] = cnp.PyArray_STRIDE(x, i) // cnp.PyArray_ITEMSIZE(x)


cdef int _fill(fa_args *a, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out,
               object lse, object mask, int causal, int align, int64_t wl, int64_t wr,
               object kv_len, double scale, int num_threads, object mods) except -1:
    fa_args_init(a)
    a.dtype, a.q_dtype, a.out_dtype = _code(k), _code(q), _code(out)
    a.B, a.Hq, a.L, a.E = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    a.Hkv, a.S, a.Ev = k.shape[1], k.shape[2], v.shape[3]
    a.q, a.k, a.v = cnp.PyArray_DATA(q), cnp.PyArray_DATA(k), cnp.PyArray_DATA(v)
    a.out = cnp.PyArray_DATA(out)
    _strides(q, a.q_stride, 3)
    _strides(k, a.k_stride, 3)
    _strides(v, a.v_stride, 3)
    _strides(out, a.out_stride, 3)
    a.scale = scale
    if mask is not None:
        a.mask_kind = FA_MASK_BOOL if (<cnp.ndarray>mask).dtype.itemsize == 1 else FA_MASK_ADD
        a.mask = cnp.PyArray_DATA(<cnp.ndarray>mask)
        _strides(<cnp.ndarray>mask, a.mask_stride, 4)
    a.causal, a.align, a.window_left, a.window_right = causal, align, wl, wr
    if kv_len is not None:
        a.kv_len = <const int64_t *>cnp.PyArray_DATA(<cnp.ndarray>kv_len)
    if lse is not None:
        a.lse = cnp.PyArray_DATA(<cnp.ndarray>lse)
        _strides(<cnp.ndarray>lse, a.lse_stride, 3)
    a.num_threads = num_threads
    if mods is not None:
        _fill_modifiers(a, mods)
    return 0


cdef int _code(cnp.ndarray x) except -1:
    # the fa_dtype of an array the API has checked
    cdef int c = _float_code(x)
    if c >= 0:
        return c
    if cnp.PyArray_TYPE(x) == cnp.NPY_INT8:
        return FA_I8
    raise TypeError(f"no fastattn dtype for {x.dtype}")


cdef const float *_row_scales(object x, int64_t *stride):
    # an int8 pair's scales as a (B, Hkv, S, 1) view: its data and row strides, or NULL
    if x is None:
        return NULL
    _strides(<cnp.ndarray>x, stride, 3)
    return <const float *>cnp.PyArray_DATA(<cnp.ndarray>x)


cdef int _fill_modifiers(fa_args *a, dict mods) except -1:
    # mods: softcap (float, 0 off), alibi_slopes float64 (B, Hq), sinks float64
    # (Hq,) contiguous, q_start / k_start int64 (B,) contiguous, int8's k_scale /
    # v_scale (B, Hkv, S, 1) and k_channel float32 (B, Hkv, 1, E); absent or None: off
    cdef cnp.ndarray x
    a.softcap = mods.get("softcap") or 0.0
    x = mods.get("alibi_slopes")
    if x is not None:
        a.alibi_slopes = <const double *>cnp.PyArray_DATA(x)
        a.alibi_stride[0] = cnp.PyArray_STRIDE(x, 0) // 8
        a.alibi_stride[1] = cnp.PyArray_STRIDE(x, 1) // 8
    x = mods.get("sinks")
    if x is not None:
        a.sinks = <const double *>cnp.PyArray_DATA(x)
    a.k_scale = _row_scales(mods.get("k_scale"), a.k_scale_stride)
    a.v_scale = _row_scales(mods.get("v_scale"), a.v_scale_stride)
    x = mods.get("k_channel")  # (B, Hkv, 1, E), E contiguous
    if x is not None:
        a.k_channel = <const float *>cnp.PyArray_DATA(x)
        a.k_channel_stride[0] = cnp.PyArray_STRIDE(x, 0) // 4
        a.k_channel_stride[1] = cnp.PyArray_STRIDE(x, 1) // 4
    x = mods.get("q_start")
    if x is not None:
        a.q_start = <const int64_t *>cnp.PyArray_DATA(x)
    x = mods.get("k_start")
    if x is not None:
        a.k_start = <const int64_t *>cnp.PyArray_DATA(x)
    return 0


cdef _raise(int rc):
    msg = fa_strerror(rc).decode()
    if rc == FA_ERR_NOMEM:
        raise MemoryError(msg)
    raise ValueError(msg)


cdef int _strategy(fa_strategy *s, object force) except -1:
    # force: None or a dict with any of layout ("auto", "lanes", "rows"),
    # rows_per_item, chunk_keys, threads (0 or absent: the driver decides)
    s.layout, s.rows_per_item, s.chunk_keys, s.threads = 0, 0, 0, 0
    s.row_blocks, s.key_chunks, s.items, s.serial, s.key_block, s.lane_block = 0, 0, 0, 0, 0, 0
    if force is None:
        return 0
    unknown = set(force) - {"layout", "rows_per_item", "chunk_keys", "threads"}
    if unknown:
        raise ValueError(f"strategy: unknown fields {sorted(unknown)}")
    s.layout = LAYOUTS[force.get("layout", "auto")]
    s.rows_per_item = force.get("rows_per_item", 0)
    s.chunk_keys = force.get("chunk_keys", 0)
    s.threads = force.get("threads", 0)
    return 0


def attention(q, k, v, out, lse, mask, int causal, int align, int64_t wl, int64_t wr,
              kv_len, double scale, int num_threads, bint check_only=False, force=None, mods=None):
    """Runs (or, with check_only, only checks) one call on 4-D views.

    q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), out (B, Hq, L, Ev),
    lse (B, Hq, L) or None, mask (B, Hq, L, S) bool-as-uint8 or q's dtype, or
    None; kv_len int64 (B,) or None. Last axes contiguous, data aligned.
    force: a strategy to impose (see _strategy; tests only), or None.
    mods: the score modifiers (see _fill_modifiers), or None.
    """
    cdef fa_args a
    cdef fa_strategy s
    cdef int rc
    _fill(&a, q, k, v, out, lse, mask, causal, align, wl, wr, kv_len, scale, num_threads, mods)
    _strategy(&s, force)
    if check_only:
        rc = fa_check(&a)
    elif force is None:
        with nogil:
            rc = fa_attention(&a)
    else:
        with nogil:
            rc = fa_attention_with(&a, &s)
    if rc:
        _raise(rc)


def plan(q, k, v, out, lse, mask, int causal, int align, int64_t wl, int64_t wr,
         kv_len, double scale, int num_threads, force=None, mods=None):
    """What the driver decides for this call (arguments as attention's):
    a dict of layout, rows_per_item, chunk_keys, threads, row_blocks,
    key_chunks, items, serial, key_block and lane_block (the rows of one
    lane-layout sub-block). Runs nothing."""
    cdef fa_args a
    cdef fa_strategy s, d
    _fill(&a, q, k, v, out, lse, mask, causal, align, wl, wr, kv_len, scale, num_threads, mods)
    _strategy(&s, force)
    rc = fa_plan_call(&a, &s, &d)
    if rc:
        _raise(rc)
    names = {v: n for n, v in LAYOUTS.items()}
    return {"layout": names[d.layout], "rows_per_item": d.rows_per_item, "chunk_keys": d.chunk_keys,
            "threads": d.threads, "row_blocks": d.row_blocks, "key_chunks": d.key_chunks,
            "items": d.items, "serial": bool(d.serial), "key_block": d.key_block,
            "lane_block": d.lane_block}


def isa():
    """Name of the micro-kernel set in use."""
    return fa_isa().decode()


def set_isa(name):
    cdef bytes b = (name or "auto").encode()
    if fa_set_isa(b) != 0:
        raise ValueError(
            f"set_isa: {name!r} is not available here; choose one of "
            f"{available_isas() + ['auto']}")


def isa_supported(name):
    return bool(fa_isa_supported(name.encode()))


def available_isas():
    """The micro-kernel sets compiled in that this CPU runs, best first."""
    return [n for n in ISAS if fa_isa_supported(n.encode())]


def cpu_features():
    """The CPU extensions dispatch found (e.g. ["avx2", "fma", "f16c"])."""
    return fa_cpu_features().decode().split()


cdef extern from *:
    """
    #ifndef FA_SOURCE_DIGEST
    #define FA_SOURCE_DIGEST "unknown"
    #endif
    """
    const char *FA_SOURCE_DIGEST


def source_digest():
    """src_c/manifest.py's source_digest() of the tree this module was built from."""
    return FA_SOURCE_DIGEST.decode()


def openmp():
    return bool(fa_openmp())


def max_threads():
    return fa_max_threads()


cdef int _bf16_type = -1  # ml_dtypes' bfloat16 type number, once an array of it is seen


cdef int _float_code(cnp.ndarray x):
    # the fa_dtype of a float array, or -1: bfloat16 is known by name
    # (ml_dtypes registers it at a type number of its own)
    global _bf16_type
    cdef int t = cnp.PyArray_TYPE(x)
    if t == cnp.NPY_FLOAT32:
        return FA_F32
    if t == cnp.NPY_FLOAT64:
        return FA_F64
    if t == cnp.NPY_FLOAT16:
        return FA_F16
    if t == _bf16_type:
        return FA_BF16
    if _bf16_type < 0 and cnp.PyArray_ITEMSIZE(x) == 2 and x.dtype.name == "bfloat16":
        _bf16_type = t
        return FA_BF16
    return -1


cdef bint _plain(object x, int ndim, int type_num):
    # an exact ndarray of that rank and dtype that C can read in place
    if type(x) is not cnp.ndarray:
        return False
    cdef cnp.ndarray a = <cnp.ndarray>x
    if cnp.PyArray_NDIM(a) != ndim or cnp.PyArray_TYPE(a) != type_num:
        return False
    if not cnp.PyArray_ISALIGNED(a) or not cnp.PyArray_ISNOTSWAPPED(a):
        return False
    cdef int i
    cdef Py_ssize_t size = cnp.PyArray_ITEMSIZE(a)
    for i in range(ndim):
        if cnp.PyArray_STRIDE(a, i) % size:
            return False
    return cnp.PyArray_DIM(a, ndim - 1) <= 1 or cnp.PyArray_STRIDE(a, ndim - 1) == size


def attention_fast(q, k, v, bint causal, kv_lengths=None, double scale=0.0, int num_threads=0,
                   out=None):
    """The common call — q, k, v plain arrays of one rank (2, 3 or 4), k and v
    of one dtype (float32, float16, bfloat16), q float32 or 16-bit (out in
    q's dtype), or all three float64; equal batch axes, no mask, kv_lengths None or
    a 1-D int64 array with one entry per batch entry of 4-D inputs (a KV
    cache's decoding step), out None or a writeable plain array of the
    result's shape whose memory is clear of the inputs' (a layer's
    concatenated-heads view); scale 0 means 1/sqrt(E), num_threads 0 the
    OpenMP default — checked and run without the general path's
    broadcasting. Returns None for anything else, and for any argument C
    refuses: the caller then takes the general path, which words the error."""
    if type(q) is not cnp.ndarray or type(k) is not cnp.ndarray:
        return None
    cdef cnp.ndarray qa = <cnp.ndarray>q, ka = <cnp.ndarray>k, va, oa
    cdef int nd = cnp.PyArray_NDIM(qa)
    cdef int dt = cnp.PyArray_TYPE(qa), dt_kv = cnp.PyArray_TYPE(ka)  # out has q's dtype
    cdef int code_q = _float_code(qa), code_kv = _float_code(ka)
    if nd < 2 or nd > 4 or code_q < 0 or code_kv < 0 or (code_q == FA_F64) != (code_kv == FA_F64):
        return None
    if not (_plain(q, nd, dt) and _plain(k, nd, dt_kv) and _plain(v, nd, dt_kv)):
        return None
    va = <cnp.ndarray>v
    cdef int i
    for i in range(nd - 3):  # batch axes: equal, no broadcasting here
        if cnp.PyArray_DIM(qa, i) != cnp.PyArray_DIM(ka, i) or cnp.PyArray_DIM(qa, i) != cnp.PyArray_DIM(va, i):
            return None
    cdef int64_t L = cnp.PyArray_DIM(qa, nd - 2), E = cnp.PyArray_DIM(qa, nd - 1)
    cdef int64_t S = cnp.PyArray_DIM(ka, nd - 2), Ev = cnp.PyArray_DIM(va, nd - 1)
    cdef int64_t Hq = cnp.PyArray_DIM(qa, nd - 3) if nd >= 3 else 1
    cdef int64_t Hkv = cnp.PyArray_DIM(ka, nd - 3) if nd >= 3 else 1
    if (cnp.PyArray_DIM(ka, nd - 1) != E or cnp.PyArray_DIM(va, nd - 2) != S or E < 1 or Ev < 1
            or Hkv < 1 or Hq % Hkv or (nd >= 3 and cnp.PyArray_DIM(va, nd - 3) != Hkv)):
        return None
    cdef cnp.npy_intp shape[4]
    for i in range(nd - 1):
        shape[i] = cnp.PyArray_DIM(qa, i)
    shape[nd - 1] = Ev
    if out is None:
        out = cnp.PyArray_SimpleNew(nd, shape, dt)
    elif not _plain(out, nd, dt) or not cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out):
        return None
    else:
        oa = <cnp.ndarray>out
        for i in range(nd):
            if cnp.PyArray_DIM(oa, i) != shape[i]:
                return None
        if _overlap(oa, qa) or _overlap(oa, <cnp.ndarray>k) or _overlap(oa, <cnp.ndarray>v) or (
                type(kv_lengths) is cnp.ndarray and _overlap(oa, <cnp.ndarray>kv_lengths)):
            return None
    oa = <cnp.ndarray>out

    cdef fa_args a
    cdef int rc
    fa_args_init(&a)
    a.dtype, a.q_dtype, a.out_dtype = code_kv, code_q, code_q
    a.B = 1
    if nd == 4:
        a.B = cnp.PyArray_DIM(qa, 0)
    a.Hq, a.Hkv, a.L, a.S, a.E, a.Ev = Hq, Hkv, L, S, E, Ev
    a.q, a.k, a.v, a.out = cnp.PyArray_DATA(qa), cnp.PyArray_DATA(ka), cnp.PyArray_DATA(va), cnp.PyArray_DATA(oa)
    _strides_right(qa, a.q_stride)
    _strides_right(ka, a.k_stride)
    _strides_right(va, a.v_stride)
    _strides_right(oa, a.out_stride)
    a.scale = scale if scale != 0 else 1.0 / sqrt(<double>E)  # as _api._scale: the same bits
    a.causal = causal
    a.num_threads = num_threads
    cdef cnp.ndarray lens
    if kv_lengths is not None:
        if (type(kv_lengths) is not cnp.ndarray or nd != 4 or cnp.PyArray_NDIM(<cnp.ndarray>kv_lengths) != 1
                or cnp.PyArray_TYPE(<cnp.ndarray>kv_lengths) != cnp.NPY_INT64
                or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>kv_lengths)
                or cnp.PyArray_DIM(<cnp.ndarray>kv_lengths, 0) != a.B):
            return None
        lens = <cnp.ndarray>kv_lengths
        a.kv_len = <const int64_t *>cnp.PyArray_DATA(lens)
    if fa_check(&a):
        return None
    with nogil:
        rc = fa_attention(&a)
    if rc:
        _raise(rc)
    return out


cdef bint _overlap(cnp.ndarray a, cnp.ndarray b):
    # whether the byte extents of a and b intersect (what np.may_share_memory
    # tests); an empty array touches nothing
    cdef char *lo_a
    cdef char *hi_a
    cdef char *lo_b
    cdef char *hi_b
    if cnp.PyArray_SIZE(a) == 0 or cnp.PyArray_SIZE(b) == 0:
        return False
    _extent(a, &lo_a, &hi_a)
    _extent(b, &lo_b, &hi_b)
    return lo_a < hi_b and lo_b < hi_a


cdef void _extent(cnp.ndarray x, char **lo, char **hi):
    # [lo, hi): the bytes a non-empty array's elements span, any strides
    cdef char *p = <char *>cnp.PyArray_DATA(x)
    cdef Py_ssize_t first = 0, last = 0, step
    cdef int i
    for i in range(cnp.PyArray_NDIM(x)):
        step = cnp.PyArray_STRIDE(x, i) * (cnp.PyArray_DIM(x, i) - 1)
        if step < 0:
            first += step
        else:
            last += step
    lo[0] = p + first
    hi[0] = p + last + cnp.PyArray_ITEMSIZE(x)


cdef void _strides_right(cnp.ndarray x, int64_t *dst):
    # element strides of (batch, head, row) for a 2-, 3- or 4-D array; absent axes 0
    cdef int nd = cnp.PyArray_NDIM(x), i
    cdef int64_t size = cnp.PyArray_ITEMSIZE(x)
    for i in range(3):
        dst[i] = cnp.PyArray_STRIDE(x, nd - 4 + i) // size if nd - 4 + i >= 0 else 0


def exp2(x, isa):
    """2^x through the named micro-kernel set's vector exp2 (for its accuracy
    test); x a contiguous float32 or float64 array."""
    cdef cnp.ndarray xa = cnp.PyArray_GETCONTIGUOUS(x)
    cdef cnp.ndarray ya = cnp.PyArray_EMPTY(1, [xa.size], cnp.PyArray_TYPE(xa), 0)
    cdef int dtype = FA_F32 if cnp.PyArray_TYPE(xa) == cnp.NPY_FLOAT32 else FA_F64
    if cnp.PyArray_TYPE(xa) not in (cnp.NPY_FLOAT32, cnp.NPY_FLOAT64):
        raise TypeError(f"exp2 takes float32 or float64; got {x.dtype}")
    if fa_test_exp2(isa.encode(), dtype, cnp.PyArray_DATA(xa), cnp.PyArray_DATA(ya), xa.size):
        raise ValueError(f"ISA {isa!r} is not available here")
    return ya.reshape(x.shape)


def softcap(x, isa, double c):
    """c·tanh(x/c) through the named micro-kernel set's softcap (for its
    accuracy test); x a float32 or float64 array."""
    cdef cnp.ndarray xa = cnp.PyArray_GETCONTIGUOUS(x)
    if cnp.PyArray_TYPE(xa) not in (cnp.NPY_FLOAT32, cnp.NPY_FLOAT64):
        raise TypeError(f"softcap takes float32 or float64; got {x.dtype}")
    cdef cnp.ndarray ya = cnp.PyArray_EMPTY(1, [xa.size], cnp.PyArray_TYPE(xa), 0)
    cdef int dtype = FA_F32 if cnp.PyArray_TYPE(xa) == cnp.NPY_FLOAT32 else FA_F64
    if fa_test_softcap(isa.encode(), dtype, cnp.PyArray_DATA(xa), cnp.PyArray_DATA(ya), xa.size, c):
        raise ValueError(f"ISA {isa!r} is not available here")
    return ya.reshape(x.shape)


include "_kernel_raw.pxi"
