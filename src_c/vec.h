/* vec.h — the small vector vocabulary every kernel is written in.
 *
 * GCC/clang vector extensions: one source that the compiler maps onto the
 * ISA flags of the file including it (one lane for scalar, SSE2/NEON, AVX2+FMA,
 * AVX-512). Included once per element type by kernel_dtype.h; kernel_isa.h defines:
 *   FA_T       float or double          FA_SFX   _f32 or _f64 (name suffix)
 *   FA_TU      same-width unsigned int  FA_MANT  mantissa bits (23 or 52)
 *   FA_VBYTES  vector width in bytes
 * Names carry the suffix so both element types live in one file.
 */
#ifndef FA_VEC_INTRINSICS
#define FA_VEC_INTRINSICS
#if defined(__SSE2__)
#include <immintrin.h> /* v_max only */
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif
#endif

#define FN(x) FA_CAT(x, FA_SFX)
#define T FA_T
#define VT FN(vt)   /* W lanes of T */
#define VU FN(vu)   /* W unsigned lanes of the same width: masks and bit tricks */
#define W ((int)(FA_VBYTES / sizeof(FA_T)))

typedef FA_T VT __attribute__((vector_size(FA_VBYTES)));
typedef FA_TU VU __attribute__((vector_size(FA_VBYTES)));

/* x − 0 is x for every x (−0 too), so this folds to one broadcast; 0 + x would not. */
static inline VT FN(v_splat)(T x) { return x - (VT){0}; }

/* Lane-wise m ? a : b (C has no vector ?:, so the blend is spelled in bits). */
static inline VT FN(v_select)(VU m, VT a, VT b) {
    return (VT)((m & (VU)a) | (~m & (VU)b));
}

/* max that keeps `a` when `b` is NaN: a NaN score then reaches exp and the
 * row sum, so it still propagates to the output, but never poisons the
 * running maximum of the other lanes' rows. That is x86's MAXPS(b, a)
 * (b > a ? b : a) and arm64's FMAXNM; one instruction where the width
 * matches, where the portable blend took three on the softmax's critical
 * path (docs/tuning.md). */
static inline VT FN(v_max)(VT a, VT b) {
#if FA_VBYTES == 64 && defined(__AVX512F__)
    return FA_MANT == 23 ? (VT)_mm512_max_ps((__m512)b, (__m512)a) : (VT)_mm512_max_pd((__m512d)b, (__m512d)a);
#elif FA_VBYTES == 32 && defined(__AVX__)
    return FA_MANT == 23 ? (VT)_mm256_max_ps((__m256)b, (__m256)a) : (VT)_mm256_max_pd((__m256d)b, (__m256d)a);
#elif FA_VBYTES == 16 && defined(__SSE2__)
    return FA_MANT == 23 ? (VT)_mm_max_ps((__m128)b, (__m128)a) : (VT)_mm_max_pd((__m128d)b, (__m128d)a);
#elif FA_VBYTES == 16 && defined(__aarch64__)
    return FA_MANT == 23 ? (VT)vmaxnmq_f32((float32x4_t)a, (float32x4_t)b)
                         : (VT)vmaxnmq_f64((float64x2_t)a, (float64x2_t)b);
#else
    return FN(v_select)((VU)(b > a), b, a);
#endif
}

/* |x|: the sign bit cleared. */
static inline VT FN(v_abs)(VT x) {
    return (VT)((VU)x & ~(VU)FN(v_splat)(-(T)0));
}

/* a·b + c rounded once where the ISA has FMA (AVX2 with -mfma, AVX-512,
 * arm64), spelled as an intrinsic so that it is never merged with a plain
 * product of the same operands; elsewhere a·b + c, rounded twice. */
static inline VT FN(v_fma)(VT a, VT b, VT c) {
#if FA_VBYTES == 64 && defined(__AVX512F__)
    return FA_MANT == 23 ? (VT)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c)
                         : (VT)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
#elif FA_VBYTES == 32 && defined(__FMA__)
    return FA_MANT == 23 ? (VT)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c)
                         : (VT)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#elif FA_VBYTES == 16 && defined(__aarch64__)
    return FA_MANT == 23 ? (VT)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b)
                         : (VT)vfmaq_f64((float64x2_t)c, (float64x2_t)a, (float64x2_t)b);
#else
    return a * b + c;
#endif
}

