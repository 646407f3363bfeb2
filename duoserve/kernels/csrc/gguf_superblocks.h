/* Fast mode for the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), a super-block (256 values) at a
 * time, as llama.cpp computes them.
 *
 * x's rows are quantized per super-block: 256 int8 values under one float scale dx, and the sum
 * of each run of 16 (`quantize_row_super`). A super-block of weights then needs one or two float
 * steps: its sub-blocks' integer dot products are multiplied by their integer scales and summed
 * as integers, and only that sum meets the float scales (q unsigned, s a run of 32 or 16 values
 * with its own scale sc[s] and min mn[s]):
 *     Q4_K, Q5_K (runs of 32), Q2_K (of 16):
 *         d * dx * sum_s sc[s] * (q_s . x_s)  -  dmin * dx * sum_s mn[s] * (sum of x_s)
 *     Q6_K, Q3_K (runs of 16, q stored + 32 or + 4):
 *         d * dx * sum_s sc[s] * (q_s . x_s - 32 (or 4) * sum of x_s)
 * The per-32 path of gguf_linear.c spends a float conversion, a product and a sum on every 32
 * values, and unpacks a sub-block's scales again for each: at one row it read Q4_K and Q6_K 5-7x
 * slower than Q4_0.
 *
 * The integers are exact and the same on every path (AVX-512 with or without VNNI, AVX2, plain
 * C); each (weight row, x row) pair takes the same float operations in the same order whatever
 * the tile it is computed in, so a row's result does not depend on its batch.
 * Included by gguf_linear.c alone, after gguf_blocks.h. */
#ifndef DUOSERVE_GGUF_SUPERBLOCKS_H
#define DUOSERVE_GGUF_SUPERBLOCKS_H

#define SUPER 256         /* values of a super-block, and of a quantized block of x on this path */
#define SUPER_TILE_X 4    /* rows of x sharing a weight row's decoding */

static inline int takes_superblock_rows(int type) {
    return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K;
}
/* the types with a scale per 32 values and a min per 32 (the others: per 16) */
#define SCALES_PER_32(t) ((t) == Q4_K || (t) == Q5_K)
/* the types with a min (d_min times an integer) per run; the others are stored + 32 (Q6_K) or + 4 (Q3_K) */
#define HAS_MINS(t) ((t) == Q4_K || (t) == Q5_K || (t) == Q2_K)
#define STORED_PLUS(t) ((t) == Q6_K ? 32 : 4)
/* where a super-block keeps d (and d_min after it) */
#define D_AT(t) ((t) == Q2_K ? 80 : (t) == Q3_K ? 108 : (t) == Q6_K ? 208 : 0)

/* x's rows quantized per super-block: values (row-major like x), one scale per 256, the sum of
 * each run of 16 values */
typedef struct { const int8_t *q; const float *d; const int16_t *sums; int k; } SuperRows;

static void quantize_row_super(const float *x, int k, int8_t *q, float *d, int16_t *sums) {
    for (int sb = 0; sb < k / SUPER; sb++) {
        const float *v = x + sb * SUPER;
#ifdef VECTOR
        __m512 top = _mm512_setzero_ps();
        for (int j = 0; j < SUPER; j += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(v + j)));
        const float amax = _mm512_reduce_max_ps(top);
#else
        float amax = 0.0f;
        for (int j = 0; j < SUPER; j++) amax = fmaxf(amax, fabsf(v[j]));
#endif
        const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int run = 0; run < SUPER / 16; run++) {
            const float *u = v + run * 16;
            int8_t *out = q + sb * SUPER + run * 16;
#ifdef VECTOR   /* a product and a rounding to nearest each exact: the bits of the loop below */
            const __m512i qi = _mm512_cvtps_epi32(_mm512_roundscale_ps(
                _mm512_mul_ps(_mm512_loadu_ps(u), _mm512_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(qi));
            sums[sb * 16 + run] = (int16_t)_mm512_reduce_add_epi32(qi);
#else
            int sum = 0;
            for (int j = 0; j < 16; j++) {
                const int qv = (int)nearbyintf(u[j] * inv);
                out[j] = (int8_t)qv;
                sum += qv;
            }
            sums[sb * 16 + run] = (int16_t)sum;
#endif
        }
        d[sb] = scale;
    }
}

