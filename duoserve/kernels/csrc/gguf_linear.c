/* Linear layers computed straight from GGUF quantized blocks, and their dequantization.
 *
 * Weights stay in the file's own block format: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (32 values
 * a block) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256 values a super-block), row-major [n, k] with k
 * a multiple of the block. Every block type is read the same way (gguf_blocks.h, the table of types), 32
 * consecutive values at a time: unsigned integers q[32] with a scale and an offset for each half
 * of 16, so that
 *     w[j] = scale[j / 16] * q[j] + offset[j / 16]
 * with the same arithmetic as the reference dequantization (ggml's, and the `gguf` Python
 * package's): every product of a stored fp16 scale and a small integer is exact in float32.
 *
 * Three uses of it:
 *   gguf_dequantize     rows of w (all, or gathered by id) as float32 or bfloat16;
 *   gguf_linear_exact   y = x @ w^T, each block widened to float32 in registers, float32 sums;
 *   gguf_linear_fast    y = x @ w^T with x quantized to 8 bits per block of 32 (a float scale,
 *                       round to nearest) and integer dot products (vpmaddubsw with AVX2,
 *                       vpdpbusd with VNNI: the same integers), as llama.cpp computes; the
 *                       K-quants against x quantized per super-block of 256 instead, their
 *                       integer scales applied to integer sums (gguf_superblocks.h).
 * Both matmuls take any number of rows of x with one arithmetic: a row's result does not
 * depend on the other rows of its call. Each also has a team entry (gguf_rows_team, then
 * gguf_matmul_team), the same body run by the threads of the caller's parallel region: the C++
 * decode step (decode_step.c) computes its projections with it, and the entries above open their
 * own region around it, so both give the same bits. A CPU without AVX-512 but with AVX2 (VEC_AVX2) takes
 * the float steps in 256-bit registers. The work is split over threads by output rows. x [m, k]
 * and y [m, n] are float32, or bfloat16 (io_bf16); products and sums are float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if !(defined(__AVX2__) && defined(__FMA__)) && defined(__GNUC__) && !defined(__clang__)
/* The portable paths compute in plain C: -ffast-math's unsafe optimizations would let the compiler
 * regroup a sum one way for a single row and another way for a tile of rows (the tests saw it), so
 * that a row's result would depend on its batch. */
#pragma GCC optimize("no-unsafe-math-optimizations")
#endif

#include "gguf_blocks.h"
#include "gguf_team.h"

static inline void store_out(void *y, int io_bf16, int64_t at, float v) {
    if (io_bf16) ((uint16_t *)y)[at] = f32_to_bf16(v);
    else ((float *)y)[at] = v;
}

#include "gguf_interleaved.h"

#ifdef VECTOR
/* 16 floats -> 16 bfloat16, rounded to nearest even like f32_to_bf16 (NaN aside) */
static inline __m256i to_bf16_vec(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

/* the 32 values widened: w = scale * q + offset, two registers of 16 floats */
static inline void sub_floats_vec(__m256i q, const float scale[2], const float offset[2], __m512 *w0, __m512 *w1) {
    __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
    __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
    *w0 = _mm512_fmadd_ps(f0, _mm512_set1_ps(scale[0]), _mm512_set1_ps(offset[0]));
    *w1 = _mm512_fmadd_ps(f1, _mm512_set1_ps(scale[1]), _mm512_set1_ps(offset[1]));
}
#elif defined(VEC_AVX2)
/* the 32 values widened, four registers of 8 floats: w = scale * q + offset */
static inline __attribute__((always_inline)) void sub_floats_vec8(__m256i q, const float scale[2],
                                                                  const float offset[2], __m256 w[4]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);  /* halves 0 and 1 */
    const __m256 s0 = _mm256_set1_ps(scale[0]), o0 = _mm256_set1_ps(offset[0]);
    const __m256 s1 = _mm256_set1_ps(scale[1]), o1 = _mm256_set1_ps(offset[1]);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s0, o0);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), s0, o0);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s1, o1);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), s1, o1);
}
#endif

/* one row of w -> k float32 values, or bfloat16 ones */
static inline __attribute__((always_inline)) void dequantize_row(int type, const uint8_t *row, int k, void *out, int out_bf16) {
    int per_block = BLOCK_VALUES[type], subs = per_block / 32;
    for (int blk = 0; blk < k / per_block; blk++) {
        const uint8_t *b = row + (int64_t)blk * BLOCK_BYTES[type];
        for (int s = 0; s < subs; s++) {
            float scale[2], offset[2];
            sub_scales(type, b, s, scale, offset);
            int64_t col = (int64_t)blk * per_block + s * 32;
#ifdef VECTOR
            __m512 w0, w1;
            sub_floats_vec(sub_values_vec(type, b, s), scale, offset, &w0, &w1);
            if (out_bf16) {
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + col), to_bf16_vec(w0));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + col + 16), to_bf16_vec(w1));
            } else {
                _mm512_storeu_ps((float *)out + col, w0);
                _mm512_storeu_ps((float *)out + col + 16, w1);
            }
#elif defined(VEC_AVX2)
            __m256 wv[4];
            sub_floats_vec8(sub_values_vec(type, b, s), scale, offset, wv);
            if (out_bf16) {
                float v[32];
                for (int j = 0; j < 4; j++) _mm256_storeu_ps(v + 8 * j, wv[j]);
                for (int j = 0; j < 32; j++) ((uint16_t *)out)[col + j] = f32_to_bf16(v[j]);
            } else {
                for (int j = 0; j < 4; j++) _mm256_storeu_ps((float *)out + col + 8 * j, wv[j]);
            }
