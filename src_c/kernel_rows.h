/* kernel_rows.h — the row layout: items of a few query rows (decoding: one
 * new row per head, or the g heads of one grouped-query group). Included by
 * kernel_dtype.h, whose vocabulary, masks and finishing step it shares.
 *
 * With few rows the lane layout wastes its lanes: one row in a 16-lane vector
 * is one useful multiply-add per K element, and decoding must stream K and V
 * at memory speed. Here vectors run along the head dim instead: a score is a
 * dot product of q with a K row (vector FMAs, then one horizontal sum), and
 * P·V adds p·(V row) into each output row. Every K and V vector is loaded
 * once and used by all the item's rows.
 */
#define FA_FEW FA_ROWS_MAX   /* rows at most: the per-row arrays below */

/* max of the lanes; like v_max, a NaN lane never wins. */
static inline T FN(v_hmax)(VT x) {
    T t[W];
    memcpy(t, &x, sizeof t);
    for (int w = W / 2; w > 0; w /= 2)
        for (int u = 0; u < w; u++) t[u] = t[u + w] > t[u] ? t[u + w] : t[u];
    return t[0];
}

/* One row computes the scores of FA_ROW_SUPER blocks at a time (st holds
 * FA_ST_BLOCKS blocks: FA_FEW rows of one block, or FA_ROW_SUPER blocks of
 * one row), then softmax and P·V block by block as before: K and V are read
 * in runs of FA_ROW_SUPER blocks, not in alternate blocks. The same
 * operations in the same order: the same bits. */
#ifndef FA_ROW_SUPER
#define FA_ROW_SUPER 1
#endif
_Static_assert(FA_ROW_SUPER >= 1, "a run is at least one block");
#define FA_ST_BLOCKS (FA_ROW_SUPER > FA_FEW ? FA_ROW_SUPER : FA_FEW)

/* Scratch of one thread: q rows (FA_FEW × E, padded to whole vectors), o rows
 * (FA_FEW × Ev), scores (FA_ST_BLOCKS × FA_BK). */
static size_t FN(rows_scratch_bytes)(int64_t E, int64_t Ev) {
    const size_t nE = (size_t)((E + W - 1) / W), nEv = (size_t)((Ev + W - 1) / W);
    return FN(round_up)(FA_FEW * nE * sizeof(VT)) + 3 * FN(round_up)(FA_FEW * nEv * sizeof(VT)) +
           FN(round_up)(FA_ST_BLOCKS * FA_BK * sizeof(T));
}

/* s[r][j] = q_r · K_j for the nb keys of a block, R rows (a constant here).
 * Each dot product ends as one vector of partial sums; W keys' vectors are
 * summed together by v_hsums (one transpose-and-add tree per W scores, not a
 * tree per score). Lanes past nb are written too (st rows hold FA_BK, a
 * multiple of W); rows_softmax overwrites them with −inf. A single row
 * reads each K row whole in turn (it streams K faster that way:
 * docs/tuning.md) and takes FA_ROW_KEYS keys at a time, each with its own
 * accumulator: one key's E/W multiply-adds are a chain (16 × 5 cycles at
 * E = 128 on Zen 2, longer than the loads), so only independent keys keep
 * the FMA units busy. Four keys share one tree (v_hsums4: int8 rows on a
 * Xeon from memory 0.91 of the time of four trees, "Stop 35"). Each score is
 * still the same sum in the same order: the same bits. */
_Static_assert(FA_BK % W == 0, "rows of st hold whole vectors of scores");
/* Keys at a time for one row (a set may choose; the AVX-512 sets take 1, each
 * key's row read whole in turn, for the hardware prefetcher: "Stop 28"). */
#ifndef FA_ROW_KEYS
#define FA_ROW_KEYS 4
#endif
/* Items of R rows (R > 1) over converted storage where FA_ROWS_E_CONST(R)
 * holds compute their scores with E a constant at E = 4·W and 8·W
 * (dot_scores_n; 0: never). */
#ifndef FA_ROWS_E_CONST
#define FA_ROWS_E_CONST(R) 0
#endif
/* Items of R rows (R > 1) where FA_ROWS_KEY_PAIRS(R) holds compute their
 * scores two keys at a time (dot_scores_keys; 0: one). */
#ifndef FA_ROWS_KEY_PAIRS
#define FA_ROWS_KEY_PAIRS(R) 0
#endif
/* Vectors of K or V a 64-byte cache line holds (at least 1; a power of 2): the rows with
 * several query rows ask for the next block a line at a time (docs/tuning.md). */
#define FA_LINE_VECS (64 / (W * (int)sizeof(KV)) > 0 ? 64 / (W * (int)sizeof(KV)) : 1)
/* P·V's vectors of the head dim at a time (dot_values_n), set per ISA by
 * measurement (kernels_<isa>.c): items of up to FA_ROWS_WHOLE_MAX rows read
 * each V row whole (8 vectors where 8 hold it, else FA_ROW_GROUP; with
 * FA_ROW_SHORT_G4, 4 where 4 hold it); items of more rows take
 * FA_ROWS_MANY_G vectors at a time. Each G is one more copy of the P·V loop
 * for every row count: G = 4 everywhere made the AVX2 kernel's sanitizer
 * build (CI) a third slower, for rows of E <= 32 only there. */
