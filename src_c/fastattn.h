/* fastattn.h — the public C API of fastattn.
 *
 * One struct (fa_args) describes a call, one function (fa_attention) runs it:
 *
 *     out = softmax(Q Kᵀ · scale + mask) V
 *
 * with optional score modifiers, in this order: scale → softcap → ALiBi bias
 * → masks (bool, additive, causal, window, kv_len) → softmax with a sink
 * logit in the denominator.
 *
 * fused, tiled and multi-threaded, without storing the L×S score matrix.
 * Plain C99 with no Python: a C program can include this header and link the
 * sources in src_c/. Every call returns 0 or an FA_ERR_* code; fa_strerror()
 * turns a code into a sentence.
 */
#ifndef FASTATTN_H
#define FASTATTN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types. dtype is K's and V's storage; q and out may be 16 or 32 bits
 * when K and V are not float64 (q_dtype, out_dtype; 0: dtype's own, float32
 * for FA_I8). Scores, softmax and accumulation are float64 for FA_F64 and
 * float32 for every other: that computation type is also lse's and an
 * additive mask's. FA_F16 is IEEE binary16, FA_BF16 bfloat16 (the top half of
 * a float32), FA_I8 symmetric int8 with one float32 scale per key/value row
 * (k_scale, v_scale): the key is k[j]·k_scale[j], or k[j]·k_scale[j]·k_channel
 * with optional per-channel key factors (one E-vector per batch entry and K
 * head: they keep an outlier channel from coarsening every other channel's
 * step; docs/int8.md). */
enum fa_dtype { FA_F32 = 1, FA_F64 = 2, FA_F16 = 3, FA_BF16 = 4, FA_I8 = 5 };

/* mask: none; bool (uint8, nonzero = may attend); additive (dtype's type, added
 * to the scaled scores, -inf allowed). */
enum fa_mask_kind { FA_MASK_NONE = 0, FA_MASK_BOOL = 1, FA_MASK_ADD = 2 };

/* Where query row i sits among the keys, for causal, window and ALiBi:
 * bottom-right puts it at key position d(i) = i + S_b - L (the last L of the
 * S_b valid keys, as in KV-cache decoding); top-left at d(i) = i (PyTorch's
 * is_causal). S_b is kv_len[b] when kv_len is given, else S. Explicit
 * positions (q_start, k_start) override both. */
enum fa_align { FA_ALIGN_BOTTOM_RIGHT = 0, FA_ALIGN_TOP_LEFT = 1 };

enum fa_error {
    FA_OK = 0,
    FA_ERR_NULL_ARGS,     /* args is NULL */
    FA_ERR_DTYPE,         /* dtype is not an fa_dtype */
    FA_ERR_SIZE,          /* a size is negative, or E/Ev/Hkv is 0 with work to do */
    FA_ERR_HEADS,         /* Hq is not a multiple of Hkv */
    FA_ERR_NULL_POINTER,  /* q, k, v, out (or mask, kv_len) NULL where needed */
    FA_ERR_STRIDE,        /* offsets overflow int64, or out/lse elements alias */
    FA_ERR_SCALE,         /* scale is NaN or infinite */
    FA_ERR_MASK_KIND,     /* mask_kind is not an fa_mask_kind */
    FA_ERR_ALIGN,         /* align is not an fa_align, or causal not 0/1 */
    FA_ERR_WINDOW,        /* window_left or window_right below -1 */
    FA_ERR_KV_LEN,        /* a kv_len entry is negative or above S */
    FA_ERR_THREADS,       /* num_threads is negative */
    FA_ERR_NOMEM,         /* scratch memory could not be allocated */
    FA_ERR_ISA,           /* unknown ISA name, or not supported by this CPU/build */
    FA_ERR_STRATEGY,      /* a forced strategy (internal test hook) is out of range */
    FA_ERR_SOFTCAP,       /* softcap is negative, NaN or infinite */
    FA_ERR_ALIBI,         /* an ALiBi slope is NaN or infinite */
    FA_ERR_SINKS,         /* a sink is NaN or +inf */
    FA_ERR_POSITION,      /* a q_start or k_start entry is beyond ±2^60 */
    FA_ERR_DTYPES,        /* q_dtype or out_dtype does not go with dtype */
    FA_ERR_SCALES,        /* FA_I8 without k_scale and v_scale, or scales (or k_channel) given for another dtype */
    FA_ERR_COUNT
};

