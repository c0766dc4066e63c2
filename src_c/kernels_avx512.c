/* kernels_avx512.c — 512-bit vectors; compiled with -mavx512f/bw/vl/dq only.
 * 32 zmm registers: 6×4 accumulators + 4 of Qᵀ + 1 broadcast; 64 float rows an item.
 * kernels_avx512bf16.c and kernels_amx.c include this file after naming their
 * own set, so the three sets share every setting below (one copy, the same
 * bits). */
#ifndef FA_ISA
#define FA_ISA avx512
#define FA_ISA_NAME "avx512"
#endif
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
/* Row layout (kernel_rows.h), measured on Zen 4 (docs/tuning.md, "Stop 25"):
 * up to 4 rows read V a whole row at a time (4 vectors at E <= 64), 5-8
 * rows 2 vectors at a time (below); items of more than 4
 * rows of float32, or more than 2 of 16-bit or int8 storage, ask for a
 * block's V rows with its scores, and one row computes the scores of 64
 * blocks at a time (4096 keys: K and V each
 * read in runs of 1 MiB of float32 at E = 128; 8 blocks at stop 27, 64 from
 * stop 32 on a Xeon, from memory 0.91-0.95 of the time, "Stop 32"). One row
 * reads K one key at a time, each row whole and in order ("Stop 28"). int8
 * rows are 4 keys to a 512-byte run, still one stream, so int8 takes 4 keys
 * at a time (independent sums, 0.89-1.01 of the time alone, "Stop 32").
 * One row asks for the next block's K and V rows (prefetcht1, a block
 * ahead) as it goes: stop 28 had dropped these on Zen 4, where they cost,
 * but then the prefetch's memory operand kept the P·V accumulators in
 * memory (internal.h). With a register operand, on a Xeon from memory
 * (1x32x1x4096x128, 1 and 2 threads): float32 0.93-0.96 of the time,
 * float16 0.89-0.96, int8 0.81-0.90 (E = 64: 0.65); from L2/L3 0.97-1.18,
 * one tiny call 1.30 ("Stop 33"); the avx512bf16 set, run by AMD's Zen 4
 * and 5, asks for int8 only (kernels_avx512bf16.c). Items of 2-4 rows of
 * float32 or float64, which do not ask for V with their scores, ask for the
 * next block's V in their P·V (1x32/8x1x8192x128 float32 0.87-0.89; 16-bit
 * and int8, which ask for V with their scores, 1.05-1.08 that way). */
#define FA_ROWS_WHOLE_MAX 4
/* Items of 5-8 rows (multi-query decoding) take P·V 2 vectors at a time.
 * 8 rows of 4 vectors need 32 accumulators, all 32 registers, so some live
 * in memory, a load and a store a key; 4 measured fastest on Zen 4 at stop
 * 25, but with the scores as they are since stop 40, 2 took 0.89-0.96 of
 * the time there from memory (every dtype; 1 and 2 threads) and
 * 0.78-0.94 from cache (Zen 4, "Stop 43"), and on a Sapphire Rapids Xeon
 * (the amx set) 0.89-0.94 from memory, 0.91-0.96 from cache ("Stop 34").
 * G changes no bits: each sum runs over the keys in order for any G. */
#define FA_ROWS_MANY_G 2
#define FA_ROW_SHORT_G4 1
#define FA_ROW_KEYS (sizeof(KV) == 1 ? 4 : 1)
#define FA_ROW_SUPER 64
#define FA_ROW_PF_BYTES 1
#define FA_ROW_PF_V_ROWS (sizeof(KV) >= 4 ? 4 : 1)
#define FA_ROWS_PF_V_NOW(R) ((R) > (sizeof(KV) >= 4 ? 4 : 2))
/* Items of 5-8 rows over 16-bit storage and of any rows over int8 sum
 * their scores with E a constant at E = 64 and 128 (kernel_rows.h). On a
 * Xeon from memory (1x8/1x1x32768x128, 1x32/8x1x8192x128), runs of 7-11
 * rounds: multi-query float16, bfloat16 and int8 0.94-1.00, 0.96-0.99 and
 * 0.93-0.95 of the time, grouped int8 0.92-0.94. Grouped 16-bit rows (4)
 * took 0.89-0.91 from L2, but from memory float16 0.99-1.02 and bfloat16
 * 0.99-1.05, so they keep the loop ("Stop 40"). */
#define FA_ROWS_E_CONST(R) (sizeof(KV) == 1 || (R) > 4)
/* Items of 5-8 rows (multi-query decoding) compute their scores two keys at
 * a time, each q vector loaded once into a register for both (kernel_rows.h):
 * on a Xeon from memory, 1x8/1x1x32768x128 float16, bfloat16, int8 and
 * float32 0.97, 0.95, 0.96 and 0.96 of the time, float16 on two threads
 * 0.95. Grouped rows (4) measured level (0.99-1.02) and keep one key
 * ("Stop 40"). */
#define FA_ROWS_KEY_PAIRS(R) ((R) > 4)
#include "kernel_isa.h"
