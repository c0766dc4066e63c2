/* vec.h — the small vector vocabulary every kernel is written in.
 *
 * GCC/clang vector extensions: one source that the compiler maps onto the
 * ISA flags of the file including it (one lane for scalar, SSE2/NEON, AVX2+FMA,
 * AVX-512). Included once per element type by kernel_item.h, which defines:
 *   FA_T       float or double          FA_SFX   _f32 or _f64 (name suffix)
 *   FA_TU      same-width unsigned int  FA_MANT  mantissa bits (23 or 52)
 *   FA_VBYTES  vector width in bytes
 * Names carry the suffix so both element types live in one file.
 */
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
 * running maximum of the other lanes' rows. */
static inline VT FN(v_max)(VT a, VT b) { return FN(v_select)((VU)(b > a), b, a); }

#include "vexp2.h"