#ifndef FA_ROW_GROUP
#define FA_ROW_GROUP 8
#endif
#ifndef FA_ROWS_WHOLE_MAX
#define FA_ROWS_WHOLE_MAX 1
#endif
#ifndef FA_ROWS_MANY_G
#define FA_ROWS_MANY_G 1
#endif
#ifndef FA_ROW_SHORT_G4
#define FA_ROW_SHORT_G4 0
#endif
/* Items of 2 to FA_ROWS_WHOLE_MAX rows of over 8 vectors over converting
 * storage (16-bit, int8) take P·V FA_ROWS_CONVERT_G vectors at a time where
 * a set names it (0: FA_ROW_GROUP, as float32): the widening needs
 * registers too. */
#ifndef FA_ROWS_CONVERT_G
#define FA_ROWS_CONVERT_G 0
#endif
/* The block prefetches: one row's scores (dot_scores_row) ask for the next
 * block's K rows in a burst of FA_ROW_KEYS rows before the sums, and P·V for
 * the next block's V rows for items of up to FA_ROW_PF_V_ROWS rows, for
 * storage of at least FA_ROW_PF_BYTES bytes an element (0: none); the spread
 * K prefetch of stops 25-27 is gone with stop 28 ("Stop 28"). GCC 12
 * compiled these calls to nothing until stop 26 (fa_prefetch_l2_kept in
 * internal.h), so every set measured without them; now each set asks for
 * them where it measured faster (docs/tuning.md, "Stop 26"). */
#ifndef FA_ROW_PF_BYTES
#define FA_ROW_PF_BYTES 0
#endif
#ifndef FA_ROW_PF_V_ROWS
#define FA_ROW_PF_V_ROWS 0
#endif
#define FA_ROW_PF (FA_ROW_PF_BYTES > 0 && (int)sizeof(KV) >= FA_ROW_PF_BYTES)
/* One row asks (its K burst and its V rows) only for storage of at most
 * FA_ROW1_PF_MAX_BYTES bytes an element: on Zen 3 one float32 or 16-bit row
 * read from memory faster with no software prefetch at all, int8 slower
 * ("Stop 36"). Items of several rows are not affected. */
#ifndef FA_ROW1_PF_MAX_BYTES
#define FA_ROW1_PF_MAX_BYTES 8
#endif
#define FA_ROW1_PF (FA_ROW_PF && (int)sizeof(KV) <= FA_ROW1_PF_MAX_BYTES)
/* Items of R rows where FA_ROWS_PF_V_NOW(R) holds ask for this block's V rows
 * while they compute its scores, a line with each line of K (0: never). With
 * several rows a key costs many multiply-adds, so V, asked for then, is there
 * by P·V, which otherwise waits for it (docs/tuning.md, "Stop 27"). */
#ifndef FA_ROWS_PF_V_NOW
#define FA_ROWS_PF_V_NOW(R) 0
#endif

/* One row over bfloat16 storage reads K and V in pair order (kv_pair in
 * kernel_dtype.h): each pair of whole vectors (2c, 2c+1) of a row as its
 * even elements, then its odd ones. q's packed row holds each pair in that
 * order too (pairs_order at the packing), and so do the P·V sums, put back
 * in element order at the store. A score is then the same products summed
 * in other lanes (other bits than element order, the same for any thread
 * count); o's elements are the same sums (the same bits). Only where one
 * row takes every key one at a time (FA_ROW_KEYS 1: the general loop of
 * dot_scores_n never sees it) and P·V takes G = 4, 8 or FA_ROW_GROUP
 * (always, for one row over converted storage; all even). The pairs need
 * no registers to widen, so over 8 vectors one row reads V whole rows at a
 * time (FA_ROW_GROUP), not in strips of 8 as float16 and int8 do. On a
 * Xeon, 1x32x1x4096x128 from memory took 0.77-0.79 of the time with the
 * AVX2 set (0.90 with strips of 8), from cache 0.88 (0.84), and 0.96-0.98
 * with AVX-512. Items of several rows keep element order: there the
 * multiply-adds outnumber the conversions, and the pair loops measured
 * level or slower (docs/tuning.md, "Stop 38"). */
#if FA_KV_PAIRS
#define FA_ROW1_PAIRS (FA_ROW_KEYS == 1)

/* The first n_pairs pairs of vectors of a row of T, from element order into
 * pair order (to_pairs) or back. */
