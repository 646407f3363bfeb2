/* LoRA adapters' updates added to a projection's output rows (lora.c): the tables worker/lora.py
 * builds, one per adapter, and the team entry the decode step and the duoserve::lora_rows op call. */
#ifndef DUOSERVE_LORA_H
#define DUOSERVE_LORA_H

#include <stdint.h>

#define LORA_MAX_SLICES 3          /* a fused projection's parts: q, k and v */
#define LORA_MAX_STACKED 768       /* the most rows of an update's stacked A (ranks of its slices) */
#define LORA_PROJECTIONS 4         /* a layer's qkv, o_proj, gate_up and down, in this order */

#ifdef __cplusplus
extern "C" {
#endif

/* one part of a projection's output: rows [offset, offset + rows) += scale * B @ xa[r0:r1] */
struct lora_slice {
    const void *bt;                /* B transposed: [r1 - r0, rows], in the update's dtype */
    int64_t offset, rows, r0, r1;
    float scale;
};

/* an adapter's update of one projection (a == NULL: it has none): xa = a @ x, then its slices */
struct lora_update {
    const void *a;                 /* [stacked, in]: every slice's A */
    int64_t stacked, in, num_slices;
    int64_t bf16;                  /* a and bt in bfloat16 (a bfloat16 model's: half the bytes), else float32 */
    struct lora_slice slices[LORA_MAX_SLICES];
};

/* y [m, out] += each row's adapter's update `index` (layer * LORA_PROJECTIONS + projection) of
 * x [m, in], both in the model dtype (bf: bfloat16); row_adapter[t] indexes tables (each an
 * adapter's struct lora_update [layers * LORA_PROJECTIONS]) or is -1: the base, left as it is.
 * xa: scratch shared by the team, [m, stride] floats (stride: at least every update's stacked
 * rows, at most LORA_MAX_STACKED). A team entry: every thread of a parallel region calls it (the
 * work shared out; it ends at a barrier). */
void lora_rows_team(const int64_t *row_adapter, const int64_t *tables, int64_t index, const void *x, void *y,
                    int m, int in, int out, int bf, float *xa, int stride);

/* the same in a parallel region of its own (the eager model's hooks: duoserve::lora_rows);
 * returns 0, or -2 when its scratch could not be allocated */
int lora_rows(const int64_t *row_adapter, const int64_t *tables, int64_t index, const void *x, void *y, int m, int in,
              int out, int bf, int num_threads);

#ifdef __cplusplus
}
#endif

#endif