/* One step of a compensated running sum that is rescaled as it goes (the
 * online softmax's  x := x·s + a  for the output and the denominator):
 * the value is the pair x + e, e the rounding errors so far, and
 *     x·s = p + pe  exactly      (pe = fma(x, s, −p); 0 without FMA)
 *     p + a = t + te             (Fast2Sum: exact when |p| ≥ |a|, which holds
 *                                 once x holds more than one block)
 *     x := t,   e := e·s + (pe + te)
 * so x + e carries the sum to about 2u·Σ|a| whatever the number of steps,
 * where a plain x := x·s + a drifts by up to (steps)·u (Kahan; the same
 * bound holds when |p| < |a|, as the first steps). A non-finite x makes e
 * meaningless: FN(comp_value) drops e then. Every lane is independent. */
static inline void FN(v_comp_step)(VT *x, VT *e, VT s, VT a) {
    const VT p = *x * s, pe = FN(v_fma)(*x, s, -p);
    const VT t = p + a, te = (p - t) + a;
    *e = FN(v_fma)(*e, s, pe + te);
    *x = t;
}

/* x + e, or x where x is not finite (inf or NaN; e is then NaN or ±inf). */
static inline VT FN(comp_value)(VT x, VT e) {
    const VU finite = (VU)(FN(v_abs)(x) < FN(v_splat)((T)INFINITY));
    return x + (VT)(finite & (VU)e);
}

/* An unaligned load (memcpy compiles to one). */
static inline VT FN(v_loadu)(const T *x) {
    VT v;
    memcpy(&v, x, sizeof v);
    return v;
}

/* W in the preprocessor, for the shuffle index lists below. */
#define FA_WPP (FA_VBYTES / (FA_MANT == 23 ? 4 : 8))

/* x[0..W) := its transpose (x[i][j] ↔ x[j][i]), in registers: log2 W stages,
 * each swapping the off-diagonal h×h blocks of every 2h×2h block with
 * two-vector shuffles. Needs __builtin_shufflevector (clang, GCC ≥ 12);
 * elsewhere a round trip through memory. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define FA_LO(j, h) (((j) & (h)) ? FA_WPP + (j) - (h) : (j))
#define FA_HI(j, h) (((j) & (h)) ? FA_WPP + (j) : (j) + (h))
#define FA_IDX2(M, h) M(0, h), M(1, h)
#define FA_IDX4(M, h) FA_IDX2(M, h), M(2, h), M(3, h)
#define FA_IDX8(M, h) FA_IDX4(M, h), M(4, h), M(5, h), M(6, h), M(7, h)
#define FA_IDX16(M, h) FA_IDX8(M, h), M(8, h), M(9, h), M(10, h), M(11, h), M(12, h), M(13, h), M(14, h), M(15, h)
#if FA_WPP == 16
#define FA_IDX FA_IDX16
#elif FA_WPP == 8
#define FA_IDX FA_IDX8
#elif FA_WPP == 4
#define FA_IDX FA_IDX4
#elif FA_WPP == 2
#define FA_IDX FA_IDX2
#endif
#define FA_STAGE(h)                                                          \
    for (int i = 0; i < W; i++)                                              \
        if (!(i & (h))) {                                                    \
            VT a_ = x[i], b_ = x[i + (h)];                                   \
            x[i] = __builtin_shufflevector(a_, b_, FA_IDX(FA_LO, h));        \
            x[i + (h)] = __builtin_shufflevector(a_, b_, FA_IDX(FA_HI, h));  \
        }
static inline void FN(v_transpose)(VT *x) {
#if FA_WPP >= 16
    FA_STAGE(8)
#endif
#if FA_WPP >= 8
    FA_STAGE(4)
#endif
#if FA_WPP >= 4
    FA_STAGE(2)
#endif
#if FA_WPP >= 2
    FA_STAGE(1)
#endif
    (void)x;
}
#undef FA_STAGE

/* Σ of the lanes, as a tree (W/2 + W/4 + … adds, log2 W deep): at each
 * stage h = W/2 … 1 lane u takes lane u + h, in registers. */
#define FA_DOWN(j, h) ((j) < (h) ? (j) + (h) : (j))
static inline T FN(v_hsum)(VT x) {
#if FA_WPP >= 16
    x += __builtin_shufflevector(x, x, FA_IDX(FA_DOWN, 8));
#endif
#if FA_WPP >= 8
    x += __builtin_shufflevector(x, x, FA_IDX(FA_DOWN, 4));
#endif
#if FA_WPP >= 4
    x += __builtin_shufflevector(x, x, FA_IDX(FA_DOWN, 2));
#endif
#if FA_WPP >= 2
    x += __builtin_shufflevector(x, x, FA_IDX(FA_DOWN, 1));
#endif
    return x[0];
}
#undef FA_DOWN

