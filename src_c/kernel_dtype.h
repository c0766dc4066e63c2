/* kernel_dtype.h — every kernel of one element type in one ISA, and its
 * table entry (kernel<FA_SFX>). Included by kernel_isa.h once per dtype,
 * with FA_T, FA_SFX, FA_TU, FA_MANT, FA_VBYTES and FA_LOG defined (see vec.h);
 * undefines them at the end. Owns what both item layouts share: scratch
 * rounding, the masks on a key block, and a row's finishing step.
 */
#include "vec.h"

static inline size_t FN(round_up)(size_t n) {
    return (n + FA_ALIGN - 1) / FA_ALIGN * FA_ALIGN;
}

/* Structural visibility on a boundary block: key j0+j is visible to row r iff
 * lo[r] ≤ j0+j ≤ hi[r]. Score (r, j) of the block is st[r·rs + j·js]. */
static void FN(mask_ranges)(T *st, int64_t rs, int64_t js, int64_t j0, int64_t nb, int64_t rows,
                            const int64_t *lo, const int64_t *hi) {
    for (int64_t j = 0; j < nb; j++)
        for (int64_t r = 0; r < rows; r++)
            if (j0 + j < lo[r] || j0 + j > hi[r]) st[r * rs + j * js] = -(T)INFINITY;
}

/* The caller's mask on one block: bool (0 hides) or additive (· log2 e, since
 * scores are base 2). m_row[r] is row r's element offset, j0 the first key. */
static void FN(mask_elements)(T *st, int64_t rs, int64_t js, const fa_args *a, const int64_t *m_row,
                              int64_t rows, int64_t j0, int64_t nb) {
    const int64_t m_cs = a->mask_stride[3];
    if (a->mask_kind == FA_MASK_BOOL) {
        const uint8_t *mk = (const uint8_t *)a->mask + j0 * m_cs;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < nb; j++)
                if (!mk[m_row[r] + j * m_cs]) st[r * rs + j * js] = -(T)INFINITY;
    } else {
        const T *mk = (const T *)a->mask + j0 * m_cs;
        const T log2e = (T)1.4426950408889634074;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < nb; j++) st[r * rs + j * js] += mk[m_row[r] + j * m_cs] * log2e;
    }
}

/* Both masks on a block of scores: the caller's first, then the structural
 * ranges, and those only on a block that crosses some row's range boundary
 * (after the caller's mask, so a NaN there at a hidden key stays hidden). */
static inline void FN(mask_block)(T *st, int64_t rs, int64_t js, const fa_args *a, const fa_rows *f,
                                  const int64_t *lo, const int64_t *hi, const int64_t *m_row, int64_t rows,
                                  int64_t j0, int64_t nb) {
    if (a->mask_kind != FA_MASK_NONE) FN(mask_elements)(st, rs, js, a, m_row, rows, j0, nb);
    if (f->lo_max > j0 || f->hi_min < j0 + nb - 1) FN(mask_ranges)(st, rs, js, j0, nb, rows, lo, hi);
}

/* A row's finishing step, from its running max m (base 2) and sum l:
 *     out = o · (1/l),   lse = m·ln 2 + ln l   (natural log)
 * A row with no visible key has l = 0: 1/l becomes 0 (o is 0 too) and lse −inf. */
static inline T FN(finish_inv_l)(T l) { return l == 0 ? 0 : 1 / l; }
static inline T FN(finish_lse)(T m, T l) {
    return l == 0 ? -(T)INFINITY : m * (T)0.69314718055994530942 + FA_LOG(l);
}

/* Where an item writes: the caller's out and lse, or its split-KV part. */
static inline T *FN(item_out)(const fa_item *it, const fa_args *a) {
    return it->partial ? (T *)it->partial : (T *)a->out;
}
static inline T *FN(item_lse)(const fa_item *it, const fa_args *a) {
    return it->partial ? (T *)it->partial : (T *)a->lse;
}

#include "kernel_lanes.h"
#include "kernel_rows.h"

static size_t FN(scratch_bytes)(int64_t E, int64_t Ev) {
    size_t lanes = FN(lanes_scratch_bytes)(E, Ev), rows = FN(rows_scratch_bytes)(E, Ev);
    return lanes > rows ? lanes : rows;
}

/* y = 2^x through the kernel's own v_exp2, for the accuracy test. */
static void FN(exp2_array)(const void *xp, void *yp, int64_t n) {
    const T *x = (const T *)xp;
    T *y = (T *)yp;
    for (int64_t i = 0; i < n; i += W) {
        VT xv = FN(v_splat)(0), yv;
        for (int u = 0; u < W && i + u < n; u++) xv[u] = x[i + u];
        yv = FN(v_exp2)(xv);
        for (int u = 0; u < W && i + u < n; u++) y[i + u] = yv[u];
    }
}

static const fa_kernel FN(kernel) = {
    FA_NV * W,  /* lane_rows */
    W / 2,      /* rows_auto: half a vector or less (measured per ISA: docs/tuning.md) */
    FA_BK,
    FN(scratch_bytes),
    FN(lanes_item),
    FN(rows_item),
    FN(exp2_array),
};

#undef FN
#undef T
#undef VT
#undef VU
#undef W
#undef FA_T
#undef FA_SFX
#undef FA_TU
#undef FA_MANT
#undef FA_VBYTES
#undef FA_LOG
#undef FA_WPP
