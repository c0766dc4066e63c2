/* test_capi.c — the C API alone, no Python: builds against src_c/ and checks
 * fa_attention against a naive double-precision loop, for every micro-kernel
 * set this CPU runs, float and double, with causal, window, kv_len, a bool
 * mask, GQA, lse, and the score modifiers (softcap, ALiBi, sinks, explicit
 * positions), 16-bit and int8 storage (int8 keys with channel factors too);
 * then checks that bad arguments are refused.
 * Build: see tests/test_c_api.py (the AVX files need their own flags).
 * Exit status 0 and "C API: N passed, 0 failed" when all is well.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "fastattn.h"
#include "convert.h" /* src_c's exact float16/bfloat16 conversions, to build 16-bit inputs */

enum { B = 2, HQ = 4, HKV = 2, L = 37, S = 70, E = 24, EV = 9 };

/* The modifiers of the case being run (all off: softcap 0, no slopes, no sinks, no positions). */
static struct {
    double softcap;
    const double *slopes; /* (HQ), the same for every batch entry */
    const double *sinks;  /* (HQ) */
    const int64_t *q_start, *k_start;
    int channels; /* FA_I8: per-channel key factors (k_channel) */
} mods;

static int passed, failed;
static void check(int ok, const char *what) {
    if (ok) passed++;
    else { failed++; printf("FAIL: %s\n", what); }
}

/* Naive reference for one (b, h, i) row: the definition, spelled out. */
static void naive_row(const double *q, const double *k, const double *v, const unsigned char *mask,
                      const int64_t *kv_len, int b, int h, int i, int causal, int align, int64_t wl,
                      int64_t wr, double scale, double *out, double *lse) {
    int hk = h / (HQ / HKV);
    int64_t Sb = kv_len[b];
    int64_t d = i + (align == FA_ALIGN_TOP_LEFT ? 0 : Sb - L);
    if (mods.q_start || mods.k_start) d = (mods.q_start ? mods.q_start[b] : 0) + i - (mods.k_start ? mods.k_start[b] : 0);
    double s[S], mx = -INFINITY, sum = 0;
    for (int j = 0; j < S; j++) {
        int vis = j < Sb && mask[((b * HQ + h) * L + i) * S + j];
        if (causal && j > d) vis = 0;
        if (wl >= 0 && j < d - wl) vis = 0;
        if (wr >= 0 && j > d + wr) vis = 0;
        double dot = 0;
        for (int e = 0; e < E; e++) dot += q[((b * HQ + h) * L + i) * E + e] * k[((b * HKV + hk) * S + j) * E + e];
        double x = dot * scale;                                             /* scale */
        if (mods.softcap > 0) x = mods.softcap * tanh(x / mods.softcap);   /* softcap */
        if (mods.slopes) x -= mods.slopes[h] * fabs((double)(j - d));       /* ALiBi */
        s[j] = vis ? x : -INFINITY;                                         /* masks */
        if (s[j] > mx) mx = s[j];
    }
    const double sink = mods.sinks ? mods.sinks[h] : -INFINITY;
    if (sink > mx) mx = sink;
    for (int e = 0; e < EV; e++) out[e] = 0;
    if (mx == -INFINITY) { *lse = -INFINITY; return; }
    sum = exp(sink - mx); /* the sink's share of the denominator (0 without one) */
    for (int j = 0; j < S; j++) {
        double p = exp(s[j] - mx);
        sum += p;
        for (int e = 0; e < EV; e++) out[e] += p * v[((b * HKV + hk) * S + j) * EV + e];
    }
    for (int e = 0; e < EV; e++) out[e] /= sum;
    *lse = mx + log(sum);
}

static double rnd(void) { return rand() / (double)RAND_MAX * 2 - 1; }

