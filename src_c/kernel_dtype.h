/* kernel_dtype.h — every kernel of one element type in one ISA, and its
 * table entry (kernel<FA_SFX>). Included by kernel_isa.h once per dtype,
 * with FA_T, FA_SFX, FA_TU, FA_MANT, FA_VBYTES, FA_LOG and FA_EXP defined
 * (see vec.h); undefines them at the end. Owns what both item layouts share:
 * scratch rounding, the score modifiers and masks on a key block, and a
 * row's finishing step. Scores are in natural units (Q packed as Q·scale);
 * the softmax takes 2^((s − m)·log2 e), so a huge finite mask value (a
 * padding mask of finfo.min) stays finite and equal scores stay equal.
 */
#include "vec.h"

static inline size_t FN(round_up)(size_t n) {
    return (n + FA_ALIGN - 1) / FA_ALIGN * FA_ALIGN;
}

/* ---- K and V storage (KV), loaded as T ----
 * FA_KV_F16 / FA_KV_BF16: 16-bit codes; FA_KV_I8: int8 times a per-row
 * scale (applied by the callers); else KV is T. FA_CONVERTS: KV is not T. */
#if defined(FA_KV_F16) || defined(FA_KV_BF16)
typedef uint16_t FN(kv_t);
#define FA_CONVERTS 1
#elif defined(FA_KV_I8)
typedef int8_t FN(kv_t);
#define FA_CONVERTS 1
#else
typedef T FN(kv_t);
#define FA_CONVERTS 0
#endif
#define KV FN(kv_t)

/* Compute-only code (the lane layout's tiles, softmax, packing, store)
 * depends on T alone: a converting storage calls the float32 set's. */
#if FA_CONVERTS
#define CN(x) FA_CAT(x, _f32)
#else
#define CN(x) FN(x)
#endif

/* One element. */
static inline T FN(kv_at)(const KV *p) {
#if defined(FA_KV_F16)
    return fa_f16_to_f32(*p);
#elif defined(FA_KV_BF16)
    return fa_bf16_to_f32(*p);
#else
    return (T)*p;
#endif
}

#if FA_CONVERTS
/* W lanes of storage, widened: 16-bit codes to 32-bit lanes, int8 to T. */
typedef KV FN(kv_vec) __attribute__((vector_size(FA_WPP * sizeof(KV))));
#endif

#if FA_MANT == 23
/* W 16-bit codes as floats, exactly (the values of convert.h's functions):
 * float16 (bf16 = 0) or bfloat16 (bf16 = 1, a constant wherever it is
 * inlined). K and V storage and 16-bit q load through here. F16C, AVX-512
 * and NEON convert float16 in one instruction; bfloat16 zero-extends from
 * memory and shifts into the high half (GCC 12 spells the generic widening
 * as two 128-bit halves and an insert, six instructions a ymm where these
 * are two: docs/tuning.md); elsewhere the same arithmetic lane-wise. */
typedef uint16_t FN(h16_vec) __attribute__((vector_size(FA_WPP * sizeof(uint16_t))));
static inline __attribute__((always_inline)) VT FN(h16_load)(const uint16_t *p, const int bf16) {
    if (bf16) {
#if FA_VBYTES == 64 && defined(__AVX512F__)
        return (VT)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif FA_VBYTES == 32 && defined(__AVX2__)
        return (VT)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
        FN(h16_vec) x;
        memcpy(&x, p, sizeof x);
        return (VT)(__builtin_convertvector(x, VU) << 16);
#endif
    }
#if FA_VBYTES == 64 && defined(__AVX512F__)
    return (VT)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif FA_VBYTES == 32 && defined(__F16C__)
    return (VT)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#elif FA_VBYTES == 16 && defined(__aarch64__)
    float16x4_t h;
    memcpy(&h, p, sizeof h);
    return (VT)vcvt_f32_f16(h);
#else
    /* binary16 → float as in convert.h: magnitude bits times 2^112, or the
     * all-ones exponent for inf and NaN */
    FN(h16_vec) x;
    memcpy(&x, p, sizeof x);
    const VU h = __builtin_convertvector(x, VU);
    const VU sign = (h & 0x8000u) << 16, mag = (h & 0x7fffu) << 13;
    const VU scaled = (VU)((VT)mag * 0x1p112f);
    const VU special = (VU)((h & 0x7c00u) == 0x7c00u);
    return (VT)(sign | (special & (mag | 0x7f800000u)) | (~special & scaled));
#endif
}
#endif

