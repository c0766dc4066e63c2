/* kernel_isa.h — instantiates kernel_item.h for float and double and exports
 * one fa_kernel table, named fa_kernel_<FA_ISA>. A kernels_<isa>.c wrapper
 * defines the ISA's name and tile sizes, then includes this file; that
 * wrapper's compile flags decide the instructions.
 *   FA_ISA, FA_ISA_NAME     table suffix and printed name
 *   FA_VBYTES_F32/_F64      vector width in bytes per element type
 *   FA_NV, FA_MR, FA_BK     see kernel_item.h
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "internal.h"

#define FA_T float
#define FA_SFX _f32
#define FA_TU uint32_t
#define FA_MANT 23
#define FA_VBYTES FA_VBYTES_F32
static inline float log_t_f32(float x) { return logf(x); }
#include "kernel_item.h"
#undef FA_T
#undef FA_SFX
#undef FA_TU
#undef FA_MANT
#undef FA_VBYTES

#define FA_T double
#define FA_SFX _f64
#define FA_TU uint64_t
#define FA_MANT 52
#define FA_VBYTES FA_VBYTES_F64
static inline double log_t_f64(double x) { return log(x); }
#include "kernel_item.h"

const fa_kernel FA_CAT(fa_kernel_, FA_ISA) = {
    FA_ISA_NAME,
    FA_NV * (FA_VBYTES_F32 / 4),
    FA_NV * (FA_VBYTES_F64 / 8),
    FA_VBYTES_F32 / 4 / 2, /* few rows: half a vector or less */
    FA_VBYTES_F64 / 8 / 2,
    scratch_bytes_f32,
    scratch_bytes_f64,
    item_f32,
    item_f64,
    rows_item_f32,
    rows_item_f64,
    exp2_array_f32,
    exp2_array_f64,
};
