/* plan.c — the strategy for one call: which item layout, how many query rows
 * per item, whether the keys are split into chunks, and how many threads.
 * Each rule says why it exists. Nothing here changes the math of a row, and
 * nothing depends on the thread count except the thread count itself, so
 * every num_threads gives the same bits. fa_plan_call reports the decision
 * (tests ask it instead of copying these constants) and a forced strategy
 * overrides any part of it.
 */
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <unistd.h>
#include "plan.h"

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

/* At most this many threads per processor (and at least FA_MIN_THREAD_CAP in
 * all): more only adds overhead. Results do not depend on the count, so
 * capping it changes no bit. */
#define FA_THREADS_PER_PROC 4
#define FA_MIN_THREAD_CAP 64

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

/* Processors this process may run on. */
static int fa_procs(void) {
#if defined(_OPENMP)
    return omp_get_num_procs();
#else
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
#endif
}

/* Keys that some batch entry can see: S, or the longest kv_len. */
static int64_t fa_keys_seen(const fa_args *a) {
    if (!a->kv_len) return a->S;
    int64_t most = 0;
    for (int64_t b = 0; b < a->B; b++)
        if (a->kv_len[b] > most) most = a->kv_len[b];
    return most;
}

/* Layout and rows per item. Few rows per key/value head (decoding): all of
 * them in one row-layout item, whose vectors run along the head dim; else
 * blocks of the kernel's lanes in lane layout, where one vector holds one
 * element of as many query rows. */
static int plan_rows(const fa_args *a, const fa_kernel *kern, int64_t group, const fa_strategy *force,
                     fa_work *w) {
    const int64_t rows_in_group = group * a->L;
    w->layout = force->layout ? force->layout
                              : (rows_in_group <= kern->rows_auto ? FA_LAYOUT_ROWS : FA_LAYOUT_LANES);
    const int64_t most = w->layout == FA_LAYOUT_ROWS ? FA_ROWS_MAX : kern->lane_rows;
    if (force->rows_per_item > most) return FA_ERR_STRATEGY;
    w->bq = force->rows_per_item ? force->rows_per_item : most;
    if (w->bq > rows_in_group) w->bq = rows_in_group;
    w->item = w->layout == FA_LAYOUT_ROWS ? kern->rows_item : kern->lanes_item;
    w->per_head = a->L >= w->bq;
    w->nqb = (a->L + w->bq - 1) / w->bq;
    w->blocks = w->per_head ? group * w->nqb : (rows_in_group + w->bq - 1) / w->bq;
    w->n_base = a->B * a->Hkv * w->blocks;
    /* Causal or window: a later query block sees more keys (bottom-right:
     * the last one sees them all), so the costliest go first and the cheap
     * ones fill the gaps at the end (longest-processing-time-first). */
    w->reverse = a->causal || a->window_right >= 0;
    return FA_OK;
}

/* Key chunks. They cover the keys some batch entry can see (a KV cache is
 * often far from full), so every chunk has work; a multiple of 64 keys, so
 * chunks end on key-block boundaries. */
static int plan_chunks(const fa_args *a, const fa_strategy *force, int64_t S_seen, fa_work *w) {
    w->n_chunks = 1;
    w->chunk = a->S;
    if (force->chunk_keys) {
        const int64_t n = (S_seen + force->chunk_keys - 1) / force->chunk_keys;
        if (n > FA_CHUNKS_MAX) return FA_ERR_STRATEGY;
        if (n > 1) {
            w->chunk = force->chunk_keys;
            w->n_chunks = n;
        }
    } else if (w->n_base < FA_SPLIT_ITEMS && S_seen >= 2 * FA_SPLIT_MIN_KEYS) {
        int64_t want = (FA_SPLIT_ITEMS + w->n_base - 1) / w->n_base, most = S_seen / FA_SPLIT_MIN_KEYS;
        int64_t n = want < most ? want : most;
        w->chunk = ((S_seen + n - 1) / n + 63) / 64 * 64;
        w->n_chunks = (S_seen + w->chunk - 1) / w->chunk;
    }
    w->n_items = w->n_base * w->n_chunks;
    w->part_bytes = w->n_chunks > 1 ? (size_t)w->bq * (size_t)(a->Ev + 1) * w->elem_bytes : 0;
    return FA_OK;
}

