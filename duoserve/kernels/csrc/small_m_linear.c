/* y = x @ w^T (+ bias) for the few-row inputs of decoding (a handful of sequences).
 *
 * With a few rows of x, a linear layer reads every weight once and does two flops per weight
 * and row: its time is the weight bytes over the memory bandwidth (up to 6 rows in float32 and
 * 4 in bfloat16 here, dense.SMALL_M; beyond, oneDNN's GEMM is faster). The work is split over
 * the threads by output rows; each tile holds TILE_N weight rows against up to TILE_M rows
 * of x in registers and prefetches the next tile's rows while it computes, which keeps
 * enough cache misses in flight to stream from DRAM at close to its read bandwidth
 * (BENCHMARKS.md). bfloat16 weights are widened to float32 in registers: products and sums
 * are float32, like oneDNN's. A portable loop serves CPUs without AVX-512.
 *
 * x, y, bias: float32 when w is float32, bfloat16 when w is bfloat16. w: [n, k] row-major.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define TILE_N 8
#define TILE_M 2

static inline float load_scalar(const void *p, int is_bf16, int64_t i) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_scalar(void *p, int is_bf16, int64_t i, float v) {
    if (is_bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

#ifdef __AVX512F__
static inline __m512 load16(const void *p, int is_bf16, int64_t i, __mmask16 mask) {
    if (is_bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
}

/* rows [row, row + rows) of w against rows [0, m) of x (m <= TILE_M); sums into out[m][rows] */
static void tile(const void *x, const void *w, int is_bf16, int64_t row, int rows, int m, int k,
                 float out[TILE_M][TILE_N]) {
    __m512 acc[TILE_M][TILE_N];
    for (int i = 0; i < TILE_M; i++)
        for (int r = 0; r < TILE_N; r++) acc[i][r] = _mm512_setzero_ps();
    int elem = is_bf16 ? 2 : 4;
    for (int kk = 0; kk < k; kk += 16) {
        __mmask16 mask = k - kk >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - kk)) - 1);
        __m512 xv[TILE_M];
        for (int i = 0; i < m; i++) xv[i] = load16(x, is_bf16, (int64_t)i * k + kk, mask);
        for (int r = 0; r < rows; r++) {
            _mm_prefetch((const char *)w + ((row + r + TILE_N) * (int64_t)k + kk) * elem, _MM_HINT_T0);
            __m512 wv = load16(w, is_bf16, (row + r) * (int64_t)k + kk, mask);
            for (int i = 0; i < m; i++) acc[i][r] = _mm512_fmadd_ps(wv, xv[i], acc[i][r]);
        }
    }
    for (int i = 0; i < m; i++)
        for (int r = 0; r < rows; r++) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}
#else
static void tile(const void *x, const void *w, int is_bf16, int64_t row, int rows, int m, int k,
                 float out[TILE_M][TILE_N]) {
    for (int i = 0; i < m; i++)
        for (int r = 0; r < rows; r++) {
            float sum = 0.0f;
            for (int kk = 0; kk < k; kk++)
                sum += load_scalar(x, is_bf16, (int64_t)i * k + kk) * load_scalar(w, is_bf16, (row + r) * (int64_t)k + kk);
            out[i][r] = sum;
        }
}
#endif

/* x: [m, k]; w: [n, k]; bias: [n] or NULL; y: [m, n]. Returns 0. */
int small_m_linear(const void *x, const void *w, const void *bias, void *y, int is_bf16, int m, int n, int k,
                   int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int row = 0; row < n; row += TILE_N) {
        int rows = n - row < TILE_N ? n - row : TILE_N;
        for (int i0 = 0; i0 < m; i0 += TILE_M) {
            int rows_of_x = m - i0 < TILE_M ? m - i0 : TILE_M;
            float out[TILE_M][TILE_N];
            const char *xi = (const char *)x + (int64_t)i0 * k * (is_bf16 ? 2 : 4);
            tile(xi, w, is_bf16, row, rows, rows_of_x, k, out);
            for (int i = 0; i < rows_of_x; i++)
                for (int r = 0; r < rows; r++) {
                    float v = out[i][r] + (bias ? load_scalar(bias, is_bf16, row + r) : 0.0f);
                    store_scalar(y, is_bf16, (int64_t)(i0 + i) * n + row + r, v);
                }
        }
    }
    return 0;
}