static void FN(pairs_order)(T *x, int64_t n_pairs, int to_pairs) {
    for (int64_t c = 0; c < n_pairs; c++) {
        T *y = x + 2 * c * W, t[2 * W];
        memcpy(t, y, sizeof t);
        for (int i = 0; i < W; i++) {
            if (to_pairs) {
                y[i] = t[2 * i];
                y[W + i] = t[2 * i + 1];
            } else {
                y[2 * i] = t[i];
                y[2 * i + 1] = t[W + i];
            }
        }
    }
}
#endif

/* One row, keys j0 .. j0 + FA_ROW_KEYS − 1: st[j] = q · K_j. */
static inline __attribute__((always_inline)) void FN(dot_scores_row)(
    T *st, const VT *qs, const KV *k, int64_t k_rs, int64_t E, int64_t j0) {
    const int64_t full = E / W, tail = E % W;
    VT acc[FA_ROW_KEYS];
    for (int t = 0; t < FA_ROW_KEYS; t++) {
        if (FA_ROW1_PF) fa_prefetch_l2_kept(k + (j0 + t + FA_BK) * k_rs, E * (int64_t)sizeof(KV));
        acc[t] = (VT){0};
    }
    int64_t u = 0;
#if FA_KV_PAIRS
    if (FA_ROW1_PAIRS) /* whole pairs; an odd last vector below, in element order */
        for (; u + 2 <= full; u += 2)
            for (int t = 0; t < FA_ROW_KEYS; t++) {
                VT a, b;
                FN(kv_pair)(k + (j0 + t) * k_rs + u * W, &a, &b);
                acc[t] += qs[u] * a;
                acc[t] += qs[u + 1] * b;
            }
#endif
    for (; u < full; u++)
        for (int t = 0; t < FA_ROW_KEYS; t++) acc[t] += qs[u] * FN(kv_load)(k + (j0 + t) * k_rs + u * W);
    if (tail)
        for (int t = 0; t < FA_ROW_KEYS; t++)
            acc[t] += qs[full] * FN(kv_load_part)(k + (j0 + t) * k_rs + full * W, (int)tail);
    if (FA_ROW_KEYS % 4 == 0)
        for (int t = 0; t < FA_ROW_KEYS; t += 4) FN(v_hsums4)(acc + t, st + j0 + t);
    else
        for (int t = 0; t < FA_ROW_KEYS; t++) st[j0 + t] = FN(v_hsum)(acc[t]);
}

/* Keys jj … of the W at j0, KK (1 or 2) at a time, as long as KK remain:
 * part[r][j] = the vector of q_r · K_j's partial sums (one row: st[j] = the
 * sum); returns the first key not done. E is a constant where dot_scores_n
 * calls with one. With two keys each q vector is loaded once into a
 * register for both (FA_IN_REGISTER: GCC would otherwise fold the load
 * into both multiply-adds): on the Xeon of stop 40, twelve chains of
 * multiply-adds that each bring a 512-bit load ran 4.0-4.1 G a second,
 * on registers 5.0-6.2 G. Each score is the same sum in the same order:
 * the same bits. */
static inline __attribute__((always_inline)) int64_t FN(dot_scores_keys)(
    const int R, const int KK, T *st, VT part[][W], const VT *qs, const int64_t nE, const KV *k, int64_t k_rs,
    const int64_t E, int64_t j0, int64_t jj, int64_t nk, const KV *v, int64_t v_rs, int64_t Ev) {
    const int64_t full = E / W, tail = E % W;
    for (; jj + KK <= nk; jj += KK) {
        const KV *kj = k + (j0 + jj) * k_rs, *vj = v + (j0 + jj) * v_rs;
        VT acc[2][FA_FEW];
        for (int t = 0; t < KK; t++)
            for (int r = 0; r < R; r++) acc[t][r] = (VT){0};
        for (int64_t u = 0; u < full; u++) {
            /* The next block's rows, a line at a time: decoding streams K and V from memory once. */
            if (u % FA_LINE_VECS == 0)
                for (int t = 0; t < KK; t++) {
                    __builtin_prefetch(kj + (FA_BK + t) * k_rs + u * W, 0, 2);
                    if (FA_ROWS_PF_V_NOW(R) && u * W < Ev) __builtin_prefetch(vj + t * v_rs + u * W, 0, 2);
                }
            VT kv[2];
            for (int t = 0; t < KK; t++) kv[t] = FN(kv_load)(kj + t * k_rs + u * W);
            for (int r = 0; r < R; r++) {
                VT q = qs[r * nE + u];
                if (KK > 1) FA_IN_REGISTER(q);
                for (int t = 0; t < KK; t++) acc[t][r] += q * kv[t];
            }
        }
        if (FA_ROWS_PF_V_NOW(R)) /* V's lines past K's (tail, Ev > E) */
            for (int64_t e = (full + FA_LINE_VECS - 1) / FA_LINE_VECS * FA_LINE_VECS * W; e < Ev;
                 e += FA_LINE_VECS * W)
                for (int t = 0; t < KK; t++) __builtin_prefetch(vj + t * v_rs + e, 0, 2);
        if (tail) {
            VT kv[2];
            for (int t = 0; t < KK; t++) {
                if (full % FA_LINE_VECS == 0) __builtin_prefetch(kj + (FA_BK + t) * k_rs + full * W, 0, 2);
                kv[t] = FN(kv_load_part)(kj + t * k_rs + full * W, (int)tail);
            }
            for (int r = 0; r < R; r++)
                for (int t = 0; t < KK; t++) acc[t][r] += qs[r * nE + full] * kv[t];
        }
        for (int t = 0; t < KK; t++) {
            if (R == 1) st[j0 + jj + t] = FN(v_hsum)(acc[t][0]);
            else for (int r = 0; r < R; r++) part[r][jj + t] = acc[t][r];
        }
    }
    return jj;
}

