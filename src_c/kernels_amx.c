/* kernels_amx.c — the AVX-512 set again, with the bfloat16 entry's lane
 * layout on AMX tiles (kernel_amx.h); compiled with the AVX-512 flags plus
 * -mavx512bf16 -mamx-tile -mamx-bf16. Chosen before avx512 where the CPU has
 * AMX-BF16 and the OS grants the tile state (dispatch.c). Every tile and
 * row-layout setting is kernels_avx512.c's, included below, so every other
 * entry computes the same bits as there, and decodes as fast: until stop 31
 * this file named the tile sizes only, and its row layout ran the generic
 * defaults, 1.4-1.9x slower on grouped-query decoding (docs/tuning.md,
 * "Stop 31"). */
#define FA_ISA amx
#define FA_ISA_NAME "amx"
#define FA_AMX 1
#include "kernels_avx512.c"
