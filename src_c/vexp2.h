/* vexp2.h — 2^x on a vector, for softmax (x ≤ 0 there; valid for x ≤ 127).
 *
 * Method: n = round(x), f = x − n ∈ [−½, ½], 2^x = 2^n · 2^f.
 *   round: adding 1.5·2^MANT pushes f's bits out of the mantissa, so the sum
 *          is n exactly and its low mantissa bits hold n (two's complement);
 *   2^f:   Taylor series of e^(f·ln2), Horner form; truncation error below
 *          (ln2/2)^(deg+1)/(deg+1)!: 5e-9 (degree 7, float), 4e-18 (degree
 *          13, double), well under half an ulp;
 *   2^n:   n added to the exponent field of 2^f (AVX-512: VRNDSCALE for
 *          round, VSCALEF for 2^n, zeroing under a mask below the range:
 *          fewer instructions, the same bits).
 * x below −125 (float) / −1021 (double) returns 0: the true value is under
 * 2^−125 there, invisible next to the row maximum's 1. −inf gives exactly 0,
 * NaN stays NaN. Measured maximum error over [−125, 0] / [−1021, 0]
 * (tests/test_isa.py, 3·10⁶ points against long double): 0.84 ulp (float)
 * and 0.85 ulp (double) with FMA (avx2, avx512); 1.11 and 1.13 ulp without
 * (sse2, scalar), where each Horner step rounds twice.
 */

/* The steps below are written for N vectors side by side (N a constant
 * wherever they are inlined, at most FA_EXP2_N), so each step is N
 * independent instructions in a row. One 2^x is a chain of about 15
 * dependent instructions (~50 cycles); a loop of single calls leaves the
 * out-of-order core one chain at a time to fill its scheduler with, and ran
 * at 12 cycles a vector on Zen 2 where four chains side by side run at 7
 * (docs/tuning.md). Each vector's own operations are unchanged: the same
 * bits whatever N. */
#define FA_EXP2_N 4
#define FA_EACH(N) _Pragma("GCC unroll 4") for (int i = 0; i < (N); i++)

/* (2^f − 1)/f for f in [−½, ½]: the Taylor polynomial above less its
 * constant term, divided by f; Horner form, into p. */
static inline __attribute__((always_inline)) void FN(exp2_poly_tail_n)(const int N, VT *p, const VT *f) {
#if FA_MANT == 23
    static const T c[] = {0x1.ffcbfc588b0c7p-17f, 0x1.430912f86c787p-13f, 0x1.5d87fe78a6731p-10f,
                          0x1.3b2ab6fba4e77p-7f,  0x1.c6b08d704a0c0p-5f,  0x1.ebfbdff82c58fp-3f,
                          0x1.62e42fefa39efp-1f}; /* ln2^k / k!, k = 7 … 1 */
#else
    static const T c[] = {0x1.816193166d0f9p-40, 0x1.c3bd650fc2986p-36, 0x1.e8cac7351bb25p-32,
                          0x1.e4cf5158b8ecap-28, 0x1.b5253d395e7c4p-24, 0x1.62c0223a5c824p-20,
                          0x1.ffcbfc588b0c7p-17, 0x1.430912f86c787p-13, 0x1.5d87fe78a6731p-10,
                          0x1.3b2ab6fba4e77p-7,  0x1.c6b08d704a0c0p-5,  0x1.ebfbdff82c58fp-3,
                          0x1.62e42fefa39efp-1}; /* ln2^k / k!, k = 13 … 1 */
#endif
    FA_EACH(N) p[i] = FN(v_splat)(c[0]);
#pragma GCC unroll 16
    for (int k = 1; k < (int)(sizeof c / sizeof c[0]); k++) FA_EACH(N) p[i] = p[i] * f[i] + c[k];
}

static inline VT FN(exp2_poly_tail)(VT f) {
    VT p;
    FN(exp2_poly_tail_n)(1, &p, &f);
    return p;
}