static inline __attribute__((always_inline)) void FN(dot_scores_n)(
    const int R, T *st, const VT *qs, int64_t nE, const KV *k, int64_t k_rs, int64_t E, int64_t nb,
    const KV *v, int64_t v_rs, int64_t Ev) {
    for (int64_t j0 = 0; j0 < nb; j0 += W) {
        const int64_t nk = nb - j0 < W ? nb - j0 : W;
        VT part[FA_FEW][W];
        int64_t jj = 0;
        /* One row: E a constant at the common head dims (whole vectors), so
         * that GCC unrolls the sums and keeps the accumulators in registers
         * (on a Xeon from memory 0.93-0.96 of the time, 0.85-0.88 from cache;
         * the AVX2 set forced 0.93-1.02: "Stop 35"). */
#define FA_ROW_RUN(e) \
    for (; jj + FA_ROW_KEYS <= nk; jj += FA_ROW_KEYS) FN(dot_scores_row)(st, qs, k, k_rs, e, j0 + jj)
        if (R == 1) {
            if (E == 4 * W) FA_ROW_RUN(4 * W);
            else if (E == 8 * W) FA_ROW_RUN(8 * W);
            else if (E == 16 * W) FA_ROW_RUN(16 * W);
            else FA_ROW_RUN(E);
        }
#undef FA_ROW_RUN
        /* Several rows over converted storage: E a constant at the common
         * head dims where the set asks (FA_ROWS_E_CONST), as for one row
         * above: the sums unrolled, with no loop or prefetch test a vector.
         * Float32 keeps the loop: unrolled, its grouped rows read from
         * memory slower. Where the set asks (FA_ROWS_KEY_PAIRS), two keys
         * at a time, and an odd last key alone (docs/tuning.md, "Stop 40"). */
#define FA_KEYS(kk, e) jj = FN(dot_scores_keys)(R, kk, st, part, qs, (e) / W, k, k_rs, e, j0, jj, nk, v, v_rs, Ev)
#define FA_E_CONST (FA_CONVERTS && R > 1 && FA_ROWS_E_CONST(R))
#define FA_KK (R > 1 && FA_ROWS_KEY_PAIRS(R) ? 2 : 1)
        if (FA_E_CONST && E == 4 * W) FA_KEYS(FA_KK, 4 * W);
        else if (FA_E_CONST && E == 8 * W) FA_KEYS(FA_KK, 8 * W);
        else jj = FN(dot_scores_keys)(R, FA_KK, st, part, qs, nE, k, k_rs, E, j0, jj, nk, v, v_rs, Ev);
        if (FA_KK > 1) jj = FN(dot_scores_keys)(R, 1, st, part, qs, nE, k, k_rs, E, j0, jj, nk, v, v_rs, Ev);
#undef FA_KK
#undef FA_E_CONST
#undef FA_KEYS
        if (R == 1) continue;
        for (int r = 0; r < R; r++) {
            for (int64_t jj = nk; jj < W; jj++) part[r][jj] = (VT){0};
            const VT sums = FN(v_hsums)(part[r]);
            memcpy(st + r * FA_BK + j0, &sums, sizeof sums);
        }
    }
}

/* acc[r][i] += Σ_j p[r][j] · V_j[i·W …] for the g vectors at v (column u0·W
 * of each row), prefetching pf_bytes at pf of the next block's rows. whole
 * (a constant at each call): all G vectors are whole, so neither the count
 * nor a tail is tested per key; else `whole_vecs` of them are whole and the
 * one after has `tail` lanes. */