/* the eight six-bit scales and mins of a Q4_K super-block (12 bytes at p), a byte each */
static inline void q4k_scales_mins(const uint8_t *p, uint64_t *scales, uint64_t *mins) {
    uint32_t u0, u1, u2;
    memcpy(&u0, p, 4);
    memcpy(&u1, p + 4, 4);
    memcpy(&u2, p + 8, 4);
    const uint32_t sc_hi = (u2 & 0x0f0f0f0f) | (((u0 >> 6) & 0x03030303) << 4);
    const uint32_t mn_hi = ((u2 >> 4) & 0x0f0f0f0f) | (((u1 >> 6) & 0x03030303) << 4);
    *scales = (u0 & 0x3f3f3f3f) | (uint64_t)sc_hi << 32;
    *mins = (u1 & 0x3f3f3f3f) | (uint64_t)mn_hi << 32;
}

#ifdef VEC_AVX2
/* A super-block's integer scales as int16 (Q4_K, Q5_K: 8, one per 32 values, in the low half;
 * the others 16, one per 16) and, for the types with mins, its mins as 16 int16, one per run of
 * 16 values (Q4_K's and Q5_K's each twice): what multiplies x's sums of 16. */
static inline __attribute__((always_inline)) void super_scales(int type, const uint8_t *b, __m256i *scales,
                                                               __m256i *mins) {
    if (SCALES_PER_32(type)) {
        uint64_t sc, mn;
        q4k_scales_mins(b + 4, &sc, &mn);
        const __m128i m8 = _mm_cvtsi64_si128((long long)mn);
        *scales = _mm256_castsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        *mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
    } else if (type == Q2_K) {   /* a byte per 16 values: scale in the low nibble, min in the high */
        const __m128i v = _mm_loadu_si128((const __m128i *)b), low4 = _mm_set1_epi8(0x0f);
        *scales = _mm256_cvtepu8_epi16(_mm_and_si128(v, low4));
        *mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low4));
    } else if (type == Q3_K) {   /* six bits stored + 32: low nibbles of bytes 0-7 then their high
                                  * nibbles, topped by bit pairs of bytes 8-11 (q3k_scale) */
        const __m128i v = _mm_loadl_epi64((const __m128i *)(b + 96)), low4 = _mm_set1_epi8(0x0f);
        const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
        int32_t top_bits;
        memcpy(&top_bits, b + 104, 4);
        const __m128i top = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(top_bits), _mm_setr_epi32(0, 2, 4, 6)),
                                          _mm_set1_epi8(3));
        *scales = _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(top, 4)), _mm_set1_epi8(32)));
    } else {   /* Q6_K: int8 per 16 values */
        *scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    }
}

/* x's sums of 16 times a super-block's mins or scales, 8 int32 lanes */
static inline __m256i sums_times(__m256i per_16, const int16_t *sums) {
    return _mm256_madd_epi16(per_16, _mm256_loadu_si256((const __m256i *)sums));
}
#endif

#if defined(VECTOR)
/* 64 values a step in 512-bit registers: vpmaddubsw's pairs (q < 64 unsigned, |x| <= 127: exact
 * in int16) times the scale of their run as int16, summed into 16 int32 lanes */
static inline __m512i scaled_pairs(__m512i acc, __m512i q, __m512i x, __m512i scales) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q, x), scales);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(q, x), scales));
#endif
}

/* int16 lane t of the 32 pairs of values 64j..64j+63 -> the index of its scale: sub-block
 * 2j + t/16 (scales per 32), run 4j + t/8 (per 16) */