#else
            uint8_t q[32];
            sub_values(type, b, s, q);
            for (int j = 0; j < 32; j++) {
                float v = scale[j >> 4] * (float)q[j] + offset[j >> 4];
                if (out_bf16) ((uint16_t *)out)[col + j] = f32_to_bf16(v);
                else ((float *)out)[col + j] = v;
            }
#endif
        }
    }
}

/* rows of an interleaved w (gguf_interleaved.h), each put back in the file's blocks first */
static int dequantize_interleaved(const uint8_t *w, int type, int64_t n, int k, const int64_t *ids, int64_t count,
                                  void *out, int out_bf16, int num_threads) {
    const int64_t rows = ids ? count : n, row_bytes = (int64_t)(k / BLOCK_VALUES[type]) * BLOCK_BYTES[type];
    const int elem = out_bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        uint8_t *raw = malloc(row_bytes);
        if (!raw) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!raw) continue;
            deinterleave_row(type, w, ids ? ids[r] : r, k, raw);
            dequantize_row(type, raw, k, (char *)out + r * k * elem, out_bf16);
        }
        free(raw);
    }
    return failed ? -2 : 0;
}

/* rows of w ([n, k]: all n rows, or the `count` rows listed in `ids`) -> out [rows, k],
 * float32 or (out_bf16) bfloat16. Returns 0, or -1 for an unknown type. */
int gguf_dequantize(const uint8_t *w, int type, int64_t n, int k, const int64_t *ids, int64_t count,
                    void *out, int out_bf16, int num_threads) {
    if (!known_type(type)) return -1;
    if (type & INTERLEAVED) return dequantize_interleaved(w, type & ~INTERLEAVED, n, k, ids, count, out, out_bf16,
                                                          num_threads);
    int64_t rows = ids ? count : n, row_bytes = (int64_t)(k / BLOCK_VALUES[type]) * BLOCK_BYTES[type];
    int elem = out_bf16 ? 2 : 4;
#define DEQUANTIZE(T) \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)") \
    for (int64_t r = 0; r < rows; r++) \
        dequantize_row(T, w + (ids ? ids[r] : r) * row_bytes, k, (char *)out + r * k * elem, out_bf16);
#define DEQUANTIZE_TYPE(unused, T) DEQUANTIZE(T)
    EACH_TYPE(DEQUANTIZE_TYPE, 0)
    return 0;
}

/* the bytes of a row of k values of block type `type`, or -1 for an unknown type or a k that is
 * not a whole number of blocks */
int64_t gguf_row_bytes(int type, int k) {
    if (!known_type(type)) return -1;
    const int base = type & ~INTERLEAVED;
    if (k <= 0 || k % BLOCK_VALUES[base]) return -1;
    return (int64_t)(k / BLOCK_VALUES[base]) * (type & INTERLEAVED ? il_block_bytes(base) : BLOCK_BYTES[base]);
}

/* the table's row of a type (gguf_blocks.h): values, bytes, bias, half scales, offsets; -1 for an
 * unknown type (the tests read the compiled table against the header's text and the gguf package) */
int gguf_type_info(int type, int info[5]) {
    if (type < 0 || type > LAST_TYPE) return -1;
    info[0] = BLOCK_VALUES[type];
    info[1] = BLOCK_BYTES[type];
    info[2] = type_bias(type);
    info[3] = half_scales(type);
    info[4] = type_offsets(type);
    return 0;
}

/* one row of w -> k values, float32 or bfloat16, as gguf_dequantize computes them */
void gguf_dequantize_row(int type, const uint8_t *row, int k, void *out, int out_bf16) {
#define ROW_TYPE(unused, T) dequantize_row(T, row, k, out, out_bf16);
    EACH_TYPE(ROW_TYPE, 0)
}

int gguf_dequantize_row_of(int type, const uint8_t *w, int64_t row, int k, void *out, int out_bf16) {
    if (!(type & INTERLEAVED)) {
        gguf_dequantize_row(type, w + row * gguf_row_bytes(type, k), k, out, out_bf16);
        return 0;
    }
    type &= ~INTERLEAVED;
    uint8_t *raw = malloc((size_t)(k / BLOCK_VALUES[type]) * BLOCK_BYTES[type]);
    if (!raw) return -2;
    deinterleave_row(type, w, row, k, raw);
    gguf_dequantize_row(type, raw, k, out, out_bf16);
    free(raw);
    return 0;
}

#define MAX_ROWS 8  /* rows of x held against one weight row in registers */

/* Both matmuls split the output rows over the threads; each weight row is read once for up
 * to MAX_ROWS rows of x, whose sums stay in registers: `rows` is a constant in every call of
 * the tile functions (the dispatch below: 8, 4, 2 or 1 rows, fewer copies of the code to compile),
 * so their loops over it unroll. */
static inline int tile_rows(int left) { return left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1; }
#define ROWS_CASES(call, T) switch (rows) { \
    case 1: call(T, 1); break; case 2: call(T, 2); break; case 4: call(T, 4); break; default: call(T, 8); break; }
/* ... and so is the block type */
#define DISPATCH(call) EACH_TYPE(ROWS_CASES, call)

/* ---- exact mode: float32 products of the dequantized weight and x ---- */