static inline __attribute__((always_inline)) void FN(values_group)(
    const int R, const int G, const int whole, VT acc[][FA_ROW_GROUP], const T *st, const KV *v, int64_t v_rs, const KV *pf,
    int64_t pf_bytes, int64_t nb, int g, int64_t whole_vecs, int64_t tail) {
    for (int64_t j = 0; j < nb; j++) {
        const KV *vj = v + j * v_rs;
        if (FA_ROW_PF && R <= FA_ROW_PF_V_ROWS && (R > 1 || FA_ROW1_PF)) fa_prefetch_l2_kept(pf + j * v_rs, pf_bytes);
        int i = 0;
#if FA_KV_PAIRS
        if (FA_ROW1_PAIRS && R == 1 && G % 2 == 0) /* whole pairs (2c, 2c+1) in pair order; the rest below */
            for (; i + 1 < G && (whole || i + 1 < whole_vecs); i += 2) {
                VT a, b;
                FN(kv_pair)(vj + i * W, &a, &b);
                acc[0][i] += st[j] * a;
                acc[0][i + 1] += st[j] * b;
            }
#endif
        for (; i < G; i++) {
            if (!whole && i >= g) break;
            const VT vv = whole || i < whole_vecs ? FN(kv_load)(vj + i * W) : FN(kv_load_part)(vj + i * W, (int)tail);
            for (int r = 0; r < R; r++) acc[r][i] += st[r * FA_BK + j] * vv;
        }
    }
}

/* o[r] = o[r]·alpha[r] + Σ_j p[r][j] · V_j, G vectors of the head dim at a
 * time (a constant at each call: rows_item picks it); first: o[r] = Σ. The
 * sum starts from 0 and meets o once (a blocked sum: see TILE in
 * kernel_lanes.h). Each sum runs over j in order: the same bits for any G.
 *
 * Why whole rows: G vectors over a block's keys, then the next G, read V in
 * strips (the first G·W elements of every row of the block, then the next),
 * and from memory strips read slowly. On Zen 3 (AVX2), 1×32×1×4096×128
 * decoded 7-19 % faster with G = 16 (a whole row) than with 8, and grouped
 * rows (4 rows, G = 16 against 1) 25-40 % faster, from cache too; the
 * accumulators that 16 ymm registers do not hold live on the stack, a load
 * and a store a key, which memory hides (docs/tuning.md). One row of
 * 16-bit or int8 storage keeps 8, whose widening needs registers too: with
 * 16 it measured level from memory and up to 9 % slower from cache (one
 * bfloat16 row in pair order reads a whole row: below). On Zen 4
 * (AVX-512), 4 rows read whole (G = 8 at E = 128: 32 accumulators) took
 * 0.58-0.86x the time of G = 1, and 8 rows 4 vectors at a time 0.83-0.89x
 * (whole, 64 accumulators, was slower for int8); on an Intel Xeon 8 rows of
 * 2 vectors took 0.89-0.94x the time of 4 (the amx set's choice, "Stop
 * 34"). A whole row of 4 vectors or fewer takes G = 4 there
 * (FA_ROW_SHORT_G4): the loop of constant length
 * (E = 64, 4 rows: 0.59x with G = 4 against 0.93x with G = 8). */
_Static_assert(FA_ROWS_MANY_G <= FA_ROW_GROUP && FA_ROWS_CONVERT_G <= FA_ROW_GROUP && FA_ROW_GROUP >= 8,
               "acc holds G vectors a row");
static inline __attribute__((always_inline)) void FN(dot_values_n)(
    const int R, const int G, VT *os, int64_t nEv, const T *st, const KV *v, int64_t v_rs, int64_t Ev, int64_t nb,
    const T *alpha, int first) {
    const int64_t full = Ev / W, tail = Ev % W;
    for (int64_t u0 = 0; u0 < nEv; u0 += G) {
        const int g = nEv - u0 < G ? (int)(nEv - u0) : G;
        VT acc[FA_FEW][FA_ROW_GROUP];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < G; i++) acc[r][i] = (VT){0};
        const int64_t line = 64 / (int64_t)sizeof(KV);
        /* The next block's rows (where FA_ROW_PF asks): each cache line that
         * starts in these G vectors, every key. (A schedule for G = 1 that
         * shared a line out over its strips was removed at stop 26: GCC had
         * compiled its prefetch away, and no set runs G = 1 with one.) */
        const int64_t e0 = (u0 * W + line - 1) / line * line;
        const int64_t pf_bytes = ((u0 + g) * W - e0) * (int64_t)sizeof(KV);
        /* G whole vectors (the usual case) make the inner loop constant-length */
        if (g == G && u0 + G <= full)
            FN(values_group)(R, G, 1, acc, st, v + u0 * W, v_rs, v + FA_BK * v_rs + e0, pf_bytes, nb, g,
                             full - u0, tail);
        else
            FN(values_group)(R, G, 0, acc, st, v + u0 * W, v_rs, v + FA_BK * v_rs + e0, pf_bytes, nb, g,
                             full - u0, tail);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < g; i++) {
                VT *o = &os[r * nEv + u0 + i];
                *o = first ? acc[r][i] : *o * alpha[r] + acc[r][i];
            }
    }
}

/* As lanes_fold: the plain sums of the last FA_FOLD blocks, (os, l) at the
 * running max m, go into the compensated totals (tot + tc, lt + lc) at mt. */