static void run_case(int dtype, int causal, int align, int64_t wl, int64_t wr) {
    static double q[B * HQ * L * E], k[B * HKV * S * E], v[B * HKV * S * EV], ref[EV];
    static float qf[B * HQ * L * E], kf[B * HKV * S * E], vf[B * HKV * S * EV];
    static double out[B * HQ * L * EV], lse[B * HQ * L];
    static float outf[B * HQ * L * EV], lsef[B * HQ * L];
    static uint16_t k16[B * HKV * S * E], v16[B * HKV * S * EV];
    static int8_t k8[B * HKV * S * E], v8[B * HKV * S * EV];
    static float ksc[B * HKV * S], vsc[B * HKV * S], kch[B * HKV * E];
    static unsigned char mask[B * HQ * L * S];
    int64_t kv_len[B] = {S, S - 11};
    for (int i = 0; i < B * HQ * L * E; i++) qf[i] = (float)(q[i] = rnd());
    for (int i = 0; i < B * HKV * S * E; i++) kf[i] = (float)(k[i] = rnd());
    for (int i = 0; i < B * HKV * S * EV; i++) vf[i] = (float)(v[i] = rnd());
    for (int i = 0; i < B * HQ * L * S; i++) mask[i] = rand() % 7 != 0;
    /* q and k are rounded through float for both dtypes' references */
    for (int i = 0; i < B * HQ * L * E; i++) q[i] = qf[i];
    for (int i = 0; i < B * HKV * S * E; i++) k[i] = kf[i];
    for (int i = 0; i < B * HKV * S * EV; i++) v[i] = vf[i];
    /* 16-bit and int8 storage: K and V stored so, the reference reads the stored values exactly */
    const int storage = dtype == FA_F16 || dtype == FA_BF16 || dtype == FA_I8;
    if (dtype == FA_F16 || dtype == FA_BF16) {
        for (int i = 0; i < B * HKV * S * E; i++) {
            k16[i] = dtype == FA_F16 ? fa_f32_to_f16(kf[i]) : fa_f32_to_bf16(kf[i]);
            k[i] = dtype == FA_F16 ? fa_f16_to_f32(k16[i]) : fa_bf16_to_f32(k16[i]);
        }
        for (int i = 0; i < B * HKV * S * EV; i++) {
            v16[i] = dtype == FA_F16 ? fa_f32_to_f16(vf[i]) : fa_f32_to_bf16(vf[i]);
            v[i] = dtype == FA_F16 ? fa_f16_to_f32(v16[i]) : fa_bf16_to_f32(v16[i]);
        }
    }
    /* channel factors: 1, or 2^(e % 5) · 0.75 (the key is k8 · scale · factor) */
    for (int i = 0; i < B * HKV * E; i++) kch[i] = mods.channels ? 0.75f * (float)(1 << (i % E % 5)) : 1.0f;
    if (dtype == FA_I8) /* symmetric per row: scale = max|x / factor| / 127 */
        for (int row = 0; row < B * HKV * S; row++) {
            float mk = 0, mv = 0;
            const float *c = kch + row / S * E;
            for (int e = 0; e < E; e++) mk = fmaxf(mk, fabsf(kf[row * E + e] / c[e]));
            for (int e = 0; e < EV; e++) mv = fmaxf(mv, fabsf(vf[row * EV + e]));
            ksc[row] = mk / 127; vsc[row] = mv / 127;
            for (int e = 0; e < E; e++) {
                k8[row * E + e] = (int8_t)lrintf(kf[row * E + e] / c[e] / ksc[row]);
                k[row * E + e] = (double)k8[row * E + e] * ksc[row] * c[e];
            }
            for (int e = 0; e < EV; e++) {
                v8[row * EV + e] = (int8_t)lrintf(vf[row * EV + e] / vsc[row]);
                v[row * EV + e] = (double)v8[row * EV + e] * vsc[row];
            }
        }

    fa_args a;
    fa_args_init(&a);
    a.dtype = dtype;
    a.B = B; a.Hq = HQ; a.Hkv = HKV; a.L = L; a.S = S; a.E = E; a.Ev = EV;
    int f32 = dtype != FA_F64;
    a.q = f32 ? (void *)qf : (void *)q;
    a.k = f32 ? (void *)kf : (void *)k;
    a.v = f32 ? (void *)vf : (void *)v;
    if (dtype == FA_F16 || dtype == FA_BF16) { a.k = k16; a.v = v16; }
    if (dtype == FA_I8) {
        a.k = k8; a.v = v8; a.k_scale = ksc; a.v_scale = vsc;
        int64_t ss[3] = {HKV * S, S, 1};
        for (int d = 0; d < 3; d++) { a.k_scale_stride[d] = ss[d]; a.v_scale_stride[d] = ss[d]; }
        if (mods.channels) {
            a.k_channel = kch;
            a.k_channel_stride[0] = HKV * E; a.k_channel_stride[1] = E;
        }
    }
    if (storage) { a.q_dtype = FA_F32; a.out_dtype = FA_F32; }
    a.out = f32 ? (void *)outf : (void *)out;
    a.lse = f32 ? (void *)lsef : (void *)lse;
    int64_t qs[3] = {HQ * L * E, L * E, E}, ks[3] = {HKV * S * E, S * E, E};
    int64_t vs[3] = {HKV * S * EV, S * EV, EV}, os[3] = {HQ * L * EV, L * EV, EV}, ls[3] = {HQ * L, L, 1};
    for (int d = 0; d < 3; d++) {
        a.q_stride[d] = qs[d]; a.k_stride[d] = ks[d]; a.v_stride[d] = vs[d];
        a.out_stride[d] = os[d]; a.lse_stride[d] = ls[d];
    }
    a.scale = 0.3;
    a.mask_kind = FA_MASK_BOOL;
    a.mask = mask;
    a.mask_stride[0] = HQ * L * S; a.mask_stride[1] = L * S; a.mask_stride[2] = S; a.mask_stride[3] = 1;
    a.causal = causal; a.align = align; a.window_left = wl; a.window_right = wr;
    a.kv_len = kv_len;
    a.softcap = mods.softcap;
    a.alibi_slopes = mods.slopes;
    a.alibi_stride[0] = 0; a.alibi_stride[1] = 1;
    a.sinks = mods.sinks;
    a.q_start = mods.q_start; a.k_start = mods.k_start;
    a.num_threads = 2;
    int rc = fa_attention(&a);
    check(rc == FA_OK, fa_strerror(rc));
    double worst = 0;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < HQ; h++)
            for (int i = 0; i < L; i++) {
                double ref_lse;
                naive_row(q, k, v, mask, kv_len, b, h, i, causal, align, wl, wr, 0.3, ref, &ref_lse);
                int row = (b * HQ + h) * L + i;
                for (int e = 0; e < EV; e++) {
                    double got = f32 ? outf[row * EV + e] : out[row * EV + e];
                    double err = fabs(got - ref[e]);
                    if (!(err <= worst)) worst = err; /* NaN makes worst NaN */
                }
                double got_lse = f32 ? lsef[row] : lse[row];
                if (isinf(ref_lse)) { if (!(isinf(got_lse) && got_lse < 0)) worst = INFINITY; }
                else if (!(fabs(got_lse - ref_lse) <= worst)) worst = fmax(worst, fabs(got_lse - ref_lse));
            }
    char what[160];
    static const char *names[] = {"", "f32", "f64", "f16", "bf16", "i8"};
    snprintf(what, sizeof what, "%s %s causal=%d align=%d window=(%lld,%lld) softcap=%g alibi=%d sinks=%d "
             "positions=%d channels=%d: max error %.3g", fa_isa(), names[dtype], causal, align, (long long)wl,
             (long long)wr, mods.softcap, !!mods.slopes, !!mods.sinks, !!mods.q_start, mods.channels, worst);
    check(worst < (f32 ? 2e-5 : 1e-12), what);
}