/* W elements (whole vector), as T. */
static inline VT FN(kv_load)(const KV *p) {
#if !FA_CONVERTS
    return FN(v_loadu)(p);
#elif defined(FA_KV_F16)
    return FN(h16_load)(p, 0);
#elif defined(FA_KV_BF16)
    return FN(h16_load)(p, 1);
/* int8: sign-extend to 32 bits, then convert (GCC 12 scalarises a direct
 * __builtin_convertvector from int8 lanes, so each ISA spells it out). */
#elif defined(FA_KV_I8) && FA_VBYTES == 64 && defined(__AVX512F__)
    return (VT)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(FA_KV_I8) && FA_VBYTES == 32 && defined(__AVX2__)
    return (VT)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#elif defined(FA_KV_I8) && FA_VBYTES == 16 && defined(__SSE2__)
    int32_t four;
    memcpy(&four, p, 4);
    __m128i x = _mm_cvtsi32_si128(four);
    x = _mm_unpacklo_epi8(x, x);                      /* each byte twice */
    x = _mm_srai_epi32(_mm_unpacklo_epi16(x, x), 24); /* four times, then sign-extended */
    return (VT)_mm_cvtepi32_ps(x);
#elif defined(FA_KV_I8) && FA_VBYTES == 16 && defined(__aarch64__)
    int8x8_t b = vdup_n_s8(0);
    memcpy(&b, p, 4);  /* the low four lanes hold the elements */
    return (VT)vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(b))));
#else
    FN(kv_vec) x;
    memcpy(&x, p, sizeof x);
    return __builtin_convertvector(x, VT);
#endif
}

/* 2W bfloat16 elements (two whole vectors) at p, as T, in pair order: read
 * as W 32-bit words, element 2i is word i's low half and 2i+1 its high half
 * (little-endian), so a = words << 16 holds the even elements and
 * b = words & 0xffff0000 the odd ones, exactly: one instruction a vector
 * where kv_load's zero-extension and shift take two (the zero-extension a
 * shuffle). The row layout keeps q and o in the same order (kernel_rows.h). */
#if defined(FA_KV_BF16) && FA_MANT == 23 && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define FA_KV_PAIRS 1
static inline __attribute__((always_inline)) void FN(kv_pair)(const KV *p, VT *a, VT *b) {
    VU words;
    memcpy(&words, p, sizeof words);
    *a = (VT)(words << 16);
    *b = (VT)(words & 0xffff0000u);
}
#else
#define FA_KV_PAIRS 0
#endif

/* The first n < W elements, the rest 0 (never reads past p[n-1]). */
static inline VT FN(kv_load_part)(const KV *p, int n) {
    VT v = {0};
    for (int u = 0; u < n; u++) v[u] = FN(kv_at)(p + u);
    return v;
}

#if FA_CONVERTS
/* dst rows (stride d_rs) := n rows of cols elements from src (stride s_rs),
 * converted; int8 rows times their scale (scale[j·sc_rs]). The lane layout
 * converts each key block into L1 this way, then runs the float tiles on it.
 * prefetch: ask for the next block's rows (FA_BK on) into L2 as it goes, as
 * scores_tile_n does for float storage (items of one vector of rows). */