static inline __m512i scale_index(int type, int j) {
    uint16_t idx[32];
    for (int t = 0; t < 32; t++) idx[t] = (uint16_t)(SCALES_PER_32(type) ? 2 * j + t / 16 : 4 * j + t / 8);
    return _mm512_loadu_si512(idx);
}

/* values 64j..64j+63 of super-block b, unsigned, in one register */
static inline __attribute__((always_inline)) __m512i super_values(int type, const uint8_t *b, int j) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), three = _mm512_set1_epi8(3);
    if (type == Q4_K) {   /* 32 bytes: sub-block 2j in the low nibbles, 2j + 1 in the high */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
        return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low4);
    }
    if (type == Q6_K) {   /* half j/2: ql's 64 bytes' low (j even) or high nibbles, topped by qh's bit pairs */
        const int h = j / 2;
        const __m512i l = _mm512_loadu_si512(b + 64 * h);
        const __m256i hq = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(hq), _mm256_srli_epi16(hq, 2), 1);
        return j % 2 == 0 ? _mm512_or_si512(_mm512_and_si512(l, low4), _mm512_slli_epi16(_mm512_and_si512(hi, three), 4))
                          : _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low4),
                                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hi, 4), three), 4));
    }
    /* Q2_K, Q3_K, Q5_K: sub-blocks 2j and 2j + 1 as gguf_blocks.h reads them */
    return _mm512_inserti64x4(_mm512_castsi256_si512(sub_values_vec(type, b, 2 * j)),
                              sub_values_vec(type, b, 2 * j + 1), 1);
}

/* one weight row (nsb super-blocks) against X rows of x: out[i] */
static inline __attribute__((always_inline)) void super_tile(int type, const uint8_t *row, int nsb, SuperRows xs,
                                                             const int X, float out[SUPER_TILE_X]) {
    const __m512i idx[4] = {scale_index(type, 0), scale_index(type, 1), scale_index(type, 2), scale_index(type, 3)};
    __m512 acc[SUPER_TILE_X];
    __m256 min_acc[SUPER_TILE_X];
    for (int i = 0; i < X; i++) {
        acc[i] = _mm512_setzero_ps();
        min_acc[i] = _mm256_setzero_ps();
    }
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + (int64_t)sb * BLOCK_BYTES[type];
        const int8_t *x0 = xs.q + (int64_t)sb * SUPER;
        __m256i scales16, mins16 = _mm256_setzero_si256();
        super_scales(type, b, &scales16, &mins16);
        const __m512i scales = _mm512_castsi256_si512(scales16);
        __m512i iacc[SUPER_TILE_X];
        for (int i = 0; i < X; i++) iacc[i] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i q = super_values(type, b, j), s = _mm512_permutexvar_epi16(idx[j], scales);
            for (int i = 0; i < X; i++)
                iacc[i] = scaled_pairs(iacc[i], q, _mm512_loadu_si512(x0 + (int64_t)i * xs.k + 64 * j), s);
        }
        const float d = f16_to_f32(b + D_AT(type));
        for (int i = 0; i < X; i++) {
            const float dx = xs.d[(int64_t)i * (xs.k / SUPER) + sb];
            const int16_t *sums = xs.sums + (int64_t)i * (xs.k / 16) + sb * 16;
            if (HAS_MINS(type)) {
                const float dmin = f16_to_f32(b + D_AT(type) + 2);
                min_acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums_times(mins16, sums)), _mm256_set1_ps(dmin * dx),
                                             min_acc[i]);
            } else {   /* the values' stored offset: STORED_PLUS * sc . sums, out of the integers */
                const __m256i offset = _mm256_mullo_epi32(sums_times(scales16, sums), _mm256_set1_epi32(STORED_PLUS(type)));
                iacc[i] = _mm512_sub_epi32(iacc[i], _mm512_zextsi256_si512(offset));
            }
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i]), _mm512_set1_ps(d * dx), acc[i]);
        }
    }
    for (int i = 0; i < X; i++) out[i] = _mm512_reduce_add_ps(acc[i]) - hsum256(min_acc[i]);
}
#elif defined(VEC_AVX2)
/* 32 values a step in 256-bit registers: vpmaddubsw's pairs times their scale, into 8 int32 lanes */
static inline __m256i scaled_pairs(__m256i acc, __m256i q, __m256i x, __m256i scales) {
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(acc, _mm256_maddubs_epi16(q, x), scales);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), scales));
#endif
}

