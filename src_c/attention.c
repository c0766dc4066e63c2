/* attention.c — the driver behind fa_attention: checks every argument, plans
 * the call, splits it into work items and runs them on fastattn's worker
 * threads (pool.c; an OpenMP team where there are no POSIX threads).
 * The arithmetic lives in the per-ISA kernels (kernel_item.h); this file owns
 * argument checking, the work decomposition, threads and scratch memory.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if !defined(_WIN32)
#include <unistd.h>
#endif
#include "internal.h"
#include "pool.h"

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

/* Below this many multiply-adds (L·S·(E+Ev) summed over heads, S counting
 * only keys some batch entry can see) a call runs on the calling thread:
 * such a call takes tens of microseconds on one core, and waking a worker
 * costs a good part of that. */
#define FA_SERIAL_WORK (1 << 20)

/* Split-KV: a call with fewer row blocks than this (decoding: one query row
 * per head) also splits the keys into chunks, computed in parallel and merged
 * by log-sum-exp. The chunk length depends on the shape only, never on the
 * thread count, so every num_threads gives the same bits. */
#define FA_SPLIT_ITEMS 32
#define FA_SPLIT_MIN_KEYS 512

/* How a call is cut into work items (see fa_item). */
typedef struct fa_work {
    int few;           /* row-layout items (kernel_rows.h) */
    int64_t bq;        /* query rows per item: the kernel's lanes, or all g·L rows */
    int per_head;      /* L >= bq: blocks stay inside one query head */
    int64_t nqb;       /* per_head: blocks per head */
    int64_t blocks;    /* row blocks per (batch entry, key/value head) */
    int64_t n_base;    /* row blocks in all: B · Hkv · blocks */
    int64_t n_chunks;  /* key chunks per row block (1: no split) */
    int64_t chunk;     /* keys per chunk */
    int reverse;       /* causal or window: later rows first */
    size_t part_bytes; /* one split-KV part: bq · (Ev + 1) elements */
} fa_work;

/* Keys that some batch entry can see: S, or the longest kv_len. */
static int64_t fa_keys_seen(const fa_args *a) {
    if (!a->kv_len) return a->S;
    int64_t most = 0;
    for (int64_t b = 0; b < a->B; b++)
        if (a->kv_len[b] > most) most = a->kv_len[b];
    return most;
}

static fa_work plan_work(const fa_args *a, int64_t bq, int64_t few, int64_t group) {
    fa_work w;
    /* Few rows per key/value head (decoding): all of them in one row-layout
     * item; otherwise blocks of bq rows in lane layout. */
    w.few = group * a->L <= few;
    w.bq = w.few ? group * a->L : bq;
    w.per_head = a->L >= w.bq;
    w.nqb = (a->L + bq - 1) / bq;
    w.blocks = w.per_head ? group * w.nqb : (group * a->L + bq - 1) / bq;
    w.n_base = a->B * a->Hkv * w.blocks;
    /* Chunks cover the keys some batch entry can see (a KV cache is often
     * far from full), so every chunk has work. */
    w.n_chunks = 1;
    w.chunk = a->S;
    const int64_t S_seen = fa_keys_seen(a);
    if (w.n_base < FA_SPLIT_ITEMS && S_seen >= 2 * FA_SPLIT_MIN_KEYS) {
        int64_t want = (FA_SPLIT_ITEMS + w.n_base - 1) / w.n_base, most = S_seen / FA_SPLIT_MIN_KEYS;
        int64_t n = want < most ? want : most;
        w.chunk = ((S_seen + n - 1) / n + 63) / 64 * 64;
        w.n_chunks = (S_seen + w.chunk - 1) / w.chunk;
    }
    w.reverse = a->causal || a->window_right >= 0;
    w.part_bytes = (size_t)bq * (size_t)(a->Ev + 1) * (a->dtype == FA_F32 ? sizeof(float) : sizeof(double));
    return w;
}

