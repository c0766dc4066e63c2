/* convert.h — scalar conversions between float and the 16-bit storage types,
 * bit-exact and portable (no _Float16, no F16C): what the kernels' scalar
 * paths, the output stores and the split-KV merge use. The vector loads of
 * K and V (vec.h) convert the same way, with F16C/NEON where the ISA has it.
 *   float16:  IEEE binary16 (1, 5, 10 bits);  bfloat16: the top half of a float.
 * float → 16 bits rounds to nearest, ties to even; NaN stays NaN (quiet),
 * overflow gives ±inf. 16 bits → float is exact.
 */
#ifndef FA_CONVERT_H
#define FA_CONVERT_H

#include <stdint.h>
#include <string.h>

static inline uint32_t fa_bits_f32(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float fa_f32_bits(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* binary16 → float: the 15 magnitude bits shifted into a float's place are
 * the value times 2^-112 for normal and subnormal halves alike; infinities and
 * NaNs (exponent 31) get the float's all-ones exponent instead. */
static inline float fa_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, mag = (uint32_t)(h & 0x7fffu) << 13;
    if ((h & 0x7c00u) == 0x7c00u) return fa_f32_bits(sign | 0x7f800000u | mag);
    return fa_f32_bits(sign | fa_bits_f32(fa_f32_bits(mag) * 0x1p112f));
}

static inline float fa_bf16_to_f32(uint16_t h) { return fa_f32_bits((uint32_t)h << 16); }

/* float → bfloat16: add half of the dropped 16 bits' range, minus one unless
 * the kept part is odd (ties to even); a carry into the exponent is the
 * correct rounding up, up to inf. */
static inline uint16_t fa_f32_to_bf16(float x) {
    const uint32_t u = fa_bits_f32(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* float → binary16, ties to even. Normal results: round the 23-bit mantissa
 * to 10 bits in integer arithmetic (a carry may bump the exponent, up to inf);
 * subnormal results: let a float addition of 0.5 (2^-1, whose ulp is 2^-24,
 * the smallest half subnormal) do the rounding. */
static inline uint16_t fa_f32_to_f16(float x) {
    const uint32_t u = fa_bits_f32(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN, quiet, its sign kept */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                /* ≥ 65520: inf */
    if (a < 0x38800000u) {                                                  /* below 2^-14: subnormal or 0 */
        const float r = fa_f32_bits(a) + 0.5f;                              /* rounds at 2^-24 */
        return (uint16_t)(sign | (fa_bits_f32(r) - 0x3f000000u));
    }
    const uint32_t m = a - 0x38000000u;                                     /* rebias 127 → 15 */
    return (uint16_t)(sign | ((m + 0x0fffu + ((m >> 13) & 1u)) >> 13));
}

#endif /* FA_CONVERT_H */