/* int16 lanes 0-7 take element a of a register of 8 int16 (both 128-bit halves the same), 8-15 element b */
static inline __m256i pick_pair(__m256i scales, int a, int b) {
    return _mm256_shuffle_epi8(scales, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * b)),
                                                        _mm_set1_epi16((short)(0x0100 + 0x0202 * a))));
}

static inline __attribute__((always_inline)) void super_tile(int type, const uint8_t *row, int nsb, SuperRows xs,
                                                             const int X, float out[SUPER_TILE_X]) {
    __m256 acc[SUPER_TILE_X], min_acc[SUPER_TILE_X];
    for (int i = 0; i < X; i++) acc[i] = min_acc[i] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + (int64_t)sb * BLOCK_BYTES[type];
        const int8_t *x0 = xs.q + (int64_t)sb * SUPER;
        __m256i scales16, mins16 = _mm256_setzero_si256();
        super_scales(type, b, &scales16, &mins16);
        /* both 128-bit halves the 8 scales a sub-block picks from: all 8 (per 32), or runs 0-7 / 8-15 */
        const __m256i low8 = _mm256_permute2x128_si256(scales16, scales16, 0x00);
        const __m256i high8 = _mm256_permute2x128_si256(scales16, scales16, 0x11);
        __m256i iacc[SUPER_TILE_X];
        for (int i = 0; i < X; i++) iacc[i] = _mm256_setzero_si256();
        for (int sub = 0; sub < 8; sub++) {
            const __m256i q = sub_values_vec(type, b, sub);
            const __m256i s = SCALES_PER_32(type) ? pick_pair(low8, sub, sub)
                                                  : pick_pair(sub < 4 ? low8 : high8, (2 * sub) % 8, (2 * sub + 1) % 8);
            for (int i = 0; i < X; i++)
                iacc[i] = scaled_pairs(iacc[i], q, _mm256_loadu_si256((const __m256i *)(x0 + (int64_t)i * xs.k + 32 * sub)), s);
        }
        const float d = f16_to_f32(b + D_AT(type));
        for (int i = 0; i < X; i++) {
            const float dx = xs.d[(int64_t)i * (xs.k / SUPER) + sb];
            const int16_t *sums = xs.sums + (int64_t)i * (xs.k / 16) + sb * 16;
            if (HAS_MINS(type)) {
                const float dmin = f16_to_f32(b + D_AT(type) + 2);
                min_acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums_times(mins16, sums)), _mm256_set1_ps(dmin * dx),
                                             min_acc[i]);
            } else {
                iacc[i] = _mm256_sub_epi32(iacc[i], _mm256_mullo_epi32(sums_times(scales16, sums),
                                                                       _mm256_set1_epi32(STORED_PLUS(type))));
            }
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i]), _mm256_set1_ps(d * dx), acc[i]);
        }
    }
    for (int i = 0; i < X; i++) out[i] = hsum256(acc[i]) - hsum256(min_acc[i]);
}
#else
/* the integer scale and min of run `run` (of 16 values) of a super-block */
static inline void run_scale_min(int type, const uint8_t *b, int run, int *sc, int *mn) {
    *mn = 0;
    if (SCALES_PER_32(type)) k_scale_min(b + 4, run / 2, sc, mn);
    else if (type == Q2_K) { *sc = b[run] & 0x0f; *mn = b[run] >> 4; }
    else if (type == Q3_K) *sc = q3k_scale(b + 96, run) - 32;
    else *sc = ((const int8_t *)(b + 192))[run];
}