static inline __attribute__((always_inline)) void exact_tile(const float *x, const uint8_t *row, int type, int k,
                                                             const int rows, float *out) {
    int per_block = BLOCK_VALUES[type], blocks = k / per_block, subs = per_block / 32;
    int64_t row_bytes = (int64_t)blocks * BLOCK_BYTES[type];
#ifdef VECTOR
    __m512 acc[MAX_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
#elif defined(VEC_AVX2)
    __m256 acc[MAX_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm256_setzero_ps();
#else
    float acc[MAX_ROWS] = {0};
#endif
    for (int blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + (int64_t)blk * BLOCK_BYTES[type];
        __builtin_prefetch(b + row_bytes);
        for (int s = 0; s < subs; s++) {
            float scale[2], offset[2];
            sub_scales(type, b, s, scale, offset);
            int col = blk * per_block + s * 32;
#ifdef VECTOR
            __m512 w0, w1;
            sub_floats_vec(sub_values_vec(type, b, s), scale, offset, &w0, &w1);
            for (int i = 0; i < rows; i++) {
                const float *xi = x + (int64_t)i * k + col;
                acc[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xi), acc[i]);
                acc[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xi + 16), acc[i]);
            }
#elif defined(VEC_AVX2)
            __m256 wv[4];
            sub_floats_vec8(sub_values_vec(type, b, s), scale, offset, wv);
            for (int i = 0; i < rows; i++) {
                const float *xi = x + (int64_t)i * k + col;
                for (int j = 0; j < 4; j++) acc[i] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(xi + 8 * j), acc[i]);
            }
#else
            uint8_t q[32];
            float wv[32];
            sub_values(type, b, s, q);
            for (int j = 0; j < 32; j++) wv[j] = scale[j >> 4] * (float)q[j] + offset[j >> 4];
            for (int i = 0; i < rows; i++) {
                const float *xi = x + (int64_t)i * k + col;
                float sum = 0.0f;
                for (int j = 0; j < 32; j++) sum += wv[j] * xi[j];
                acc[i] += sum;
            }
#endif
        }
    }
    for (int i = 0; i < rows; i++) {
#ifdef VECTOR
        out[i] = _mm512_reduce_add_ps(acc[i]);
#elif defined(VEC_AVX2)
        out[i] = hsum256(acc[i]);
#else
        out[i] = acc[i];
#endif
    }
}


/* the team's share of y[:, col0:col0 + n] (rows ldy apart) = x @ w^T, x float32 rows */
static void exact_matmul_team(const float *x, const uint8_t *w, int type, int m, int n, int k, void *y, int io_bf16,
                              int64_t ldy, int col0) {
    int64_t row_bytes = (int64_t)(k / BLOCK_VALUES[type]) * BLOCK_BYTES[type];
    #pragma omp for schedule(static)
    for (int r = 0; r < n; r++) {
        for (int i0 = 0, rows; i0 < m; i0 += rows) {
            rows = tile_rows(m - i0);
            float out[MAX_ROWS] = {0};
#define EXACT(T, R) exact_tile(x + (int64_t)i0 * k, w + r * row_bytes, T, k, R, out)
            DISPATCH(EXACT)
            for (int i = 0; i < rows; i++) store_out(y, io_bf16, (int64_t)(i0 + i) * ldy + col0 + r, out[i]);
        }
    }
}

/* ---- fast mode: x quantized to int8 per block of 32, integer dot products ---- */

/* One row of x as int8 blocks of 32: values xq, scale dx and, per half of 16 and per block,
 * dx * sum(xq); per block sum(xq) too (isums). */
static void quantize_row(const float *x, int k, int8_t *xq, float *dx, float *half_sums, float *block_sums,
                         int16_t *isums) {
    for (int blk = 0; blk < k / 32; blk++) {
        const float *v = x + blk * 32;
#ifdef VECTOR
        /* the same operations on 16 values at a time (a maximum, a product and a rounding to
         * nearest each are exact whatever their grouping): the same bits, without the scalar
         * loop's 4 % of a batch-12 decode step */
        const __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
#else
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
#endif
        float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        int sums[2] = {0, 0};
#ifdef VECTOR
        const __m512 scale = _mm512_set1_ps(inv);
        const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, scale), round));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, scale), round));
        _mm_storeu_si128((__m128i *)(xq + blk * 32), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(xq + blk * 32 + 16), _mm512_cvtepi32_epi8(qhi));
        sums[0] = _mm512_reduce_add_epi32(qlo);
        sums[1] = _mm512_reduce_add_epi32(qhi);
#else
        for (int j = 0; j < 32; j++) {
            int qv = (int)nearbyintf(v[j] * inv);
            xq[blk * 32 + j] = (int8_t)qv;
            sums[j >> 4] += qv;
        }
#endif
        dx[blk] = d;
        half_sums[2 * blk] = d * (float)sums[0];
        half_sums[2 * blk + 1] = d * (float)sums[1];
        block_sums[blk] = d * (float)(sums[0] + sums[1]);
        isums[blk] = (int16_t)(sums[0] + sums[1]);   /* |sum| <= 32 * 127 */
    }
}

/* the quantized rows of x: values, the scale of each block of 32, dx * sum per half of 16 */
typedef struct { const int8_t *q; const float *d, *half_sums; int xblocks; } QRows;

/* one weight sub-block (q, scales, offsets) against sub-block g of quantized row i, in plain C */
static inline float sub_dot(const uint8_t q[32], const float scale[2], const float offset[2], QRows xr, int i,
                            int k, int g) {
    const int64_t at = (int64_t)i * xr.xblocks + g;
    const int8_t *xv = xr.q + (int64_t)i * k + g * 32;
    int dot[2] = {0, 0};
    for (int j = 0; j < 32; j++) dot[j >> 4] += (int)q[j] * (int)xv[j];
    return xr.d[at] * (scale[0] * (float)dot[0] + scale[1] * (float)dot[1]) +
           offset[0] * xr.half_sums[at * 2] + offset[1] * xr.half_sums[at * 2 + 1];
}

#ifdef VEC_AVX2
#define FAST_VEC 1
/* Types whose weight is scale * (a signed integer): a bias in gguf_blocks.h's table (Q4_0: q - 8,
 * Q5_0: q - 16, Q8_0, Q6_K: q - 32, Q3_K: q - 4), with no offset term; the others (Q4_1, Q5_1, Q2_K,
 * Q4_K, Q5_K) are scale * q + offset, q unsigned. */
