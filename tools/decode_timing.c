/* tools/decode_timing.c — times fa_attention on one decoding shape from C,
 * with no Python in the loop: the program behind the kernel A/Bs of
 * docs/tuning.md (stops 32 on). tools/decode_ab.py builds it against each
 * variant's library and alternates the builds process by process.
 *
 *   decode_timing DTYPE B HQ HKV L S E THREADS CALLS COPIES [CAUSAL]
 *
 * DTYPE is K's and V's storage: f32, f16, bf16 or i8 (one float32 scale per
 * row); q and out are float32, or Q_DTYPE's (f32, f16, bf16) where the
 * environment sets it: bfloat16 q, K, V and out take the AMX tiles where the
 * CPU has them (prefill: L > 8 rows a K/V head). COPIES sets of K and V are used in turn, so
 * that with enough of them (their bytes well past the last-level cache) each
 * call reads K and V from memory, as each layer of a model reads its own
 * cache; COPIES 1 reads them from cache. HUGE=1 in the environment asks for
 * transparent huge pages, as NumPy's large arrays get: on the Xeon of stop 35
 * int8 decoding ran 0.78 of the time on them. Prints the median
 * milliseconds of CALLS timed calls (after 3 untimed ones). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "fastattn.h"

static void *buffer(size_t bytes) {
    const size_t page = (size_t)2 << 20; /* a huge page: the buffers start on one */
    const size_t size = (bytes + page - 1) / page * page;
    void *p = NULL;
    if (posix_memalign(&p, page, size)) {
        fprintf(stderr, "decode_timing: out of memory for %zu bytes\n", bytes);
        exit(3);
    }
    const char *huge = getenv("HUGE");
#ifdef MADV_HUGEPAGE /* Linux */
    if (huge && atoi(huge)) madvise(p, size, MADV_HUGEPAGE);
#else
    (void)huge;
#endif
    memset(p, 0, size); /* touch every page before timing */
    return p;
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Uniform in [-0.5, 0.5): a fixed LCG, so every build times the same data. */
static uint32_t lcg = 12345;
static float uniform(void) {
    lcg = lcg * 1664525u + 1013904223u;
    return (float)(lcg >> 8) / 16777216.0f - 0.5f;
}

/* x stored as DTYPE (the values are small and normal: plain rounding). */
static void put(int dtype, void *base, size_t i, float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if (dtype == FA_F32) ((float *)base)[i] = x;
    else if (dtype == FA_BF16) ((uint16_t *)base)[i] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    else if (dtype == FA_F16) { /* |x| < 0.5 and, past 2^-14, normal */
        const int exp = (int)((bits >> 23) & 0xff) - 127 + 15;
        const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
        ((uint16_t *)base)[i] = exp <= 0 ? sign : (uint16_t)(sign | (exp << 10) | ((bits & 0x7fffff) >> 13));
    } else ((int8_t *)base)[i] = (int8_t)(x * 254.0f); /* scale 1/254 below: x to within a step */
}

