/* kernel_lanes.h — the lane layout: one work item of attention on one thread,
 * the FlashAttention-2 loop over key blocks with an online softmax, for up to
 * BQ query rows of one (batch, key/value head). Included by kernel_dtype.h
 * once per element type; vec.h gives the vector vocabulary, kernels_<isa>.c
 * the tile sizes:
 *   FA_NV  vectors of query rows per item (BQ = FA_NV · W rows)
 *   FA_MR  rows of a register tile          FA_BK  keys per block
 *
 * Layout: query rows live in vector LANES. Qᵀ is packed once per item (E × BQ,
 * scaled by scale·log2 e), so a score tile Sᵀ (keys × BQ) is a small GEMM with
 * K's rows broadcast straight from the caller's memory: K and V are never
 * copied or transposed. The softmax state (m, l) and the output accumulator
 * Oᵀ (Ev × BQ) are lane-wise too, so the row max, row sum and rescaling need
 * no horizontal reduction at all. Across key blocks, Oᵀ and l are summed
 * with compensation (lanes_fold), so their float32 error does not grow with S.
 */
#define BQ (FA_NV * W)
#define TILE FN(tile)

#if defined(FA_AMX_TILES)
#include "kernel_amx.h"
#endif

/* Key blocks summed plainly into ot (and l) before they are folded into the
 * compensated totals (lanes_fold): an item over at most FA_FOLD · FA_BK keys
 * never folds, and keeps the bits it had before folds existed. */
#ifndef FA_FOLD
#define FA_FOLD 8
#endif

/* Sub-blocks. An item of many rows (prefill) holds FA_SUBS blocks of BQ
 * rows, up to FA_SUB_ROWS rows in all, which take each key block in turn:
 * the block is read from memory or L3 once for all of them and stays in
 * L1/L2 while they use it, and converting storage (16-bit, int8) converts
 * it into scratch once for all of them. Each block computes exactly what an
 * item of its rows alone would (the same key blocks, folds and bits); only
 * the block's reads and conversion are shared. Measured (docs/tuning.md):
 * on Zen 2 (AVX2, 16 rows a block) converting once per 16 rows had cost a
 * float16 prefill 15 % of float32's time, a bfloat16 one 20 %; with float
 * storage, on Sapphire Rapids, 1×8×4096×4096×64 (2 MiB of K and V a head,
 * a core's whole L2 there) ran 5-7 % faster with the AVX2 set, sse2's 3-7 %,
 * float64's 3-14 %, and the other prefill shapes level. AVX-512's float32
 * blocks already hold 64 rows, and items stay that small for many cores;
 * the AMX and VDPBF16PS sets read K in place. */
#define FA_SUB_ROWS 64
#if !defined(FA_AMX_TILES) && !defined(FA_DPBF16_SCORES)
#define FA_SUBS (FA_NV * W < FA_SUB_ROWS ? FA_SUB_ROWS / (FA_NV * W) : 1) /* BQ is gone by the kernel table */
#else
#define FA_SUBS 1
#endif

/* Scratch of one sub-block: qt (E × BQ), st (FA_BK × BQ), ot, the total tot
 * and its compensation tc (Ev × BQ each), m, l, alpha, and the totals' lt,
 * lc, mt. */
static size_t FN(lanes_sub_bytes)(int64_t E, int64_t Ev) {
    size_t lane_row = (size_t)BQ * sizeof(T);
    return FN(round_up)((size_t)E * lane_row) + FN(round_up)((size_t)FA_BK * lane_row) +
           3 * FN(round_up)((size_t)Ev * lane_row) + 6 * FN(round_up)(lane_row);
}

/* Scratch of one thread: for converting storage a block of K (FA_BK × E)
 * and V (FA_BK × Ev), which the sub-blocks share; then FA_SUBS sub-blocks'. */
static size_t FN(lanes_scratch_bytes)(int64_t E, int64_t Ev) {
    size_t kv = FA_CONVERTS ? FN(round_up)((size_t)FA_BK * E * sizeof(T)) + FN(round_up)((size_t)FA_BK * Ev * sizeof(T)) : 0;
    return FA_SUBS * FN(lanes_sub_bytes)(E, Ev) + kv;
}

/* From here to softmax_block, and lanes_pack_q, lanes_modify, lanes_store:
 * compute-only code, which depends on T alone. A converting storage (16-bit,
 * int8) calls the float32 instantiation's (CN), compiled once. */
#if !FA_CONVERTS

/* The register tile, the only place the FLOPs happen:
 *     c[r][·] = c[r][·]·c_scale[·] + Σ_k a[r·a_rs + k·a_ks] · b[k][·]
 * for MRC rows r and the first NVC vectors of lanes (c_scale NULL: c = Σ);
 * rows of b and c are FA_NV vectors apart. pf (or NULL): pf_lines cache
 * lines from pf on, the next key block's, to ask for along the way (see
 * next_block). Each a scalar is broadcast once
 * and meets NVC vectors of b: up to FA_MR·FA_NV accumulators stay in
 * registers. MRC and NVC are constants wherever this is inlined.
 * The sum starts from 0 and meets c once at the end: O over S keys is then a
 * blocked sum (K terms per block), whose float32 error would still grow like
 * (K + S/K)·u (not S·u as one running sum does); lanes_fold makes it
 * independent of S. */
