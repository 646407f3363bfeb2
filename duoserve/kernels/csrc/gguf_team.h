/* gguf_linear.c's team entries: a GGUF matmul computed by the threads of the caller's OpenMP
 * parallel region (each call an orphaned worksharing loop ending in its barrier), with the same
 * body and bits as gguf_linear_fast / gguf_linear_exact. Included by gguf_linear.c and
 * decode_step.c. */
#ifndef DUOSERVE_GGUF_TEAM_H
#define DUOSERVE_GGUF_TEAM_H
#include <stdint.h>

/* x's rows as the matmuls read them, shared by the team: float32 copies of bfloat16 rows (f),
 * and in fast mode the rows quantized to int8 blocks of 32 (q), each block's scale (d) and
 * scale * sum of its values per half of 16 and per block; for the types that take x per
 * super-block (gguf_takes_superblock_rows) also quantized per 256 values (super_q, super_d) with
 * the integer sum of each run of 16 (super_sums) */
struct gguf_rows {
    float *f;
    int8_t *q;
    float *d, *half_sums, *block_sums;
    int16_t *isums;   /* sum(q) per block of 32 (interleaved weights) */
    int8_t *super_q;
    float *super_d;
    int16_t *super_sums;
};

/* 1 where fast mode computes block type `type` from x quantized per super-block of 256 (the
 * K-quants: gguf_superblocks.h), 0 where per block of 32 */
int gguf_takes_superblock_rows(int type);

/* buffers for m rows of k values: f where `floats`, the quantized rows where `quantized`;
 * 0, or -2 (nothing left allocated) */
int gguf_rows_alloc(struct gguf_rows *r, int m, int k, int floats, int quantized);
void gguf_rows_free(struct gguf_rows *r);

/* x [m, k] (float32, or bfloat16 with io_bf16) into r: converted where bfloat16, quantized
 * unless exact (per super-block too where `super`: a weight to come takes it) */
void gguf_rows_team(const void *x, int io_bf16, int m, int k, int exact, int super, const struct gguf_rows *r);

/* y[i, col0 + j] (rows ldy apart) = row i of x . row j of w, for w [n, k] of block type `type`
 * (checked by the caller), x as gguf_rows_team left it in r; sets *failed where a thread had no
 * memory for its tiles */
void gguf_matmul_team(const struct gguf_rows *r, const void *x, int io_bf16, int exact, const uint8_t *w, int type,
                      int m, int n, int k, void *y, int64_t ldy, int col0, int *failed);

/* one row of w ([k] of block type `type`) -> k values, float32 or bfloat16, as gguf_dequantize */
void gguf_dequantize_row(int type, const uint8_t *row, int k, void *out, int out_bf16);

/* row `row` of w ([n, k] of block type `type`, interleaved ones too) -> k values, as
 * gguf_dequantize; 0, or -2 without memory for an interleaved row's blocks */
int gguf_dequantize_row_of(int type, const uint8_t *w, int64_t row, int k, void *out, int out_bf16);
#endif
