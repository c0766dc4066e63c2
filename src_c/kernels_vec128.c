/* kernels_vec128.c — 128-bit vectors with baseline flags: SSE2 on every x86-64,
 * NEON on every arm64. Registers: 16 (x86) / 32 (arm64); 6×2 accumulators fit both. */
#define FA_ISA vec128
#if defined(__aarch64__) || defined(__ARM_NEON)
#define FA_ISA_NAME "neon"
#else
#define FA_ISA_NAME "sse2"
#endif
#define FA_VBYTES_F32 16
#define FA_VBYTES_F64 16
#ifndef FA_NV
#define FA_NV 2
#endif
#ifndef FA_MR
#define FA_MR 6
#endif
#ifndef FA_BK
#define FA_BK 64
#endif
/* Row layout (kernel_rows.h): 16 vectors of P·V at a time, for two rows too
 * (SSE2 measured on Zen 3: docs/tuning.md; NEON, which has twice the
 * registers, is only run under qemu here, not timed). */
#define FA_ROW_GROUP 16
#define FA_ROWS_WHOLE_MAX FA_ROWS_MAX
#include "kernel_isa.h"
