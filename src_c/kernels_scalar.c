/* kernels_scalar.c — the portable fallback: one lane, any C compiler and CPU.
 * Also what FASTATTN_ISA=scalar forces, so every build can test it. */
#define FA_ISA scalar
#define FA_ISA_NAME "scalar"
#define FA_VBYTES_F32 4
#define FA_VBYTES_F64 8
#ifndef FA_NV
#define FA_NV 4  /* 4 rows per item */
#endif
#ifndef FA_MR
#define FA_MR 4  /* 4×4 accumulators */
#endif
#ifndef FA_BK
#define FA_BK 64
#endif
#include "kernel_isa.h"
