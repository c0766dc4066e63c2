/* kernels_avx512bf16.c — the AVX-512 set again, with the bfloat16 entry's
 * lane-layout scores on AVX512-BF16's VDPBF16PS (kernel_dpbf16.h) for
 * bfloat16 q; compiled with the AVX-512 flags plus -mavx512bf16. Chosen
 * before avx512 where the CPU has AVX512-BF16 and not AMX (AMD Zen 4 and 5;
 * dispatch.c). Every tile and row-layout setting is kernels_avx512.c's,
 * included below, so every other entry computes the same bits as there. */
#define FA_ISA avx512bf16
#define FA_ISA_NAME "avx512bf16"
#define FA_DPBF16 1
/* One row of float32 or 16-bit K/V asks for nothing ahead here, as on the
 * AVX2 set. The CPUs that run this set are mostly AMD's Zen 4 and 5 (of
 * Intel's, Cooper Lake; those with AMX run the amx set). On Zen 4 dec4k
 * (1x32x1x4096x128) from memory took 0.74 of the time in float32 and
 * 0.76-0.78 in float16 and bfloat16 without the prefetch that stop 33
 * measured faster on a Xeon (0.93-0.96 there); 0.88 on two threads; from
 * cache 0.84 (float32) and 1.00 (float16). int8 keeps it (1.20 without).
 * docs/tuning.md, "Stop 43". */
#define FA_ROW1_PF_MAX_BYTES 1
#include "kernels_avx512.c"