/* Tensors are 4-D: (batch, head, row, column). Strides are in ELEMENTS, for
 * the batch, head and row axes; the column axis is contiguous. A stride of 0
 * broadcasts. Query head h reads key/value head h / (Hq / Hkv) (grouped-query
 * attention; Hkv == Hq is plain multi-head, Hkv == 1 multi-query). */
typedef struct fa_args {
    int dtype;                          /* enum fa_dtype: K's and V's */
    int q_dtype, out_dtype;             /* 0: dtype's (see enum fa_dtype) */
    int64_t B, Hq, Hkv, L, S, E, Ev;    /* batch, heads, lengths, head dims */
    const void *q;                      /* (B, Hq,  L, E)  */
    const void *k;                      /* (B, Hkv, S, E)  */
    const void *v;                      /* (B, Hkv, S, Ev) */
    void *out;                          /* (B, Hq,  L, Ev), written */
    int64_t q_stride[3], k_stride[3], v_stride[3], out_stride[3];
    double scale;                       /* scores are (q·k) * scale */

    int mask_kind;                      /* enum fa_mask_kind */
    const void *mask;                   /* (B, Hq, L, S) through mask_stride */
    int64_t mask_stride[4];             /* batch, head, row, column (any, 0 ok) */

    int causal;                         /* 1: key j visible iff j <= d(i) */
    int align;                          /* enum fa_align: d(i) for causal and window */
    int64_t window_left, window_right;  /* visible iff d(i)-left <= j <= d(i)+right; -1 unbounded */
    const int64_t *kv_len;              /* B entries: keys j >= kv_len[b] invisible; or NULL */

    void *lse;                          /* (B, Hq, L) log-sum-exp (natural log), or NULL */
    int64_t lse_stride[3];

    /* Score modifiers (fa_args_init turns each off). */
    double softcap;                     /* > 0: a scaled score s becomes softcap·tanh(s/softcap); 0: off */
    const double *alibi_slopes;         /* (B, Hq) through alibi_stride: adds −slope·|j − d(i)|; or NULL */
    int64_t alibi_stride[2];            /* batch, head (0 broadcasts) */
    const double *sinks;                /* (Hq): a logit per query head that joins the softmax
                                           denominator and adds no value (−inf: none); or NULL.
                                           lse then includes it. */
    const float *k_scale, *v_scale;     /* FA_I8: (B, Hkv, S) one scale per key / value row */
    int64_t k_scale_stride[3], v_scale_stride[3];   /* batch, head, row */
    const float *k_channel;             /* FA_I8, optional: (B, Hkv, E) through k_channel_stride,
                                           E contiguous; key element e is multiplied by k_channel[e]
                                           (folded into q: one multiply per query element); or NULL */
    int64_t k_channel_stride[2];        /* batch, head (0 broadcasts) */
    const int64_t *q_start, *k_start;   /* (B): global positions of query row 0 and key 0, or NULL
                                           (0). Either given: d(i) = q_start[b] + i − k_start[b],
                                           overriding align, so a shard of a cache gets exactly
                                           its part of the full causal/window/ALiBi attention. */

    int num_threads;                    /* 0: OpenMP's default (omp_get_max_threads) */
} fa_args;

/* Fills *args with an empty call: no mask, not causal, unbounded window,
 * no kv_len, no lse, default threads, scale 1. The caller sets the rest. */
void fa_args_init(fa_args *args);

/* Runs the call. A row with no visible key gets zeros and lse -inf.
 * Results are bitwise identical for every num_threads. Thread-safe. */
int fa_attention(const fa_args *args);

/* Checks args without running: the same code fa_attention would return. */
int fa_check(const fa_args *args);

const char *fa_strerror(int code);

/* The micro-kernel set in use ("amx", "avx512", "avx2", "sse2", "neon", "scalar").
 * "amx" is "avx512" with bfloat16 q, K, V and out on AMX tiles (E a multiple
 * of 32, Ev of 16); Linux x86-64 with AMX-BF16 only. */
const char *fa_isa(void);

/* Forces a micro-kernel set by name (NULL or "" or "auto": the best this CPU
 * supports). Returns FA_ERR_ISA when unknown or unsupported here. Process-wide;
 * the environment variable FASTATTN_ISA sets the initial choice. */
int fa_set_isa(const char *name);

/* The CPU extensions dispatch found, space-separated ("avx2 fma f16c ..."). */
const char *fa_cpu_features(void);

/* Whether the named micro-kernel set is compiled in and runs on this CPU. */
int fa_isa_supported(const char *name);

/* Whether the library was built with OpenMP; the default thread count. */
int fa_openmp(void);
int fa_max_threads(void);

#ifdef __cplusplus
}
#endif

#endif /* FASTATTN_H */
