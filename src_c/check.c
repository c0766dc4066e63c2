/* check.c — the C boundary validates itself: fa_args_init's defaults, every
 * argument check (fa_check) and the sentence for each error code. A C caller
 * gets the same answers the Python layer words its exceptions from.
 */
#include <math.h>
#include <string.h>
#include "internal.h"

/* Whether q or out may have dtype io (0: dtype's own) with K/V of dtype kv. */
static int fa_io_dtype_ok(int kv, int io) {
    if (io == 0) return 1;
    if (kv == FA_F64) return io == FA_F64;
    return io == FA_F32 || io == FA_F16 || io == FA_BF16;
}

void fa_args_init(fa_args *a) {
    memset(a, 0, sizeof *a);
    a->dtype = FA_F32;
    a->scale = 1.0;
    a->mask_kind = FA_MASK_NONE;
    a->align = FA_ALIGN_BOTTOM_RIGHT;
    a->window_left = a->window_right = -1;
}

static const char *const fa_messages[FA_ERR_COUNT] = {
    [FA_OK] = "success",
    [FA_ERR_NULL_ARGS] = "fa_attention: args is NULL",
    [FA_ERR_DTYPE] = "fa_attention: dtype must be FA_F32, FA_F64, FA_F16, FA_BF16 or FA_I8",
    [FA_ERR_SIZE] = "fa_attention: sizes must be non-negative, and E, Ev and Hkv at least 1",
    [FA_ERR_HEADS] = "fa_attention: Hq must be a multiple of Hkv",
    [FA_ERR_NULL_POINTER] = "fa_attention: q, k, v, out (and mask, kv_len when used) must not be NULL",
    [FA_ERR_STRIDE] = "fa_attention: strides overflow int64, or elements of out or lse overlap",
    [FA_ERR_SCALE] = "fa_attention: scale must be finite",
    [FA_ERR_MASK_KIND] = "fa_attention: mask_kind must be FA_MASK_NONE, FA_MASK_BOOL or FA_MASK_ADD",
    [FA_ERR_ALIGN] = "fa_attention: causal must be 0 or 1, align FA_ALIGN_BOTTOM_RIGHT or FA_ALIGN_TOP_LEFT",
    [FA_ERR_WINDOW] = "fa_attention: window_left and window_right must be -1 (unbounded) or >= 0",
    [FA_ERR_KV_LEN] = "fa_attention: every kv_len entry must be between 0 and S",
    [FA_ERR_THREADS] = "fa_attention: num_threads must be >= 0 (0: the OpenMP default)",
    [FA_ERR_NOMEM] = "fa_attention: out of memory for scratch buffers",
    [FA_ERR_ISA] = "fa_set_isa: unknown ISA, or not supported by this CPU or build",
    [FA_ERR_STRATEGY] = "fa_attention_with: a forced strategy is out of range",
    [FA_ERR_SOFTCAP] = "fa_attention: softcap must be 0 (off) or a finite positive number",
    [FA_ERR_ALIBI] = "fa_attention: every ALiBi slope must be finite",
    [FA_ERR_SINKS] = "fa_attention: sinks must not be NaN or +inf (-inf: no sink)",
    [FA_ERR_POSITION] = "fa_attention: q_start and k_start entries must lie within +-2^60",
    [FA_ERR_DTYPES] = "fa_attention: q_dtype and out_dtype must be 0, FA_F32, FA_F16 or FA_BF16 "
                      "(FA_F64 only, and only, with dtype FA_F64)",
    [FA_ERR_SCALES] = "fa_attention: FA_I8 needs k_scale and v_scale; other dtypes take none (nor k_channel)",
};

const char *fa_strerror(int code) {
    if (code < 0 || code >= FA_ERR_COUNT) return "fastattn: unknown error code";
    return fa_messages[code];
}

/* Largest |offset| a tensor of n[0..3] elements per axis reaches through
 * strides st[0..3] (the last contiguous when st[3] == 1), or -1 on overflow. */
static int64_t span(const int64_t n[4], const int64_t st[4]) {
    int64_t total = 0;
    for (int d = 0; d < 4; d++) {
        int64_t s = st[d] < 0 ? -st[d] : st[d], part;
        if (st[d] == INT64_MIN) return -1;
        if (n[d] <= 1) continue;
        if (__builtin_mul_overflow(s, n[d] - 1, &part) || __builtin_add_overflow(total, part, &total))
            return -1;
    }
    return total;
}

/* Whether no two elements of an output share an address: sorted by stride,
 * every axis must step past everything the smaller axes cover. Sufficient
 * (not necessary), and true for every array NumPy allocates or slices. */
static int no_self_overlap(const int64_t n[4], const int64_t st_signed[4]) {
    /* A negative stride only mirrors an axis: overlap depends on |stride|
     * (span() has already ruled out overflow). */
    int64_t st[4];
    for (int d = 0; d < 4; d++) st[d] = st_signed[d] < 0 ? -st_signed[d] : st_signed[d];
    int order[4] = {0, 1, 2, 3};
    for (int i = 1; i < 4; i++)
        for (int j = i; j > 0 && st[order[j]] < st[order[j - 1]]; j--) {
            int t = order[j]; order[j] = order[j - 1]; order[j - 1] = t;
        }
    int64_t covered = 1; /* elements spanned by the axes so far, plus one */
    for (int i = 0; i < 4; i++) {
        int d = order[i];
        if (n[d] <= 1) continue;
        if (st[d] < covered) return 0;
        covered = st[d] * (n[d] - 1) + covered;
    }
    return 1;
}