/* Processors this process may run on. */
static int fa_procs(void) {
#if defined(_OPENMP)
    return omp_get_num_procs();
#elif defined(_SC_NPROCESSORS_ONLN)
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
#else
    return 1;
#endif
}

/* At most this many threads per processor (and at least FA_MIN_THREAD_CAP in
 * all): more only adds overhead (and under an OpenMP team, a count the system
 * cannot create makes libgomp exit the whole process). Results do not depend
 * on the count, so capping it changes no bit. */
#define FA_THREADS_PER_PROC 4
#define FA_MIN_THREAD_CAP 64

/* Item idx in the order threads take them. With causal or window masks a
 * later query block sees more keys (bottom-right: the last one sees them
 * all), so the costliest blocks go first and with dynamic scheduling the
 * cheap ones fill the gaps at the end (longest-processing-time-first). */
static fa_item item_at(const fa_args *a, const fa_work *w, int64_t group, int64_t idx, char *parts) {
    fa_item it;
    const int64_t base = idx / w->n_chunks, c = idx % w->n_chunks, blk = base % w->blocks;
    it.hk = base / w->blocks % a->Hkv;
    it.b = base / w->blocks / a->Hkv;
    if (w->per_head) {
        int64_t qb = blk % w->nqb;
        if (w->reverse) qb = w->nqb - 1 - qb;
        it.t0 = blk / w->nqb * a->L + qb * w->bq;
        it.rows = a->L - qb * w->bq < w->bq ? a->L - qb * w->bq : w->bq;
    } else {
        it.t0 = blk * w->bq;
        it.rows = group * a->L - it.t0 < w->bq ? group * a->L - it.t0 : w->bq;
    }
    it.j_from = c * w->chunk;
    it.j_to = it.j_from + w->chunk < a->S ? it.j_from + w->chunk : a->S;
    it.partial = w->n_chunks > 1 ? parts + (size_t)idx * w->part_bytes : NULL;
    return it;
}

static inline double load_t(const void *p, int64_t i, int f32) {
    return f32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}
static inline void store_t(void *p, int64_t i, double x, int f32) {
    if (f32) ((float *)p)[i] = (float)x;
    else ((double *)p)[i] = x;
}

/* Merges the split-KV parts of row block `base` into out and lse:
 *     lse = log Σ_c e^(lse_c),   out = Σ_c e^(lse_c − lse) · out_c
 * in double, chunks in order (the same bits for every thread count). A row
 * no chunk sees gets zeros and -inf; a NaN in any chunk makes the row NaN,
 * as it would unsplit. */
static void merge_parts(const fa_args *a, const fa_work *w, int64_t group, int64_t base, char *parts) {
    const int f32 = a->dtype == FA_F32;
    const int64_t Ev = a->Ev, nc = w->n_chunks;
    const fa_item it = item_at(a, w, group, base * nc, parts);
    for (int64_t r = 0; r < it.rows; r++) {
        const int64_t t = it.t0 + r, h = it.hk * group + t / a->L, i = t % a->L;
        double top = -INFINITY, sum = 0;
        for (int64_t c = 0; c < nc; c++) {
            double lse_c = load_t(parts + (size_t)(base * nc + c) * w->part_bytes, it.rows * Ev + r, f32);
            if (lse_c > top || isnan(lse_c)) top = isnan(top) ? top : lse_c;
        }
        void *o = (char *)a->out + (it.b * a->out_stride[0] + h * a->out_stride[1] + i * a->out_stride[2]) *
                                       (int64_t)(f32 ? sizeof(float) : sizeof(double));
        double wgt[FA_SPLIT_ITEMS]; /* n_chunks never exceeds FA_SPLIT_ITEMS */
        for (int64_t c = 0; c < nc; c++) {
            wgt[c] = exp(load_t(parts + (size_t)(base * nc + c) * w->part_bytes, it.rows * Ev + r, f32) - top);
            sum += wgt[c]; /* a NaN top (or part) makes every weight NaN */
        }
        for (int64_t e = 0; e < Ev; e++) {
            double acc = 0;
            for (int64_t c = 0; c < nc; c++)
                if (wgt[c] != 0) acc += wgt[c] * load_t(parts + (size_t)(base * nc + c) * w->part_bytes, r * Ev + e, f32);
            store_t(o, e, top == -INFINITY ? 0 : acc / sum, f32);
        }
        if (!a->lse) continue;
        store_t(a->lse, it.b * a->lse_stride[0] + h * a->lse_stride[1] + i * a->lse_stride[2],
                top == -INFINITY ? -INFINITY : top + log(sum), f32);
    }
}

