/* dispatch.c — picks the micro-kernel set once, from the running CPU.
 * Compiled with baseline flags only: it must run on any CPU of its
 * architecture to find out what that CPU can do. FASTATTN_ISA (read at the
 * first call) or fa_set_isa() forces a lower set, so tests can run each one.
 */
#include <stdlib.h>
#include <string.h>
#include "internal.h"

static const fa_kernel *const fa_all_kernels[] = {
#if defined(FA_HAVE_AVX512)
    &fa_kernel_avx512,
#endif
#if defined(FA_HAVE_AVX2)
    &fa_kernel_avx2,
#endif
    &fa_kernel_vec128,
    &fa_kernel_scalar,
};
#define FA_N_KERNELS (sizeof fa_all_kernels / sizeof fa_all_kernels[0])

static int cpu_runs(const fa_kernel *k) {
#if defined(__x86_64__) || defined(__i386__)
    /* __builtin_cpu_supports also checks that the OS saves the wide registers. */
    __builtin_cpu_init();
#if defined(FA_HAVE_AVX512)
    if (k == &fa_kernel_avx512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
#if defined(FA_HAVE_AVX2)
    if (k == &fa_kernel_avx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
#endif
    (void)k;
    return 1; /* vec128 and scalar use baseline instructions only */
}

static const fa_kernel *find(const char *name) {
    for (size_t i = 0; i < FA_N_KERNELS; i++)
        if (strcmp(fa_all_kernels[i]->name, name) == 0 && cpu_runs(fa_all_kernels[i])) return fa_all_kernels[i];
    return NULL;
}

static const fa_kernel *best(void) {
    for (size_t i = 0; i < FA_N_KERNELS; i++)
        if (cpu_runs(fa_all_kernels[i])) return fa_all_kernels[i];
    return &fa_kernel_scalar;
}

/* Read and written with atomics: a C program may call from several threads. */
static const fa_kernel *fa_selected = NULL;

const fa_kernel *fa_current_kernel(void) {
    const fa_kernel *k = __atomic_load_n(&fa_selected, __ATOMIC_ACQUIRE);
    if (k) return k;
    const char *env = getenv("FASTATTN_ISA");
    k = (env && *env && strcmp(env, "auto") != 0) ? find(env) : NULL;
    if (!k) k = best(); /* an unknown FASTATTN_ISA falls back; fa_isa() tells */
    __atomic_store_n(&fa_selected, k, __ATOMIC_RELEASE);
    return k;
}

int fa_set_isa(const char *name) {
    const fa_kernel *k = (!name || !*name || strcmp(name, "auto") == 0) ? best() : find(name);
    if (!k) return FA_ERR_ISA;
    __atomic_store_n(&fa_selected, k, __ATOMIC_RELEASE);
    return FA_OK;
}

int fa_isa_supported(const char *name) { return name && find(name) != NULL; }

const char *fa_isa(void) { return fa_current_kernel()->name; }

int fa_test_exp2(const char *isa, int dtype, const void *x, void *y, int64_t n) {
    const fa_kernel *k = isa ? find(isa) : NULL;
    if (!k) return FA_ERR_ISA;
    if (dtype == FA_F32) k->exp2_f32((const float *)x, (float *)y, n);
    else if (dtype == FA_F64) k->exp2_f64((const double *)x, (double *)y, n);
    else return FA_ERR_DTYPE;
    return FA_OK;
}
