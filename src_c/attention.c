/* attention.c — the driver behind fa_attention: checks every argument, plans
 * the call, splits it into work items and runs them on an OpenMP team.
 * The arithmetic lives in the per-ISA kernels (kernel_item.h); this file owns
 * argument checking, the work decomposition, threads and scratch memory.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(_OPENMP) && !defined(_WIN32)
#include <pthread.h>
#define FA_FORK_GUARD 1
#endif
#include "internal.h"

#ifdef FA_FORK_GUARD
/* GCC's OpenMP runtime is not fork-safe: a child forked after a parallel
 * region inherits a thread pool whose threads do not exist there, and its
 * next parallel region waits for them forever. A child of a process that has
 * run fastattn therefore computes on its calling thread alone: same results
 * (they never depend on the thread count), no hang. */
static volatile int fa_forked = 0;
static void fa_mark_forked(void) { fa_forked = 1; }
static pthread_once_t fa_fork_once = PTHREAD_ONCE_INIT;
static void fa_install_fork_guard(void) { pthread_atfork(NULL, NULL, fa_mark_forked); }
#endif

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
    [FA_ERR_DTYPE] = "fa_attention: dtype must be FA_F32 or FA_F64",
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
};

const char *fa_strerror(int code) {
    if (code < 0 || code >= FA_ERR_COUNT) return "fastattn: unknown error code";
    return fa_messages[code];
}

int fa_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int fa_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
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
    if (a->dtype != FA_F32 && a->dtype != FA_F64) return FA_ERR_DTYPE;
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
    if (a->num_threads < 0) return FA_ERR_THREADS;
    if (empty) return FA_OK;

    if (!a->q || !a->k || !a->v || !a->out) return FA_ERR_NULL_POINTER;
    if (a->mask_kind != FA_MASK_NONE && !a->mask) return FA_ERR_NULL_POINTER;
    if (a->kv_len)
        for (int64_t b = 0; b < a->B; b++)
            if (a->kv_len[b] < 0 || a->kv_len[b] > a->S) return FA_ERR_KV_LEN;

    const int64_t n_q[4] = {a->B, a->Hq, a->L, a->E}, n_k[4] = {a->B, a->Hkv, a->S, a->E};
    const int64_t n_v[4] = {a->B, a->Hkv, a->S, a->Ev}, n_o[4] = {a->B, a->Hq, a->L, a->Ev};
    const int64_t n_m[4] = {a->B, a->Hq, a->L, a->S}, n_l[4] = {a->B, a->Hq, a->L, 1};
#define ST4(s) {s[0], s[1], s[2], 1}
    const int64_t s_q[4] = ST4(a->q_stride), s_k[4] = ST4(a->k_stride), s_v[4] = ST4(a->v_stride);
    const int64_t s_o[4] = ST4(a->out_stride), s_l[4] = ST4(a->lse_stride);
#undef ST4
    if (span(n_q, s_q) < 0 || span(n_k, s_k) < 0 || span(n_v, s_v) < 0 || span(n_o, s_o) < 0)
        return FA_ERR_STRIDE;
    if (a->mask_kind != FA_MASK_NONE && span(n_m, a->mask_stride) < 0) return FA_ERR_STRIDE;
    if (!no_self_overlap(n_o, s_o)) return FA_ERR_STRIDE;
    if (a->lse && (span(n_l, s_l) < 0 || !no_self_overlap(n_l, s_l))) return FA_ERR_STRIDE;
    return FA_OK;
}

/* Below this many multiply-adds (L·S·(E+Ev) summed over heads) a call runs on
 * the calling thread: waking a team costs a few microseconds, more than the
 * whole call. */
#define FA_SERIAL_WORK (1 << 18)

/* Work items in the order threads take them. Causal and window rows later in
 * the sequence see more keys (bottom-right: the last query block sees all of
 * them), so with dynamic scheduling the costliest blocks go first and the
 * cheap ones fill the gaps at the end (longest-processing-time-first). */