#define SIGNED_WEIGHT(t) (type_bias(t) != 0)
/* types with a scale per half of 16 values (the others' halves share one) */
#define HALF_SCALES(t) half_scales(t)
/* offsets kept per sub-block: Q2_K's two halves have their own min, the other types' share one */
#define OFFSETS(t) type_offsets(t)
#define TILE_W 4       /* weight rows of a tile (a weight row's sums for TILE_X rows of x in registers) */
#ifdef VECTOR
#define TILE_X 4       /* rows of x of a tile: AVX-512's 32 registers hold 4 x 4 sums and their inputs */
#else
#define TILE_X 2       /* 16 registers */
#endif
#if defined(VECTOR) && defined(__AVX512VNNI__)
/* AVX-512 VNNI: two sub-blocks (64 values) a step in 512-bit registers for tiles of 4 rows of x:
 * lanes 0-7 sum sub-block g, lanes 8-15 sub-block g + 1, the 16 lanes summed at the end. One or
 * two rows of x (a decode step's) run the same lanes in two 256-bit halves (fast_halves): the same
 * bits, without 512-bit instructions beside the 256-bit decoding of the blocks, most of a row's
 * work. A signed weight q is read unsigned as q + 128 (its sign bit flipped), the dot product
 * starting from -128 * (x's sums of four), once per row of x and sub-block: the same integers as
 * |q| times x with q's sign (dot32), one instruction a pair of rows instead of two. */
#define FAST_512 1
#endif

/* sub-block `sub` of block b as the fast kernel reads it: 32 integers (unsigned, or signed for
 * SIGNED_WEIGHT), the scale of each lane of a dot product (lanes 0-3 sum half 0, 4-7 half 1) and
 * the OFFSETS(type) offsets (unsigned types) */
static inline __attribute__((always_inline)) void sub_weight(int type, const uint8_t *b, int sub, __m256i *q,
                                                             __m256 *lane_scales, float *offset) {
    float scale[2], off[2];
    sub_scales(type, b, sub, scale, off);
    if (type == Q8_0) *q = _mm256_loadu_si256((const __m256i *)(b + 2));  /* signed as stored: no bias to take */
    else if (type_bias(type)) *q = _mm256_sub_epi8(sub_values_vec(type, b, sub), _mm256_set1_epi8((char)type_bias(type)));
    else *q = sub_values_vec(type, b, sub);
    *lane_scales = HALF_SCALES(type) ? _mm256_set_m128(_mm_set1_ps(scale[1]), _mm_set1_ps(scale[0]))
                                     : _mm256_set1_ps(scale[0]);
    offset[0] = off[0];
    if (OFFSETS(type) == 2) offset[1] = off[1];
}

/* the 32 products of weight values q and int8 x, summed four at a time into 8 int32 lanes. Exact:
 * |q| <= 128 and |x| <= 127, so a pair of products fits vpmaddubsw's int16 (with VNNI vpdpbusd
 * sums the same four products in one instruction: the same integers). */
static inline __attribute__((always_inline)) __m256i dot32(int type, __m256i q, __m256i x) {
    if (SIGNED_WEIGHT(type)) {  /* u8 x s8 products: |q| unsigned, its sign moved onto x */
        x = _mm256_sign_epi8(x, q);
        q = _mm256_abs_epi8(q);
    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}

/* weight rows decoded once for many rows of x: values, lane scales and offsets per sub-block */
typedef struct { int8_t *q; float *lane_scales, *offsets; } Decoded;

static void decode_rows(int type, const uint8_t *w, int64_t row_bytes, int rows, int k, Decoded d) {
    const int subs = BLOCK_VALUES[type] / 32, xblocks = k / 32;
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < xblocks; g++) {
            __m256i q;
            __m256 s;
            sub_weight(type, w + r * row_bytes + (int64_t)(g / subs) * BLOCK_BYTES[type], g % subs, &q, &s,
                       d.offsets + ((int64_t)r * xblocks + g) * OFFSETS(type));
            _mm256_storeu_si256((__m256i *)(d.q + ((int64_t)r * xblocks + g) * 32), q);
            _mm256_storeu_ps(d.lane_scales + ((int64_t)r * xblocks + g) * 8, s);
        }
}

#ifdef FAST_512
/* One sub-block g of W weight rows against X rows of x into the 256-bit sums acc (the even or
 * the odd sub-blocks' lanes of fast_tile_vec's 512-bit tile) */
static inline __attribute__((always_inline)) void half_step(QRows xr, const uint8_t *w, int64_t row_bytes,
                                                            const Decoded *decoded, int type, int k, const int W,
                                                            const int X, int g, float *offsets,
                                                            __m256 acc[TILE_W][TILE_X]) {
    const int subs = BLOCK_VALUES[type] / 32, xblocks = k / 32;
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    __m256i x[TILE_X], start[TILE_X];
    for (int i = 0; i < X; i++) {
        x[i] = _mm256_loadu_si256((const __m256i *)(xr.q + (int64_t)i * k + g * 32));
        start[i] = SIGNED_WEIGHT(type) ? _mm256_sub_epi32(_mm256_setzero_si256(),
                       _mm256_dpbusd_epi32(_mm256_setzero_si256(), bias, x[i])) : _mm256_setzero_si256();
    }
    for (int r = 0; r < W; r++) {
        __m256i q;
        __m256 s;
        const int64_t at = (int64_t)r * xblocks + g;
        if (decoded) {
            q = _mm256_loadu_si256((const __m256i *)(decoded->q + at * 32));
            s = _mm256_loadu_ps(decoded->lane_scales + at * 8);
        } else {
            const uint8_t *b = w + r * row_bytes + (int64_t)(g / subs) * BLOCK_BYTES[type];
            if (g % subs == 0) __builtin_prefetch(b + TILE_W * row_bytes);
            sub_weight(type, b, g % subs, &q, &s, offsets + at * OFFSETS(type));
        }
        if (SIGNED_WEIGHT(type)) q = _mm256_xor_si256(q, bias);
        for (int i = 0; i < X; i++) {
            const __m256i dot = _mm256_dpbusd_epi32(start[i], q, x[i]);
            const __m256 scale = _mm256_mul_ps(s, _mm256_broadcast_ss(xr.d + (int64_t)i * xr.xblocks + g));
            acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r][i]);
        }
    }
}