/* The dtype code of name among the first n of f32, f16, bf16, i8; 0: none. */
static int dtype_code(const char *name, int n) {
    static const char *names[] = {"f32", "f16", "bf16", "i8"};
    static const int codes[] = {FA_F32, FA_F16, FA_BF16, FA_I8};
    for (int d = 0; d < n; d++)
        if (!strcmp(name, names[d])) return codes[d];
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 11 || argc > 12) {
        fprintf(stderr, "usage: decode_timing f32|f16|bf16|i8 B HQ HKV L S E THREADS CALLS COPIES [CAUSAL]\n");
        return 2;
    }
    const int dtype = dtype_code(argv[1], 4);
    const int64_t B = atoll(argv[2]), Hq = atoll(argv[3]), Hkv = atoll(argv[4]), L = atoll(argv[5]),
                  S = atoll(argv[6]), E = atoll(argv[7]);
    const int threads = atoi(argv[8]), calls = atoi(argv[9]), copies = atoi(argv[10]);
    if (!dtype || B < 1 || Hq < 1 || Hkv < 1 || L < 1 || S < 1 || E < 1 || threads < 0 || calls < 1 || copies < 1) {
        fprintf(stderr, "decode_timing: DTYPE must be f32, f16, bf16 or i8, the sizes, CALLS and COPIES "
                        "at least 1, THREADS at least 0 (0: OpenMP's default)\n");
        return 2;
    }
    const char *q_name = getenv("Q_DTYPE");
    const int q_dtype = q_name && *q_name ? dtype_code(q_name, 3) : FA_F32;
    if (!q_dtype) {
        fprintf(stderr, "decode_timing: Q_DTYPE must be f32, f16 or bf16, not %s\n", q_name);
        return 2;
    }
    const size_t item = dtype == FA_F32 ? 4 : dtype == FA_I8 ? 1 : 2, n_kv = (size_t)(B * Hkv * S * E);
    const size_t q_item = q_dtype == FA_F32 ? 4 : 2;
    void *q = buffer((size_t)(B * Hq * L * E) * q_item), *out = buffer((size_t)(B * Hq * L * E) * q_item);
    for (int64_t i = 0; i < B * Hq * L * E; i++) put(q_dtype, q, (size_t)i, uniform());
    void **k = malloc(copies * sizeof *k), **v = malloc(copies * sizeof *v);
    float **k_scale = malloc(copies * sizeof *k_scale), **v_scale = malloc(copies * sizeof *v_scale);
    for (int c = 0; c < copies; c++) {
        k[c] = buffer(n_kv * item);
        v[c] = buffer(n_kv * item);
        for (size_t i = 0; i < n_kv; i++) {
            put(dtype, k[c], i, uniform());
            put(dtype, v[c], i, uniform());
        }
        k_scale[c] = buffer((size_t)(B * Hkv * S) * 4);
        v_scale[c] = buffer((size_t)(B * Hkv * S) * 4);
        for (int64_t i = 0; i < B * Hkv * S; i++) k_scale[c][i] = v_scale[c][i] = 1.0f / 254.0f;
    }

    fa_args a;
    fa_args_init(&a);
    a.dtype = dtype;
    a.q_dtype = a.out_dtype = q_dtype;
    a.B = B, a.Hq = Hq, a.Hkv = Hkv, a.L = L, a.S = S, a.E = a.Ev = E;
    a.q = q, a.out = out;
    a.q_stride[0] = a.out_stride[0] = Hq * L * E;
    a.q_stride[1] = a.out_stride[1] = L * E;
    a.q_stride[2] = a.out_stride[2] = E;
    a.k_stride[0] = a.v_stride[0] = Hkv * S * E;
    a.k_stride[1] = a.v_stride[1] = S * E;
    a.k_stride[2] = a.v_stride[2] = E;
    a.k_scale_stride[0] = a.v_scale_stride[0] = Hkv * S;
    a.k_scale_stride[1] = a.v_scale_stride[1] = S;
    a.k_scale_stride[2] = a.v_scale_stride[2] = 1;
    a.scale = 1.0 / 11.3; /* about 1/sqrt(128) */
    a.causal = argc > 11 ? atoi(argv[11]) : 0;
    a.num_threads = threads;

    double *took = malloc(calls * sizeof *took);
    for (int i = -3; i < calls; i++) {
        const int c = (i + 3) % copies;
        a.k = k[c], a.v = v[c];
        if (dtype == FA_I8) a.k_scale = k_scale[c], a.v_scale = v_scale[c];
        const double t0 = seconds();
        const int rc = fa_attention(&a);
        const double t1 = seconds();
        if (rc) {
            fprintf(stderr, "decode_timing: fa_attention: %s\n", fa_strerror(rc));
            return 1;
        }
        if (i >= 0) took[i] = t1 - t0;
    }
    qsort(took, calls, sizeof *took, by_value);
    printf("%.4f\n", 1e3 * took[calls / 2]);
    return 0;
}