/* 2^x in place for N vectors (see FA_EACH). */
static inline __attribute__((always_inline)) void FN(v_exp2_n)(const int N, VT *x) {
#if FA_MANT == 23
    const T lowest = -125;
#else
    const T lowest = -1021;
#endif
    VT p[FA_EXP2_N], f[FA_EXP2_N];
#if FA_VBYTES == 64 && defined(__AVX512F__)
    /* AVX-512: round and scale in one instruction each (VRNDSCALE, VSCALEF),
     * the range in a mask register: 12 instructions, not 20. The same n, f
     * and polynomial, and p·2^n is exact for a normal result, so the bits
     * are those of the portable path below. MAXPS(lowest, x) keeps a NaN x
     * (it returns the second operand when one is NaN); below the range the
     * zeroing mask (x ≥ lowest, true for NaN: unordered) gives exactly 0. */
#if FA_MANT == 23 /* one body for both: the intrinsics by suffix */
#define FA_Z(op) _mm512_##op##_ps
#define FA_ZCMP _mm512_cmp_ps_mask
    typedef __m512 zv;
    typedef __mmask16 zmask;
#else
#define FA_Z(op) _mm512_##op##_pd
#define FA_ZCMP _mm512_cmp_pd_mask
    typedef __m512d zv;
    typedef __mmask8 zmask;
#endif
    zv n[FA_EXP2_N];
    FA_EACH(N) {
        const zv xc = FA_Z(max)(FA_Z(set1)(lowest), (zv)x[i]);
        n[i] = FA_Z(roundscale)(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        f[i] = (VT)FA_Z(sub)(xc, n[i]);
    }
    FN(exp2_poly_tail_n)(N, p, f);
    FA_EACH(N) {
        const zmask kept = FA_ZCMP((zv)x[i], FA_Z(set1)(lowest), _CMP_NLT_UQ);
        x[i] = (VT)FA_Z(maskz_scalef)(kept, (zv)(p[i] * f[i] + 1), n[i]);
    }
#undef FA_Z
#undef FA_ZCMP
#elif FA_VBYTES == 32 && FA_MANT == 23 && defined(__AVX2__)
    /* AVX2, float: MAXPS(lowest, x) clamps and keeps a NaN x (it returns the
     * second operand when one is NaN), VROUNDPS rounds to nearest even as the
     * shifter does, the integer n comes from VCVTPS2DQ (a NaN gives
     * 0x80000000, which the shift by 23 turns into 0, so NaN stays NaN), and
     * the underflow mask clears the result with one ANDNPS: the same n, f,
     * polynomial and 2^n as the portable path below, so the same bits for
     * every non-NaN x, in about 16 instructions instead of 22. */
    __m256 n[FA_EXP2_N];
    FA_EACH(N) {
        const __m256 xc = _mm256_max_ps(_mm256_set1_ps(lowest), (__m256)x[i]);
        n[i] = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        f[i] = (VT)_mm256_sub_ps(xc, n[i]);
    }
    FN(exp2_poly_tail_n)(N, p, f);
    FA_EACH(N) {
        const __m256i r = _mm256_add_epi32((__m256i)(p[i] * f[i] + 1), _mm256_slli_epi32(_mm256_cvtps_epi32(n[i]), FA_MANT));
        x[i] = (VT)_mm256_andnot_ps(_mm256_cmp_ps((__m256)x[i], _mm256_set1_ps(lowest), _CMP_LT_OQ), (__m256)r);
    }
#else
#if FA_MANT == 23
    const T shifter = 0x1.8p23f;
#else
    const T shifter = 0x1.8p52;
#endif
    VU under[FA_EXP2_N], n_bits[FA_EXP2_N];
    FA_EACH(N) {
        under[i] = (VU)(x[i] < lowest);
        const VT xc = FN(v_select)(under[i], FN(v_splat)(lowest), x[i]);
        const VT big = xc + shifter;             /* = shifter + n, rounded to nearest */
        f[i] = xc - (big - shifter);
        n_bits[i] = (VU)big - (VU)FN(v_splat)(shifter); /* n, two's complement */
    }
    FN(exp2_poly_tail_n)(N, p, f);
    FA_EACH(N) {
        VT r = (VT)((VU)(p[i] * f[i] + 1) + (n_bits[i] << FA_MANT)); /* 2^f · 2^n */
        r = FN(v_select)(under[i], FN(v_splat)(0), r);
        x[i] = FN(v_select)((VU)(x[i] != x[i]), x[i], r);        /* NaN in, NaN out */
    }
#endif
}

static inline VT FN(v_exp2)(VT x) {
    FN(v_exp2_n)(1, &x);
    return x;
}

/* The softmax's exponentials, in place, for n vectors `stride` vectors
 * apart, and their sum:
 *     x_j := 2^((x_j − m_sub)·log2 e),   returns Σ_j x_j
 * FA_EXP2_N vectors side by side (see FA_EACH), the rest one at a time; the
 * sum is added in j order, so the bits are those of one at a time. Both
 * layouts' softmax (stride: a lane-layout row of Sᵀ, or 1). */
static inline __attribute__((always_inline)) VT FN(exp2_shifted)(VT *x, int64_t stride, int64_t n, VT m_sub) {
    const T log2e = (T)1.4426950408889634074;
    VT sum = {0};
    int64_t j = 0;
    for (; j + FA_EXP2_N <= n; j += FA_EXP2_N) {
        VT p[FA_EXP2_N];
        FA_EACH(FA_EXP2_N) p[i] = (x[(j + i) * stride] - m_sub) * log2e;
        FN(v_exp2_n)(FA_EXP2_N, p);
        FA_EACH(FA_EXP2_N) {
            x[(j + i) * stride] = p[i];
            sum += p[i];
        }
    }
    for (; j < n; j++) {
        x[j * stride] = FN(v_exp2)((x[j * stride] - m_sub) * log2e);
        sum += x[j * stride];
    }
    return sum;
}

/* 2^x − 1 and 2^x for x ≤ 0 (the softcap's tanh), from one range reduction,
 * 2^x − 1 accurate where it cancels:
 * n = round(x), f = x − n, p = 2^f − 1 = f·tail(f) from the polynomial above
 * (no 1 added and taken away), 2^n exact, then
 *     2^x − 1 = 2^n·p + (2^n − 1),   2^x = 2^n·p + 2^n
 * (one rounding each). For n = 0 the first is p alone: a relative error of a
 * few ulp down to the smallest x. x below the exp2 range gives −1 for the
 * first and 2^−125·(1 + p) for the second (not 0: the caller's 1 − 2w/d
 * rounds it away); NaN gives NaN in the first only (the caller's division by
 * 2 + (2^x − 1) carries it). */
static inline VT FN(v_exp2m1_pair)(VT x, VT *e2) {
#if FA_MANT == 23
    const T shifter = 0x1.8p23f, lowest = -125;
    const FA_TU one_bits = 127;
#else
    const T shifter = 0x1.8p52, lowest = -1021;
    const FA_TU one_bits = 1023;
#endif
    VU under = (VU)(x < lowest);
    VT xc = FN(v_select)(under, FN(v_splat)(lowest), x);
    VT big = xc + shifter;
    VT n = big - shifter;
    VT f = xc - n;
    VU n_bits = (VU)big - (VU)FN(v_splat)(shifter);
    VT two_n = (VT)((n_bits + one_bits) << FA_MANT);   /* 2^n, n in [lowest, 0] */
    VT p = f * FN(exp2_poly_tail)(f);
    *e2 = two_n * p + two_n;
    VT r = two_n * p + (two_n - 1);
    r = FN(v_select)(under, FN(v_splat)(-1), r);
    return FN(v_select)((VU)(x != x), x, r);
}