/* bfloat16 q, K, V and out, E a multiple of 32 and Ev of 16: the amx set
 * runs its tile products on this (src_c/kernel_amx.h), the avx512bf16 set
 * its VDPBF16PS scores (src_c/kernel_dpbf16.h), every other set its float
 * code. Causal GQA with ragged L and S against a naive double loop on
 * the same bfloat16 values; the output's rounding to bfloat16 (2^-8 relative
 * at most) dominates the error. */
static void run_bf16_out_case(void) {
    enum { TB = 2, TL = 37, TS = 150, TE = 64, TEV = 48 };
    static uint16_t q[TB * HQ * TL * TE], k[TB * HKV * TS * TE], v[TB * HKV * TS * TEV], out[TB * HQ * TL * TEV];
    static float lse[TB * HQ * TL];
    for (int i = 0; i < TB * HQ * TL * TE; i++) q[i] = fa_f32_to_bf16((float)rnd());
    for (int i = 0; i < TB * HKV * TS * TE; i++) k[i] = fa_f32_to_bf16((float)rnd());
    for (int i = 0; i < TB * HKV * TS * TEV; i++) v[i] = fa_f32_to_bf16((float)rnd());
    int64_t kv_len[TB] = {TS, TS - 41};
    fa_args a;
    fa_args_init(&a);
    a.dtype = a.q_dtype = a.out_dtype = FA_BF16;
    a.B = TB; a.Hq = HQ; a.Hkv = HKV; a.L = TL; a.S = TS; a.E = TE; a.Ev = TEV;
    a.q = q; a.k = k; a.v = v; a.out = out; a.lse = lse;
    int64_t qs[3] = {HQ * TL * TE, TL * TE, TE}, ks[3] = {HKV * TS * TE, TS * TE, TE};
    int64_t vs[3] = {HKV * TS * TEV, TS * TEV, TEV}, os[3] = {HQ * TL * TEV, TL * TEV, TEV}, ls[3] = {HQ * TL, TL, 1};
    for (int d = 0; d < 3; d++) {
        a.q_stride[d] = qs[d]; a.k_stride[d] = ks[d]; a.v_stride[d] = vs[d];
        a.out_stride[d] = os[d]; a.lse_stride[d] = ls[d];
    }
    a.scale = 0.125; a.causal = 1; a.kv_len = kv_len; a.num_threads = 2;
    int rc = fa_attention(&a);
    check(rc == FA_OK, fa_strerror(rc));
    double worst = 0, worst_lse = 0;
    for (int b = 0; b < TB; b++)
        for (int h = 0; h < HQ; h++)
            for (int i = 0; i < TL; i++) {
                const int hk = h / (HQ / HKV), row = (b * HQ + h) * TL + i;
                const int64_t last = i + kv_len[b] - TL; /* bottom-right causal */
                double s[TS], mx = -INFINITY, sum = 0, o[TEV] = {0};
                for (int j = 0; j <= last; j++) {
                    double dot = 0;
                    for (int e = 0; e < TE; e++)
                        dot += (double)fa_bf16_to_f32(q[row * TE + e]) * fa_bf16_to_f32(k[((b * HKV + hk) * TS + j) * TE + e]);
                    s[j] = dot * 0.125;
                    mx = fmax(mx, s[j]);
                }
                for (int j = 0; j <= last; j++) {
                    const double p = exp(s[j] - mx);
                    sum += p;
                    for (int e = 0; e < TEV; e++) o[e] += p * fa_bf16_to_f32(v[((b * HKV + hk) * TS + j) * TEV + e]);
                }
                for (int e = 0; e < TEV; e++) {
                    const double err = fabs(fa_bf16_to_f32(out[row * TEV + e]) - o[e] / sum);
                    if (!(err <= worst)) worst = err;
                }
                const double lerr = fabs(lse[row] - (mx + log(sum)));
                if (!(lerr <= worst_lse)) worst_lse = lerr;
            }
    char what[128];
    snprintf(what, sizeof what, "%s bf16 q/k/v/out, E 64, Ev 48: max error %.3g, lse %.3g", fa_isa(), worst,
             worst_lse);
    /* |out| ≤ max|v| ≤ 1, where half an ulp of bfloat16 is at most 2^-9; lse is float32 */
    check(worst <= 1.0 / 256 && worst_lse <= 1e-5, what);
}

