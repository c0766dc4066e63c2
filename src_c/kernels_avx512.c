/* kernels_avx512.c — 512-bit vectors; compiled with -mavx512f/bw/vl/dq only.
 * 32 zmm registers: 6×4 accumulators + 4 of Qᵀ + 1 broadcast; 64 float rows an item. */
#define FA_ISA avx512
#define FA_ISA_NAME "avx512"
#define FA_VBYTES_F32 64
#define FA_VBYTES_F64 64
#ifndef FA_NV
#define FA_NV 4
#endif
#ifndef FA_MR
#define FA_MR 6
#endif
#ifndef FA_BK
#define FA_BK 64
#endif
#include "kernel_isa.h"
