/* LoRA updates of a step's rows, each by its own adapter. A step's rows are grouped by adapter;
 * then, in two passes shared out by the threads, xa = x A^T for each group (every slice's A
 * stacked: a row of A read once for all the group's rows, four rows' sums in flight), and
 * y[:, slice] += scale * xa B^T a block of outputs at a time (B stored transposed: the sum runs
 * across outputs). In float32, y rounded to the model dtype once per element, as one add. The
 * decode step (decode_step.c) and the eager model's hooks (duoserve::lora_rows) both call this,
 * so a row's update is the same bits on either path. */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "lora.h"

#define LORA_BLOCK 64   /* outputs a work item adds to, in registers */

static inline float lora_load(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline const struct lora_update *update_of(const int64_t *tables, int64_t adapter, int64_t index) {
    return (const struct lora_update *)(intptr_t)tables[adapter] + index;
}

/* rows in adapter order (base rows left out): order[0..n), and where each adapter's begin in it */
static int group_rows(const int64_t *row_adapter, int m, int *order) {
    int n = 0;
    for (int t = 0; t < m; t++) {   /* stable: an adapter's rows in row order, adapters by first row */
        if (row_adapter[t] < 0) continue;
        int seen = 0;
        for (int u = 0; u < t && !seen; u++) seen = row_adapter[u] == row_adapter[t];
        if (seen) continue;
        for (int u = t; u < m; u++)
            if (row_adapter[u] == row_adapter[t]) order[n++] = u;
    }
    return n;
}

void lora_rows_team(const int64_t *row_adapter, const int64_t *tables, int64_t index, const void *x, void *y,
                    int m, int in, int out, int bf, float *xa, int stride) {
    int order[m > 0 ? m : 1], starts[m + 1];
    const int n = group_rows(row_adapter, m, order);   /* every thread the same: no barrier needed */
    int groups = 0, widest = 0;
    for (int p = 0; p < n; p++) {
        if (p > 0 && row_adapter[order[p - 1]] == row_adapter[order[p]]) continue;
        starts[groups++] = p;
        const struct lora_update *u = update_of(tables, row_adapter[order[p]], index);
        if (u->a && u->in == in && u->stacked > widest && u->stacked <= stride) widest = (int)u->stacked;
    }
    starts[groups] = n;
    /* xa[t][j] = A_j . x_t for each group's rows: a row of A read once for them all */
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < (int64_t)groups * widest; item++) {
        const int g = (int)(item / widest), j = (int)(item % widest);
        const struct lora_update *u = update_of(tables, row_adapter[order[starts[g]]], index);
        if (!u->a || u->in != in || j >= u->stacked || u->stacked > stride) continue;
        const int wb = (int)u->bf16;
        const void *a = (const char *)u->a + (int64_t)j * in * (wb ? 2 : 4);
        for (int q = starts[g]; q < starts[g + 1]; q += 4) {   /* four rows at once: four sums in flight */
            const int k = starts[g + 1] - q < 4 ? starts[g + 1] - q : 4;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (k == 4 && bf) {
                const uint16_t *x0 = (const uint16_t *)x + (int64_t)order[q] * in;
                const uint16_t *x1 = (const uint16_t *)x + (int64_t)order[q + 1] * in;
                const uint16_t *x2 = (const uint16_t *)x + (int64_t)order[q + 2] * in;
                const uint16_t *x3 = (const uint16_t *)x + (int64_t)order[q + 3] * in;
                for (int i = 0; i < in; i++) {
                    const float ai = lora_load(a, i, wb);
                    acc[0] += ai * bf16_to_f32(x0[i]);
                    acc[1] += ai * bf16_to_f32(x1[i]);
                    acc[2] += ai * bf16_to_f32(x2[i]);
                    acc[3] += ai * bf16_to_f32(x3[i]);
                }
            } else if (k == 4) {
                const float *x0 = (const float *)x + (int64_t)order[q] * in;
                const float *x1 = (const float *)x + (int64_t)order[q + 1] * in;
                const float *x2 = (const float *)x + (int64_t)order[q + 2] * in;
                const float *x3 = (const float *)x + (int64_t)order[q + 3] * in;
                for (int i = 0; i < in; i++) {
                    const float ai = lora_load(a, i, wb);
                    acc[0] += ai * x0[i];
                    acc[1] += ai * x1[i];
                    acc[2] += ai * x2[i];
                    acc[3] += ai * x3[i];
                }
            } else {
                for (int c = 0; c < k; c++)
                    for (int i = 0; i < in; i++)
                        acc[c] += lora_load(a, i, wb) * lora_load(x, (int64_t)order[q + c] * in + i, bf);
            }
            for (int c = 0; c < k; c++) xa[(int64_t)order[q + c] * stride + j] = acc[c];
        }
    }
    /* y[t][lo:hi] += scale * xa[t][r0:r1] B^T for each block of LORA_BLOCK outputs of a group's
     * slices: B stored transposed, so that the sum runs across outputs, a vector at a time */
    const int blocks = (out + LORA_BLOCK - 1) / LORA_BLOCK;
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < (int64_t)groups * blocks; item++) {
        const int g = (int)(item / blocks), o0 = (int)(item % blocks) * LORA_BLOCK;
        const int o1 = o0 + LORA_BLOCK < out ? o0 + LORA_BLOCK : out;
        const struct lora_update *u = update_of(tables, row_adapter[order[starts[g]]], index);
        if (!u->a || u->in != in || u->stacked > stride) continue;
        for (int64_t s = 0; s < u->num_slices; s++) {
            const struct lora_slice *sl = &u->slices[s];
            const int64_t lo = o0 > sl->offset ? o0 : sl->offset;
            const int64_t hi = o1 < sl->offset + sl->rows ? o1 : sl->offset + sl->rows;
            if (lo >= hi) continue;
            const int64_t rank = sl->r1 - sl->r0, width = hi - lo;
            for (int q = starts[g]; q < starts[g + 1]; q += 2) {   /* two rows at once: twice the sums in flight */
                const int k = starts[g + 1] - q < 2 ? starts[g + 1] - q : 2;
                const float *v0 = xa + (int64_t)order[q] * stride + sl->r0;
                const float *v1 = xa + (int64_t)order[q + k - 1] * stride + sl->r0;
                float acc0[LORA_BLOCK] = {0}, acc1[LORA_BLOCK] = {0};
                for (int64_t j = 0; j < rank; j++) {
                    const int64_t first = j * sl->rows + (lo - sl->offset);
                    const float w0 = v0[j], w1 = v1[j];
                    for (int64_t o = 0; o < width; o++) {
                        const float b = lora_load(sl->bt, first + o, (int)u->bf16);
                        acc0[o] += w0 * b;
                        acc1[o] += w1 * b;
                    }
                }
                for (int c = 0; c < k; c++) {
                    const float *acc = c ? acc1 : acc0;
                    for (int64_t o = 0; o < width; o++) {
                        const int64_t at = (int64_t)order[q + c] * out + lo + o;
                        const float sum = lora_load(y, at, bf) + sl->scale * acc[o];
                        if (bf) ((uint16_t *)y)[at] = f32_to_bf16(sum);
                        else ((float *)y)[at] = sum;
                    }
                }
            }
        }
    }
}

int lora_rows(const int64_t *row_adapter, const int64_t *tables, int64_t index, const void *x, void *y, int m, int in,
              int out, int bf, int num_threads) {
    int stride = 1;   /* the widest stacked A among the rows' adapters: a long prompt's scratch stays small */
    for (int t = 0; t < m; t++) {
        if (row_adapter[t] < 0) continue;
        const struct lora_update *u = update_of(tables, row_adapter[t], index);
        if (u->a && u->stacked > stride && u->stacked <= LORA_MAX_STACKED) stride = (int)u->stacked;
    }
    float *xa = malloc((size_t)(m > 0 ? m : 1) * stride * sizeof(float));
    if (!xa) return -2;
    #pragma omp parallel num_threads(num_threads)
    lora_rows_team(row_adapter, tables, index, x, y, m, in, out, bf, xa, stride);
    free(xa);
    return 0;
}
