/* y = x @ w^T (+ bias) over a weight packed once for this CPU's vector units.
 *
 * The weight [n, k] is repacked at load into blocks of NB = 48 output columns: float32 as
 * [n/48][k][48], bfloat16 as [n/48][k/2][48][2] (the pairs of consecutive k that AVX512-BF16's
 * dot product takes). A register tile of MR = 8 rows of x by 48 columns (24 accumulators)
 * runs down the whole k of one block: per step it loads 3 vectors of the block and broadcasts
 * one value (float32) or pair (bfloat16) of each row of x; every load of the weight feeds 8
 * fused multiply-adds, and a block, read once from memory, is reused from the cache by every
 * tile of rows. Threads split the blocks. Products and sums are float32, in the order of k for
 * every output whatever the number of rows: a row's result does not depend on its batch.
 *
 * Measured on the project's machine (BENCHMARKS.md) against oneDNN's linear over the plain
 * weight, a SmolLM2-135M step's 121 linear layers with weights from memory: faster from one
 * row (the memory floor) to a 512-token prefill chunk. Needs AVX-512 (float32) and
 * AVX512-BF16 (bfloat16): packed_linear_supported() says which this build has.
 *
 * x, y, bias: float32 when the weight is float32, bfloat16 when it is bfloat16. x [m, k]
 * contiguous (k even for bfloat16); y [m, n].
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define NR 3            /* vectors of 16 columns in a tile */
#define NB (NR * 16)    /* columns of a block */
#define MR 8            /* rows of x in a full tile */
#define PREFETCH 64     /* steps of k ahead the tile asks for its block's lines (12 KB): measured,
                           paired with none, -16 % (fp32) and -8 % (bf16) at one row, -8 to -10 %
                           at 32, where the hardware prefetcher alone left bandwidth unused */

int packed_linear_supported(int is_bf16) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#elif defined(__AVX512F__)
    return !is_bf16;
#else
    (void)is_bf16;
    return 0;
#endif
}

/* elements of the packed weight: whole blocks, the last one and an odd k padded with zeros */
int64_t packed_linear_numel(int n, int k, int is_bf16) {
    int64_t kk = is_bf16 ? (k + 1) / 2 * 2 : k;
    return (int64_t)(n + NB - 1) / NB * NB * kk;
}

void packed_linear_pack(const void *w, void *packed, int is_bf16, int n, int k, int num_threads) {
    const int nblocks = (n + NB - 1) / NB;
    if (is_bf16) {
        const uint16_t *src = w;
        uint16_t *dst = packed;
        const int pairs = (k + 1) / 2;
        #pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int b = 0; b < nblocks; b++)
            for (int p = 0; p < pairs; p++)
                for (int c = 0; c < NB; c++)
                    for (int j = 0; j < 2; j++) {
                        int row = b * NB + c, col = 2 * p + j;
                        dst[(((int64_t)b * pairs + p) * NB + c) * 2 + j] =
                            row < n && col < k ? src[(int64_t)row * k + col] : 0;
                    }
    } else {
        const float *src = w;
        float *dst = packed;
        #pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int b = 0; b < nblocks; b++)
            for (int kk = 0; kk < k; kk++)
                for (int c = 0; c < NB; c++) {
                    int row = b * NB + c;
                    dst[((int64_t)b * k + kk) * NB + c] = row < n ? src[(int64_t)row * k + kk] : 0.0f;
                }
    }
}

#ifdef __AVX512F__
/* out[i][c] = sum over k of x[i][k] * block[k][c], for rows i < mr (a constant once inlined) */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t k, const float *block,
                                                             const int mr, float *out) {
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 b[NR];
        for (int j = 0; j < NR; j++) b[j] = _mm512_loadu_ps(block + kk * NB + j * 16);
        for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(block + (kk + PREFETCH) * NB + j * 16), _MM_HINT_T0);
        for (int i = 0; i < mr; i++) {
            __m512 a = _mm512_set1_ps(x[i * k + kk]);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) _mm512_storeu_ps(out + i * NB + j * 16, acc[i][j]);
}

