/* kernels_amx.c — the AVX-512 set again, with the bfloat16 entry's lane
 * layout on AMX tiles (kernel_amx.h); compiled with the AVX-512 flags plus
 * -mavx512bf16 -mamx-tile -mamx-bf16. Chosen before avx512 where the CPU has
 * AMX-BF16 and the OS grants the tile state (dispatch.c). Same tile sizes as
 * kernels_avx512.c, so every other entry computes the same bits as there. */
#define FA_ISA amx
#define FA_ISA_NAME "amx"
#define FA_VBYTES_F32 64
#define FA_VBYTES_F64 64
#define FA_NV 4
#define FA_MR 6
#define FA_BK 64
#define FA_AMX 1
#include "kernel_isa.h"
