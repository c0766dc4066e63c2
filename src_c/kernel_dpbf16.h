/* kernel_dpbf16.h — the lane layout's scores with AVX512-BF16's VDPBF16PS,
 * for bfloat16 q and K. Included by kernel_lanes.h in the bfloat16
 * instantiation of kernels_avx512bf16.c only (FA_DPBF16_SCORES);
 * kernel_lanes.h calls it in place of converting K and running the float
 * score tile when dp_usable() says so. P·V, the softmax, masks, modifiers,
 * folds and the store are the lane layout's float32 code, unchanged.
 *
 * VDPBF16PS adds to each float32 lane the two products of a pair of
 * bfloat16: c[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1]. A bfloat16 product is
 * exact in float32, so this is the float32 sum of exact products, like the
 * float path on the same rounded inputs, in half the instructions: one
 * VDPBF16PS takes two elements of E where an FMA takes one (on AMD Zen 4,
 * one 512-bit VDPBF16PS a cycle, as many as 512-bit FMAs: twice the
 * multiply-adds). Like AMX it treats bfloat16 subnormals (below 2^-126) as 0.
 *
 *   Sᵀ[j][lane r] = scale · Σ_i K[j][2i..2i+1] · (q_r[2i], q_r[2i+1])
 *
 * Qᵀ is packed in pairs (qt2: E/2 rows of BQ 32-bit words, lane r holding
 * q_r's pair i as its raw bits), K's pairs are broadcast straight from the
 * caller's memory as 32-bit words: K is neither converted nor copied. The
 * scale multiplies the sums as the tile stores them (q is not scaled first:
 * q·scale would not be a bfloat16). Taken for bfloat16 q only (a float32 q
 * would lose its low bits) and an even E (whole pairs).
 */
#include <immintrin.h>

static int FN(dp_usable)(const fa_plan *p) {
    return p->q_dtype == FA_BF16 && p->a->E % 2 == 0;
}

/* qt2 := Qᵀ in pairs: word i of lane r = q_r[2i] | q_r[2i+1] << 16; lanes
 * past rows 0. Rows are read 32 elements (16 words) at a time and put in
 * lanes by a 16×16 transpose of words; the last E % 32 one word at a time. */
static void FN(dp_pack_q)(const fa_plan *p, const int64_t *q_row, int64_t rows, int nvc, VT *qt2) {
    const int64_t E2 = p->a->E / 2, e2_full = E2 / W * W;
    const uint16_t *q = (const uint16_t *)p->a->q;
    for (int u = 0; u < nvc; u++) {
        const int64_t r0 = (int64_t)u * W, nr = rows - r0 < W ? rows - r0 : W;
        for (int64_t i0 = 0; i0 < e2_full; i0 += W) {
            VT x[W];
            for (int i = 0; i < W; i++) {
                x[i] = (VT){0};
                if (i < nr) memcpy(&x[i], q + q_row[r0 + i] + 2 * i0, sizeof x[i]);
            }
            FN(v_transpose)(x); /* moves 32-bit lanes, whatever they hold */
            for (int i = 0; i < W; i++) qt2[(i0 + i) * FA_NV + u] = x[i];
        }
        for (int64_t i = e2_full; i < E2; i++) {
            uint32_t w[W] = {0};
            for (int64_t r = 0; r < nr; r++) memcpy(&w[r], q + q_row[r0 + r] + 2 * i, 4);
            memcpy(&qt2[i * FA_NV + u], w, sizeof w);
        }
    }
}

/* The score tile: MRC keys × NVC vectors of lanes, st rows FA_NV vectors apart. */
static inline __attribute__((always_inline)) void FN(dp_tile)(
    const int MRC, const int NVC, VT *restrict c, const uint16_t *restrict k, const int64_t k_rs,
    const VT *restrict b, const int64_t E2, const VT scale) {
    __m512 acc[FA_MR][FA_NV];
#pragma GCC unroll 16
    for (int r = 0; r < MRC; r++)
#pragma GCC unroll 8
        for (int u = 0; u < NVC; u++) acc[r][u] = _mm512_setzero_ps();
    for (int64_t i = 0; i < E2; i++) {
        const VT *b_i = b + i * FA_NV;
#pragma GCC unroll 16
        for (int r = 0; r < MRC; r++) {
            uint32_t pair;
            memcpy(&pair, k + r * k_rs + 2 * i, 4);
            const __m512bh a_ri = (__m512bh)_mm512_set1_epi32((int)pair);
#pragma GCC unroll 8
            for (int u = 0; u < NVC; u++) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], a_ri, (__m512bh)b_i[u]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MRC; r++)
#pragma GCC unroll 8
        for (int u = 0; u < NVC; u++) c[r * FA_NV + u] = (VT)acc[r][u] * scale;
}

/* Sᵀ rows [0, nb) of a block, from K's bfloat16 rows in place (prefetching
 * the next block's K rows into L2 for items of one vector, as scores_tile_n;
 * kv_rows does V's as it converts them). */
static inline __attribute__((always_inline)) void FN(dp_scores_n)(
    const int NVC, VT *st, const uint16_t *k, int64_t k_rs, const VT *qt2, int64_t E, int64_t nb, T scale) {
    const VT sc = FN(v_splat)(scale);
    const int64_t E2 = E / 2;
    int64_t j = 0;
    for (; j + FA_MR <= nb; j += FA_MR) {
        if (NVC == 1)
            for (int64_t i = j + FA_BK; i < j + FA_BK + FA_MR; i++)
                fa_prefetch_l2(k + i * k_rs, E * (int64_t)sizeof(*k));
        FN(dp_tile)(FA_MR, NVC, st + j * FA_NV, k + j * k_rs, k_rs, qt2, E2, sc);
    }
    switch (nb - j) {
#define FA_TAIL(n) case n: FN(dp_tile)(n, NVC, st + j * FA_NV, k + j * k_rs, k_rs, qt2, E2, sc); break;
        FA_TAILS
#undef FA_TAIL
    }
}

/* One instantiation per vectors of lanes in use, as scores_tile. */
static void FN(dp_scores)(int nvc, VT *st, const uint16_t *k, int64_t k_rs, const VT *qt2, int64_t E, int64_t nb,
                          T scale) {
    _Static_assert(FA_NV == 4, "one case per width below");
    switch (nvc) {
    case 1: FN(dp_scores_n)(1, st, k, k_rs, qt2, E, nb, scale); break;
    case 2: FN(dp_scores_n)(2, st, k, k_rs, qt2, E, nb, scale); break;
    case 3: FN(dp_scores_n)(3, st, k, k_rs, qt2, E, nb, scale); break;
    default: FN(dp_scores_n)(4, st, k, k_rs, qt2, E, nb, scale); break;
    }
}