static void FN(rows_fold)(int64_t rows, int64_t nEv, VT *os, VT *tot, VT *tc, const T *m, const T *l, T *mt,
                          VT *lt, VT *lc, int first) {
    const T log2e = (T)1.4426950408889634074;
    for (int64_t r = 0; r < rows; r++) {
        const T m_sub = m[r] == -(T)INFINITY ? 0 : m[r];
        const VT beta = first ? (VT){0} : FN(v_splat)(FN(v_exp2)(FN(v_splat)((mt[r] - m_sub) * log2e))[0]);
        if (first) lt[r] = lc[r] = (VT){0};
        FN(v_comp_step)(&lt[r], &lc[r], beta, FN(v_splat)(l[r]));
        mt[r] = m[r];
        for (int64_t u = r * nEv; u < (r + 1) * nEv; u++) {
            if (first) tot[u] = tc[u] = (VT){0};
            FN(v_comp_step)(&tot[u], &tc[u], beta, os[u]);
        }
    }
}

#define FA_BY_ROWS(R, call)                                                   \
    switch (R) {                                                              \
    case 1: call(1); break;                                                   \
    case 2: call(2); break;                                                   \
    case 3: call(3); break;                                                   \
    case 4: call(4); break;                                                   \
    case 5: call(5); break;                                                   \
    case 6: call(6); break;                                                   \
    case 7: call(7); break;                                                   \
    default: call(8); break;                                                  \
    }

/* Softcap and ALiBi on one block, row by row (as in kernel_lanes.h):
 * s[r][j] := c·tanh(s/c), then += −slope_r · |j0 + j − d_r|. */
static void FN(rows_modify)(const fa_args *a, T *st, int64_t rows, int64_t j0, int64_t nb, const T *neg_slope,
                            const int64_t *diag) {
    const int64_t nbv = (nb + W - 1) / W;
    VT iota;
    for (int i = 0; i < W; i++) iota[i] = (T)i;
    for (int64_t r = 0; r < rows; r++) {
        T *s = st + r * FA_BK; /* whole vectors: FA_BK is a multiple of W, st is aligned */
        if (a->softcap > 0) FN(softcap_vectors)((VT *)s, nbv, (T)a->softcap);
        if (!a->alibi_slopes) continue;
        const VT ns = FN(v_splat)(neg_slope[r]), dd = FN(v_splat)((T)(diag[r] - j0));
        for (int64_t u = 0; u < nbv; u++) {
            VT x = FN(v_loadu)(s + u * W) + ns * FN(v_abs)(iota + (T)(u * W) - dd);
            memcpy(s + u * W, &x, sizeof x);
        }
    }
}

/* Online softmax of one block, row by row (as in softmax_block). The rows'
 * rescale factors alpha take one exponential a vector of rows, not one a
 * row (lanes are independent: the same bits). */
static void FN(rows_softmax)(T *st, int64_t rows, int64_t nb, T *m, T *l, T *alpha) {
    const int64_t nbv = (nb + W - 1) / W;
    const T log2e = (T)1.4426950408889634074;
    T block_sum[FA_FEW];
    VT shift[(FA_FEW + W - 1) / W] = {{0}}; /* (m_old − m_new)·log2 e, a lane a row */
    for (int64_t r = 0; r < rows; r++) {
        T *s = st + r * FA_BK;
        for (int64_t j = nb; j < nbv * W; j++) s[j] = -(T)INFINITY; /* pad the last vector */
        VT mx = FN(v_splat)(m[r]);
        for (int64_t u = 0; u < nbv; u++) mx = FN(v_max)(mx, FN(v_loadu)(s + u * W));
        const T m_new = FN(v_hmax)(mx), m_sub = m_new == -(T)INFINITY ? 0 : m_new;
        const VT sum = FN(exp2_shifted)((VT *)s, 1, nbv, FN(v_splat)(m_sub)); /* whole vectors, aligned (rows_modify) */
        shift[r / W][r % W] = (m[r] - m_sub) * log2e;
        block_sum[r] = FN(v_hsum)(sum);
        m[r] = m_new;
    }
    for (int64_t u = 0; u * W < rows; u++) {
        const VT a = FN(v_exp2)(shift[u]);
        for (int64_t r = u * W; r < rows && r < (u + 1) * W; r++) alpha[r] = a[r % W];
    }
    for (int64_t r = 0; r < rows; r++) l[r] = l[r] * alpha[r] + block_sum[r];
}

#if defined(FA_KV_I8)
/* st[r][j] *= scale_j (int8 storage: a key's score, or its p before P·V),
 * the block's scales read once into vectors of W keys for all its rows; a
 * last part vector key by key, so lanes past nb are never touched. */
