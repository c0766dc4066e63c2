/* kernels_avx2.c — 256-bit vectors with FMA; compiled with -mavx2 -mfma only.
 * 16 ymm registers: 6×2 accumulators + 2 of Qᵀ + 1 broadcast. */
#define FA_ISA avx2
#define FA_ISA_NAME "avx2"
#define FA_VBYTES_F32 32
#define FA_VBYTES_F64 32
#ifndef FA_NV
#define FA_NV 2
#endif
#ifndef FA_MR
#define FA_MR 6
#endif
#ifndef FA_BK
#define FA_BK 64
#endif
/* Row layout (kernel_rows.h): a whole row of E = 128 at once, for grouped
 * rows too (measured on Zen 3: docs/tuning.md); the next block's K and V
 * rows asked for in every dtype by items of several rows (measured on Zen 4
 * with this set forced, "Stop 26"). One row, measured on a real Zen 3
 * ("Stop 36", 1x32x1x4096x128 from memory, 1 / 2 threads): a key at a
 * time (int8 four), its scores in runs of 64 blocks, and no prefetch but
 * for int8 took float32 0.74 / 0.85 of the time of four keys with the
 * prefetches, float16 0.80 / 0.85, bfloat16 0.81, int8 0.84 / 0.89, float32
 * from cache 0.74; without the prefetch, int8 had taken 1.21. Grouped
 * rows of 16-bit or int8 storage take P·V 4 vectors at a time (int8 2), not
 * a whole row: on Zen 3 (1x32/8x1x8192x128, 1 thread) float16 took 0.82 of
 * the time, int8 0.77; the AVX2 set forced on a Xeon measured 0.98-1.03
 * ("Stop 36", on the Xeon). */
#define FA_ROW_GROUP 16
#define FA_ROWS_WHOLE_MAX FA_ROWS_MAX
#define FA_ROWS_CONVERT_G (sizeof(KV) == 1 ? 2 : 4)
#define FA_ROW_KEYS (sizeof(KV) == 1 ? 4 : 1)
#define FA_ROW_SUPER 64
#define FA_ROW_PF_BYTES 1
#define FA_ROW1_PF_MAX_BYTES 1
#define FA_ROW_PF_V_ROWS FA_ROWS_MAX
#include "kernel_isa.h"
