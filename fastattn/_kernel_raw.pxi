# Included at the end of _kernel.pyx. The raw-pointer entry: one fa_args
# filled from addresses, element strides and fa_dtype codes, for callers whose
# tensors are not NumPy arrays (fastattn.torch hands over torch tensors by
# data_ptr() and stride()). The caller has validated everything and keeps the
# memory alive for the call; fa_check is the backstop. No arithmetic here.
from libc.stdint cimport uintptr_t

DTYPE_CODES = {"float32": FA_F32, "float64": FA_F64, "float16": FA_F16, "bfloat16": FA_BF16,
               "int8": FA_I8}


cdef void _copy_strides(object src, int64_t *dst, int n):
    # a tuple of n element strides, or None for zeros
    cdef int i
    for i in range(n):
        dst[i] = 0 if src is None else src[i]


def attention_raw(int dtype, int q_dtype, int out_dtype, dims,
                  uintptr_t q, q_stride, uintptr_t k, k_stride, uintptr_t v, v_stride,
                  uintptr_t out, out_stride, double scale, *,
                  int causal=0, int align=0, int64_t window_left=-1, int64_t window_right=-1,
                  int mask_kind=0, uintptr_t mask=0, mask_stride=None,
                  uintptr_t kv_len=0, uintptr_t lse=0, lse_stride=None,
                  double softcap=0.0, uintptr_t sinks=0,
                  uintptr_t alibi_slopes=0, alibi_stride=None,
                  uintptr_t q_start=0, uintptr_t k_start=0,
                  uintptr_t k_scale=0, k_scale_stride=None, uintptr_t v_scale=0, v_scale_stride=None,
                  uintptr_t k_channel=0, k_channel_stride=None,
                  int num_threads=0, bint check_only=False):
    """One kernel call on raw memory (see fa_args in src_c/fastattn.h).

    dims: (B, Hq, Hkv, L, S, E, Ev). Pointers are addresses (0: NULL);
    strides are tuples of ELEMENT strides (batch, head, row; the mask's also
    column; alibi's batch, head). dtype is K's and V's fa_dtype code,
    q_dtype and out_dtype q's and out's (DTYPE_CODES). sinks and
    alibi_slopes point to float64, q_start, k_start and kv_len to int64,
    k_scale, v_scale and k_channel (int8 keys' channel factors, E contiguous,
    k_channel_stride: batch, head) to float32, an additive mask to the computation
    type (float64 for FA_F64, float32 otherwise), a bool mask to uint8.
    Raises ValueError (MemoryError) with C's sentence when C refuses."""
    cdef fa_args a
    cdef int rc
    fa_args_init(&a)
    a.dtype, a.q_dtype, a.out_dtype = dtype, q_dtype, out_dtype
    a.B, a.Hq, a.Hkv, a.L, a.S, a.E, a.Ev = dims
    a.q, a.k, a.v, a.out = <const void *>q, <const void *>k, <const void *>v, <void *>out
    _copy_strides(q_stride, a.q_stride, 3)
    _copy_strides(k_stride, a.k_stride, 3)
    _copy_strides(v_stride, a.v_stride, 3)
    _copy_strides(out_stride, a.out_stride, 3)
    a.scale = scale
    a.mask_kind, a.mask = mask_kind, <const void *>mask
    _copy_strides(mask_stride, a.mask_stride, 4)
    a.causal, a.align, a.window_left, a.window_right = causal, align, window_left, window_right
    a.kv_len = <const int64_t *>kv_len
    a.lse = <void *>lse
    _copy_strides(lse_stride, a.lse_stride, 3)
    a.softcap = softcap
    a.sinks = <const double *>sinks
    a.alibi_slopes = <const double *>alibi_slopes
    _copy_strides(alibi_stride, a.alibi_stride, 2)
    a.q_start, a.k_start = <const int64_t *>q_start, <const int64_t *>k_start
    a.k_scale, a.v_scale = <const float *>k_scale, <const float *>v_scale
    _copy_strides(k_scale_stride, a.k_scale_stride, 3)
    _copy_strides(v_scale_stride, a.v_scale_stride, 3)
    a.k_channel = <const float *>k_channel
    _copy_strides(k_channel_stride, a.k_channel_stride, 2)
    a.num_threads = num_threads
    if check_only:
        rc = fa_check(&a)
    else:
        with nogil:
            rc = fa_attention(&a)
    if rc:
        _raise(rc)