int main(void) {
    const char *isas[] = {"amx", "avx512bf16", "avx512", "avx2", "sse2", "neon", "scalar"};
    for (int n = 0; n < (int)(sizeof isas / sizeof isas[0]); n++) {
        if (!fa_isa_supported(isas[n])) continue;
        check(fa_set_isa(isas[n]) == FA_OK, "fa_set_isa");
        for (int dt = FA_F32; dt <= FA_F64; dt++) {
            run_case(dt, 0, FA_ALIGN_BOTTOM_RIGHT, -1, -1);
            run_case(dt, 1, FA_ALIGN_BOTTOM_RIGHT, -1, -1);
            run_case(dt, 1, FA_ALIGN_TOP_LEFT, 5, -1);
            run_case(dt, 0, FA_ALIGN_BOTTOM_RIGHT, 9, 3);
            /* each modifier, then all together */
            static const double slopes[HQ] = {0.5, 0.25, 0.125, 0.0625}, sinks[HQ] = {0.3, -1, -INFINITY, 2};
            static const int64_t q_start[B] = {100, 7}, k_start[B] = {80, 0};
            mods.softcap = 0.4;
            run_case(dt, 1, FA_ALIGN_BOTTOM_RIGHT, -1, -1);
            mods.softcap = 0; mods.slopes = slopes;
            run_case(dt, 1, FA_ALIGN_TOP_LEFT, -1, -1);
            mods.slopes = NULL; mods.sinks = sinks;
            run_case(dt, 0, FA_ALIGN_BOTTOM_RIGHT, 9, 3);
            mods.sinks = NULL; mods.q_start = q_start; mods.k_start = k_start;
            run_case(dt, 1, FA_ALIGN_BOTTOM_RIGHT, 30, -1);
            mods.softcap = 0.4; mods.slopes = slopes; mods.sinks = sinks;
            run_case(dt, 1, FA_ALIGN_BOTTOM_RIGHT, -1, -1);
            mods.softcap = 0; mods.slopes = NULL; mods.sinks = NULL; mods.q_start = mods.k_start = NULL;
        }
        for (int dt = FA_F16; dt <= FA_I8; dt++) { /* 16-bit and int8 K/V, float32 q and out */
            run_case(dt, 0, FA_ALIGN_BOTTOM_RIGHT, -1, -1);
            run_case(dt, 1, FA_ALIGN_TOP_LEFT, 5, -1);
        }
        mods.channels = 1; /* int8 keys with per-channel factors */
        run_case(FA_I8, 1, FA_ALIGN_BOTTOM_RIGHT, -1, -1);
        run_case(FA_I8, 0, FA_ALIGN_TOP_LEFT, 9, 3);
        mods.channels = 0;
        run_bf16_out_case();
        printf("%s: checked\n", isas[n]);
    }
    check(fa_set_isa("no-such-isa") == FA_ERR_ISA, "unknown ISA refused");
    check(fa_set_isa(NULL) == FA_OK, "back to auto");

    /* Bad arguments are refused with their own code, before anything is read. */
    fa_args a;
    fa_args_init(&a);
    check(fa_attention(NULL) == FA_ERR_NULL_ARGS, "NULL args");
    a.B = 1; a.Hq = 3; a.Hkv = 2; a.L = 4; a.S = 4; a.E = 4; a.Ev = 4;
    check(fa_attention(&a) == FA_ERR_HEADS, "Hq not a multiple of Hkv");
    a.Hkv = 1;
    check(fa_attention(&a) == FA_ERR_NULL_POINTER, "NULL q");
    a.L = -1;
    check(fa_attention(&a) == FA_ERR_SIZE, "negative L");
    a.L = 4; a.dtype = 7;
    check(fa_attention(&a) == FA_ERR_DTYPE, "bad dtype");
    a.dtype = FA_F32; a.scale = NAN;
    check(fa_attention(&a) == FA_ERR_SCALE, "NaN scale");
    a.scale = 1; a.window_left = -2;
    check(fa_attention(&a) == FA_ERR_WINDOW, "window below -1");
    a.window_left = -1; a.mask_kind = 9;
    check(fa_attention(&a) == FA_ERR_MASK_KIND, "bad mask kind");
    a.mask_kind = FA_MASK_NONE; a.num_threads = -1;
    check(fa_attention(&a) == FA_ERR_THREADS, "negative threads");
    a.num_threads = 0;
    float buf[64] = {0};
    a.q = a.k = a.v = buf; a.out = buf;
    a.out_stride[0] = 0; a.out_stride[1] = 0; a.out_stride[2] = 0; /* every row at one address */
    check(fa_attention(&a) == FA_ERR_STRIDE, "aliasing out rows");
    a.out_stride[2] = INT64_MAX / 2;
    check(fa_attention(&a) == FA_ERR_STRIDE, "stride overflow");
    int64_t bad_len[1] = {5};
    a.out_stride[0] = 16; a.out_stride[1] = 16; a.out_stride[2] = 4; a.kv_len = bad_len;
    check(fa_attention(&a) == FA_ERR_KV_LEN, "kv_len above S");
    a.kv_len = NULL; a.softcap = -1;
    check(fa_attention(&a) == FA_ERR_SOFTCAP, "negative softcap");
    a.softcap = INFINITY;
    check(fa_attention(&a) == FA_ERR_SOFTCAP, "infinite softcap");
    a.softcap = 0;
    double nan_slope[1] = {NAN}, inf_sink[1] = {INFINITY};
    a.alibi_slopes = nan_slope;
    check(fa_attention(&a) == FA_ERR_ALIBI, "NaN ALiBi slope");
    a.alibi_slopes = NULL; a.sinks = inf_sink;
    check(fa_attention(&a) == FA_ERR_SINKS, "+inf sink");
    a.sinks = NULL;
    int64_t far[1] = {(int64_t)1 << 61};
    a.k_start = far;
    check(fa_attention(&a) == FA_ERR_POSITION, "position beyond 2^60");
    a.k_start = NULL;
    float ones[4] = {1, 1, 1, 1};
    a.k_channel = ones; /* channel factors belong to FA_I8 */
    check(fa_attention(&a) == FA_ERR_SCALES, "k_channel with FA_F32");
    a.k_channel = NULL;
    check(fa_strerror(FA_ERR_HEADS)[0] != 0 && fa_strerror(12345)[0] != 0, "fa_strerror");

    printf("C API: %d passed, %d failed\n", passed, failed);
    return failed != 0;
}