static void FN(kv_rows)(T *dst, int64_t d_rs, const KV *src, int64_t s_rs, int64_t n, int64_t cols,
                        const float *scale, int64_t sc_rs, int prefetch) {
    const int64_t full = cols / W * W;
    for (int64_t j = 0; j < n; j++) {
        const KV *s = src + j * s_rs;
        if (prefetch) fa_prefetch_l2(s + FA_BK * s_rs, cols * (int64_t)sizeof(KV));
        T *d = dst + j * d_rs;
#if defined(FA_KV_I8)
        const VT sc = FN(v_splat)(scale[j * sc_rs]);
#else
        const VT sc = FN(v_splat)(1);
        (void)scale;
        (void)sc_rs;
#endif
        for (int64_t e = 0; e < full; e += W) {
            const VT x = FN(kv_load)(s + e) * sc;
            memcpy(d + e, &x, sizeof x);
        }
        for (int64_t e = full; e < cols; e++) d[e] = FN(kv_at)(s + e) * sc[0];
    }
}
#endif

/* ---- q and out in their own dtypes (fa_plan's q_dtype, out_dtype) ---- */

/* q[off + u], u < n ≤ W, as T; lanes past n 0. */
static inline VT FN(q_load)(const fa_plan *p, int64_t off, int n) {
    if (p->q_dtype == FA_F16 || p->q_dtype == FA_BF16) {
        const uint16_t *q = (const uint16_t *)p->a->q + off;
#if FA_MANT == 23
        if (n == W) return FN(h16_load)(q, p->q_dtype == FA_BF16);
#endif
        VT v = {0};
        for (int u = 0; u < n; u++) v[u] = p->q_dtype == FA_F16 ? fa_f16_to_f32(q[u]) : fa_bf16_to_f32(q[u]);
        return v;
    }
    const T *q = (const T *)p->a->q + off;
    if (n == W) return FN(v_loadu)(q);
    VT v = {0};
    for (int u = 0; u < n; u++) v[u] = q[u];
    return v;
}

/* A query row's packed elements q[off + u] · scale, times the int8 keys'
 * per-channel factors ch[u] when given (NULL: none), u < n ≤ W, lanes past
 * n 0. The fold: s_j = Σ_e (q_e·c_e)·k8_je·t_j, so the key loop is plain
 * per-token int8 whatever c is. */
static inline VT FN(q_scaled)(const fa_plan *p, int64_t off, int n, const float *ch) {
    VT x = FN(q_load)(p, off, n) * (T)p->scale;
    if (ch) {
        VT c = {0};
        for (int u = 0; u < n; u++) c[u] = (T)ch[u];
        x *= c;
    }
    return x;
}

/* n values to the item's output at element offset off: its split-KV part
 * (T), or the caller's out in out_dtype, rounded once (ties to even). */
static inline void FN(out_put)(const fa_plan *p, const fa_item *it, int64_t off, const T *vals, int64_t n) {
    if (it->partial) {
        memcpy((T *)it->partial + off, vals, (size_t)n * sizeof(T));
    } else if (p->out_dtype == FA_F16) {
        uint16_t *o = (uint16_t *)p->a->out + off;
        int64_t e = 0;
        /* whole vectors: F16C / AVX-512 round to nearest even, the bits of fa_f32_to_f16 */
#if FA_MANT == 23 && FA_VBYTES == 64 && defined(__AVX512F__)
        for (; e + W <= n; e += W)
            _mm256_storeu_si256((__m256i *)(o + e), _mm512_cvtps_ph((__m512)FN(v_loadu)(vals + e), _MM_FROUND_TO_NEAREST_INT));
#elif FA_MANT == 23 && FA_VBYTES == 32 && defined(__F16C__)
        for (; e + W <= n; e += W)
            _mm_storeu_si128((__m128i *)(o + e), _mm256_cvtps_ph((__m256)FN(v_loadu)(vals + e), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; e < n; e++) o[e] = fa_f32_to_f16((float)vals[e]);
    } else if (p->out_dtype == FA_BF16) {
        uint16_t *o = (uint16_t *)p->a->out + off;
        int64_t e = 0;
#if FA_MANT == 23
        /* whole vectors: fa_f32_to_bf16 lane-wise, the same bits */
        typedef uint16_t half_vec __attribute__((vector_size(FA_VBYTES / 2)));
        for (; e + W <= n; e += W) {
            VU u;
            memcpy(&u, vals + e, sizeof u);
            const VU nan = (u & 0x7fffffffu) > 0x7f800000u;
            const VU r = (nan & ((u >> 16) | 0x40u)) | (~nan & ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16));
            const half_vec h = __builtin_convertvector(r, half_vec);
            memcpy(o + e, &h, sizeof h);
        }
#endif
        for (; e < n; e++) o[e] = fa_f32_to_bf16((float)vals[e]);
    } else {
        memcpy((T *)p->a->out + off, vals, (size_t)n * sizeof(T));
    }
}

