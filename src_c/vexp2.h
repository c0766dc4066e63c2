/* vexp2.h — 2^x on a vector, for softmax (x ≤ 0 there; valid for x ≤ 127).
 *
 * Method: n = round(x), f = x − n ∈ [−½, ½], 2^x = 2^n · 2^f.
 *   round: adding 1.5·2^MANT pushes f's bits out of the mantissa, so the sum
 *          is n exactly and its low mantissa bits hold n (two's complement);
 *   2^f:   Taylor series of e^(f·ln2), Horner form; truncation error below
 *          (ln2/2)^(deg+1)/(deg+1)!: 5e-9 (degree 7, float), 4e-18 (degree
 *          13, double), well under half an ulp;
 *   2^n:   n added to the exponent field of 2^f.
 * x below −125 (float) / −1021 (double) returns 0: the true value is under
 * 2^−125 there, invisible next to the row maximum's 1. −inf gives exactly 0,
 * NaN stays NaN. Measured maximum error over [−125, 0] / [−1021, 0]
 * (tests/test_isa.py, 3·10⁶ points against long double): 0.84 ulp (float)
 * and 0.85 ulp (double) with FMA (avx2, avx512); 1.11 and 1.13 ulp without
 * (sse2, scalar), where each Horner step rounds twice.
 */
static inline VT FN(v_exp2)(VT x) {
#if FA_MANT == 23
    const T lowest = -125, shifter = 0x1.8p23f;
#else
    const T lowest = -1021, shifter = 0x1.8p52;
#endif
    VU under = (VU)(x < lowest);
    VT xc = FN(v_select)(under, FN(v_splat)(lowest), x);
    VT big = xc + shifter;                 /* = shifter + n, rounded to nearest */
    VT n = big - shifter;
    VT f = xc - n;
    VU n_bits = (VU)big - (VU)FN(v_splat)(shifter);  /* n, two's complement */
    VT p;
#if FA_MANT == 23
    p = FN(v_splat)(0x1.ffcbfc588b0c7p-17f);   /* ln2^k / k!, k = 7 … 0 */
    p = p * f + 0x1.430912f86c787p-13f;
    p = p * f + 0x1.5d87fe78a6731p-10f;
    p = p * f + 0x1.3b2ab6fba4e77p-7f;
    p = p * f + 0x1.c6b08d704a0c0p-5f;
    p = p * f + 0x1.ebfbdff82c58fp-3f;
    p = p * f + 0x1.62e42fefa39efp-1f;
    p = p * f + 1.0f;
#else
    p = FN(v_splat)(0x1.816193166d0f9p-40);    /* ln2^k / k!, k = 13 … 0 */
    p = p * f + 0x1.c3bd650fc2986p-36;
    p = p * f + 0x1.e8cac7351bb25p-32;
    p = p * f + 0x1.e4cf5158b8ecap-28;
    p = p * f + 0x1.b5253d395e7c4p-24;
    p = p * f + 0x1.62c0223a5c824p-20;
    p = p * f + 0x1.ffcbfc588b0c7p-17;
    p = p * f + 0x1.430912f86c787p-13;
    p = p * f + 0x1.5d87fe78a6731p-10;
    p = p * f + 0x1.3b2ab6fba4e77p-7;
    p = p * f + 0x1.c6b08d704a0c0p-5;
    p = p * f + 0x1.ebfbdff82c58fp-3;
    p = p * f + 0x1.62e42fefa39efp-1;
    p = p * f + 1.0;
#endif
    VT r = (VT)((VU)p + (n_bits << FA_MANT));   /* 2^f · 2^n */
    r = FN(v_select)(under, FN(v_splat)(0), r);
    return FN(v_select)((VU)(x != x), x, r);    /* NaN in, NaN out */
}