/* W weight rows against X (1 or 2) rows of x: fast_tile_vec's 16 lanes as two halves of 8 (even
 * and odd sub-blocks), summed as one 512-bit register at the end */
static inline __attribute__((always_inline)) void fast_halves(QRows xr, const uint8_t *w, int64_t row_bytes,
                                                              const Decoded *decoded, int type, int k, const int W,
                                                              const int X, float *offsets,
                                                              float out[TILE_W][TILE_X]) {
    const int xblocks = k / 32;
    __m256 even[TILE_W][TILE_X], odd[TILE_W][TILE_X];
    for (int r = 0; r < W; r++)
        for (int i = 0; i < X; i++) even[r][i] = odd[r][i] = _mm256_setzero_ps();
    for (int g = 0; g < xblocks; g += 2) {
        half_step(xr, w, row_bytes, decoded, type, k, W, X, g, offsets, even);
        if (g + 1 < xblocks) half_step(xr, w, row_bytes, decoded, type, k, W, X, g + 1, offsets, odd);
    }
    for (int r = 0; r < W; r++)
        for (int i = 0; i < X; i++)
            out[r][i] = _mm512_reduce_add_ps(_mm512_insertf32x8(_mm512_castps256_ps512(even[r][i]), odd[r][i], 1));
}
#endif

/* A tile: W weight rows against X rows of quantized x, one sub-block (32 values) a step. Every
 * (x row, weight row) pair takes the same operations in the same order whatever W, X and the
 * weights' source (`decoded`, or the blocks decoded in registers), so a row's result does not
 * depend on its batch: lanes += float(dot) * (lane scales * dx), then the lanes' sum. The
 * weights' offsets times x's block sums are added by offset_sum (stored into `offsets` here when
 * the weights come from the blocks). */
static inline __attribute__((always_inline)) void fast_tile_vec(QRows xr, const uint8_t *w, int64_t row_bytes,
                                                                const Decoded *decoded, int type, int k, const int W,
                                                                const int X, float *offsets, float out[TILE_W][TILE_X]) {
    const int subs = BLOCK_VALUES[type] / 32, xblocks = k / 32;
#ifdef FAST_512
    if (X <= 2) {   /* few rows (a decode step's): 256-bit halves, no 512-bit instructions */
        fast_halves(xr, w, row_bytes, decoded, type, k, W, X, offsets, out);
        return;
    }
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    __m512 acc[TILE_W][TILE_X];
    for (int r = 0; r < W; r++)
        for (int i = 0; i < X; i++) acc[r][i] = _mm512_setzero_ps();
    for (int g = 0; g < xblocks; g += 2) {
        const int two = g + 1 < xblocks;   /* an odd last sub-block: the upper lanes are zeros */
        const __mmask64 bytes = two ? ~0ULL : 0xffffffffULL;
        __m512i xv[TILE_X], start[TILE_X];
        __m512 dx[TILE_X];
        for (int i = 0; i < X; i++) {
            xv[i] = _mm512_maskz_loadu_epi8(bytes, xr.q + (int64_t)i * k + g * 32);
            const float *d = xr.d + (int64_t)i * xr.xblocks + g;
            dx[i] = _mm512_insertf32x8(_mm512_set1_ps(d[0]), _mm256_set1_ps(two ? d[1] : 0.0f), 1);
            start[i] = SIGNED_WEIGHT(type) ? _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(
                           _mm512_setzero_si512(), bias, xv[i])) : _mm512_setzero_si512();
        }
        for (int r = 0; r < W; r++) {
            __m512i q;
            __m512 s;
            const int64_t at = (int64_t)r * xblocks + g;
            if (decoded) {
                q = _mm512_maskz_loadu_epi8(bytes, decoded->q + at * 32);
                s = _mm512_maskz_loadu_ps(two ? 0xffff : 0xff, decoded->lane_scales + at * 8);
            } else {
                const uint8_t *row = w + r * row_bytes;
                const uint8_t *b = row + (int64_t)(g / subs) * BLOCK_BYTES[type];
                __m256i q0, q1 = _mm256_setzero_si256();
                __m256 s0, s1 = _mm256_setzero_ps();
                if (g % subs == 0) __builtin_prefetch(b + TILE_W * row_bytes);
                sub_weight(type, b, g % subs, &q0, &s0, offsets + at * OFFSETS(type));
                if (two) {
                    const uint8_t *b1 = row + (int64_t)((g + 1) / subs) * BLOCK_BYTES[type];
                    sub_weight(type, b1, (g + 1) % subs, &q1, &s1, offsets + (at + 1) * OFFSETS(type));
                }
                q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
                s = _mm512_insertf32x8(_mm512_castps256_ps512(s0), s1, 1);
            }
            if (SIGNED_WEIGHT(type)) q = _mm512_xor_si512(q, bias);
            for (int i = 0; i < X; i++) {
                const __m512i dot = _mm512_dpbusd_epi32(start[i], q, xv[i]);
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, dx[i]), acc[r][i]);
            }
        }
    }
    for (int r = 0; r < W; r++)
        for (int i = 0; i < X; i++) out[r][i] = _mm512_reduce_add_ps(acc[r][i]);
