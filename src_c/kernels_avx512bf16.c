/* kernels_avx512bf16.c — the AVX-512 set again, with the bfloat16 entry's
 * lane-layout scores on AVX512-BF16's VDPBF16PS (kernel_dpbf16.h) for
 * bfloat16 q; compiled with the AVX-512 flags plus -mavx512bf16. Chosen
 * before avx512 where the CPU has AVX512-BF16 and not AMX (AMD Zen 4 and 5;
 * dispatch.c). Every tile and row-layout setting is kernels_avx512.c's,
 * included below, so every other entry computes the same bits as there. */
#define FA_ISA avx512bf16
#define FA_ISA_NAME "avx512bf16"
#define FA_DPBF16 1
#include "kernels_avx512.c"