/* plain C: the same integers, one super-block's float steps in one order */
static inline void super_tile(int type, const uint8_t *row, int nsb, SuperRows xs, const int X,
                              float out[SUPER_TILE_X]) {
    for (int i = 0; i < X; i++) {
        const int8_t *xq = xs.q + (int64_t)i * xs.k;
        const int16_t *sums = xs.sums + (int64_t)i * (xs.k / 16);
        float acc = 0.0f, min_acc = 0.0f;
        for (int sb = 0; sb < nsb; sb++) {
            const uint8_t *b = row + (int64_t)sb * BLOCK_BYTES[type];
            const float dx = xs.d[(int64_t)i * (xs.k / SUPER) + sb];
            int32_t isum = 0, msum = 0;
            for (int sub = 0; sub < 8; sub++) {
                uint8_t q[32];
                sub_values(type, b, sub, q);
                for (int half = 0; half < 2; half++) {
                    const int run = 2 * sub + half;
                    int sc, mn, dot = 0;
                    run_scale_min(type, b, run, &sc, &mn);
                    for (int j = 16 * half; j < 16 * half + 16; j++) dot += q[j] * xq[sb * SUPER + sub * 32 + j];
                    if (HAS_MINS(type)) {
                        isum += sc * dot;
                        msum += mn * sums[sb * 16 + run];
                    } else {
                        isum += sc * (dot - STORED_PLUS(type) * sums[sb * 16 + run]);
                    }
                }
            }
            const float d = f16_to_f32(b + D_AT(type));
            acc += (float)isum * (d * dx);
            if (HAS_MINS(type)) min_acc += (float)msum * (f16_to_f32(b + D_AT(type) + 2) * dx);
        }
        out[i] = acc - min_acc;
    }
}
#endif

/* the team's share of y[:, col0:col0 + n] (rows ldy apart) = x @ w^T for a K-quant weight,
 * x quantized per super-block; the weight rows split over the threads */
static void super_matmul_team(SuperRows xs, const uint8_t *w, int type, int m, int n, int k, void *y, int io_bf16,
                              int64_t ldy, int col0) {
    const int nsb = k / SUPER;
    const int64_t row_bytes = (int64_t)nsb * BLOCK_BYTES[type];
    #pragma omp for schedule(static)
    for (int r = 0; r < n; r++) {
        const uint8_t *row = w + r * row_bytes;
        for (int i0 = 0, X; i0 < m; i0 += X) {
            X = m - i0 >= SUPER_TILE_X ? SUPER_TILE_X : m - i0 >= 2 ? 2 : 1;
            const SuperRows xi = {xs.q + (int64_t)i0 * k, xs.d + (int64_t)i0 * nsb, xs.sums + (int64_t)i0 * (k / 16), k};
            float out[SUPER_TILE_X];
#define SUPER_X(T, XC) super_tile(T, row, nsb, xi, XC, out)
#define SUPER_CASES(T) if (X == SUPER_TILE_X) { SUPER_X(T, SUPER_TILE_X); } else if (X == 2) { SUPER_X(T, 2); } \
    else { SUPER_X(T, 1); }
            switch (type) {
            case Q2_K: SUPER_CASES(Q2_K) break;
            case Q3_K: SUPER_CASES(Q3_K) break;
            case Q4_K: SUPER_CASES(Q4_K) break;
            case Q5_K: SUPER_CASES(Q5_K) break;
            default: SUPER_CASES(Q6_K) break;
            }
            for (int i = 0; i < X; i++) store_out(y, io_bf16, (int64_t)(i0 + i) * ldy + col0 + r, out[i]);
        }
    }
}

#endif