#else
    __m256 acc[TILE_W][TILE_X];
    for (int r = 0; r < W; r++)
        for (int i = 0; i < X; i++) acc[r][i] = _mm256_setzero_ps();
    for (int g = 0; g < xblocks; g++) {
        __m256i xv[TILE_X];
        for (int i = 0; i < X; i++) xv[i] = _mm256_loadu_si256((const __m256i *)(xr.q + (int64_t)i * k + g * 32));
        for (int r = 0; r < W; r++) {
            __m256i q;
            __m256 s;
            if (decoded) {
                q = _mm256_loadu_si256((const __m256i *)(decoded->q + ((int64_t)r * xblocks + g) * 32));
                s = _mm256_loadu_ps(decoded->lane_scales + ((int64_t)r * xblocks + g) * 8);
            } else {
                const uint8_t *b = w + r * row_bytes + (int64_t)(g / subs) * BLOCK_BYTES[type];
                if (g % subs == 0) __builtin_prefetch(b + TILE_W * row_bytes);
                sub_weight(type, b, g % subs, &q, &s, offsets + ((int64_t)r * xblocks + g) * OFFSETS(type));
            }
            for (int i = 0; i < X; i++) {
                const __m256 scale = _mm256_mul_ps(s, _mm256_broadcast_ss(xr.d + (int64_t)i * xr.xblocks + g));
                acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(type, q, xv[i])), scale, acc[r][i]);
            }
        }
    }
    for (int r = 0; r < W; r++)
        for (int i = 0; i < X; i++) out[r][i] = hsum256(acc[r][i]);
#endif
}

/* sum over the `count` offsets of offset * (dx * sum of x's values under it: a sub-block's 32, or a
 * half's 16 for Q2_K): eight lanes, their sum, then the offsets left over, in that order wherever
 * it is inlined */
static inline __attribute__((always_inline)) float offset_sum(const float *offsets, const float *sums, int count) {
    __m256 acc = _mm256_setzero_ps();
    int g = 0;
    for (; g + 8 <= count; g += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(offsets + g), _mm256_loadu_ps(sums + g), acc);
    float sum = hsum256(acc);
    for (; g < count; g++) sum = fmaf(offsets[g], sums[g], sum);
    return sum;
}

#define X_CASES(call, T, W) if (X == TILE_X) { call(T, W, TILE_X); } else if (X == 2) { call(T, W, 2); } \
    else { call(T, W, 1); }
#define W_CASES(call, T) if (W == TILE_W) { X_CASES(call, T, TILE_W) } else { X_CASES(call, T, 1) }
/* Every type, though the K-quants no longer come here (gguf_matmul_team sends them to
 * gguf_superblocks.h): with their cases left out GCC laid out the others' tiles so that Q4_1 ran
 * 1.11-1.18x slower at 4-12 rows (gguf_linear_ab.py, a Zen 4), the code otherwise the same. */
#define TILE_DISPATCH(call) EACH_TYPE(W_CASES, call)

/* Rows of x past which a tile's weight rows are decoded once into a buffer rather than in registers
 * for each tile of x rows. Q4_1's and Q8_0's blocks decode in a few instructions, cheaper than the
 * buffer's stores and loads until a tile is shared by many (gguf_linear_ab.py on a Zen 4: 0.73x and
 * 0.76x the time at 8 rows, the same at 64-128 for Q4_1); the other types' decoding costs more. AVX2's tiles of x are 2 rows, each
 * decoding the weights again: there the buffer past one tile, as before (not measured otherwise). */
static inline int decode_once_past(int type) {
#ifdef FAST_512
    return type == Q4_1 ? 32 : type == Q8_0 ? 128 : TILE_X;
#else
    (void)type;
    return TILE_X;
#endif
}

/* the team's share of y[:, col0:col0 + n] (rows ldy apart) = x @ w^T over quantized rows xr, the
 * weight rows split over the threads in tiles of TILE_W; past decode_once_past(type) rows of x the
 * tile's weight rows are decoded once into a buffer of the thread's */
