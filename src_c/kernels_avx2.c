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
 * rows asked for in every dtype and row count (measured on Zen 4 with this
 * set forced, "Stop 26"). */
#define FA_ROW_GROUP 16
#define FA_ROWS_WHOLE_MAX FA_ROWS_MAX
#define FA_ROW_PF_BYTES 1
#define FA_ROW_PF_V_ROWS FA_ROWS_MAX
#include "kernel_isa.h"
