/* decode.c — decoding steps against a growing KV cache, through fastattn's C API only.
 *
 * Build from the repository root (plain C, no Python in the program; any CPU):
 *
 *   python3 src_c/manifest.py lib --program examples/c/decode.c
 *
 * which compiles build/c/libfastattn.a (every kernel set for cc's target, each file with
 * its own flags), links this file against it and prints each command it runs.
 * Run: build/c/decode [steps [threads]].
 *
 * A (1, HKV, capacity, E) cache in float16 (half the bytes of float32: decoding reads the
 * whole cache every step) is allocated once; each step appends one token's key and value per
 * KV head, rounded to float16, then one float32 query row per query head (grouped-query,
 * HQ/HKV heads per KV head) attends to the filled part: kv_len says how much is filled, causal
 * places the query at the newest key. The kernel converts float16 to float32 as it loads and
 * computes in float32. Every step is checked against a naive loop in double over the same
 * rounded cache.
 * Exit status 0 and "passed" when every step agrees.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "fastattn.h"
#include "convert.h" /* fa_f32_to_f16 / fa_f16_to_f32: exact, ties to even (src_c/convert.h) */

enum { HQ = 8, HKV = 2, E = 64 };

/* xorshift64: the same numbers on every platform, unlike rand(). */
static uint64_t state = 0x9E3779B97F4A7C15ull;
static float uniform(void) {
    state ^= state << 13; state ^= state >> 7; state ^= state << 17;
    return (float)((state >> 11) * (1.0 / 9007199254740992.0) * 2 - 1);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The definition for query head h at cache length n: softmax(q·kᵀ·scale) v over keys 0..n-1
 * (causal with one query row at position n-1 hides nothing), in double. */
static void naive(const float *q, const uint16_t *k, const uint16_t *v, int64_t cap, int64_t n, int h,
                  double scale, double *out, double *lse, double *s) {
    int hk = h / (HQ / HKV);
    const uint16_t *kh = k + (int64_t)hk * cap * E, *vh = v + (int64_t)hk * cap * E;
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < n; j++) {
        double dot = 0;
        for (int e = 0; e < E; e++) dot += (double)q[h * E + e] * fa_f16_to_f32(kh[j * E + e]);
        s[j] = dot * scale;
        if (s[j] > mx) mx = s[j];
    }
    for (int e = 0; e < E; e++) out[e] = 0;
    for (int64_t j = 0; j < n; j++) {
        double p = exp(s[j] - mx);  /* stable: the row max subtracted */
        sum += p;
        for (int e = 0; e < E; e++) out[e] += p * fa_f16_to_f32(vh[j * E + e]);
    }
    for (int e = 0; e < E; e++) out[e] /= sum;
    *lse = mx + log(sum);
}

int main(int argc, char **argv) {
    int64_t cap = argc > 1 ? atoll(argv[1]) : 1200;  /* steps = capacity: the cache ends full */
    int threads = argc > 2 ? atoi(argv[2]) : 0;       /* 0: OpenMP's default */
    if (cap < 1 || threads < 0) {
        fprintf(stderr, "usage: %s [steps >= 1 [threads >= 0]]\n", argv[0]);
        return 2;
    }
    uint16_t *k = calloc((size_t)(HKV * cap * E), sizeof *k);  /* (1, HKV, cap, E), float16 */
    uint16_t *v = calloc((size_t)(HKV * cap * E), sizeof *v);
    float q[HQ * E], out[HQ * E], lse[HQ];
    double *s = malloc((size_t)cap * sizeof *s), ref[E], ref_lse;
    if (!k || !v || !s) { fprintf(stderr, "out of memory\n"); return 2; }

    fa_args a;
    fa_args_init(&a);
    a.dtype = FA_F16;                          /* the cache's storage */
    a.q_dtype = a.out_dtype = FA_F32;          /* queries and outputs stay float32 */
    a.B = 1; a.Hq = HQ; a.Hkv = HKV; a.L = 1; a.S = cap; a.E = E; a.Ev = E;
    a.q = q; a.k = k; a.v = v; a.out = out; a.lse = lse;
    /* Element strides for (batch, head, row); the last axis is contiguous. The whole
     * capacity is passed as S: kv_len, not S, says which keys exist. */
    int64_t qs[3] = {HQ * E, E, E}, ks[3] = {HKV * cap * E, cap * E, E}, ls[3] = {HQ, 1, 1};
    for (int d = 0; d < 3; d++) {
        a.q_stride[d] = a.out_stride[d] = qs[d];
        a.k_stride[d] = a.v_stride[d] = ks[d];
        a.lse_stride[d] = ls[d];
    }
    a.scale = 1.0 / sqrt((double)E);
    a.causal = 1;
    a.align = FA_ALIGN_BOTTOM_RIGHT;  /* the query is the newest token: row 0 sits at key n-1 */
    int64_t kv_len = 0;
    a.kv_len = &kv_len;
    a.num_threads = threads;

    double worst = 0, worst_lse = 0, kernel_s = 0;
    for (int64_t t = 0; t < cap; t++) {
        /* Append this token's key and value for every KV head, in place. */
        for (int h = 0; h < HKV; h++)
            for (int e = 0; e < E; e++) {
                k[(h * cap + t) * E + e] = fa_f32_to_f16(uniform());
                v[(h * cap + t) * E + e] = fa_f32_to_f16(uniform());
            }
        kv_len = t + 1;
        for (int i = 0; i < HQ * E; i++) q[i] = uniform();

        double t0 = now();
        int rc = fa_attention(&a);
        kernel_s += now() - t0;
        if (rc != FA_OK) {
            printf("step %lld: fa_attention failed: %s\n", (long long)t, fa_strerror(rc));
            return 1;
        }
        for (int h = 0; h < HQ; h++) {
            naive(q, k, v, cap, kv_len, h, a.scale, ref, &ref_lse, s);
            for (int e = 0; e < E; e++) {
                double err = fabs(out[h * E + e] - ref[e]);
                if (!(err <= worst)) worst = err;  /* a NaN makes worst NaN: fails below */
            }
            double err = fabs(lse[h] - ref_lse);
            if (!(err <= worst_lse)) worst_lse = err;
        }
    }
    /* The kernel accumulates in float32: outputs in [-1, 1] within ~1e-6, lse to a few ulp
     * of its magnitude (~log n); 1e-4 leaves room and still catches any wrong key or head. */
    int ok = worst <= 1e-4 && worst_lse <= 1e-4;
    printf("decode: %lld steps, float16 cache, Hq %d / Hkv %d, E %d, isa %s, %d threads\n", (long long)cap, HQ, HKV,
           E, fa_isa(), threads ? threads : fa_max_threads());
    printf("fa_attention: %.0f steps/s (cache length 1 to %lld, kernel time only)\n",
           cap / kernel_s, (long long)cap);
    printf("max error against double: out %.3g, lse %.3g: %s\n", worst, worst_lse,
           ok ? "passed" : "FAILED");
    free(k); free(v); free(s);
    return ok ? 0 : 1;
}