int fa_check(const fa_args *a) {
    if (!a) return FA_ERR_NULL_ARGS;
    if (a->dtype < FA_F32 || a->dtype > FA_I8) return FA_ERR_DTYPE;
    if (!fa_io_dtype_ok(a->dtype, a->q_dtype) || !fa_io_dtype_ok(a->dtype, a->out_dtype)) return FA_ERR_DTYPES;
    if ((a->dtype == FA_I8) != (a->k_scale != NULL) || (a->dtype == FA_I8) != (a->v_scale != NULL) ||
        (a->k_channel && a->dtype != FA_I8))
        return FA_ERR_SCALES;
    if (a->B < 0 || a->Hq < 0 || a->Hkv < 0 || a->L < 0 || a->S < 0 || a->E < 0 || a->Ev < 0)
        return FA_ERR_SIZE;
    const int empty = a->B == 0 || a->Hq == 0 || a->L == 0;
    if (!empty && (a->Hkv < 1 || a->E < 1 || a->Ev < 1)) return FA_ERR_SIZE;
    if (!empty && a->Hq % a->Hkv != 0) return FA_ERR_HEADS;
    if (a->mask_kind != FA_MASK_NONE && a->mask_kind != FA_MASK_BOOL && a->mask_kind != FA_MASK_ADD)
        return FA_ERR_MASK_KIND;
    if ((a->causal != 0 && a->causal != 1) ||
        (a->align != FA_ALIGN_BOTTOM_RIGHT && a->align != FA_ALIGN_TOP_LEFT))
        return FA_ERR_ALIGN;
    if (a->window_left < -1 || a->window_right < -1) return FA_ERR_WINDOW;
    if (!isfinite(a->scale)) return FA_ERR_SCALE;
    if (!(a->softcap >= 0) || isinf(a->softcap)) return FA_ERR_SOFTCAP;
    if (a->num_threads < 0) return FA_ERR_THREADS;
    if (empty) return FA_OK;

    if (!a->q || !a->k || !a->v || !a->out) return FA_ERR_NULL_POINTER;
    if (a->mask_kind != FA_MASK_NONE && !a->mask) return FA_ERR_NULL_POINTER;
    if (a->kv_len)
        for (int64_t b = 0; b < a->B; b++)
            if (a->kv_len[b] < 0 || a->kv_len[b] > a->S) return FA_ERR_KV_LEN;
    const int64_t far = (int64_t)1 << 60;
    for (int64_t b = 0; (a->q_start || a->k_start) && b < a->B; b++)
        if ((a->q_start && (a->q_start[b] > far || a->q_start[b] < -far)) ||
            (a->k_start && (a->k_start[b] > far || a->k_start[b] < -far)))
            return FA_ERR_POSITION;
    if (a->alibi_slopes)
        for (int64_t b = 0; b < a->B; b++)
            for (int64_t h = 0; h < a->Hq; h++)
                if (!isfinite(a->alibi_slopes[b * a->alibi_stride[0] + h * a->alibi_stride[1]]))
                    return FA_ERR_ALIBI;
    if (a->sinks)
        for (int64_t h = 0; h < a->Hq; h++)
            if (isnan(a->sinks[h]) || a->sinks[h] == INFINITY) return FA_ERR_SINKS;

    const int64_t n_q[4] = {a->B, a->Hq, a->L, a->E}, n_k[4] = {a->B, a->Hkv, a->S, a->E};
    const int64_t n_v[4] = {a->B, a->Hkv, a->S, a->Ev}, n_o[4] = {a->B, a->Hq, a->L, a->Ev};
    const int64_t n_m[4] = {a->B, a->Hq, a->L, a->S}, n_l[4] = {a->B, a->Hq, a->L, 1};
#define ST4(s) {s[0], s[1], s[2], 1}
    const int64_t s_q[4] = ST4(a->q_stride), s_k[4] = ST4(a->k_stride), s_v[4] = ST4(a->v_stride);
    const int64_t s_o[4] = ST4(a->out_stride), s_l[4] = ST4(a->lse_stride);
    if (span(n_q, s_q) < 0 || span(n_k, s_k) < 0 || span(n_v, s_v) < 0 || span(n_o, s_o) < 0)
        return FA_ERR_STRIDE;
    if (a->mask_kind != FA_MASK_NONE && span(n_m, a->mask_stride) < 0) return FA_ERR_STRIDE;
    if (a->dtype == FA_I8) {
        const int64_t n_s[4] = {a->B, a->Hkv, a->S, 1};
        const int64_t s_ks[4] = ST4(a->k_scale_stride), s_vs[4] = ST4(a->v_scale_stride);
        if (span(n_s, s_ks) < 0 || span(n_s, s_vs) < 0) return FA_ERR_STRIDE;
        const int64_t n_c[4] = {a->B, a->Hkv, 1, a->E}, s_c[4] = {a->k_channel_stride[0], a->k_channel_stride[1], 0, 1};
        if (a->k_channel && span(n_c, s_c) < 0) return FA_ERR_STRIDE;
    }
#undef ST4
    if (!no_self_overlap(n_o, s_o)) return FA_ERR_STRIDE;
    if (a->lse && (span(n_l, s_l) < 0 || !no_self_overlap(n_l, s_l))) return FA_ERR_STRIDE;
    return FA_OK;
}