static void FN(rows_scale)(T *sb, int64_t rows, const float *scale, int64_t scale_rs, int64_t nb) {
    int64_t j0 = 0;
    for (; j0 + W <= nb; j0 += W) {
        VT sc;
        for (int i = 0; i < W; i++) sc[i] = scale[(j0 + i) * scale_rs];
        for (int64_t r = 0; r < rows; r++) {
            VT *x = (VT *)(sb + r * FA_BK + j0); /* whole vectors: FA_BK is a multiple of W, st is aligned */
            *x *= sc;
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = j0; j < nb; j++) sb[r * FA_BK + j] *= scale[j * scale_rs];
}
#endif

static inline __attribute__((always_inline)) void FN(rows_item_n)(const fa_plan *p, const fa_item *it, void *scratch,
                                                                 const int64_t rows) {
    const fa_args *a = p->a;
    const int64_t E = a->E, Ev = a->Ev;
    const int64_t nE = (E + W - 1) / W, nEv = (Ev + W - 1) / W;
    const KV *k = (const KV *)a->k + it->b * a->k_stride[0] + it->hk * a->k_stride[1];
    const KV *v = (const KV *)a->v + it->b * a->v_stride[0] + it->hk * a->v_stride[1];
    const int64_t k_rs = a->k_stride[2], v_rs = a->v_stride[2];
#if defined(FA_KV_I8)
    const float *ks = a->k_scale + it->b * a->k_scale_stride[0] + it->hk * a->k_scale_stride[1];
    const float *vs = a->v_scale + it->b * a->v_scale_stride[0] + it->hk * a->v_scale_stride[1];
    const int64_t ks_rs = a->k_scale_stride[2], vs_rs = a->v_scale_stride[2];
#endif

    char *sp = (char *)scratch;
    VT *qs = (VT *)sp;  sp += FN(round_up)(FA_FEW * (size_t)nE * sizeof(VT));
    VT *os = (VT *)sp;  sp += FN(round_up)(FA_FEW * (size_t)nEv * sizeof(VT));
    VT *tot = (VT *)sp; sp += FN(round_up)(FA_FEW * (size_t)nEv * sizeof(VT));
    VT *tc = (VT *)sp;  sp += FN(round_up)(FA_FEW * (size_t)nEv * sizeof(VT));
    T *st = (T *)sp;

    int64_t lo[FA_FEW], hi[FA_FEW], q_row[FA_FEW], m_row[FA_FEW];
    const fa_rows f = fa_item_rows(p, it, lo, hi, q_row, m_row);

    /* Packing: q · scale (· channel factors), each row padded with zeros to whole vectors. */
    const float *ch = fa_item_channels(a, it);
    for (int64_t r = 0; r < rows; r++) {
        T *dst = (T *)(qs + r * nE);
        for (int64_t e0 = 0; e0 < E; e0 += W) {
            const VT x = FN(q_scaled)(p, q_row[r] + e0, E - e0 < W ? (int)(E - e0) : W, ch ? ch + e0 : NULL);
            memcpy(dst + e0, &x, sizeof x); /* rows hold nE·W elements: the padding lanes are 0 */
        }
        for (int64_t e = E; e < nE * W; e++) dst[e] = 0;
#if FA_KV_PAIRS
        if (FA_ROW1_PAIRS && rows == 1) FN(pairs_order)(dst, E / W / 2, 1);
#endif
    }
    T m[FA_FEW], l[FA_FEW], alpha[FA_FEW], mt[FA_FEW];
    VT lt[FA_FEW], lc[FA_FEW];
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -(T)INFINITY;
        l[r] = 0;
    }
    if (f.j_begin >= f.j_end)
        for (int64_t u = 0; u < rows * nEv; u++) os[u] = (VT){0};
    T neg_slope[FA_FEW] = {0}, sink[FA_FEW]; /* zeros: item_mods fills them where they are read (ALiBi), */
    int64_t diag[FA_FEW] = {0};               /* which GCC cannot see in rows_item_one */
    const int modify = a->softcap > 0 || a->alibi_slopes;
    if (a->alibi_slopes || a->sinks) FN(item_mods)(p, it, rows, neg_slope, diag, sink);
    else for (int64_t r = 0; r < rows; r++) sink[r] = -(T)INFINITY;

    /* The block loop, as in the lane layout. */
    int64_t fresh = f.j_begin;
    int folds = 0;
    for (int64_t j0 = f.j_begin; j0 < f.j_end; j0 += FA_BK) {
        const int64_t nb = f.j_end - j0 < FA_BK ? f.j_end - j0 : FA_BK;
        T *sb = st; /* this block's scores */
        if (FA_ROW_SUPER > 1 && rows == 1) {
            const int64_t b = (j0 - f.j_begin) / FA_BK % FA_ROW_SUPER;
            sb = st + b * FA_BK;
            if (b == 0) { /* the scores of the next FA_ROW_SUPER blocks */
                const int64_t ns = f.j_end - j0 < FA_ROW_SUPER * FA_BK ? f.j_end - j0 : FA_ROW_SUPER * FA_BK;
                FN(dot_scores_n)(1, st, qs, nE, k + j0 * k_rs, k_rs, E, ns, v + j0 * v_rs, v_rs, Ev);
            }
        } else {
#define FA_CALL(R) FN(dot_scores_n)(R, st, qs, nE, k + j0 * k_rs, k_rs, E, nb, v + j0 * v_rs, v_rs, Ev)
            FA_BY_ROWS(rows, FA_CALL)
#undef FA_CALL
        }
#if defined(FA_KV_I8)
        FN(rows_scale)(sb, rows, ks + j0 * ks_rs, ks_rs, nb); /* s = (q · k8) · k_scale */
#endif
        if (modify) FN(rows_modify)(a, sb, rows, j0, nb, neg_slope, diag);
        FN(mask_block)(sb, FA_BK, 1, a, &f, lo, hi, m_row, rows, j0, nb);
        FN(rows_softmax)(sb, rows, nb, m, l, alpha);
#if defined(FA_KV_I8)
        FN(rows_scale)(sb, rows, vs + j0 * vs_rs, vs_rs, nb); /* p·(v8·v_scale) = (p·v_scale)·v8; l already has p */
#endif
#define FA_VALUES(R, G) FN(dot_values_n)(R, G, os, nEv, sb, v + j0 * v_rs, v_rs, Ev, nb, alpha, j0 == fresh)
#define FA_CALL(R)                                                          \
    if (R > FA_ROWS_WHOLE_MAX) FA_VALUES(R, FA_ROWS_MANY_G);                \
    else if (FA_ROW_SHORT_G4 && nEv <= 4) FA_VALUES(R, 4);                  \
    else if (nEv <= 8 || (FA_CONVERTS && R == 1)) FA_VALUES(R, 8); /* 1 row: G even (FA_ROW1_PAIRS) */ \
    else if (FA_ROWS_CONVERT_G && FA_CONVERTS) FA_VALUES(R, FA_ROWS_CONVERT_G); \
    else FA_VALUES(R, FA_ROW_GROUP);
#if FA_KV_PAIRS
        /* One row in pair order: whole rows of up to FA_ROW_GROUP vectors (above) */
        if (FA_ROW1_PAIRS && rows == 1 && nEv > 8) FA_VALUES(1, FA_ROW_GROUP);
        else
#endif
        FA_BY_ROWS(rows, FA_CALL)
#undef FA_VALUES
#undef FA_CALL
        if (j0 + FA_BK < f.j_end && j0 + FA_BK - fresh == FA_FOLD * FA_BK) {
            FN(rows_fold)(rows, nEv, os, tot, tc, m, l, mt, lt, lc, !folds++);
            fresh = j0 + FA_BK;
            for (int64_t r = 0; r < rows; r++) l[r] = 0;
        }
    }
    if (folds) {
        FN(rows_fold)(rows, nEv, os, tot, tc, m, l, mt, lt, lc, 0);
        for (int64_t r = 0; r < rows; r++) {
            l[r] = FN(comp_value)(lt[r], lc[r])[0];
            for (int64_t u = r * nEv; u < (r + 1) * nEv; u++) os[u] = FN(comp_value)(tot[u], tc[u]);
        }
    }

    /* The store: out = o · (1/l), and lse (the shared finishing step). */
    T *lse = FN(item_lse)(it, a);
    for (int64_t r = 0; r < rows; r++) {
        int64_t lse_off, o_off = fa_out_offset(p, it, r, &lse_off);
        T inv, lse_r;
        FN(finish_row)(m[r], l[r], sink[r], &inv, lse ? &lse_r : NULL);
        T *o_r = (T *)(os + r * nEv);
#if FA_KV_PAIRS
        if (FA_ROW1_PAIRS && rows == 1) FN(pairs_order)(o_r, Ev / W / 2, 0);
#endif
        for (int64_t e = 0; e < Ev; e++) o_r[e] *= inv;
        FN(out_put)(p, it, o_off, o_r, Ev);
        if (lse) lse[lse_off] = lse_r;
    }
}

/* One row (decoding one query a K/V head) is compiled apart from items of
 * several rows: rows_item_n with rows the constant 1 leaves only its own
 * loops, and the several-row function none of them. In one function, GCC
 * allocated registers and stack across every row count, so a change to one
 * row's loop moved the multi-query float32 time by 8 % with its own code
 * unchanged (Zen 4, docs/tuning.md "Stop 43"). */
static __attribute__((noinline)) void FN(rows_item_one)(const fa_plan *p, const fa_item *it, void *scratch) {
    FN(rows_item_n)(p, it, scratch, 1);
}

static __attribute__((noinline)) void FN(rows_item_many)(const fa_plan *p, const fa_item *it, void *scratch) {
    const int64_t rows = it->rows;
    if (rows < 2) __builtin_unreachable(); /* rows_item sends one row elsewhere */
    FN(rows_item_n)(p, it, scratch, rows);
}

static void FN(rows_item)(const fa_plan *p, const fa_item *it, void *scratch) {
    if (it->rows == 1) FN(rows_item_one)(p, it, scratch);
    else FN(rows_item_many)(p, it, scratch);
}

#undef FA_FEW
#undef FA_ROW1_PAIRS
#undef FA_ST_BLOCKS
#undef FA_BY_ROWS
