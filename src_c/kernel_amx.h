/* kernel_amx.h — the lane layout's two products on Intel AMX tiles, for
 * bfloat16 q, K, V and out. Included by kernel_dtype.h in the bfloat16
 * instantiation of kernels_amx.c only (FA_AMX_TILES); kernel_lanes.h calls
 * it in place of its float tiles when amx_usable() says so. Everything else
 * of an item (masks, modifiers, the online softmax, the folds, the store)
 * is the lane layout's own float32 code on the same buffers.
 *
 * A tile product C += A·B (TDPBF16PS) takes A as 16 rows of 32 bfloat16,
 * B as 16 rows of 16 bfloat16 pairs ("VNNI": B[k/2][2n + k%2] = B(k, n)) and
 * accumulates 16×16 float32 in C; every bf16×bf16 product is exact in float32.
 *   Scores  Sᵀ (keys × query lanes) = K · Qᵀ: A is K's rows read in place
 *           from the caller's memory, B is Qᵀ packed once per item (qv).
 *   Values  Oᵀ (Ev × query lanes) += Vᵀ · Pᵀ: A is the block's V transposed
 *           (a slot of vt), B is the block's probabilities in key pairs (pv).
 * The items of one (batch entry, K/V head) read the same key blocks, so
 * each thread keeps the blocks of V it transposed, in slots tagged with
 * the block (amx_tag), for the call: the next item of that head finds them.
 * Both results land in the lane layout's arrays (st, ot: a row of BQ floats),
 * so the float code after them is unchanged.
 *
 * Accuracy: the probabilities p ∈ [0, 1] are float32; one bfloat16 would
 * round each by up to 2^-9 relative. Each is split as p = hi + lo (both
 * bfloat16, |p − hi − lo| ≤ 2^-17·p; amx_softmax) and both halves are multiplied, so
 * P·V costs two tile products but keeps ~17 bits of every weight, under the
 * half-ulp of the bfloat16 output by far. That is also why this path is
 * taken only for a bfloat16 out (and bfloat16 q: a float32 q rounded to
 * bfloat16 would lose its low bits). AMX treats bfloat16 subnormals
 * (below 2^-126) as 0.
 */
#include <immintrin.h>

/* Slots of transposed V blocks a thread keeps, one per key block j0/FA_BK
 * of a head, for heads of up to FA_AMX_SLOTS blocks (16384 keys: 2 MiB
 * at Ev = 64). A longer head keeps its first blocks; the rest go through
 * one more slot, transposed at every visit (reusing slots in turn would
 * evict every block before the next item came back to it). */
#define FA_AMX_SLOTS 256

static int64_t FN(amx_slots)(int64_t S) {
    const int64_t blocks = S / FA_BK + 2; /* blocks may start anywhere: one more, and the spare */
    return blocks < FA_AMX_SLOTS + 1 ? blocks : FA_AMX_SLOTS + 1;
}

/* Which block a slot holds: its keys [j0, j0 + nb) of head (b, hk). */
typedef struct FN(amx_tag) {
    int64_t b, hk, j0, nb;
} FN(amx_tag);

/* One thread's tile buffers, after the lane layout's scratch. */
typedef struct FN(amx_bufs) {
    int64_t *ready;   /* 0 until the thread's first item of the call clears the tags */
    uint16_t *qv;     /* Qᵀ pairs: FA_NV blocks of E/2 rows × 16 lanes × 2 */
    uint16_t *pv_hi[2]; /* a block's P, high halves: FA_NV blocks of FA_BK/2 rows × 16 × 2; two blocks' */
    uint16_t *pv_lo[2]; /* and the low halves (see amx_values) */
    uint16_t *kpad;   /* the last keys of a block when fewer than 16: 16 rows × E, zero-filled */
    FN(amx_tag) *tags; /* slots: which block each holds */
    uint16_t *vt;     /* slots of a block's Vᵀ each: Ev rows × FA_BK keys */
    int64_t slots;
} FN(amx_bufs);