static void item_coords(const fa_args *a, int64_t n_qblocks, int64_t idx, int64_t *b, int64_t *h,
                        int64_t *qb) {
    int64_t bh = idx / n_qblocks, r = idx % n_qblocks;
    *qb = (a->causal || a->window_right >= 0) ? n_qblocks - 1 - r : r;
    *h = bh % a->Hq;
    *b = bh / a->Hq;
}

static void *scratch_alloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, FA_ALIGN, bytes ? bytes : FA_ALIGN) != 0) return NULL;
    return p;
}

static void zero_rows(const fa_args *a) {
    /* S == 0 (or every key hidden): zeros and lse -inf, written by the kernel's
     * own end-of-item code would also do, but there are no key blocks to walk. */
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->Hq; h++)
            for (int64_t i = 0; i < a->L; i++) {
                int64_t o = b * a->out_stride[0] + h * a->out_stride[1] + i * a->out_stride[2];
                int64_t lo = b * a->lse_stride[0] + h * a->lse_stride[1] + i * a->lse_stride[2];
                if (a->dtype == FA_F32) {
                    memset((float *)a->out + o, 0, (size_t)a->Ev * sizeof(float));
                    if (a->lse) ((float *)a->lse)[lo] = -INFINITY;
                } else {
                    memset((double *)a->out + o, 0, (size_t)a->Ev * sizeof(double));
                    if (a->lse) ((double *)a->lse)[lo] = -INFINITY;
                }
            }
}

int fa_attention(const fa_args *a) {
    int err = fa_check(a);
    if (err) return err;
    if (a->B == 0 || a->Hq == 0 || a->L == 0) return FA_OK;
    if (a->S == 0) {
        zero_rows(a);
        return FA_OK;
    }

    const fa_kernel *kern = fa_current_kernel();
    const int f32 = a->dtype == FA_F32;
    fa_plan plan;
    plan.a = a;
    plan.group = a->Hq / a->Hkv;
    plan.scale_log2e = a->scale * 1.4426950408889634074;
    /* A window side wider than every key and row is the same as unbounded;
     * clamping keeps d ± window inside int64. */
    const int64_t far = a->S + a->L;
    plan.wl = a->window_left > far ? far : a->window_left;
    plan.wr = a->window_right > far ? far : a->window_right;

    const int64_t bq = f32 ? kern->rows_f32 : kern->rows_f64;
    const size_t scratch = f32 ? kern->scratch_f32(a->E, a->Ev) : kern->scratch_f64(a->E, a->Ev);
    void (*item)(const fa_plan *, int64_t, int64_t, int64_t, void *) = f32 ? kern->item_f32 : kern->item_f64;
    const int64_t n_qblocks = (a->L + bq - 1) / bq;
    const int64_t n_items = a->B * a->Hq * n_qblocks;

#ifdef FA_FORK_GUARD
    pthread_once(&fa_fork_once, fa_install_fork_guard);
    const int forked = fa_forked;
#else
    const int forked = 0;
#endif
    int threads = forked ? 1 : a->num_threads > 0 ? a->num_threads : fa_max_threads();
    double work = (double)a->B * a->Hq * a->L * a->S * (a->E + a->Ev);
    if (work < FA_SERIAL_WORK) threads = 1;
    if ((int64_t)threads > n_items) threads = (int)n_items;

    if (threads <= 1) {
        void *buf = scratch_alloc(scratch);
        if (!buf) return FA_ERR_NOMEM;
        for (int64_t idx = 0; idx < n_items; idx++) {
            int64_t b, h, qb;
            item_coords(a, n_qblocks, idx, &b, &h, &qb);
            item(&plan, b, h, qb * bq, buf);
        }
        free(buf);
        return FA_OK;
    }

    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        void *buf = scratch_alloc(scratch);
        if (!buf) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t idx = 0; idx < n_items; idx++) {
            if (!buf) continue;
            int64_t b, h, qb;
            item_coords(a, n_qblocks, idx, &b, &h, &qb);
            item(&plan, b, h, qb * bq, buf);
        }
        free(buf);
    }
    /* A thread without scratch skipped its items: the output is incomplete. */
    return failed ? FA_ERR_NOMEM : FA_OK;
}
