/* kernel_isa.h — one micro-kernel set: instantiates kernel_dtype.h once per
 * K/V storage type (computing in float for all but double) and exports the
 * set's table, fa_isa_<FA_ISA>, indexed by enum fa_dtype. A kernels_<isa>.c wrapper defines the ISA's name and tile
 * sizes, then includes this file; that wrapper's compile flags decide the
 * instructions. A new dtype is one more instantiation and one more entry.
 *   FA_ISA, FA_ISA_NAME     table suffix and printed name
 *   FA_VBYTES_F32/_F64      vector width in bytes per element type
 *   FA_NV, FA_MR, FA_BK     see kernel_lanes.h
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "convert.h"
#include "internal.h"

#define FA_T float
#define FA_SFX _f32
#define FA_TU uint32_t
#define FA_MANT 23
#define FA_VBYTES FA_VBYTES_F32
#define FA_LOG logf
#define FA_EXP expf
#include "kernel_dtype.h"

#define FA_T double
#define FA_SFX _f64
#define FA_TU uint64_t
#define FA_MANT 52
#define FA_VBYTES FA_VBYTES_F64
#define FA_LOG log
#define FA_EXP exp
#include "kernel_dtype.h"

/* 16-bit and int8 storage: float computation, conversion in the loads. */
#define FA_T float
#define FA_SFX _f16
#define FA_TU uint32_t
#define FA_MANT 23
#define FA_VBYTES FA_VBYTES_F32
#define FA_LOG logf
#define FA_EXP expf
#define FA_KV_F16 1
#include "kernel_dtype.h"
#undef FA_KV_F16

#define FA_T float
#define FA_SFX _bf16
#define FA_TU uint32_t
#define FA_MANT 23
#define FA_VBYTES FA_VBYTES_F32
#define FA_LOG logf
#define FA_EXP expf
#define FA_KV_BF16 1
#include "kernel_dtype.h"
#undef FA_KV_BF16

#define FA_T float
#define FA_SFX _i8
#define FA_TU uint32_t
#define FA_MANT 23
#define FA_VBYTES FA_VBYTES_F32
#define FA_LOG logf
#define FA_EXP expf
#define FA_KV_I8 1
#include "kernel_dtype.h"
#undef FA_KV_I8

const fa_isa_table FA_CAT(fa_isa_, FA_ISA) = {
    FA_ISA_NAME,
    {[FA_F32] = &kernel_f32, [FA_F64] = &kernel_f64, [FA_F16] = &kernel_f16, [FA_BF16] = &kernel_bf16,
     [FA_I8] = &kernel_i8},
};