#ifdef __AVX512BF16__
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t k, const uint16_t *block,
                                                              const int mr, float *out) {
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh b[NR];
        for (int j = 0; j < NR; j++) b[j] = (__m512bh)_mm512_loadu_si512(block + (p * NB + j * 16) * 2);
        for (int j = 0; j < NR; j++)
            _mm_prefetch((const char *)(block + ((p + PREFETCH) * NB + j * 16) * 2), _MM_HINT_T0);
        for (int i = 0; i < mr; i++) {
            int32_t pair;
            memcpy(&pair, x + i * k + 2 * p, sizeof pair);
            __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) _mm512_storeu_ps(out + i * NB + j * 16, acc[i][j]);
}
#endif

/* one tile of mr rows starting at x: the row count a compile-time constant in each case */
static void tile(const void *x, int64_t k, const void *block, int is_bf16, int mr, float *out) {
#define TILE_CASE(R)                                                              \
    case R:                                                                       \
        if (is_bf16) TILE_BF16(R); else tile_f32(x, k, block, R, out);            \
        break;
#ifdef __AVX512BF16__
#define TILE_BF16(R) tile_bf16(x, k, block, R, out)
#else
#define TILE_BF16(R) (void)0
#endif
    switch (mr) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
        TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
    }
#undef TILE_CASE
#undef TILE_BF16
}

static void store_rows(const float *out, int rows, int cols, const void *bias, int is_bf16, void *y, int64_t ldy) {
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < cols; c += 16) {
            __mmask16 mask = cols - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cols - c)) - 1);
            __m512 v = _mm512_loadu_ps(out + i * NB + c);
            if (is_bf16) {
                if (bias) {
                    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)bias + c);
                    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
                }
                /* round to nearest even, NaN kept: as f32_to_bf16 */
                __m512i bits = _mm512_castps_si512(v);
                __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
                __m512i rounded = _mm512_srli_epi32(
                    _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
                __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
                _mm256_mask_storeu_epi16((uint16_t *)y + i * ldy + c, mask, _mm512_cvtepi32_epi16(rounded));
            } else {
                if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, (const float *)bias + c));
                _mm512_mask_storeu_ps((float *)y + i * ldy + c, mask, v);
            }
        }
}

/* The work of one call shared by the threads of the enclosing parallel region (an orphaned
 * worksharing loop, ending in its barrier; alone outside any region): the fused decode step
 * (decode_step.c) calls it inside its own region. The caller checks packed_linear_supported. */
void packed_linear_team(const void *x, const void *packed, const void *bias, void *y, int is_bf16, int m, int n,
                        int k) {
    const int nblocks = (n + NB - 1) / NB;
    const int elem = is_bf16 ? 2 : 4;
    const int64_t block_elems = (int64_t)NB * k;
    #pragma omp for schedule(static)
    for (int b = 0; b < nblocks; b++) {
        float out[MR * NB];
        const char *block = (const char *)packed + b * block_elems * elem;
        const int cols = n - b * NB < NB ? n - b * NB : NB;
        const void *bias_b = bias ? (const char *)bias + (int64_t)b * NB * elem : NULL;
        for (int i0 = 0; i0 < m; i0 += MR) {
            const int rows = m - i0 < MR ? m - i0 : MR;
            tile((const char *)x + (int64_t)i0 * k * elem, k, block, is_bf16, rows, out);
            store_rows(out, rows, cols, bias_b, is_bf16, (char *)y + ((int64_t)i0 * n + b * NB) * elem, n);
        }
    }
}

/* Returns 0, or -1 when this build cannot run that dtype (packed_linear_supported). */
int packed_linear(const void *x, const void *packed, const void *bias, void *y, int is_bf16, int m, int n, int k,
                  int num_threads) {
    if (!packed_linear_supported(is_bf16) || (is_bf16 && k % 2)) return -1;
    #pragma omp parallel num_threads(num_threads)
    packed_linear_team(x, packed, bias, y, is_bf16, m, n, k);
    return 0;
}
#else
int packed_linear(const void *x, const void *packed, const void *bias, void *y, int is_bf16, int m, int n, int k,
                  int num_threads) {
    (void)x; (void)packed; (void)bias; (void)y; (void)is_bf16; (void)m; (void)n; (void)k; (void)num_threads;
    return -1;
}
void packed_linear_team(const void *x, const void *packed, const void *bias, void *y, int is_bf16, int m, int n,
                        int k) {
    (void)x; (void)packed; (void)bias; (void)y; (void)is_bf16; (void)m; (void)n; (void)k;
}
#endif
