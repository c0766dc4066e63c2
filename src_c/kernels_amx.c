/* kernels_amx.c — the AVX-512 set again, with the bfloat16 entry's lane
 * layout on AMX tiles (kernel_amx.h); compiled with the AVX-512 flags plus
 * -mavx512bf16 -mamx-tile -mamx-bf16. Chosen before avx512 where the CPU has
 * AMX-BF16 and the OS grants the tile state (dispatch.c). Every tile and
 * row-layout setting but FA_ROWS_MANY_G is kernels_avx512.c's, included
 * below, so every other entry computes the same bits as there, and decodes
 * as fast: until stop 31 this file named the tile sizes only, and its row
 * layout ran the generic defaults, 1.4-1.9x slower on grouped-query
 * decoding (docs/tuning.md, "Stop 31"). */
#define FA_ISA amx
#define FA_ISA_NAME "amx"
#define FA_AMX 1
/* The one row-layout setting of its own: items of 5-8 rows (multi-query
 * decoding) take P·V 2 vectors at a time, not 4. 8 rows of 4 need 32
 * accumulators, all 32 registers, so some live in memory, a load and a store
 * a key; on Zen 4 that measured fastest all the same (docs/tuning.md, "Stop
 * 25"), on this set's CPUs (Intel Xeons, Sapphire Rapids on) 2 vectors took
 * 0.89-0.94 of the time from memory, 0.91-0.96 from cache ("Stop 34"). G changes
 * no bits: each sum runs over the keys in order for any G. */
#define FA_ROWS_MANY_G 2
#include "kernels_avx512.c"
