/* attention.c — fa_attention: checks the call (check.c), plans it (plan.c),
 * runs its work items on fastattn's worker threads (pool.c), each thread in
 * its own scratch, and merges split-KV parts. The arithmetic lives in the
 * per-ISA kernels (kernel_dtype.h); this file owns running and merging.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "convert.h"
#include "internal.h"
#include "plan.h"
#include "pool.h"

/* Parts and lse are in the computation type (f32: float, else double). */
static inline double load_t(const void *p, int64_t i, int f32) {
    return f32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}
static inline void store_t(void *p, int64_t i, double x, int f32) {
    if (f32) ((float *)p)[i] = (float)x;
    else ((double *)p)[i] = x;
}

/* An output element in out's dtype: rounded once from the computation type
 * (float32 to 16 bits, ties to even). */
static inline void store_out(void *p, int64_t i, double x, int out_dtype) {
    switch (out_dtype) {
    case FA_F64: ((double *)p)[i] = x; break;
    case FA_F16: ((uint16_t *)p)[i] = fa_f32_to_f16((float)x); break;
    case FA_BF16: ((uint16_t *)p)[i] = fa_f32_to_bf16((float)x); break;
    default: ((float *)p)[i] = (float)x; break;
    }
}

static inline size_t dtype_bytes(int dtype) {
    return dtype == FA_F64 ? 8 : dtype == FA_F32 ? 4 : dtype == FA_I8 ? 1 : 2;
}

#define FA_MERGE_RUN 256 /* output elements a row merged at a time (a stack buffer of doubles) */

/* Merges the split-KV parts of row block `base` into out and lse:
 *     lse = log Σ_c e^(lse_c),   out = Σ_c e^(lse_c − lse) · out_c
 * in double, chunks in order (the same bits for every thread count). A row
 * no chunk sees gets zeros and -inf; a NaN in any chunk makes the row NaN,
 * as it would unsplit. */
static void merge_parts(const fa_work *w, int64_t base, char *parts) {
    const fa_args *a = w->plan.a;
    const int f32 = a->dtype != FA_F64, out_dtype = w->plan.out_dtype;
    const int64_t Ev = a->Ev, nc = w->n_chunks;
    const fa_item it = fa_item_at(w, base * nc, parts);
    for (int64_t r = 0; r < it.rows; r++) {
        int64_t h, i, lse_off;
        fa_row_at(&w->plan, &it, r, &h, &i);
        const int64_t o_off = fa_out_offset(&w->plan, &it, r, &lse_off); /* in each chunk's part (it.partial) */
        /* The sink logit, if any, joins here once (the parts are computed without it). */
        const double sink = a->sinks ? a->sinks[h] : -INFINITY;
        double top = sink, sum = 0;
        for (int64_t c = 0; c < nc; c++) {
            double lse_c = load_t(parts + (size_t)(base * nc + c) * w->part_bytes, lse_off, f32);
            if (lse_c > top || isnan(lse_c)) top = isnan(top) ? top : lse_c;
        }
        void *o = (char *)a->out + (it.b * a->out_stride[0] + h * a->out_stride[1] + i * a->out_stride[2]) *
                                       (int64_t)dtype_bytes(out_dtype);
        double wgt[FA_CHUNKS_MAX];
        for (int64_t c = 0; c < nc; c++) {
            wgt[c] = exp(load_t(parts + (size_t)(base * nc + c) * w->part_bytes, lse_off, f32) - top);
            sum += wgt[c]; /* a NaN top (or part) makes every weight NaN */
        }
        if (sink > -INFINITY) sum += exp(sink - top);
        /* Each element's sum runs over the chunks in order, as above; the
         * chunks are the outer loop, so each part's row is read as a run of
         * Ev values (vectors), not one value from each of nc parts. */
        for (int64_t e0 = 0; e0 < Ev; e0 += FA_MERGE_RUN) {
            const int64_t n = Ev - e0 < FA_MERGE_RUN ? Ev - e0 : FA_MERGE_RUN;
            double acc[FA_MERGE_RUN];
            for (int64_t e = 0; e < n; e++) acc[e] = 0;
            for (int64_t c = 0; c < nc; c++) {
                if (wgt[c] == 0) continue;
                const char *part = parts + (size_t)(base * nc + c) * w->part_bytes;
                if (f32)
                    for (int64_t e = 0; e < n; e++) acc[e] += wgt[c] * ((const float *)part)[o_off + e0 + e];
                else
                    for (int64_t e = 0; e < n; e++) acc[e] += wgt[c] * ((const double *)part)[o_off + e0 + e];
            }
            for (int64_t e = 0; e < n; e++) {
                /* rounded to the computation type first, as an unsplit call's output is */
                const double o_e = top == -INFINITY ? 0 : acc[e] / sum;
                store_out(o, e0 + e, f32 ? (double)(float)o_e : o_e, out_dtype);
            }
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
    const fa_work *w;
    char *parts;
    int64_t next;  /* the next item to take (atomic) */
    int64_t done;  /* items computed (atomic) */
} fa_job;

/* One thread's share: take items in order (costliest first, see fa_item_at)
 * until none are left, in this thread's own scratch. A thread that cannot
 * get scratch takes none, and the others do its share. */
static void run_items(void *ctx) {
    fa_job *job = (fa_job *)ctx;
    const fa_work *w = job->w;
    void *buf = scratch_alloc(w->scratch);
    if (!buf) return;
    memset(buf, 0, w->scratch < FA_ALIGN ? w->scratch : FA_ALIGN); /* the contract of internal.h */
    int64_t idx, done = 0;
    while ((idx = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < w->n_items) {
        const fa_item it = fa_item_at(w, idx, job->parts);
        w->item(&w->plan, &it, buf);
        done++;
    }
    __atomic_fetch_add(&job->done, done, __ATOMIC_RELEASE);
    free(buf);
}

int fa_attention_with(const fa_args *a, const fa_strategy *force) {
    int err = fa_check(a);
    if (err) return err;
    /* S == 0 needs no case of its own: every row's key range is empty, and
     * the kernels write such a row as zeros with lse -inf. */
    if (a->B == 0 || a->Hq == 0 || a->L == 0) return FA_OK;
    fa_work w;
    if ((err = fa_plan_work(a, force, &w))) return err;
    char *parts = NULL;
    if (w.n_chunks > 1 && !(parts = scratch_alloc((size_t)w.n_items * w.part_bytes))) return FA_ERR_NOMEM;

    fa_job job = {&w, parts, 0, 0};
    fa_pool_run(w.threads, run_items, &job);
    /* Every thread that lacked scratch took no item; if none had any, items
     * are left and the output is incomplete. */
    const int failed = job.done < w.n_items;
    if (parts && !failed)
        for (int64_t base = 0; base < w.n_base; base++) merge_parts(&w, base, parts);
    free(parts);
    return failed ? FA_ERR_NOMEM : FA_OK;
}

int fa_attention(const fa_args *a) { return fa_attention_with(a, NULL); }
