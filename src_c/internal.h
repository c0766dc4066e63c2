/* internal.h — what the driver (attention.c, plan.c), the CPU dispatch
 * (dispatch.c) and the per-ISA kernels share. Not part of the public API.
 *
 * The contract: the driver validates the call (check.c), plans it (plan.c:
 * layout, rows per item, key chunks, threads) and hands out work items; a
 * kernel computes one item on one thread, in its own scratch, and knows
 * nothing of threads. A thread's scratch lives for one call, and its first
 * FA_ALIGN bytes are zero when the thread takes its first item: a kernel may
 * keep there what the items of one call on one thread share (kernel_amx.h).
 */
#ifndef FA_INTERNAL_H
#define FA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include "fastattn.h"

#define FA_CAT_(a, b) a##b
#define FA_CAT(a, b) FA_CAT_(a, b)

/* Scratch buffers start on cache-line (and AVX-512 vector) boundaries. */
#define FA_ALIGN 64

/* One past the largest enum fa_dtype: the kernel table's length. */
#define FA_DTYPE_END 6

/* The dtype q or out has when the caller left it 0. */
static inline int fa_io_dtype(int kv, int io) {
    return io ? io : kv == FA_I8 ? FA_F32 : kv;
}

/* The bytes [p, p + bytes) into L2 (prefetcht1), one prefetch per 64 bytes
 * from p, four per pass: the kernels prefetch every line of the next key
 * block's rows, and in decoding a loop step per line cost more instructions
 * than the prefetches themselves (callgrind, docs/tuning.md). */