static size_t FN(amx_bytes)(int64_t E, int64_t Ev, int64_t S) {
    const size_t slots = (size_t)FN(amx_slots)(S);
    return FN(round_up)((size_t)FA_NV * E * 16 * 2) + 4 * FN(round_up)((size_t)FA_NV * FA_BK * 16 * 2) +
           FN(round_up)((size_t)16 * E * 2) + FN(round_up)(slots * sizeof(FN(amx_tag))) +
           slots * FN(round_up)((size_t)Ev * FA_BK * 2);
}

/* ready: the call's state at the scratch's start (zero when the thread's
 * first item starts, internal.h); p: after the lane layout's buffers. */
static FN(amx_bufs) FN(amx_carve)(int64_t *ready, char *p, int64_t E, int64_t Ev, int64_t S) {
    FN(amx_bufs) x;
    x.ready = ready;
    x.slots = FN(amx_slots)(S);
    x.qv = (uint16_t *)p;    p += FN(round_up)((size_t)FA_NV * E * 16 * 2);
    for (int h = 0; h < 2; h++) {
        x.pv_hi[h] = (uint16_t *)p; p += FN(round_up)((size_t)FA_NV * FA_BK * 16 * 2);
        x.pv_lo[h] = (uint16_t *)p; p += FN(round_up)((size_t)FA_NV * FA_BK * 16 * 2);
    }
    x.kpad = (uint16_t *)p;  p += FN(round_up)((size_t)16 * E * 2);
    x.tags = (FN(amx_tag) *)p; p += FN(round_up)((size_t)x.slots * sizeof(FN(amx_tag)));
    x.vt = (uint16_t *)p;
    if (!*x.ready) { /* no slot holds a block yet */
        for (int64_t i = 0; i < x.slots; i++) x.tags[i] = (FN(amx_tag)){-1, -1, -1, -1};
        *x.ready = 1;
    }
    return x;
}

/* The tiles take 32 elements of E and 16 of Ev at a time; other shapes and
 * dtypes take the float tiles. */
static int FN(amx_usable)(const fa_plan *p) {
    return p->q_dtype == FA_BF16 && p->out_dtype == FA_BF16 && p->a->E % 32 == 0 && p->a->Ev % 16 == 0;
}

