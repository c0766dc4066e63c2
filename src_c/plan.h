/* plan.h — how the driver cuts one call into work items (plan.c), for
 * attention.c, which runs them. Internal; the kernels never see this.
 */
#ifndef FA_PLAN_H
#define FA_PLAN_H

#include "internal.h"

typedef struct fa_work {
    fa_plan plan;          /* what the kernels read */
    fa_item_fn item;       /* the layout's kernel */
    size_t scratch;        /* bytes of one thread's scratch */
    int layout;            /* FA_LAYOUT_LANES or FA_LAYOUT_ROWS */
    int64_t bq;            /* query rows per item */
    int per_head;          /* L >= bq: items stay inside one query head */
    int64_t nqb;           /* per_head: items per head */
    int64_t blocks;        /* row blocks per (batch entry, key/value head) */
    int64_t n_base;        /* row blocks in all: B · Hkv · blocks */
    int64_t n_chunks;      /* key chunks per row block (1: no split) */
    int64_t chunk;         /* keys per chunk */
    int64_t n_items;       /* n_base · n_chunks */
    int reverse;           /* causal or window: later rows first */
    size_t part_bytes;     /* one split-KV part: bq · (Ev + 1) elements */
    size_t elem_bytes;     /* of the computation type: split-KV parts and lse */
    int threads, serial;
    int64_t key_block, lane_block; /* the kernel's, for fa_plan_call */
} fa_work;

/* Plans a call that fa_check accepted; force as in fa_attention_with.
 * FA_ERR_STRATEGY for a forced value out of range, FA_ERR_DTYPE when the
 * kernel set in use has no kernel for the dtype. */
int fa_plan_work(const fa_args *a, const fa_strategy *force, fa_work *w);

/* Item idx (0 … n_items − 1) in the order threads take them; parts is the
 * split-KV buffer (n_items · part_bytes), or NULL without a split. */
fa_item fa_item_at(const fa_work *w, int64_t idx, char *parts);

#endif /* FA_PLAN_H */