static void *scratch_alloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, FA_ALIGN, bytes ? bytes : FA_ALIGN) != 0) return NULL;
    return p;
}

/* One call's items, shared by the threads that run them. */
typedef struct fa_job {
    const fa_plan *plan;
    const fa_work *w;
    void (*item)(const fa_plan *, const fa_item *, void *);
    size_t scratch;
    char *parts;
    int64_t n_items;
    int64_t next;  /* the next item to take (atomic) */
    int64_t done;  /* items computed (atomic) */
} fa_job;

/* One thread's share: take items in order (costliest first, see item_at)
 * until none are left, in this thread's own scratch. A thread that cannot
 * get scratch takes none, and the others do its share. */
static void run_items(void *ctx) {
    fa_job *job = (fa_job *)ctx;
    void *buf = scratch_alloc(job->scratch);
    if (!buf) return;
    int64_t idx, done = 0;
    while ((idx = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->n_items) {
        const fa_item it = item_at(job->plan->a, job->w, job->plan->group, idx, job->parts);
        job->item(job->plan, &it, buf);
        done++;
    }
    __atomic_fetch_add(&job->done, done, __ATOMIC_RELEASE);
    free(buf);
}

int fa_attention(const fa_args *a) {
    int err = fa_check(a);
    if (err) return err;
    /* S == 0 needs no case of its own: every row's key range is empty, and
     * the kernels write such a row as zeros with lse -inf. */
    if (a->B == 0 || a->Hq == 0 || a->L == 0) return FA_OK;

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

    const fa_work w = plan_work(a, f32 ? kern->rows_f32 : kern->rows_f64, f32 ? kern->few_f32 : kern->few_f64,
                                plan.group);
    const size_t scratch = f32 ? kern->scratch_f32(a->E, a->Ev) : kern->scratch_f64(a->E, a->Ev);
    void (*item)(const fa_plan *, const fa_item *, void *) =
        w.few ? (f32 ? kern->rows_item_f32 : kern->rows_item_f64) : (f32 ? kern->item_f32 : kern->item_f64);
    const int64_t n_items = w.n_base * w.n_chunks;
    char *parts = NULL;
    if (w.n_chunks > 1 && !(parts = scratch_alloc((size_t)n_items * w.part_bytes))) return FA_ERR_NOMEM;

    int threads = a->num_threads > 0 ? a->num_threads : fa_max_threads();
    double work = (double)a->B * a->Hq * a->L * fa_keys_seen(a) * (a->E + a->Ev);
    if (work < FA_SERIAL_WORK) threads = 1;
    if ((int64_t)threads > n_items) threads = (int)n_items;
    int cap = FA_THREADS_PER_PROC * fa_procs();
    if (cap < FA_MIN_THREAD_CAP) cap = FA_MIN_THREAD_CAP;
    if (threads > cap) threads = cap;

    fa_job job = {&plan, &w, item, scratch, parts, n_items, 0, 0};
#ifdef FA_HAVE_POOL
    fa_pool_run(threads, run_items, &job);
#else
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    run_items(&job);
#endif
    /* Every thread that lacked scratch took no item; if none had any, items
     * are left and the output is incomplete. */
    const int failed = job.done < n_items;
    if (parts && !failed)
        for (int64_t base = 0; base < w.n_base; base++) merge_parts(a, &w, plan.group, base, parts);
    free(parts);
    return failed ? FA_ERR_NOMEM : FA_OK;
}