/* x[0..W) := Σ of each vector's lanes, all W sums in one vector: returns y
 * with y[i] = Σ_u x[i][u]. A transpose-and-add tree: each stage pairs vector
 * i with vector i + n/2 and halves segments of length s, so lane block
 * [g·s, g·s + s/2) takes the first vector's two halves of segment g added, and
 * [g·s + s/2, (g+1)·s) the second's. W − 1 adds (and 2(W − 1) shuffles) for W
 * sums, where W separate trees take W·log2 W of each. Each sum pairs lanes in
 * the order of a single tree (u with u + W/2 first), so the bits are those of
 * W separate sums. */
#define FA_SUM_A(j, s) ((j) % (s) < (s) / 2 ? (j) : FA_WPP + (j) - (s) / 2)
#define FA_SUM_B(j, s) ((j) % (s) < (s) / 2 ? (j) + (s) / 2 : FA_WPP + (j))
static inline VT FN(v_hsums)(VT *x) {
    int n = W;
#define FA_SUM_STAGE(s)                                                          \
    n /= 2;                                                                      \
    for (int i = 0; i < n; i++)                                                  \
        x[i] = __builtin_shufflevector(x[i], x[i + n], FA_IDX(FA_SUM_A, s)) +    \
               __builtin_shufflevector(x[i], x[i + n], FA_IDX(FA_SUM_B, s));
#if FA_WPP >= 16
    FA_SUM_STAGE(16)
#endif
#if FA_WPP >= 8
    FA_SUM_STAGE(8)
#endif
#if FA_WPP >= 4
    FA_SUM_STAGE(4)
#endif
#if FA_WPP >= 2
    FA_SUM_STAGE(2)
#endif
#undef FA_SUM_STAGE
    (void)n;
    return x[0];
}

/* out[t] := Σ of x[t]'s lanes for t < 4 (W ≥ 4): v_hsums' first two stages
 * on 4 vectors leave each sum's W/4 partial sums side by side in x[0]; the
 * last log2(W/4) stages pair lanes inside those segments. The same pairing
 * order as v_hsum: the same bits. 8 shuffles and 5 adds at W = 16, where 4
 * trees take 16 of each (one row's scores, FA_ROW_KEYS 4). */
#define FA_SEG_DOWN(j, h) ((j) % (FA_WPP / 4) < (h) ? (j) + (h) : (j))
static inline void FN(v_hsums4)(const VT *x, T *out) {
#if FA_WPP >= 4
    const VT a = __builtin_shufflevector(x[0], x[2], FA_IDX(FA_SUM_A, FA_WPP)) +
                 __builtin_shufflevector(x[0], x[2], FA_IDX(FA_SUM_B, FA_WPP));
    const VT b = __builtin_shufflevector(x[1], x[3], FA_IDX(FA_SUM_A, FA_WPP)) +
                 __builtin_shufflevector(x[1], x[3], FA_IDX(FA_SUM_B, FA_WPP));
    VT y = __builtin_shufflevector(a, b, FA_IDX(FA_SUM_A, FA_WPP / 2)) +
           __builtin_shufflevector(a, b, FA_IDX(FA_SUM_B, FA_WPP / 2));
#if FA_WPP >= 16
    y += __builtin_shufflevector(y, y, FA_IDX(FA_SEG_DOWN, 2));
#endif
#if FA_WPP >= 8
    y += __builtin_shufflevector(y, y, FA_IDX(FA_SEG_DOWN, 1));
#endif
    for (int t = 0; t < 4; t++) out[t] = y[t * (W / 4)];
#else
    for (int t = 0; t < 4; t++) out[t] = FN(v_hsum)(x[t]);
#endif
}
#undef FA_SEG_DOWN
#undef FA_SUM_A
#undef FA_SUM_B
#undef FA_IDX
#else
/* Σ of the lanes, as a tree (W/2 + W/4 + … adds, log2 W deep). */
static inline T FN(v_hsum)(VT x) {
    T t[W];
    memcpy(t, &x, sizeof t);
    for (int w = W / 2; w > 0; w /= 2)
        for (int u = 0; u < w; u++) t[u] += t[u + w];
    return t[0];
}

static inline void FN(v_transpose)(VT *x) {
    T t[W][W];
    memcpy(t, x, sizeof t);
    for (int i = 0; i < W; i++)
        for (int j = 0; j < W; j++) x[i][j] = t[j][i];
}

static inline VT FN(v_hsums)(VT *x) {
    VT y;
    for (int i = 0; i < W; i++) y[i] = FN(v_hsum)(x[i]);
    return y;
}

static inline void FN(v_hsums4)(const VT *x, T *out) {
    for (int t = 0; t < 4; t++) out[t] = FN(v_hsum)(x[t]);
}
#endif

#include "vexp2.h"