/* Structural visibility on a boundary block: key j0+j is visible to row r iff
 * lo[r] ≤ j0+j ≤ hi[r]. Score (r, j) of the block is st[r·rs + j·js]. */
static void FN(mask_ranges)(T *st, int64_t rs, int64_t js, int64_t j0, int64_t nb, int64_t rows,
                            const int64_t *lo, const int64_t *hi) {
    for (int64_t j = 0; j < nb; j++)
        for (int64_t r = 0; r < rows; r++)
            if (j0 + j < lo[r] || j0 + j > hi[r]) st[r * rs + j * js] = -(T)INFINITY;
}

/* The caller's mask on one block: bool (0 hides) or additive. m_row[r] is
 * row r's element offset, j0 the first key. */
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
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < nb; j++) st[r * rs + j * js] += mk[m_row[r] + j * m_cs];
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

/* softcap on nv whole vectors of scores: s := c·tanh(s/c). With
 *     w = e^(−2|y|) = 2^(|s|·k),  u = w − 1,  k = −2·log2 e / c,  d = 2 + u = 1 + w
 * (both from v_exp2m1_pair's one range reduction, u without cancellation):
 *     tanh|y| = −u / d          where tanh|y| < 1/2 (w > 1/3)
 *     tanh|y| = 1 − 2w / d      elsewhere
 * and the sign put back. The second form matters because a capped softmax's
 * weight sits on its largest scores, near ±c: there −u/d amplifies u's
 * rounding twofold (d → 1), while 2w/d is small and carries its error
 * scaled down. Large |s| gives ±c exactly; NaN stays NaN. Measured maximum
 * error against c·tanh(s/c) in long double over |s/c| ≤ 20 (6·10⁵ points,
 * every ISA): 4.02 ulp (float) and 3.84 ulp (double), near |s/c| ~ 10⁻⁵
 * where the argument's rounding dominates; over |s/c| ≥ 1, 1.47 and 1.45 ulp
 * (2.74 and 2.78 with −u/d alone). tests/test_modifiers.py holds them to 4.5
 * and 1.75. */
static inline void FN(softcap_vectors)(VT *x, int64_t nv, T c) {
    const T k = (T)(-2 * 1.4426950408889634074) / c;
    const VU sign = (VU)FN(v_splat)(-(T)0);
    const VT third = FN(v_splat)((T)1 / 3);
    for (int64_t u = 0; u < nv; u++) {
        VT w;
        const VT em = FN(v_exp2m1_pair)(FN(v_abs)(x[u]) * k, &w);
        const VU near_one = (VU)(w < third);
        const VT q = FN(v_select)(near_one, w + w, -em) / (2 + em);
        const VT t = FN(v_select)(near_one, 1 - q, q);
        x[u] = (VT)((VU)(c * t) | ((VU)x[u] & sign));
    }
}

/* Per-row modifier inputs of an item, for its first n_lanes rows (rows past
 * it->rows get no slope and no sink): the ALiBi slope negated, the row's
 * diagonal d(i), and the sink logit (−inf: none; a split-KV part never takes
 * the sink, the merge adds it once). */
static void FN(item_mods)(const fa_plan *p, const fa_item *it, int64_t n_lanes, T *neg_slope,
                          int64_t *diag, T *sink) {
    const fa_args *a = p->a;
    for (int64_t r = 0; r < n_lanes; r++) {
        neg_slope[r] = 0;
        diag[r] = 0;
        sink[r] = -(T)INFINITY;
        if (r >= it->rows) continue;
        int64_t h, i;
        fa_row_at(p, it, r, &h, &i);
        diag[r] = fa_row_diagonal(a, it->b, i);
        if (a->alibi_slopes)
            neg_slope[r] = -(T)a->alibi_slopes[it->b * a->alibi_stride[0] + h * a->alibi_stride[1]];
        if (a->sinks && !it->partial) sink[r] = (T)a->sinks[h];
    }
}