static inline __attribute__((always_inline)) void TILE(
    const int MRC, const int NVC, VT *restrict c, const T *restrict a, const int64_t a_rs,
    const int64_t a_ks, const VT *restrict b, const int64_t K, const VT *restrict c_scale, const char *pf,
    const int64_t pf_lines) {
    VT acc[2 * FA_MR][FA_NV]; /* MRC ≤ 2·FA_MR rows when NVC ≤ FA_NV / 2 (see FA_TALL) */
    int64_t pf_due = 0; /* pf_lines lines from pf asked for evenly over the K steps */
#pragma GCC unroll 16
    for (int r = 0; r < MRC; r++)
#pragma GCC unroll 8
        for (int u = 0; u < NVC; u++)
            acc[r][u] = (VT){0};
    for (int64_t k = 0; k < K; k++) {
        const VT *b_k = b + k * FA_NV;
        if (pf)
            for (pf_due += pf_lines; pf_due >= K; pf_due -= K, pf += 64) __builtin_prefetch(pf, 0, 2);
#pragma GCC unroll 16
        for (int r = 0; r < MRC; r++) {
            const VT a_rk = FN(v_splat)(a[r * a_rs + k * a_ks]);
#pragma GCC unroll 8
            for (int u = 0; u < NVC; u++) acc[r][u] += a_rk * b_k[u];
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MRC; r++)
#pragma GCC unroll 8
        for (int u = 0; u < NVC; u++)
            c[r * FA_NV + u] = c_scale ? c[r * FA_NV + u] * c_scale[u] + acc[r][u] : acc[r][u];
}

/* FA_TAIL(n) for every n in 1 … FA_MR − 1 (FA_MR is at most 12). */
#define FA_TAILS_1 FA_TAIL(1)
#define FA_TAILS_2 FA_TAILS_1 FA_TAIL(2)
#define FA_TAILS_3 FA_TAILS_2 FA_TAIL(3)
#define FA_TAILS_4 FA_TAILS_3 FA_TAIL(4)
#define FA_TAILS_5 FA_TAILS_4 FA_TAIL(5)
#define FA_TAILS_6 FA_TAILS_5 FA_TAIL(6)
#define FA_TAILS_7 FA_TAILS_6 FA_TAIL(7)
#define FA_TAILS_8 FA_TAILS_7 FA_TAIL(8)
#define FA_TAILS_9 FA_TAILS_8 FA_TAIL(9)
#define FA_TAILS_10 FA_TAILS_9 FA_TAIL(10)
#define FA_TAILS_11 FA_TAILS_10 FA_TAIL(11)
#if FA_MR == 4
#define FA_TAILS FA_TAILS_3
#elif FA_MR == 6
#define FA_TAILS FA_TAILS_5
#elif FA_MR == 8
#define FA_TAILS FA_TAILS_7
#elif FA_MR == 12
#define FA_TAILS FA_TAILS_11
#else
#error "FA_MR must be 4, 6, 8 or 12"
#endif

/* Rows of a tile (keys of a score tile, value columns of a P·V tile) for
 * NVC vectors of lanes: with half the vectors or fewer (short items:
 * decoding with grouped heads, L < BQ), twice the rows, so the tile keeps as
 * many independent accumulators in flight (measurements: docs/tuning.md). */
#define FA_TALL(NVC) (2 * (NVC) <= FA_NV ? 2 * FA_MR : FA_MR)

/* What an item that streams K and V asks for while it computes a block
 * (see lanes_blocks): the next block's K and V rows, into L2. Rows back to
 * back (a flat range of bytes): every tile asks for its share a cache line
 * at a time, spread over its loop, because a burst beyond the core's few
 * miss buffers is mostly dropped: on Zen 2, asking for a block's rows a
 * tile's worth at once left multi-query decoding at 30 % of the memory
 * bandwidth, spread it reads twice as fast (docs/tuning.md). Rows apart in
 * memory: each score tile's K and V rows at once, before the tile. */
typedef struct FN(next_block) {
    const char *k, *v;     /* its first K and V row; NULL: nothing to ask for */
    int64_t k_row, v_row;  /* bytes of a K and a V row */
    int64_t k_rs, v_rs;    /* bytes from one row to the next */
    int flat;              /* k_rs == k_row and v_rs == v_row */
} FN(next_block);

/* Rows [j, j + n) of the next block, all at once (rows apart in memory). */
static inline void FN(ask_rows)(const FN(next_block) *nx, int64_t j, int64_t n) {
    for (int64_t i = j; i < j + n; i++) {
        fa_prefetch_l2(nx->k + i * nx->k_rs, nx->k_row);
        fa_prefetch_l2(nx->v + i * nx->v_rs, nx->v_row);
    }
}

/* Sᵀ[j][·] = Σ_e K[j][e] · Qᵀ[e][·] for the nb keys of a block, FA_TALL
 * keys a tile; each score tile asks for the next block's K rows of its own
 * keys. */
static inline __attribute__((always_inline)) void FN(scores_tile_n)(
    const int NVC, VT *st, const T *k, int64_t k_rs, const VT *qt, int64_t E, int64_t nb,
    const FN(next_block) *nx) {
    const int MRT = FA_TALL(NVC);
    const int flat = nx->k && nx->flat, rows = nx->k && !nx->flat;
#define FA_ASK(j, n) flat ? nx->k + (j) * nx->k_row : NULL, ((n) * nx->k_row + 63) / 64
    int64_t j = 0;
    for (; j + MRT <= nb; j += MRT) {
        if (rows) FN(ask_rows)(nx, j, MRT);
        TILE(MRT, NVC, st + j * FA_NV, k + j * k_rs, k_rs, 1, qt, E, 0, FA_ASK(j, MRT));
    }
    if (MRT > FA_MR && j + FA_MR <= nb) {
        if (rows) FN(ask_rows)(nx, j, FA_MR);
        TILE(FA_MR, NVC, st + j * FA_NV, k + j * k_rs, k_rs, 1, qt, E, 0, FA_ASK(j, FA_MR));
        j += FA_MR;
    }
    if (rows) FN(ask_rows)(nx, j, nb - j);
    switch (nb - j) { /* the last rows in one narrower tile, each width compiled on its own */
#define FA_TAIL(n) case n: TILE(n, NVC, st + j * FA_NV, k + j * k_rs, k_rs, 1, qt, E, 0, FA_ASK(j, n)); break;
        FA_TAILS
#undef FA_TAIL
    }
#undef FA_ASK
}

/* Oᵀ[e][·] = Oᵀ[e][·]·alpha[·] + Σ_j V[j][e] · Pᵀ[j][·] for the nb keys of a
 * block; the next block's V rows (a flat range) are shared out over the
 * tiles, each asking for `per` lines. */
static inline __attribute__((always_inline)) void FN(values_tile_n)(
    const int NVC, VT *ot, const T *v, int64_t v_rs, const VT *pt, int64_t Ev, int64_t nb, const VT *alpha,
    const FN(next_block) *nx, int64_t nx_rows) {
    const int MRT = FA_TALL(NVC);
    const int64_t tall = Ev / MRT, rest = Ev % MRT, one_more = MRT > FA_MR && rest >= FA_MR;
    const int64_t tiles = tall + one_more + (rest - one_more * FA_MR > 0);
    const int flat = nx->v && nx->flat;
    const int64_t lines = flat ? (nx_rows * nx->v_row + 63) / 64 : 0, per = (lines + tiles - 1) / tiles;
    const char *pf = flat ? nx->v : NULL;
    int64_t left = lines;
#define FA_SHARE pf, left < per ? left : per /* this tile's lines, then the next tile's: */
#define FA_NEXT (pf = pf ? pf + per * 64 : NULL, left = left > per ? left - per : 0)
    int64_t e = 0;
    for (; e + MRT <= Ev; e += MRT, FA_NEXT) TILE(MRT, NVC, ot + e * FA_NV, v + e, 1, v_rs, pt, nb, alpha, FA_SHARE);
    if (one_more) {
        TILE(FA_MR, NVC, ot + e * FA_NV, v + e, 1, v_rs, pt, nb, alpha, FA_SHARE);
        FA_NEXT;
        e += FA_MR;
    }
    switch (Ev - e) {
#define FA_TAIL(n) case n: TILE(n, NVC, ot + e * FA_NV, v + e, 1, v_rs, pt, nb, alpha, FA_SHARE); break;
        FA_TAILS
#undef FA_TAIL
    }
#undef FA_SHARE
#undef FA_NEXT
}

/* An item with few rows (short L, decoding) uses only the nvc vectors of
 * lanes its rows fill: one instantiation per width, up to FA_NV ≤ 4. */
#define FA_BY_WIDTH(nvc, call)                                    \
    switch (nvc) {                                                \
    case 1: call(1); break;                                       \
    case 2: if (FA_NV >= 2) call(FA_NV >= 2 ? 2 : 1); break;      \
    case 3: if (FA_NV >= 3) call(FA_NV >= 3 ? 3 : 1); break;      \
    default: call(FA_NV); break;                                  \
    }

static void FN(scores_tile)(int nvc, VT *st, const T *k, int64_t k_rs, const VT *qt, int64_t E, int64_t nb,
                            const FN(next_block) *nx) {
#define FA_CALL(n) FN(scores_tile_n)(n, st, k, k_rs, qt, E, nb, nx)
    FA_BY_WIDTH(nvc, FA_CALL)
#undef FA_CALL
}

static void FN(values_tile)(int nvc, VT *ot, const T *v, int64_t v_rs, const VT *pt, int64_t Ev, int64_t nb,
                            const VT *alpha, const FN(next_block) *nx, int64_t nx_rows) {
#define FA_CALL(n) FN(values_tile_n)(n, ot, v, v_rs, pt, Ev, nb, alpha, nx, nx_rows)
    FA_BY_WIDTH(nvc, FA_CALL)
#undef FA_CALL
}

/* Online softmax over one block, lane-wise (one lane = one query row):
 *     m' = max(m, max_j s_j)        alpha = e^(m − m') = 2^((m − m')·log2 e)
 *     p_j = 2^((s_j − m')·log2 e)   l' = l·alpha + Σ_j p_j
 * st is overwritten with p. A row with no visible key so far has m = −inf; it
 * subtracts 0 instead, so its p and alpha are 2^−inf = 0, never NaN. */
static void FN(softmax_block)(int nvc, VT *st, int64_t nb, VT *m, VT *l, VT *alpha) {
    const VT neg_inf = FN(v_splat)(-(T)INFINITY);
    const T log2e = (T)1.4426950408889634074;
    for (int u = 0; u < nvc; u++) {
        /* Four running maxima, so the block's max is not one chain of nb
         * dependent steps (max is exact: any order gives the same bits). */
        VT m4[4] = {m[u], m[u], m[u], m[u]};
        int64_t j = 0;
        for (; j + 4 <= nb; j += 4)
            for (int i = 0; i < 4; i++) m4[i] = FN(v_max)(m4[i], st[(j + i) * FA_NV + u]);
        for (; j < nb; j++) m4[0] = FN(v_max)(m4[0], st[j * FA_NV + u]);
        VT m_new = FN(v_max)(FN(v_max)(m4[0], m4[1]), FN(v_max)(m4[2], m4[3]));
        VT m_sub = FN(v_select)((VU)(m_new == neg_inf), FN(v_splat)(0), m_new);
        const VT sum = FN(exp2_shifted)(st + u, FA_NV, nb, m_sub);
        alpha[u] = FN(v_exp2)((m[u] - m_sub) * log2e);
        l[u] = l[u] * alpha[u] + sum;
        m[u] = m_new;
    }
}

#endif /* !FA_CONVERTS: tiles and softmax */

#if defined(FA_DPBF16_SCORES)
#include "kernel_dpbf16.h"
#endif

/* Sub-block g's lane-layout scratch, carved from the buffer the driver
 * gives; kt, vt: a key block of K and V converted to T (16-bit and int8
 * storage), first, and the same for all sub-blocks. */
#if !FA_CONVERTS
typedef struct FN(lanes_bufs) {
    VT *qt, *st, *ot, *m, *l, *alpha;
    VT *tot, *tc, *lt, *lc, *mt; /* compensated totals (lanes_fold) */
    T *kt, *vt;
} FN(lanes_bufs);
#endif

static CN(lanes_bufs) FN(lanes_carve)(void *scratch, int64_t E, int64_t Ev, int g) {
    CN(lanes_bufs) s;
    char *p = (char *)scratch;
    s.kt = (T *)p;      p += FA_CONVERTS ? FN(round_up)((size_t)FA_BK * E * sizeof(T)) : 0;
    s.vt = (T *)p;      p += FA_CONVERTS ? FN(round_up)((size_t)FA_BK * Ev * sizeof(T)) : 0;
    p += (size_t)g * FN(lanes_sub_bytes)(E, Ev);
    const size_t lane_row = (size_t)BQ * sizeof(T);
    s.qt = (VT *)p;     p += FN(round_up)((size_t)E * lane_row);
    s.st = (VT *)p;     p += FN(round_up)((size_t)FA_BK * lane_row);
    s.ot = (VT *)p;     p += FN(round_up)((size_t)Ev * lane_row);
    s.m = (VT *)p;      p += FN(round_up)(lane_row);
    s.l = (VT *)p;      p += FN(round_up)(lane_row);
    s.alpha = (VT *)p;  p += FN(round_up)(lane_row);
    s.tot = (VT *)p;    p += FN(round_up)((size_t)Ev * lane_row);
    s.tc = (VT *)p;     p += FN(round_up)((size_t)Ev * lane_row);
    s.lt = (VT *)p;     p += FN(round_up)(lane_row);
    s.lc = (VT *)p;     p += FN(round_up)(lane_row);
    s.mt = (VT *)p;
    return s;
}

#if !FA_CONVERTS
/* Packing: Qᵀ · scale (· the int8 keys' channel factors) into qt (E × BQ, row e of Qᵀ holding every
 * row's element e), padding lanes 0. Whole W×W blocks are transposed in
 * registers, the last E % W columns copied one by one. */
static void FN(lanes_pack_q)(const fa_plan *p, const int64_t *q_row, int64_t rows, int nvc, const float *ch,
                            VT *qt) {
    const int64_t E = p->a->E, e_full = E / W * W;
    T *qt_s = (T *)qt;
    for (int u = 0; u < nvc; u++) {
        const int64_t r0 = (int64_t)u * W, nr = rows - r0 < W ? rows - r0 : W;
        for (int64_t e0 = 0; e0 < e_full; e0 += W) {
            VT x[W];
            for (int i = 0; i < W; i++) x[i] = i < nr ? FN(q_scaled)(p, q_row[r0 + i] + e0, W, ch ? ch + e0 : NULL) : (VT){0};
            FN(v_transpose)(x);
            for (int i = 0; i < W; i++) qt[(e0 + i) * FA_NV + u] = x[i];
        }
    }
    for (int64_t e = e_full; e < E; e++) {
        T *dst = qt_s + e * BQ;
        if (rows < nvc * W) qt[e * FA_NV + nvc - 1] = (VT){0};
        for (int64_t r = 0; r < rows; r++) dst[r] = FN(q_scaled)(p, q_row[r] + e, 1, ch ? ch + e : NULL)[0];
    }
}

/* Softcap, then ALiBi on a block (key j0 + j, lane r):
 *     s := c·tanh(s/c),   s += −slope_r · |j0 + j − d_r|
 * with d_r − j0 converted once per block (exact while under 2^24 / 2^53).
 * Kept out of line: the block loop of a plain call stays as lean as before. */
static __attribute__((noinline)) void FN(lanes_modify)(const fa_args *a, VT *st, int nvc, int64_t j0, int64_t nb,
                                                       const T *neg_slope, const int64_t *diag) {
    if (a->softcap > 0)
        for (int64_t j = 0; j < nb; j++) FN(softcap_vectors)(st + j * FA_NV, nvc, (T)a->softcap);
    if (!a->alibi_slopes) return;
    VT ns[FA_NV], dd[FA_NV];
    for (int u = 0; u < nvc; u++)
        for (int i = 0; i < W; i++) {
            ns[u][i] = neg_slope[u * W + i];
            dd[u][i] = (T)(diag[u * W + i] - j0);
        }
    for (int64_t j = 0; j < nb; j++)
        for (int u = 0; u < nvc; u++) st[j * FA_NV + u] += ns[u] * FN(v_abs)(FN(v_splat)((T)j) - dd[u]);
}

/* Folds the plain sums of the last few key blocks, (ot, l) at the running
 * max m, into the compensated totals (tot + tc, lt + lc) at the max mt of the
 * previous fold, and moves the totals to m:
 *     beta = 2^((mt − m)·log2 e),  tot := tot·beta + ot,  lt := lt·beta + l
 * each a compensated step (v_comp_step). Why: a plain running sum of S/FA_BK
 * block sums drifts like (S/FA_BK)·u, on values sharing an offset past the
 * tolerance from 2^16 keys (docs/tuning.md); this way the error is that of
 * FA_FOLD blocks' plain sum plus about 2u, whatever S. The numerator and
 * the denominator take the same beta, so its rounding moves both alike and
 * barely the quotient. Rows with no visible key yet (m = −inf) keep 0.
 * last: the item's final fold, which leaves the totals' values x + e
 * (comp_value) in ot and l, as the store wants them, without writing the
 * totals back: one pass over them, not two. tc_zero: tc holds zeros (only
 * the first fold has been), which are not read. */
static inline __attribute__((always_inline)) void FN(lanes_fold_n)(const int last, const int tc_zero, int nvc,
                                                                   int64_t Ev, CN(lanes_bufs) s) {
    const T log2e = (T)1.4426950408889634074;
    for (int u = 0; u < nvc; u++) {
        const VT m_sub = FN(v_select)((VU)(s.m[u] == FN(v_splat)(-(T)INFINITY)), (VT){0}, s.m[u]);
        const VT beta = FN(v_exp2)((s.mt[u] - m_sub) * log2e);
        FN(v_comp_step)(&s.lt[u], &s.lc[u], beta, s.l[u]);
        s.mt[u] = s.m[u];
        if (last) s.l[u] = FN(comp_value)(s.lt[u], s.lc[u]);
        for (int64_t i = u; i < Ev * FA_NV; i += FA_NV) {
            VT x = s.tot[i], e = tc_zero ? (VT){0} : s.tc[i];
            FN(v_comp_step)(&x, &e, beta, s.ot[i]);
            if (last) s.ot[i] = FN(comp_value)(x, e);
            else s.tot[i] = x, s.tc[i] = e;
        }
    }
}
static void FN(lanes_fold)(int nvc, int64_t Ev, CN(lanes_bufs) s, int tc_zero) {
    if (tc_zero) FN(lanes_fold_n)(0, 1, nvc, Ev, s);
    else FN(lanes_fold_n)(0, 0, nvc, Ev, s);
}
static void FN(lanes_fold_last)(int nvc, int64_t Ev, CN(lanes_bufs) s, int tc_zero) {
    if (tc_zero) FN(lanes_fold_n)(1, 1, nvc, Ev, s);
    else FN(lanes_fold_n)(1, 0, nvc, Ev, s);
}

/* The first fold, into empty totals: a compensated step with beta = 0 there
 * gives tot = ot and tc = 0 exactly, lt = l and lc = 0 (where ot is inf or
 * NaN, tot is too, and comp_value ignores tc from then on). So ot's buffer
 * simply becomes the total, and the total's buffer takes the next plain sum
 * (whose first block starts Oᵀ from 0); tc is not even cleared: the next
 * fold reads zeros in its place (tc_zero). Together with the
 * last fold's single pass this took the amx set's bfloat16 1×8×1024×1024×128
 * 0.92-0.93 of its time (docs/tuning.md, "Stop 37"). */
static void FN(lanes_fold_first)(int nvc, CN(lanes_bufs) *s) {
    VT *const ot = s->ot;
    s->ot = s->tot;
    s->tot = ot;
    for (int u = 0; u < nvc; u++) {
        s->lt[u] = s->l[u];
        s->lc[u] = (VT){0};
        s->mt[u] = s->m[u];
    }
}

#endif /* !FA_CONVERTS: packing, modifiers, folds */

/* One sub-block of an item (see FA_SUBS): its rows as an item of their own,
 * their key ranges and offsets (fa_item_rows), modifiers, buffers, and
 * where its folds stand. */
typedef struct FN(lanes_sub) {
    fa_item it;
    fa_rows f;
    int64_t lo[BQ], hi[BQ], q_row[BQ], m_row[BQ], diag[BQ];
    T neg_slope[BQ], sink[BQ];
    int nvc, folds;
    int64_t fresh; /* its first key block since its last fold */
    CN(lanes_bufs) s;
} FN(lanes_sub);

/* The block loop of n sub-blocks whose first keys are a whole number of
 * key blocks apart, so they share one grid of blocks: for each key block,
 * the conversion (converting storage) once, then, for each sub-block that
 * sees the block, scores, modifiers, masks, online softmax, P·V.
 * Leaves each sub-block's Oᵀ unnormalised in ot and each lane's (m, l). The
 * first block starts Oᵀ from 0 (its alpha is 0 anyway), so Oᵀ needs no
 * clearing unless no block is visited at all; so does the first block after
 * a fold (l is cleared there). Every FA_FOLD blocks of a sub-block, if more
 * follow, its sums so far go into the compensated totals; a sub-block that
 * folded folds the rest at the end. */
static void FN(lanes_blocks)(const fa_plan *p, const fa_item *it, FN(lanes_sub) *const *subs, int n,
                             const void *amx) {
    const fa_args *a = p->a;
    const int64_t E = a->E, Ev = a->Ev;
    const KV *k = (const KV *)a->k + it->b * a->k_stride[0] + it->hk * a->k_stride[1];
    const KV *v = (const KV *)a->v + it->b * a->v_stride[0] + it->hk * a->v_stride[1];
    const int modify = a->softcap > 0 || a->alibi_slopes;
    /* An item that holds every query row of its key/value head (decoding:
     * one row per head, or a grouped-query group) reads each K/V byte once,
     * from memory, and so does an item of one vector of rows (short L): over
     * each block's tiles it asks for the next block's rows (next_block).
     * The items of a prefill share their head's K and V, which all but the
     * first find in cache, where the hardware prefetcher keeps up: asking
     * cost them 5-8 % on Zen 2 and 2-9 % on Sapphire Rapids (docs/tuning.md). */
    const int stream = it->rows <= W || it->rows == p->group * a->L;
    CN(next_block) nx = {NULL, NULL, E * (int64_t)sizeof(KV), Ev * (int64_t)sizeof(KV),
                         a->k_stride[2] * (int64_t)sizeof(KV), a->v_stride[2] * (int64_t)sizeof(KV), 0};
    nx.flat = nx.k_rs == nx.k_row && nx.v_rs == nx.v_row;
    const CN(next_block) none = {NULL, NULL, 0, 0, 0, 0, 0}; /* for the sub-blocks after the first */
#if FA_CONVERTS
    /* Each key block is converted into kt, vt (in L1), then read as T. */
    const int64_t k_rs = E, v_rs = Ev;
#if defined(FA_KV_I8)
    const int64_t ks_rs = a->k_scale_stride[2], vs_rs = a->v_scale_stride[2];
    const float *ks = a->k_scale + it->b * a->k_scale_stride[0] + it->hk * a->k_scale_stride[1];
    const float *vs = a->v_scale + it->b * a->v_scale_stride[0] + it->hk * a->v_scale_stride[1];
#define FA_ROW_SCALE(sc, j) ((sc) + (j) * sc##_rs), sc##_rs
#else
#define FA_ROW_SCALE(sc, j) NULL, 0
#endif
#else
    const int64_t k_rs = a->k_stride[2], v_rs = a->v_stride[2];
#endif
#if defined(FA_AMX_TILES)
    /* the tiles' scores stay unscaled unless something adds to them */
    const int scaled = modify || a->mask_kind == FA_MASK_ADD;
    /* A key block whose P·V waits for the next block's, to run as one
     * (amx_values): pend_n of them (0 or 1), its alpha, or fresh (Oᵀ from 0). */
    FN(amx_block) pend = {0, 0, 0};
    int pend_n = 0, pend_fresh = 0;
    VT pend_alpha[FA_NV];
#else
    (void)amx;
#endif
#if defined(FA_DPBF16_SCORES)
    const int dp = FN(dp_usable)(p); /* lanes_item packed Qᵀ in pairs */
#endif
    int64_t j_begin = INT64_MAX, j_end = INT64_MIN; /* the sub-blocks' keys together */
    for (int g = 0; g < n; g++) {
        FN(lanes_sub) *u = subs[g];
        for (int w = 0; w < FA_NV; w++) {
            u->s.m[w] = FN(v_splat)(-(T)INFINITY);
            u->s.l[w] = (VT){0};
        }
        u->fresh = u->f.j_begin;
        u->folds = 0;
        if (u->f.j_begin >= u->f.j_end) {
            for (int64_t e = 0; e < Ev; e++)
                for (int w = 0; w < u->nvc; w++) u->s.ot[e * FA_NV + w] = (VT){0};
            continue;
        }
        if (u->f.j_begin < j_begin) j_begin = u->f.j_begin;
        if (u->f.j_end > j_end) j_end = u->f.j_end;
    }
    for (int64_t j0 = j_begin; j0 < j_end; j0 += FA_BK) {
#if FA_CONVERTS
        const int64_t nb_all = j_end - j0 < FA_BK ? j_end - j0 : FA_BK; /* converted: every sub-block's keys */
        const T *k_blk = subs[0]->s.kt, *v_blk = subs[0]->s.vt; /* converted below, unless the tiles read K and V in place */
        int converted = 0;
#else
        const T *k_blk = k + j0 * k_rs, *v_blk = v + j0 * v_rs;
#endif
        const int64_t n_next = stream ? (j_end - j0 - FA_BK < FA_BK ? j_end - j0 - FA_BK : FA_BK) : 0;
        nx.k = n_next > 0 ? (const char *)(k + (j0 + FA_BK) * a->k_stride[2]) : NULL;
        nx.v = n_next > 0 ? (const char *)(v + (j0 + FA_BK) * a->v_stride[2]) : NULL;
        int asked = 0; /* the first sub-block to take this block asks for the next one */
        for (int g = 0; g < n; g++) {
            FN(lanes_sub) *u = subs[g];
            if (j0 < u->f.j_begin || j0 >= u->f.j_end) continue;
            const int64_t nb = u->f.j_end - j0 < FA_BK ? u->f.j_end - j0 : FA_BK;
            const CN(next_block) *ask = asked++ ? &none : &nx;
            const CN(lanes_bufs) s = u->s;
            const int nvc = u->nvc;
#if defined(FA_AMX_TILES)
            if (amx) {
                FN(amx_scores)(amx, s.st, k + j0 * a->k_stride[2], a->k_stride[2], nb, E, nvc);
                if (scaled) FN(amx_scale)(s.st, nb, nvc, (T)p->scale);
            } else
#endif
#if defined(FA_DPBF16_SCORES)
            if (dp) { /* K's bfloat16 pairs read in place; V converted as below (one sub-block here) */
                FN(dp_scores)(nvc, s.st, k + j0 * a->k_stride[2], a->k_stride[2], s.qt, E, nb, (T)p->scale);
                FN(kv_rows)(s.vt, Ev, v + j0 * a->v_stride[2], a->v_stride[2], nb, Ev, NULL, 0, nvc == 1);
            } else
#endif
            {
#if FA_CONVERTS
                /* The conversion asks for the next block's rows too, a row at a
                 * time. Both together, on Zen 2, 1×8/1×1×32768×128 float16
                 * decoding from memory: 3.2 ms against 3.3 (the tiles only) and
                 * 3.9 (the conversion only); from cache 7 % slower than the
                 * conversion only, the tiles only 12 % (docs/tuning.md). */
                if (!converted++) {
                    FN(kv_rows)(s.kt, E, k + j0 * a->k_stride[2], a->k_stride[2], nb_all, E, FA_ROW_SCALE(ks, j0), stream);
                    FN(kv_rows)(s.vt, Ev, v + j0 * a->v_stride[2], a->v_stride[2], nb_all, Ev, FA_ROW_SCALE(vs, j0), stream);
                }
#endif
                CN(scores_tile)(nvc, s.st, k_blk, k_rs, s.qt, E, nb, ask);
            }
            /* the sub-block's last block; a fold after this block */
            const int last = j0 + FA_BK >= u->f.j_end, fold_due = !last && j0 + FA_BK - u->fresh == FA_FOLD * FA_BK;
            (void)last;
            if (modify) CN(lanes_modify)(a, s.st, nvc, j0, nb, u->neg_slope, u->diag);
            FN(mask_block)((T *)s.st, 1, BQ, a, &u->f, u->lo, u->hi, u->m_row, u->it.rows, j0, nb);
#if defined(FA_AMX_TILES)
            if (amx) {
                VT m_prev[FA_NV]; /* a waiting block's test below needs the max before this block */
                for (int w = 0; pend_n && w < nvc; w++) m_prev[w] = s.m[w];
                const FN(amx_block) here = {j0, nb, pend_n ? !pend.set : 0};
                FN(amx_softmax)(amx, here.set, nvc, s.st, nb, s.m, s.l, s.alpha, scaled ? 1 : (T)p->scale);
                const int64_t v_rs_ = a->v_stride[2]; /* v_rs is the converted scratch's */
                if (pend_n) {
                    /* One P·V for both blocks where this block's alpha leaves
                     * Oᵀ as it is: 1 in every lane that has seen a key (a lane
                     * that has not holds Oᵀ = 0, which any alpha keeps). */
                    int both = FN(amx_slot)(amx, pend.j0) != FN(amx_slot)(amx, j0);
                    for (int w = 0; both && w < nvc; w++)
                        if (_mm512_cmp_ps_mask((__m512)s.alpha[w], _mm512_set1_ps(1), _CMP_NEQ_UQ) &
                            _mm512_cmp_ps_mask((__m512)m_prev[w], _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ))
                            both = 0;
                    const VT *pa = pend_fresh ? NULL : pend_alpha;
                    if (both) {
                        const FN(amx_block) two[2] = {pend, here};
                        FN(amx_values)(amx, s.ot, &u->it, v, v_rs_, two, 2, Ev, nvc, pa);
                    } else {
                        FN(amx_values)(amx, s.ot, &u->it, v, v_rs_, &pend, 1, Ev, nvc, pa);
                        FN(amx_values)(amx, s.ot, &u->it, v, v_rs_, &here, 1, Ev, nvc, s.alpha);
                    }
                    pend_n = 0;
                } else if (last || fold_due) { /* Oᵀ is due now */
                    FN(amx_values)(amx, s.ot, &u->it, v, v_rs_, &here, 1, Ev, nvc, j0 == u->fresh ? 0 : s.alpha);
                } else {
                    pend = here;
                    pend_n = 1;
                    pend_fresh = j0 == u->fresh;
                    for (int w = 0; w < nvc; w++) pend_alpha[w] = s.alpha[w];
                }
            } else
#endif
            {
                CN(softmax_block)(nvc, s.st, nb, s.m, s.l, s.alpha);
                CN(values_tile)(nvc, s.ot, v_blk, v_rs, s.st, Ev, nb, j0 == u->fresh ? 0 : s.alpha, ask, n_next);
            }
            if (fold_due) {
                if (u->folds++) CN(lanes_fold)(nvc, Ev, s, u->folds == 2);
                else CN(lanes_fold_first)(nvc, &u->s);
                u->fresh = j0 + FA_BK;
                for (int w = 0; w < nvc; w++) s.l[w] = (VT){0};
            }
        }
    }
    for (int g = 0; g < n; g++)
        if (subs[g]->folds) CN(lanes_fold_last)(subs[g]->nvc, Ev, subs[g]->s, subs[g]->folds == 1);
#undef FA_ROW_SCALE
}

#if !FA_CONVERTS
/* The store: out = Oᵀ · (1/l) lane-wise, transposed back into the caller's
 * rows (whole W×W blocks in registers), and each row's lse; sink: each
 * lane's sink logit, or NULL for none. */
static void FN(lanes_store)(const fa_plan *p, const fa_item *it, const T *sink, int nvc, CN(lanes_bufs) s) {
    const fa_args *a = p->a;
    const int64_t Ev = a->Ev, rows = it->rows, ev_full = Ev / W * W;
    const T *m_s = (const T *)s.m, *l_s = (const T *)s.l, *ot_s = (const T *)s.ot;
    T *lse = FN(item_lse)(it, a);
    T *inv = (T *)s.alpha, lse_r[BQ];
    if (sink) /* finish_row lane by lane */
        for (int64_t r = 0; r < (int64_t)nvc * W; r++)
            FN(finish_row)(m_s[r], l_s[r], sink[r], &inv[r], lse ? &lse_r[r] : NULL);
    else { /* no sink: finish_row's 1/l (0 for l = 0) a vector at a time, the same bits */
        for (int u = 0; u < nvc; u++) s.alpha[u] = FN(v_select)((VU)(s.l[u] == 0), (VT){0}, 1 / s.l[u]);
        if (lse)
            for (int64_t r = 0; r < it->rows; r++) FN(finish_row)(m_s[r], l_s[r], -(T)INFINITY, &inv[r], &lse_r[r]);
    }
    for (int64_t e = 0; e < Ev; e++)
        for (int u = 0; u < nvc; u++) s.ot[e * FA_NV + u] *= s.alpha[u];
    int64_t o_off[BQ], lse_off[BQ];
    for (int64_t r = 0; r < rows; r++) o_off[r] = fa_out_offset(p, it, r, &lse_off[r]);
    for (int u = 0; u < nvc; u++) {
        const int64_t r0 = (int64_t)u * W, nr = rows - r0 < W ? rows - r0 : W;
        for (int64_t e0 = 0; e0 < ev_full; e0 += W) {
            VT x[W];
            for (int i = 0; i < W; i++) x[i] = s.ot[(e0 + i) * FA_NV + u];
            FN(v_transpose)(x);
            for (int64_t i = 0; i < nr; i++) FN(out_put)(p, it, o_off[r0 + i] + e0, (const T *)&x[i], W);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t e = ev_full; e < Ev; e++) FN(out_put)(p, it, o_off[r] + e, &ot_s[e * BQ + r], 1);
        if (lse) lse[lse_off[r]] = lse_r[r];
    }
}
#endif /* !FA_CONVERTS: the store */

static void FN(lanes_item)(const fa_plan *p, const fa_item *it, void *scratch) {
#if defined(FA_AMX_TILES)
    int64_t *call_state = (int64_t *)scratch; /* the call's first FA_ALIGN bytes: see amx_carve */
    scratch = (char *)scratch + FA_ALIGN;
#endif
    const fa_args *a = p->a;
    /* Sub-block g: rows g·BQ … of the item, and rows g·BQ … of its split-KV part. */
    FN(lanes_sub) subs[FA_SUBS];
    _Static_assert(FA_SUBS <= 32, "sub-blocks are marked done in an unsigned");
    const int n = (int)((it->rows + BQ - 1) / BQ); /* at most FA_SUBS: the plan's lane_rows */
    for (int g = 0; g < n; g++) {
        FN(lanes_sub) *u = &subs[g];
        u->it = *it;
        u->it.t0 = it->t0 + (int64_t)g * BQ;
        u->it.rows = it->rows - (int64_t)g * BQ < BQ ? it->rows - (int64_t)g * BQ : BQ;
        if (it->partial) u->it.partial = (T *)it->partial + (size_t)g * BQ * (size_t)(a->Ev + 1);
        u->s = FN(lanes_carve)(scratch, a->E, a->Ev, g);
        u->f = fa_item_rows(p, &u->it, u->lo, u->hi, u->q_row, u->m_row);
        u->nvc = (int)((u->it.rows + W - 1) / W); /* vectors of lanes in use */
        if (a->alibi_slopes || a->sinks) FN(item_mods)(p, &u->it, u->nvc * W, u->neg_slope, u->diag, u->sink);
    }
#if defined(FA_AMX_TILES)
    /* The tile buffers follow the lane layout's (amx_bytes); one sub-block here. */
    FN(amx_bufs) tiles;
    const FN(amx_bufs) *amx = NULL;
    if (FN(amx_usable)(p)) {
        tiles = FN(amx_carve)(call_state, (char *)scratch + FN(lanes_scratch_bytes)(a->E, a->Ev), a->E, a->Ev,
                              a->S);
        amx = &tiles;
        FN(amx_begin)();
        FN(amx_pack_q)(p, subs[0].q_row, subs[0].it.rows, subs[0].nvc, tiles.qv);
    } else
#else
    const void *amx = NULL;
#endif
#if defined(FA_DPBF16_SCORES)
    if (FN(dp_usable)(p)) FN(dp_pack_q)(p, subs[0].q_row, subs[0].it.rows, subs[0].nvc, subs[0].s.qt);
    else
#endif
        for (int g = 0; g < n; g++)
            CN(lanes_pack_q)(p, subs[g].q_row, subs[g].it.rows, subs[g].nvc, fa_item_channels(a, it), subs[g].s.qt);
    /* Sub-blocks whose first keys are a whole number of blocks apart run
     * together (causal, kv_lengths: all of them); a window can start each
     * one elsewhere, and then it runs on its own grid, as an item of its own
     * would. A sub-block that sees no key joins any group. */
    unsigned done = 0;
    for (int g0 = 0; g0 < n; g0++) {
        if (done >> g0 & 1u) continue;
        FN(lanes_sub) *group[FA_SUBS];
        int m = 0;
        const int empty0 = subs[g0].f.j_begin >= subs[g0].f.j_end;
        for (int g = g0; g < n; g++) {
            const int empty = subs[g].f.j_begin >= subs[g].f.j_end;
            if ((done >> g & 1u) ||
                !(g == g0 || empty || (!empty0 && (subs[g].f.j_begin - subs[g0].f.j_begin) % FA_BK == 0)))
                continue;
            group[m++] = &subs[g];
            done |= 1u << g;
        }
        FN(lanes_blocks)(p, it, group, m, amx);
    }
#if defined(FA_AMX_TILES)
    if (amx) _tile_release();
#endif
    for (int g = 0; g < n; g++)
        CN(lanes_store)(p, &subs[g].it, a->sinks && !it->partial ? subs[g].sink : NULL, subs[g].nvc, subs[g].s);
}

#undef TILE
#undef BQ
#undef FA_BY_WIDTH