static void fast_matmul_team(QRows xr, const float *block_sums, const uint8_t *w, int type, int m, int n, int k,
                             void *y, int io_bf16, int64_t ldy, int col0, int *failed) {
    const int xblocks = k / 32;
    const int64_t row_bytes = (int64_t)(k / BLOCK_VALUES[type]) * BLOCK_BYTES[type];
    const int tiles = (n + TILE_W - 1) / TILE_W, decode_once = m > decode_once_past(type);
    /* Q8_0 at one or two rows of x: weight rows one at a time, one sequential stream of bytes per
     * thread instead of four rows read side by side. Its blocks take a few instructions, so the
     * memory's pace is all there is: a decode step of one 0.82-0.95x the time on the default model,
     * 0.66-0.72x on Gemma 3 270M (a Q8_0 head of 178 MB; step_times.py, a Zen 4). Only a matrix
     * that stays in the cache between calls, as a microbenchmark's does, was faster in tiles (their
     * shared work on x's side); the 4- and 5-bit types, which decode more, ran up to 1.26x slower
     * one row at a time everywhere. The same bits either way. */
    const int one_stream = type == Q8_0 && m <= 2;
    {
        int8_t *dq = decode_once ? malloc((size_t)TILE_W * k) : NULL;
        float *scales = decode_once ? malloc(sizeof(float) * TILE_W * xblocks * 8) : NULL;
        float *offsets = malloc(sizeof(float) * TILE_W * xblocks * OFFSETS(type));
        const int ready = !((decode_once && (!dq || !scales)) || !offsets);
        if (!ready) {
            #pragma omp atomic write
            *failed = 1;
        }
        {   /* every thread meets the loop (a worksharing construct), one without buffers skips its tiles */
            #pragma omp for schedule(static)
            for (int t = 0; t < tiles; t++) {
                if (!ready) continue;
                const int r0 = t * TILE_W, full = n - r0 >= TILE_W && !one_stream;
                /* a tile of fewer than TILE_W rows (n not a multiple, or one_stream) runs its rows one at a time */
                for (int r1 = r0; r1 < (full ? r0 + 1 : r0 + TILE_W < n ? r0 + TILE_W : n); r1++) {
                    const int W = full ? TILE_W : 1;
                    const uint8_t *wr = w + (int64_t)r1 * row_bytes;
                    Decoded d = {dq, scales, offsets};
                    if (decode_once) decode_rows(type, wr, row_bytes, W, k, d);
                    for (int i0 = 0, X; i0 < m; i0 += X) {   /* tiles of TILE_X rows of x, then of 2, then 1 */
                        X = m - i0 >= TILE_X ? TILE_X : m - i0 >= 2 ? 2 : 1;
                        float out[TILE_W][TILE_X];
                        QRows xi = {xr.q + (int64_t)i0 * k, xr.d + (int64_t)i0 * xblocks, NULL, xblocks};
#define FAST_VEC_TILE(T, WC, XC) fast_tile_vec(xi, wr, row_bytes, decode_once ? &d : NULL, T, k, WC, XC, offsets, out)
                        TILE_DISPATCH(FAST_VEC_TILE)
                        for (int r = 0; r < W; r++)
                            for (int i = 0; i < X; i++) {
                                float v = out[r][i];
                                if (!SIGNED_WEIGHT(type)) {
                                    const int per = OFFSETS(type), count = xblocks * per;
                                    const float *sums = per == 2 ? xr.half_sums : block_sums;
                                    v += offset_sum(offsets + (int64_t)r * count, sums + (int64_t)(i0 + i) * count, count);
                                }
                                store_out(y, io_bf16, (int64_t)(i0 + i) * ldy + col0 + r1 + r, v);
                            }
                    }
                }
            }
        }
        free(dq); free(scales); free(offsets);
    }
}
#endif

/* the portable version: one sub-block of 32 a step, integer dot products in plain C */
static inline __attribute__((always_inline)) void fast_tile(QRows xr, const uint8_t *row, int type, int k,
                                                            const int rows, float *out) {
    int per_block = BLOCK_VALUES[type], blocks = k / per_block, subs = per_block / 32;
    int64_t row_bytes = (int64_t)blocks * BLOCK_BYTES[type];
    float acc[MAX_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = 0.0f;
    for (int blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + (int64_t)blk * BLOCK_BYTES[type];
        __builtin_prefetch(b + row_bytes);
        for (int s = 0; s < subs; s++) {
            float scale[2], offset[2];
            uint8_t q[32];
            sub_scales(type, b, s, scale, offset);
            sub_values(type, b, s, q);
            for (int i = 0; i < rows; i++) acc[i] += sub_dot(q, scale, offset, xr, i, k, blk * subs + s);
        }
    }
    for (int i = 0; i < rows; i++) out[i] = acc[i];
}

#ifndef FAST_VEC
/* the team's share of y[:, col0:col0 + n] over quantized rows, in plain C */
static void fast_matmul_portable_team(QRows xr, const uint8_t *w, int type, int m, int n, int k, void *y,
                                      int io_bf16, int64_t ldy, int col0) {
    const int xblocks = k / 32;
    int64_t row_bytes = (int64_t)(k / BLOCK_VALUES[type]) * BLOCK_BYTES[type];
    #pragma omp for schedule(static)
    for (int r = 0; r < n; r++) {
        for (int i0 = 0, rows; i0 < m; i0 += rows) {
            rows = tile_rows(m - i0);
            float out[MAX_ROWS] = {0};
            QRows xi = {xr.q + (int64_t)i0 * k, xr.d + i0 * xblocks, xr.half_sums + i0 * xblocks * 2, xblocks};
#define FAST(T, R) fast_tile(xi, w + r * row_bytes, T, k, R, out)
            DISPATCH(FAST)
            for (int i = 0; i < rows; i++) store_out(y, io_bf16, (int64_t)(i0 + i) * ldy + col0 + r, out[i]);
        }
    }
}
#endif

#include "gguf_superblocks.h"
#include "gguf_interleaved_k.h"

/* ---- the team entries (gguf_team.h) and the entries that open their own region ---- */

int gguf_takes_superblock_rows(int type) { return takes_superblock_rows(type & ~INTERLEAVED); }

/* w [n, k] of block type `type` (the file's layout) -> out [n, gguf_row_bytes(type | INTERLEAVED, k)],
 * its rows interleaved (gguf_interleaved.h); returns type | INTERLEAVED, or -1 where the type or n
 * does not allow it */
int gguf_interleave(const uint8_t *w, int type, int64_t n, int k, uint8_t *out, int num_threads) {
    if (type < 0 || type > LAST_TYPE || !interleavable(type) || n % GROUP || k <= 0 || k % BLOCK_VALUES[type])
        return -1;
    const int blocks = k / BLOCK_VALUES[type], bytes = BLOCK_BYTES[type], il_bytes = il_block_bytes(type);
    const int64_t row_bytes = (int64_t)blocks * bytes, il_row_bytes = (int64_t)blocks * il_bytes;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < n / GROUP; g++)
        for (int b = 0; b < blocks; b++) {
            const uint8_t *src[GROUP];
            for (int r = 0; r < GROUP; r++) src[r] = w + (g * GROUP + r) * row_bytes + (int64_t)b * bytes;
            interleave_block(type, src, out + g * GROUP * il_row_bytes + (int64_t)b * GROUP * il_bytes);
        }
    return type | INTERLEAVED;
}

