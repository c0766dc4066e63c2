/* dispatch.c — picks the micro-kernel set (an fa_isa_table) once, from the running CPU.
 * Compiled with baseline flags only: it must run on any CPU of its
 * architecture to find out what that CPU can do. FASTATTN_ISA (read at the
 * first call) or fa_set_isa() forces a lower set, so tests can run each one.
 */
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#if defined(FA_HAVE_AMX) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static const fa_isa_table *const fa_all_isas[] = {
#if defined(FA_HAVE_AMX)
    &fa_isa_amx,
#endif
#if defined(FA_HAVE_AVX512BF16)
    &fa_isa_avx512bf16,
#endif
#if defined(FA_HAVE_AVX512)
    &fa_isa_avx512,
#endif
#if defined(FA_HAVE_AVX2)
    &fa_isa_avx2,
#endif
    &fa_isa_vec128,
    &fa_isa_scalar,
};
#define FA_N_ISAS (sizeof fa_all_isas / sizeof fa_all_isas[0])

/* AMX-BF16 and AMX-TILE in CPUID (leaf 7, EDX bits 22 and 24). Only looked
 * for on Linux, the one OS here that says how to ask for the tile state. */
#if defined(__x86_64__) || defined(__i386__)
static int amx_in_cpu(void) {
#if defined(FA_HAVE_AMX) && defined(__linux__)
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
#else
    return 0;
#endif
}
#endif

/* The CPU has AMX and Linux lets this process use the tile state: a process
 * must ask (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18) before
 * its first tile instruction, which would otherwise fault. The permission
 * holds for every thread of the process. Asked once. */
#if defined(FA_HAVE_AMX)
static int amx_granted(void) {
#if defined(__linux__)
    static int state; /* 0: not asked yet, 1: granted, 2: refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s) return s == 1;
    s = amx_in_cpu() && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0 ? 1 : 2;
    __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    return s == 1;
#else
    return 0;
#endif
}
#endif

#if (defined(__x86_64__) || defined(__i386__)) && \
    (defined(FA_HAVE_AVX512) || defined(FA_HAVE_AVX512BF16) || defined(FA_HAVE_AMX))
/* What the avx512 set needs, and every set built on its code. Asked of the
 * CPU, not of the avx512 set's table: a checking build (tools/sanitize.sh)
 * may leave that set out and keep amx or avx512bf16. */
static int avx512_in_cpu(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("f16c");
}
#endif

static int cpu_runs(const fa_isa_table *k) {
#if defined(__x86_64__) || defined(__i386__)
    /* __builtin_cpu_supports also checks that the OS saves the wide registers. */
    __builtin_cpu_init();
#if defined(FA_HAVE_AMX)
    if (k == &fa_isa_amx) return avx512_in_cpu() && __builtin_cpu_supports("avx512bf16") && amx_granted();
#endif
#if defined(FA_HAVE_AVX512BF16)
    if (k == &fa_isa_avx512bf16) return avx512_in_cpu() && __builtin_cpu_supports("avx512bf16");
#endif
#if defined(FA_HAVE_AVX512)
    if (k == &fa_isa_avx512) return avx512_in_cpu();
#endif
#if defined(FA_HAVE_AVX2)
    if (k == &fa_isa_avx2)  /* F16C converts float16 K and V; every AVX2 CPU has it */
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
#endif
    (void)k;
    return 1; /* vec128 and scalar use baseline instructions only */
}

static const fa_isa_table *find(const char *name) {
    for (size_t i = 0; i < FA_N_ISAS; i++)
        if (strcmp(fa_all_isas[i]->name, name) == 0 && cpu_runs(fa_all_isas[i])) return fa_all_isas[i];
    return NULL;
}

static const fa_isa_table *best(void) {
    for (size_t i = 0; i < FA_N_ISAS; i++)
        if (cpu_runs(fa_all_isas[i])) return fa_all_isas[i];
    return &fa_isa_scalar;
}

/* Read and written with atomics: a C program may call from several threads. */
static const fa_isa_table *fa_selected = NULL;

const fa_isa_table *fa_current_isa(void) {
    const fa_isa_table *k = __atomic_load_n(&fa_selected, __ATOMIC_ACQUIRE);
    if (k) return k;
    const char *env = getenv("FASTATTN_ISA");
    k = (env && *env && strcmp(env, "auto") != 0) ? find(env) : NULL;
    if (!k) k = best(); /* an unknown FASTATTN_ISA falls back; fa_isa() tells */
    __atomic_store_n(&fa_selected, k, __ATOMIC_RELEASE);
    return k;
}

int fa_set_isa(const char *name) {
    const fa_isa_table *k = (!name || !*name || strcmp(name, "auto") == 0) ? best() : find(name);
    if (!k) return FA_ERR_ISA;
    __atomic_store_n(&fa_selected, k, __ATOMIC_RELEASE);
    return FA_OK;
}

int fa_isa_supported(const char *name) { return name && find(name) != NULL; }

/* The CPU extensions dispatch looked for and found, space-separated (the
 * conversions of float16 K/V need F16C on x86-64; arm64's NEON has them). */
const char *fa_cpu_features(void) {
    static char found[160];
    static int done;
    if (__atomic_load_n(&done, __ATOMIC_ACQUIRE)) return found;
    char buf[sizeof found] = "";
#if defined(__x86_64__) || defined(__i386__)
    static const char *const names[] = {"sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
                                        "avx512vl", "avx512dq", "avx512bf16", "amx-bf16"};
    __builtin_cpu_init();
    const int has[] = {__builtin_cpu_supports("sse2"), __builtin_cpu_supports("avx"), __builtin_cpu_supports("avx2"),
                       __builtin_cpu_supports("fma"), __builtin_cpu_supports("f16c"),
                       __builtin_cpu_supports("avx512f"), __builtin_cpu_supports("avx512bw"),
                       __builtin_cpu_supports("avx512vl"), __builtin_cpu_supports("avx512dq"),
                       __builtin_cpu_supports("avx512bf16"), amx_in_cpu()};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (has[i]) {
            if (buf[0]) strcat(buf, " ");
            strcat(buf, names[i]);
        }
#elif defined(__aarch64__)
    strcat(buf, "neon fp16-conversion");
#endif
    memcpy(found, buf, sizeof found);
    __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
    return found;
}

const char *fa_isa(void) { return fa_current_isa()->name; }

int fa_test_exp2(const char *isa, int dtype, const void *x, void *y, int64_t n) {
    const fa_isa_table *k = isa ? find(isa) : NULL;
    if (!k) return FA_ERR_ISA;
    if (dtype < 0 || dtype >= FA_DTYPE_END || !k->by_dtype[dtype]) return FA_ERR_DTYPE;
    k->by_dtype[dtype]->exp2(x, y, n);
    return FA_OK;
}

int fa_test_softcap(const char *isa, int dtype, const void *x, void *y, int64_t n, double c) {
    const fa_isa_table *k = isa ? find(isa) : NULL;
    if (!k) return FA_ERR_ISA;
    if (dtype < 0 || dtype >= FA_DTYPE_END || !k->by_dtype[dtype]) return FA_ERR_DTYPE;
    k->by_dtype[dtype]->softcap(x, y, n, c);
    return FA_OK;
}