/* Threads: the caller's count (or OpenMP's default), one for a call too
 * small to wake a worker, never more than there are items or than the
 * machine can use. */
static void plan_threads(const fa_args *a, const fa_strategy *force, int64_t S_seen, fa_work *w) {
    const double work = (double)a->B * a->Hq * a->L * S_seen * (a->E + a->Ev);
    int threads = force->threads ? force->threads : a->num_threads > 0 ? a->num_threads : fa_max_threads();
    w->serial = work < FA_SERIAL_WORK;
    if (w->serial && !force->threads) threads = 1;
    if ((int64_t)threads > w->n_items) threads = (int)(w->n_items > 0 ? w->n_items : 1);
    int cap = FA_THREADS_PER_PROC * fa_procs();
    if (cap < FA_MIN_THREAD_CAP) cap = FA_MIN_THREAD_CAP;
    w->threads = threads > cap ? cap : threads;
}

int fa_plan_work(const fa_args *a, const fa_strategy *force, fa_work *w) {
    static const fa_strategy automatic;
    if (!force) force = &automatic;
    if (force->layout < FA_LAYOUT_AUTO || force->layout > FA_LAYOUT_ROWS || force->rows_per_item < 0 ||
        force->chunk_keys < 0 || force->threads < 0)
        return FA_ERR_STRATEGY;
    const fa_kernel *kern = fa_current_isa()->by_dtype[a->dtype];
    if (!kern) return FA_ERR_DTYPE;
    memset(w, 0, sizeof *w);
    w->plan.a = a;
    w->plan.group = a->Hq / a->Hkv;
    w->plan.scale = a->scale;
    w->plan.q_dtype = fa_io_dtype(a->dtype, a->q_dtype);
    w->plan.out_dtype = fa_io_dtype(a->dtype, a->out_dtype);
    /* A window side wider than every key and row is the same as unbounded
     * (with explicit positions, |d| stays under 2^61 + L); clamping keeps
     * d ± window inside int64. */
    const int64_t far = (a->q_start || a->k_start) ? (int64_t)1 << 62 : a->S + a->L;
    w->plan.wl = a->window_left > far ? far : a->window_left;
    w->plan.wr = a->window_right > far ? far : a->window_right;
    w->elem_bytes = a->dtype == FA_F64 ? sizeof(double) : sizeof(float); /* the computation type */
    w->scratch = kern->scratch_bytes(a->E, a->Ev, a->S);
    w->key_block = kern->key_block;
    w->lane_block = kern->lane_block;
    const int64_t S_seen = fa_keys_seen(a);
    int err = plan_rows(a, kern, w->plan.group, force, w);
    if (!err) err = plan_chunks(a, force, S_seen, w);
    if (!err) plan_threads(a, force, S_seen, w);
    return err;
}

fa_item fa_item_at(const fa_work *w, int64_t idx, char *parts) {
    const fa_args *a = w->plan.a;
    const int64_t group = w->plan.group;
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

int fa_plan_call(const fa_args *a, const fa_strategy *force, fa_strategy *d) {
    int err = fa_check(a);
    if (err) return err;
    memset(d, 0, sizeof *d);
    if (a->B == 0 || a->Hq == 0 || a->L == 0) { /* nothing to run */
        d->threads = 1;
        d->serial = 1;
        return FA_OK;
    }
    fa_work w;
    if ((err = fa_plan_work(a, force, &w))) return err;
    d->layout = w.layout;
    d->rows_per_item = w.bq;
    d->chunk_keys = w.chunk;
    d->threads = w.threads;
    d->row_blocks = w.n_base;
    d->key_chunks = w.n_chunks;
    d->items = w.n_items;
    d->serial = w.serial;
    d->key_block = w.key_block;
    d->lane_block = w.lane_block;
    return FA_OK;
}