int gguf_rows_alloc(struct gguf_rows *r, int m, int k, int floats, int quantized) {
    const size_t values = (size_t)m * k, blocks = values / 32;
    *r = (struct gguf_rows){0};
    int ok = 1;
    if (floats) ok = (r->f = malloc(sizeof(float) * (values ? values : 1))) != NULL;
    if (ok && quantized) {
        r->q = malloc(values ? values : 1);
        r->d = malloc(sizeof(float) * (blocks ? blocks : 1));
        r->half_sums = malloc(sizeof(float) * 2 * (blocks ? blocks : 1));
        r->block_sums = malloc(sizeof(float) * (blocks ? blocks : 1));
        r->isums = malloc(sizeof(int16_t) * (blocks ? blocks : 1));
        r->super_q = malloc(values ? values : 1);
        r->super_d = malloc(sizeof(float) * (values / SUPER + 1));
        r->super_sums = malloc(sizeof(int16_t) * (values / 16 + 1));
        ok = r->q && r->d && r->half_sums && r->block_sums && r->isums && r->super_q && r->super_d && r->super_sums;
    }
    if (!ok) gguf_rows_free(r);
    return ok ? 0 : -2;
}

void gguf_rows_free(struct gguf_rows *r) {
    free(r->f); free(r->q); free(r->d); free(r->half_sums); free(r->block_sums); free(r->isums);
    free(r->super_q); free(r->super_d); free(r->super_sums);
    *r = (struct gguf_rows){0};
}

void gguf_rows_team(const void *x, int io_bf16, int m, int k, int exact, int super, const struct gguf_rows *r) {
    const int xblocks = k / 32;
    if (exact && !io_bf16) return;   /* float32 rows are read in place */
    #pragma omp for schedule(static)
    for (int i = 0; i < m; i++) {
        const float *row = (const float *)x + (int64_t)i * k;
        if (io_bf16) {
            float *f = r->f + (int64_t)i * k;
            for (int j = 0; j < k; j++) f[j] = bf16_to_f32(((const uint16_t *)x)[(int64_t)i * k + j]);
            row = f;
        }
        if (!exact)
            quantize_row(row, k, r->q + (int64_t)i * k, r->d + (int64_t)i * xblocks,
                         r->half_sums + (int64_t)i * xblocks * 2, r->block_sums + (int64_t)i * xblocks,
                         r->isums + (int64_t)i * xblocks);
        if (!exact && super && k % SUPER == 0)
            quantize_row_super(row, k, r->super_q + (int64_t)i * k, r->super_d + (int64_t)i * (k / SUPER),
                               r->super_sums + (int64_t)i * (k / 16));
    }
}

void gguf_matmul_team(const struct gguf_rows *r, const void *x, int io_bf16, int exact, const uint8_t *w, int type,
                      int m, int n, int k, void *y, int64_t ldy, int col0, int *failed) {
    if (exact) {
        exact_matmul_team(io_bf16 ? r->f : (const float *)x, w, type, m, n, k, y, io_bf16, ldy, col0);
        return;
    }
    if (type & INTERLEAVED) {
        const int base = type & ~INTERLEAVED;
        if (takes_superblock_rows(base)) {
            const SuperRows xs = {r->super_q, r->super_d, r->super_sums, k};
            il_super_matmul_team(base, w, xs, m, n, k, y, io_bf16, ldy, col0);
        } else {
            il_matmul_team(base, w, r->q, r->d, r->block_sums, r->isums, m, n, k, y, io_bf16, ldy, col0);
        }
        return;
    }
    if (takes_superblock_rows(type)) {
        const SuperRows xs = {r->super_q, r->super_d, r->super_sums, k};
        super_matmul_team(xs, w, type, m, n, k, y, io_bf16, ldy, col0);
        return;
    }
    const QRows xr = {r->q, r->d, r->half_sums, k / 32};
#ifdef FAST_VEC
    fast_matmul_team(xr, r->block_sums, w, type, m, n, k, y, io_bf16, ldy, col0, failed);
#else
    (void)failed;
    fast_matmul_portable_team(xr, w, type, m, n, k, y, io_bf16, ldy, col0);
#endif
}

/* x [m, k] @ w^T -> y [m, n], in a region of num_threads threads around the team entries */
static int linear_entry(const void *x, const uint8_t *w, int type, int m, int n, int k, void *y, int io_bf16,
                        int exact, int num_threads) {
    if (!known_type(type) || (exact && (type & INTERLEAVED))) return -1;
    struct gguf_rows rows;
    if (gguf_rows_alloc(&rows, m, k, io_bf16, !exact) != 0) return -2;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        gguf_rows_team(x, io_bf16, m, k, exact, takes_superblock_rows(type & ~INTERLEAVED), &rows);
        gguf_matmul_team(&rows, x, io_bf16, exact, w, type, m, n, k, y, n, 0, &failed);
    }
    gguf_rows_free(&rows);
    return failed ? -2 : 0;
}

/* x [m, k] and y [m, n]: float32, or bfloat16 with io_bf16 (sums are float32 either way) */
int gguf_linear_exact(const void *x, const uint8_t *w, int type, int m, int n, int k, void *y, int io_bf16,
                      int num_threads) {
    return linear_entry(x, w, type, m, n, k, y, io_bf16, 1, num_threads);
}

int gguf_linear_fast(const void *x, const uint8_t *w, int type, int m, int n, int k, void *y, int io_bf16,
                     int num_threads) {
    return linear_entry(x, w, type, m, n, k, y, io_bf16, 0, num_threads);
}