/* Every tile 16 rows of 64 bytes: A (16 × 32 bf16), B (16 × 16 pairs), C (16 × 16 float). */
static void FN(amx_begin)(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* Sᵀ rows [0, nb) of a block := K·Qᵀ, unscaled (st: rows of BQ floats). Keys
 * go 16 to a tile, two key tiles against two lane blocks at a time (C in
 * tmm0–3, K in tmm4–5, Qᵀ in tmm6–7); a last tile of fewer than 16 keys is
 * copied into kpad first (a tile always reads 16 rows). */
static void FN(amx_scores)(const FN(amx_bufs) *x, VT *st, const uint16_t *k, int64_t k_rs, int64_t nb,
                           int64_t E, int nvc) {
    const int64_t groups = (nb + 15) / 16;
    const int64_t tail = nb % 16;
    if (tail) {
        memset(x->kpad, 0, (size_t)16 * E * 2);
        for (int64_t j = 0; j < tail; j++) memcpy(x->kpad + j * E, k + (nb - tail + j) * k_rs, (size_t)E * 2);
    }
    T *st_f = (T *)st;
    for (int64_t g = 0; g < groups; g += 2) {
        const int two_g = g + 1 < groups;
        const uint16_t *a0 = (tail && g == groups - 1) ? x->kpad : k + g * 16 * k_rs;
        const uint16_t *a1 = (tail && g + 1 == groups - 1) ? x->kpad : k + (g + 1) * 16 * k_rs;
        const int64_t s0 = a0 == x->kpad ? E * 2 : k_rs * 2, s1 = a1 == x->kpad ? E * 2 : k_rs * 2;
        for (int u = 0; u < nvc; u += 2) {
            const int two_u = u + 1 < nvc;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t e0 = 0; e0 < E; e0 += 32) {
                _tile_loadd(4, a0 + e0, s0);
                _tile_loadd(6, x->qv + u * E * 16 + e0 * 16, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two_u) {
                    _tile_loadd(7, x->qv + (u + 1) * E * 16 + e0 * 16, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two_g) {
                    _tile_loadd(5, a1 + e0, s1);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two_u) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, st_f + g * 16 * BQ + u * 16, BQ * 4);
            if (two_u) _tile_stored(1, st_f + g * 16 * BQ + (u + 1) * 16, BQ * 4);
            if (two_g) _tile_stored(2, st_f + (g + 1) * 16 * BQ + u * 16, BQ * 4);
            if (two_g && two_u) _tile_stored(3, st_f + (g + 1) * 16 * BQ + (u + 1) * 16, BQ * 4);
        }
    }
}

/* st rows [0, nb) := scale · st: natural units, for what adds to scores
 * (modifiers, an additive mask). Otherwise amx_softmax scales as it reads. */
static void FN(amx_scale)(VT *st, int64_t nb, int nvc, T scale) {
    const VT sc = FN(v_splat)(scale);
    for (int64_t j = 0; j < nb; j++)
        for (int u = 0; u < nvc; u++) st[j * FA_NV + u] *= sc;
}

/* x[0..16) := its transpose as a 16×16 matrix of 32-bit words: pairs of
 * rows interleaved by words, then by word pairs (a 4×4 transpose inside each
 * 128-bit lane), then the lanes moved by two lane shuffles. */
static inline void FN(amx_transpose16)(__m512i *x) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 4) {
        t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
        t[i + 2] = _mm512_unpacklo_epi32(x[i + 2], x[i + 3]);
        t[i + 3] = _mm512_unpackhi_epi32(x[i + 2], x[i + 3]);
        x[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        x[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        x[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        x[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* x[4g + c] lane L now holds column 4L + c of rows 4g … 4g+3 */
    for (int c = 0; c < 4; c++) {
        const __m512i a01 = _mm512_shuffle_i32x4(x[c], x[4 + c], 0x44), a23 = _mm512_shuffle_i32x4(x[c], x[4 + c], 0xEE);
        const __m512i b01 = _mm512_shuffle_i32x4(x[8 + c], x[12 + c], 0x44),
                      b23 = _mm512_shuffle_i32x4(x[8 + c], x[12 + c], 0xEE);
        t[c] = _mm512_shuffle_i32x4(a01, b01, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(a01, b01, 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(a23, b23, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(a23, b23, 0xDD);
    }
    for (int i = 0; i < 16; i++) x[i] = t[i];
}

/* qv := Qᵀ in pairs, query row r in lane r % 16 of block r / 16; lanes past
 * rows are 0. The raw bfloat16 bits: scale is applied to the scores. A pair
 * (q[2i], q[2i+1]) is one 32-bit word, so 16 rows × 32 elements is a 16×16
 * transpose of words. */
static void FN(amx_pack_q)(const fa_plan *p, const int64_t *q_row, int64_t rows, int nvc, uint16_t *qv) {
    const int64_t E = p->a->E;
    const uint16_t *q = (const uint16_t *)p->a->q;
    for (int u = 0; u < nvc; u++)
        for (int64_t e0 = 0; e0 < E; e0 += 32) {
            __m512i w[16];
            for (int i = 0; i < 16; i++)
                w[i] = u * 16 + i < rows ? _mm512_loadu_si512(q + q_row[u * 16 + i] + e0) : _mm512_setzero_si512();
            FN(amx_transpose16)(w);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(qv + u * E * 16 + (e0 / 2 + i) * 32, w[i]);
        }
}

/* Word indices that interleave the two 256-bit halves of a vector: element
 * 2c is the low half's c, 2c + 1 the high half's c. */
static inline __m512i FN(amx_interleave_idx)(void) {
    static const uint16_t idx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_loadu_si512(idx);
}

/* vt := the block's Vᵀ (Ev rows × FA_BK keys), keys past nb 0 up to a
 * multiple of 32. Key pairs (2m, 2m + 1) interleaved are 32-bit words
 * (V[2m][e], V[2m+1][e]); transposed as words, row e lists its keys in order. */
static void FN(amx_pack_v)(uint16_t *vt, const uint16_t *v, int64_t v_rs, int64_t nb, int64_t Ev) {
    const __m512i idx = FN(amx_interleave_idx)();
    const int64_t nb32 = (nb + 31) / 32 * 32;
    for (int64_t j0 = 0; j0 < nb32; j0 += 32)
        for (int64_t e0 = 0; e0 < Ev; e0 += 16) {
            __m512i w[16];
            for (int m = 0; m < 16; m++) {
                const int64_t j = j0 + 2 * m;
                const __m256i r0 = j < nb ? _mm256_loadu_si256((const __m256i *)(v + j * v_rs + e0)) : _mm256_setzero_si256();
                const __m256i r1 = j + 1 < nb ? _mm256_loadu_si256((const __m256i *)(v + (j + 1) * v_rs + e0))
                                              : _mm256_setzero_si256();
                w[m] = _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1));
            }
            FN(amx_transpose16)(w);
            for (int e = 0; e < 16; e++) _mm512_storeu_si512(vt + (e0 + e) * FA_BK + j0, w[e]);
        }
}

/* One pair of keys' probabilities into pv_hi, pv_lo (see amx_softmax). */
static inline __attribute__((always_inline)) void FN(amx_put_pair)(VT p0, VT p1, __m512i idx, __m512i top,
                                                                   uint16_t *hi_dst, uint16_t *lo_dst) {
    const __m512i hi = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0));
    const __m512 r0 = (__m512)p0 - (__m512)_mm512_slli_epi32(hi, 16);
    const __m512 r1 = (__m512)p1 - (__m512)_mm512_and_si512(hi, top);
    /* (r1 & top) | (r0 >> 16): imm 0xE4 picks A where C is set, else B */
    const __m512i lo = _mm512_ternarylogic_epi32((__m512i)r1, _mm512_srli_epi32((__m512i)r0, 16), top, 0xE4);
    _mm512_storeu_si512(hi_dst, hi);
    _mm512_storeu_si512(lo_dst, lo);
}

/* The exponents and the pairs of one lane block; natural: the scores are
 * in natural units already (see amx_softmax), a constant where inlined. */
static inline __attribute__((always_inline)) VT FN(amx_exp_pairs)(const int natural, const VT *st, int u,
                                                                  int64_t nb, VT c, VT d, VT m_sub,
                                                                  uint16_t *hi_u, uint16_t *lo_u) {
    const __m512i idx = FN(amx_interleave_idx)(), top = _mm512_set1_epi32((int)0xffff0000u);
    const T log2e = (T)1.4426950408889634074;
    const int64_t pairs = (nb + 31) / 32 * 16, full = nb / 2;
    VT sum0 = {0}, sum1 = {0};
#define FA_AMX_X(s_) (natural ? ((s_) - m_sub) * log2e : (s_) * c - d)
    int64_t i = 0;
    for (; i < full; i++) {
        const VT p0 = FN(v_exp2)(FA_AMX_X(st[2 * i * FA_NV + u]));
        const VT p1 = FN(v_exp2)(FA_AMX_X(st[(2 * i + 1) * FA_NV + u]));
        sum0 += p0;
        sum1 += p1;
        FN(amx_put_pair)(p0, p1, idx, top, hi_u + i * 32, lo_u + i * 32);
    }
    for (; i < pairs; i++) { /* the odd last key, then zeros up to a multiple of 32 keys */
        const VT p0 = 2 * i < nb ? FN(v_exp2)(FA_AMX_X(st[2 * i * FA_NV + u])) : (VT){0};
        sum0 += p0;
        FN(amx_put_pair)(p0, (VT){0}, idx, top, hi_u + i * 32, lo_u + i * 32);
    }
#undef FA_AMX_X
    return sum0 + sum1;
}

/* How far (natural units) a block's max may pass the reference m before m
 * moves: p = e^(s − m) is then at most e^8 ≈ 2981, far inside float32 and
 * exp2's range (x ≤ 127), and hi + lo keep the same relative precision at
 * any magnitude. Σ p·v / Σ p is the same quotient whatever m (the factor
 * e^(max − m) cancels), and lse = m + ln l. */
#define FA_AMX_LAG 8

/* The lane layout's online softmax (softmax_block) on scores st · scale,
 * writing the probabilities straight into pv_hi, pv_lo as key pairs (rows
 * past nb 0, up to a multiple of 32) instead of back into st:
 *     c = scale · max_j st_j,  m' = c if c > m + FA_AMX_LAG else m,
 *     alpha = 2^((m − m')·log2 e)
 *     p_j = 2^((scale · st_j − m')·log2 e),   l' = l·alpha + Σ_j p_j
 * (scale > 0 commutes with the max, rounding included). The exponent is one
 * FMA on raw scores, s·c − d with c = scale·log2 e, d = m'·log2 e: the
 * rounding of d is common to the block's p and cancels in Σ p·v / Σ p.
 * Scores already in natural units (scale 1: an additive mask may hold
 * finfo.min, whose ·log2 e would overflow) subtract first, as softmax_block.
 * Each pair of keys (rows 2i, 2i + 1) becomes one vector of 32-bit words
 * (p_2i, p_2i+1):
 *     hi = both rounded to bfloat16 (ties to even), interleaved;
 *     lo = the remainders p − hi, exact in float32 (Sterbenz: hi is within
 *          2^-9 of p), cut to their top 16 bits (error ≤ 2^-8·|p − hi|),
 * so |p − hi − lo| ≤ 2^-17·p. The hi words, read as floats, give back
 * hi itself: the high half of a word is hi(p_2i+1), the low half shifted up
 * hi(p_2i). */
static void FN(amx_softmax)(const FN(amx_bufs) *x, int set, int nvc, const VT *st, int64_t nb, VT *m, VT *l,
                            VT *alpha, T scale) {
    const VT neg_inf = FN(v_splat)(-(T)INFINITY), sc = FN(v_splat)(scale);
    const T log2e = (T)1.4426950408889634074;
    for (int u = 0; u < nvc; u++) {
        VT m4[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
        int64_t j = 0;
        for (; j + 4 <= nb; j += 4)
            for (int i = 0; i < 4; i++) m4[i] = FN(v_max)(m4[i], st[(j + i) * FA_NV + u]);
        for (; j < nb; j++) m4[0] = FN(v_max)(m4[0], st[j * FA_NV + u]);
        const VT cand = FN(v_max)(FN(v_max)(m4[0], m4[1]), FN(v_max)(m4[2], m4[3])) * sc;
        /* Lazy reference: m moves only where the block's max passes it by
         * more than FA_AMX_LAG (and from −inf), so most blocks keep alpha = 1
         * in every lane and amx_values skips rescaling Oᵀ. p ≤ e^FA_AMX_LAG. */
        const VT m_new = FN(v_select)((VU)(cand > m[u] + FN(v_splat)(FA_AMX_LAG)), cand, m[u]);
        const VT m_sub = FN(v_select)((VU)(m_new == neg_inf), FN(v_splat)(0), m_new);
        uint16_t *hi_u = x->pv_hi[set] + u * FA_BK / 2 * 32, *lo_u = x->pv_lo[set] + u * FA_BK / 2 * 32;
        const VT sum = scale == 1 ? FN(amx_exp_pairs)(1, st, u, nb, sc, m_sub, m_sub, hi_u, lo_u)
                                  : FN(amx_exp_pairs)(0, st, u, nb, sc * log2e, m_sub * log2e, m_sub, hi_u, lo_u);
        alpha[u] = FN(v_exp2)((m[u] - m_sub) * log2e);
        l[u] = l[u] * alpha[u] + sum;
        m[u] = m_new;
    }
}

/* The slot that holds (or will hold) the block at j0: the last is the spare. */
static int64_t FN(amx_slot)(const FN(amx_bufs) *x, int64_t j0) {
    return j0 / FA_BK < x->slots - 1 ? j0 / FA_BK : x->slots - 1;
}

/* One key block of P·V: its first key, its keys, and which of the two P
 * buffers amx_softmax wrote it into. */
typedef struct FN(amx_block) {
    int64_t j0, nb;
    int set;
} FN(amx_block);

/* Oᵀ := Oᵀ·alpha + Vᵀ·Pᵀ over the keys of n (1 or 2) consecutive key blocks
 * (alpha NULL: Oᵀ := Vᵀ·Pᵀ), P from amx_softmax; two blocks only where the
 * second's alpha would leave Oᵀ as it is (see lanes_blocks) and they use
 * different slots.
 * The old Oᵀ is rescaled in place and loaded as the accumulator; two Ev
 * tiles against two lane blocks at a time (C tmm0–3, Vᵀ tmm4–5, P tmm6–7).
 * The tile products add the blocks' key chunks in order into C, which is
 * loaded and stored exactly, so two blocks at once give the bits of two
 * calls; they halve the loads and stores of C, and the wait for each C's
 * last product before its store: on the amx set, a second call per block
 * had cost bfloat16 1×8×1024×1024×128 0.35 of its time, twice the products
 * in one call 0.24 (docs/tuning.md, "Stop 37"). */
static void FN(amx_values)(const FN(amx_bufs) *x, VT *ot, const fa_item *it, const uint16_t *v, int64_t v_rs,
                           const FN(amx_block) *blk, int n, int64_t Ev, int nvc, const VT *alpha) {
    const uint16_t *vts[2];
    int64_t chunks[2];
    for (int b = 0; b < n; b++) {
        const int64_t j0 = blk[b].j0, nb = blk[b].nb, slot = FN(amx_slot)(x, j0);
        FN(amx_tag) *tag = &x->tags[slot];
        uint16_t *vt = x->vt + slot * (FN(round_up)((size_t)Ev * FA_BK * 2) / 2);
        if (tag->b != it->b || tag->hk != it->hk || tag->j0 != j0 || tag->nb != nb) {
            FN(amx_pack_v)(vt, v + j0 * v_rs, v_rs, nb, Ev);
            *tag = (FN(amx_tag)){it->b, it->hk, j0, nb};
        }
        vts[b] = vt;
        chunks[b] = (nb + 31) / 32;
    }
    /* alpha is exactly 1 in every lane whose max did not move: most blocks past the first few */
    for (int u = 0; alpha && u < nvc; u++)
        if (_mm512_cmp_ps_mask((__m512)alpha[u], _mm512_set1_ps(1), _CMP_NEQ_UQ))
            for (int64_t e = 0; e < Ev; e++) ot[e * FA_NV + u] *= alpha[u];
    T *ot_f = (T *)ot;
    const int64_t groups = Ev / 16;
    for (int64_t g = 0; g < groups; g += 2) {
        const int two_g = g + 1 < groups;
        for (int u = 0; u < nvc; u += 2) {
            const int two_u = u + 1 < nvc;
            T *c0 = ot_f + g * 16 * BQ + u * 16, *c2 = c0 + 16 * BQ;
            if (alpha) {
                _tile_loadd(0, c0, BQ * 4);
                if (two_u) _tile_loadd(1, c0 + 16, BQ * 4);
                if (two_g) _tile_loadd(2, c2, BQ * 4);
                if (two_g && two_u) _tile_loadd(3, c2 + 16, BQ * 4);
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int b = 0; b < n; b++)
                for (int64_t c = 0; c < chunks[b]; c++) {
                    const uint16_t *halves[2] = {x->pv_hi[blk[b].set], x->pv_lo[blk[b].set]};
                    _tile_loadd(4, vts[b] + g * 16 * FA_BK + c * 32, FA_BK * 2);
                    if (two_g) _tile_loadd(5, vts[b] + (g + 1) * 16 * FA_BK + c * 32, FA_BK * 2);
                    for (int h = 0; h < 2; h++) {
                        _tile_loadd(6, halves[h] + (u * FA_BK / 2 + c * 16) * 32, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (two_g) _tile_dpbf16ps(2, 5, 6);
                        if (two_u) {
                            _tile_loadd(7, halves[h] + ((u + 1) * FA_BK / 2 + c * 16) * 32, 64);
                            _tile_dpbf16ps(1, 4, 7);
                            if (two_g) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                }
            _tile_stored(0, c0, BQ * 4);
            if (two_u) _tile_stored(1, c0 + 16, BQ * 4);
            if (two_g) _tile_stored(2, c2, BQ * 4);
            if (two_g && two_u) _tile_stored(3, c2 + 16, BQ * 4);
        }
    }
}