/* A row's finishing step, from its running max m and sum l (Σ 2^((s−m)·log2 e)):
 *     out = o · (1/l),   lse = m + ln l
 * A row with no visible key has l = 0: 1/l becomes 0 (o is 0 too) and lse −inf.
 * With a sink logit σ the denominator gains e^σ, taken against t = max(m, σ):
 *     out = o · e^(m−t) / (l·e^(m−t) + e^(σ−t)),   lse = t + ln(l·e^(m−t) + e^(σ−t))
 * so a row with no visible key gets 0 and lse σ. */
static inline void FN(finish_row)(T m, T l, T sink, T *inv, T *lse /* NULL: not wanted */) {
    if (sink == -(T)INFINITY) {
        *inv = l == 0 ? 0 : 1 / l;
        if (lse) *lse = l == 0 ? -(T)INFINITY : m + FA_LOG(l);
        return;
    }
    const T t = m > sink ? m : sink, e_m = FA_EXP(m - t), denom = l * e_m + FA_EXP(sink - t);
    *inv = e_m / denom;
    if (lse) *lse = t + FA_LOG(denom);
}

/* Where an item writes its lse: the caller's, or its split-KV part's. */
static inline T *FN(item_lse)(const fa_item *it, const fa_args *a) {
    return it->partial ? (T *)it->partial : (T *)a->lse;
}

/* kernels_amx.c's bfloat16 entry: the lane layout's products on AMX tiles. */
#if defined(FA_AMX) && defined(FA_KV_BF16)
#define FA_AMX_TILES 1
#endif
/* kernels_avx512bf16.c's bfloat16 entry: the lane layout's scores on VDPBF16PS. */
#if defined(FA_DPBF16) && defined(FA_KV_BF16)
#define FA_DPBF16_SCORES 1
#endif

#include "kernel_lanes.h"
#include "kernel_rows.h"

static size_t FN(scratch_bytes)(int64_t E, int64_t Ev, int64_t S) {
    size_t lanes = FN(lanes_scratch_bytes)(E, Ev), rows = FN(rows_scratch_bytes)(E, Ev);
#if defined(FA_AMX_TILES)
    lanes += FA_ALIGN + FN(amx_bytes)(E, Ev, S); /* a call's state first, the tiles' after the lane layout's */
#else
    (void)S;
#endif
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

/* y = c·tanh(x/c) through the kernel's own softcap, for the accuracy test. */
static void FN(softcap_array)(const void *xp, void *yp, int64_t n, double c) {
    const T *x = (const T *)xp;
    T *y = (T *)yp;
    for (int64_t i = 0; i < n; i += W) {
        VT v = FN(v_splat)(0);
        for (int u = 0; u < W && i + u < n; u++) v[u] = x[i + u];
        FN(softcap_vectors)(&v, 1, (T)c);
        for (int u = 0; u < W && i + u < n; u++) y[i + u] = v[u];
    }
}

static const fa_kernel FN(kernel) = {
    FA_SUBS * FA_NV * W,  /* lane_rows: FA_SUBS blocks of FA_NV vectors of rows (kernel_lanes.h) */
    FA_NV * W,  /* lane_block */
    W / 2,      /* rows_auto: half a vector or less (measured per ISA: docs/tuning.md) */
    FA_BK,
    FN(scratch_bytes),
    FN(lanes_item),
    FN(rows_item),
    FN(exp2_array),
    FN(softcap_array),
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
#undef FA_EXP
#undef FA_WPP
#undef KV
#undef FA_CONVERTS
#undef FA_KV_PAIRS
#undef CN
#undef FA_AMX_TILES
#undef FA_DPBF16_SCORES
#undef FA_SUBS
#undef FA_SUB_ROWS