static inline void fa_prefetch_l2(const void *p, int64_t bytes) {
    const char *c = (const char *)p;
    int64_t i = 0;
    for (; i + 256 <= bytes; i += 256) {
        __builtin_prefetch(c + i, 0, 2);
        __builtin_prefetch(c + i + 64, 0, 2);
        __builtin_prefetch(c + i + 128, 0, 2);
        __builtin_prefetch(c + i + 192, 0, 2);
    }
    for (; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

/* The same, but never dropped by the compiler. GCC 12 compiles some calls of
 * fa_prefetch_l2 to nothing (objdump, stop 26): in the row layout's P·V
 * loops and one row's K burst on every set, in the 16-bit and int8 block
 * conversions (kv_rows), in some of the float scores tiles. A ten-line test
 * reproduces it at -O2: this function, inlined or not, with a constant or a
 * variable length, leaves no prefetch; a loop of one prefetch a pass is
 * kept. Why was not pinned down. Every figure in docs/tuning.md before stop
 * 26 was measured with the build as compiled, so the row layout asks with
 * this one only where asking measured faster (kernel_rows.h, FA_ROW_PF);
 * the lane layout's calls are left as they compile. An asm statement the
 * compiler must keep, where the target has one.
 *
 * The address goes in as a register ("r"), not as a memory operand ("m"):
 * with a memory operand GCC 12 kept one row's P·V accumulators in memory
 * across the asm, a load and a store of every vector for every key (objdump
 * of rows_item, stop 33), which cost more than the prefetches saved; every
 * row-layout measurement with prefetches before stop 33 paid that. */
static inline void fa_prefetch_l2_kept(const void *p, int64_t bytes) {
    const char *c = (const char *)p;
    for (int64_t i = 0; i < bytes; i += 64) {
#if defined(__x86_64__) || defined(__i386__)
        __asm__ volatile("prefetcht1 (%0)" : : "r"(c + i));
#elif defined(__aarch64__)
        __asm__ volatile("prfm pldl2keep, [%0]" : : "r"(c + i));
#else
        __builtin_prefetch(c + i, 0, 2);
#endif
    }
}

/* x stays in a register from here on: an empty asm that may change it, so
 * GCC loads it once instead of folding the load into each instruction that
 * uses it (kernel_rows.h, dot_scores_keys). */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define FA_IN_REGISTER(x) __asm__("" : "+v"(x))
#elif defined(__GNUC__) && defined(__aarch64__)
#define FA_IN_REGISTER(x) __asm__("" : "+w"(x))
#else
#define FA_IN_REGISTER(x) ((void)0)
#endif

/* Rows a row-layout item holds at most (its per-row arrays live on the stack). */
#define FA_ROWS_MAX 8

/* Split-KV parts merged per row block at most (the merge keeps one weight each). */
#define FA_CHUNKS_MAX 256

/* Everything a kernel needs about one call, derived once by the driver. */
typedef struct fa_plan {
    const fa_args *a;
    int64_t group;        /* Hq / Hkv: query heads per key/value head */
    double scale;         /* the caller's: Q is packed as Q·scale */
    int q_dtype, out_dtype; /* resolved (never 0) */
    int64_t wl, wr;       /* window, -1 replaced by a bound past every key */
} fa_plan;

/* One work item. The g·L query rows that read key/value head hk of batch
 * entry b are numbered t = (h − hk·g)·L + i (query head h, row i): grouped
 * query heads are one tall block, so each K/V byte is read once per group.
 * An item takes rows [t0, t0 + rows) against keys [j_from, j_to). */
typedef struct fa_item {
    int64_t b, hk, t0, rows, j_from, j_to;
    void *partial;   /* NULL: write out and lse. Else a split-KV part: row by row,
                        the normalised output (Ev values), then the row's lse; so
                        rows r0… of an item are a part of their own from r0·(Ev + 1) */
} fa_item;

/* The item's per-channel key factors (FA_I8's k_channel), or NULL. */
static inline const float *fa_item_channels(const fa_args *a, const fa_item *it) {
    return a->k_channel ? a->k_channel + it->b * a->k_channel_stride[0] + it->hk * a->k_channel_stride[1] : NULL;
}

typedef void (*fa_item_fn)(const fa_plan *p, const fa_item *it, void *scratch);

/* One (ISA, dtype) entry of the kernel table: the same sources
 * (kernel_dtype.h) compiled for one ISA and one K/V storage type; each
 * converts q, K and V to its computation type as it loads them. */
typedef struct fa_kernel {
    int64_t lane_rows;        /* query rows a lane-layout item holds (its vector lanes) */
    int64_t lane_block;       /* of which one sub-block holds this many (FA_NV vectors; kernel_lanes.h) */
    int64_t rows_auto;        /* the driver picks the row layout for at most this many rows */
    int64_t key_block;        /* keys per block of the online softmax (FA_BK) */
    size_t (*scratch_bytes)(int64_t E, int64_t Ev, int64_t S);   /* one thread's, either layout */
    fa_item_fn lanes_item;    /* rows in vector lanes (kernel_lanes.h) */
    fa_item_fn rows_item;     /* vectors along the head dim (kernel_rows.h), ≤ FA_ROWS_MAX rows */
    void (*exp2)(const void *x, void *y, int64_t n);  /* the kernel's 2^x, for tests */
    void (*softcap)(const void *x, void *y, int64_t n, double c);  /* c·tanh(x/c), for tests */
} fa_kernel;

/* One micro-kernel set: a name and its entries, indexed by enum fa_dtype
 * (NULL where the set has no kernel for that dtype). */
typedef struct fa_isa_table {
    const char *name;
    const fa_kernel *by_dtype[FA_DTYPE_END];
} fa_isa_table;

/* The compiled-in sets (dispatch.c lists which exist in this build). */
extern const fa_isa_table fa_isa_scalar;
extern const fa_isa_table fa_isa_vec128;
#if defined(FA_HAVE_AVX2)
extern const fa_isa_table fa_isa_avx2;
#endif
#if defined(FA_HAVE_AVX512)
extern const fa_isa_table fa_isa_avx512;
#endif
#if defined(FA_HAVE_AVX512BF16)
extern const fa_isa_table fa_isa_avx512bf16;
#endif
#if defined(FA_HAVE_AMX)
extern const fa_isa_table fa_isa_amx;
#endif

/* The set in use (chosen once from the CPU, FASTATTN_ISA or fa_set_isa). */
const fa_isa_table *fa_current_isa(void);

/* Test hook: y = 2^x (n elements, dtype FA_F32/FA_F64) with the named set's
 * vector exp2; FA_ERR_ISA when that set is not available here. */
int fa_test_exp2(const char *isa, int dtype, const void *x, void *y, int64_t n);

/* Test hook: y = c·tanh(x/c) with the named set's softcap; as fa_test_exp2. */
int fa_test_softcap(const char *isa, int dtype, const void *x, void *y, int64_t n, double c);

/* ---- Strategy: what the driver decides for a call, and a way to force it ---- */

enum fa_layout { FA_LAYOUT_AUTO = 0, FA_LAYOUT_LANES = 1, FA_LAYOUT_ROWS = 2 };

/* As a request (fa_attention_with): 0 is "the driver decides" for every
 * field; the rest is forced. As an answer (fa_plan_call): every field filled. */
typedef struct fa_strategy {
    int layout;             /* enum fa_layout */
    int64_t rows_per_item;  /* lanes: 1 … lane_rows; rows: 1 … FA_ROWS_MAX */
    int64_t chunk_keys;     /* keys per split-KV chunk (one chunk: no split) */
    int threads;            /* threads that take items (1: the calling thread alone) */
    /* answers only */
    int64_t row_blocks;     /* items before splitting the keys */
    int64_t key_chunks;     /* chunks per row block */
    int64_t items;          /* row_blocks · key_chunks */
    int64_t key_block;      /* keys per block in the kernel (block sums and skipping) */
    int64_t lane_block;     /* rows of one lane-layout sub-block: a lanes item holds whole ones */
    int serial;             /* the call is too small to wake a worker */
} fa_strategy;

/* fa_attention with parts of the strategy forced (NULL: none). Forcing
 * changes which items run where, never the math: results stay within the
 * reference's tolerance, and are bitwise the same for any forced thread count. */
int fa_attention_with(const fa_args *args, const fa_strategy *force);

/* What fa_attention_with(args, force) would do, without running it. The
 * same code as fa_check, or FA_ERR_STRATEGY for a forced value out of range. */
int fa_plan_call(const fa_args *args, const fa_strategy *force, fa_strategy *decided);

/* ---- Visibility and addressing, shared by both layouts ---- */

/* Rows [lo, hi] of keys visible to query row i of batch entry b from the
 * structural restrictions (kv_len, causal, window); the mask comes on top.
 * Empty when hi < lo. Both ends are non-decreasing in i, which is what lets a
 * kernel skip whole key blocks and mask only the blocks on the boundary. */
/* Query row i's diagonal d(i) in batch entry b: its key position for causal,
 * window and ALiBi (fastattn.h: explicit positions, else the alignment rule). */
static inline int64_t fa_row_diagonal(const fa_args *a, int64_t b, int64_t i) {
    if (a->q_start || a->k_start)
        return (a->q_start ? a->q_start[b] : 0) + i - (a->k_start ? a->k_start[b] : 0);
    const int64_t S_b = a->kv_len ? a->kv_len[b] : a->S;
    return i + (a->align == FA_ALIGN_TOP_LEFT ? 0 : S_b - a->L);
}

static inline void fa_visible_range(const fa_plan *p, int64_t b, int64_t i,
                                    int64_t *lo, int64_t *hi) {
    const fa_args *a = p->a;
    int64_t S_b = a->kv_len ? a->kv_len[b] : a->S;
    int64_t d = fa_row_diagonal(a, b, i);
    int64_t l = 0, h = S_b - 1;
    if (p->wl >= 0 && d - p->wl > l) l = d - p->wl;
    if (a->causal && d < h) h = d;
    if (p->wr >= 0 && d + p->wr < h) h = d + p->wr;
    *lo = l;
    *hi = h;
}

/* Row r of an item: query head *h and position *i. */
static inline void fa_row_at(const fa_plan *p, const fa_item *it, int64_t r, int64_t *h, int64_t *i) {
    const int64_t t = it->t0 + r;
    *h = it->hk * p->group + t / p->a->L;
    *i = t % p->a->L;
}

/* What an item's kernel needs of its rows: each row's visible key range
 * [lo, hi] within the item's keys, and its element offsets into q and the
 * mask; over all rows, the union [j_begin, j_end) of the ranges (empty when
 * j_begin >= j_end) and the largest lo and smallest hi, which tell a block
 * that every row sees entirely (lo_max <= j0 and j1 - 1 <= hi_min). */
typedef struct fa_rows {
    int64_t j_begin, j_end, lo_max, hi_min;
} fa_rows;

static inline fa_rows fa_item_rows(const fa_plan *p, const fa_item *it, int64_t *lo, int64_t *hi,
                                   int64_t *q_row, int64_t *m_row) {
    const fa_args *a = p->a;
    fa_rows f = {INT64_MAX, INT64_MIN, INT64_MIN, INT64_MAX};
    for (int64_t r = 0; r < it->rows; r++) {
        int64_t h, i;
        fa_row_at(p, it, r, &h, &i);
        fa_visible_range(p, it->b, i, &lo[r], &hi[r]);
        if (lo[r] < it->j_from) lo[r] = it->j_from; /* split-KV: this item's share of the keys */
        if (hi[r] > it->j_to - 1) hi[r] = it->j_to - 1;
        if (lo[r] > f.lo_max) f.lo_max = lo[r];
        if (hi[r] < f.hi_min) f.hi_min = hi[r];
        if (lo[r] <= hi[r] && lo[r] < f.j_begin) f.j_begin = lo[r];
        if (lo[r] <= hi[r] && hi[r] + 1 > f.j_end) f.j_end = hi[r] + 1;
        q_row[r] = it->b * a->q_stride[0] + h * a->q_stride[1] + i * a->q_stride[2];
        m_row[r] = it->b * a->mask_stride[0] + h * a->mask_stride[1] + i * a->mask_stride[2];
    }
    return f;
}

/* Where row r's output and lse go: the caller's arrays, or the item's
 * split-KV part (row r's Ev outputs at r·(Ev + 1), its lse after them). */
static inline int64_t fa_out_offset(const fa_plan *p, const fa_item *it, int64_t r, int64_t *lse_off) {
    const fa_args *a = p->a;
    int64_t h, i;
    if (it->partial) {
        *lse_off = r * (a->Ev + 1) + a->Ev;
        return r * (a->Ev + 1);
    }
    fa_row_at(p, it, r, &h, &i);
    *lse_off = it->b * a->lse_stride[0] + h * a->lse_stride[1] + i * a->lse_stride[2];
    return it->b * a->out_stride[0] + h * a->out_stride[1] + i * a->out_stride[2];
}

#endif /* FA_INTERNAL_H */
