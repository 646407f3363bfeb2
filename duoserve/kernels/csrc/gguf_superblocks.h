/* Fast mode for Q4_K and Q6_K, a super-block (256 values) at a time, as llama.cpp computes them.
 *
 * x's rows are quantized per super-block: 256 int8 values under one float scale dx, and the sum
 * of each run of 16 (`quantize_row_super`). A super-block of weights then needs one float step:
 * its sub-blocks' integer dot products are multiplied by their integer scales and summed as
 * integers, and only that sum meets the float scales,
 *     Q4_K: d * dx * sum_s sc[s] * (q_s . x_s)  -  dmin * dx * sum_s mn[s] * (sum of x_s)
 *     Q6_K: d * dx * (sum_t sc[t] * (q_t . x_t)  -  32 * sum_t sc[t] * (sum of x_t))
 * (s the eight sub-blocks of 32, t the sixteen runs of 16, q unsigned). The per-32 path of
 * gguf_linear.c spends a float conversion, a product and a sum on every 32 values, and unpacks a
 * sub-block's scales again for each: at one row it read Q4_K and Q6_K 5-7x slower than Q4_0.
 *
 * The integers are exact and the same on every path (AVX-512 with or without VNNI, AVX2, plain
 * C); each (weight row, x row) pair takes the same float operations in the same order whatever
 * the tile it is computed in, so a row's result does not depend on its batch.
 * Included by gguf_linear.c alone, after gguf_blocks.h. */
#ifndef DUOSERVE_GGUF_SUPERBLOCKS_H
#define DUOSERVE_GGUF_SUPERBLOCKS_H

#define SUPER 256         /* values of a super-block, and of a quantized block of x on this path */
#define SUPER_TILE_X 4    /* rows of x sharing a weight row's decoding */

static inline int takes_superblock_rows(int type) { return type == Q4_K || type == Q6_K; }

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

#if defined(VECTOR)
/* 64 values a step in 512-bit registers: vpmaddubsw's pairs (|q| < 64, |x| <= 127: exact in int16)
 * times the scale of their sub-block or run as int16, summed into 16 int32 lanes */
static inline __m512i scaled_pairs(__m512i acc, __m512i q, __m512i x, __m512i scales) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q, x), scales);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(q, x), scales));
#endif
}

/* int16 lane t of the 32 pairs of values 64j..64j+63 -> its scale's index: Q4_K's sub-block 2j + t/16;
 * Q6_K's run 4j + t/8 */
static inline __m512i scale_index(int type, int j) {
    uint16_t idx[32];
    for (int t = 0; t < 32; t++) idx[t] = (uint16_t)(type == Q4_K ? 2 * j + t / 16 : 4 * j + t / 8);
    return _mm512_loadu_si512(idx);
}

/* one weight row (nsb super-blocks) against X rows of x: out[i] */
static inline __attribute__((always_inline)) void super_tile(int type, const uint8_t *row, int nsb, SuperRows xs,
                                                             const int X, float out[SUPER_TILE_X]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), three = _mm512_set1_epi8(3);
    const __m512i idx0 = scale_index(type, 0), idx1 = scale_index(type, 1), idx2 = scale_index(type, 2),
                  idx3 = scale_index(type, 3);
    __m512 acc[SUPER_TILE_X];
    __m256 min_acc[SUPER_TILE_X];
    for (int i = 0; i < X; i++) {
        acc[i] = _mm512_setzero_ps();
        min_acc[i] = _mm256_setzero_ps();
    }
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + (int64_t)sb * BLOCK_BYTES[type];
        __m512i iacc[SUPER_TILE_X];
        for (int i = 0; i < X; i++) iacc[i] = _mm512_setzero_si512();
        const int8_t *x0 = xs.q + (int64_t)sb * SUPER;
        if (type == Q4_K) {
            uint64_t sc, mn;
            q4k_scales_mins(b + 4, &sc, &mn);
            const __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
            const __m128i m8 = _mm_cvtsi64_si128((long long)mn);
            const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));   /* each sub-block's min twice */
            const __m512i idx[4] = {idx0, idx1, idx2, idx3};
            for (int j = 0; j < 4; j++) {   /* 32 bytes: sub-block 2j in the low nibbles, 2j + 1 in the high */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
                const __m512i q = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v),
                                                                      _mm256_srli_epi16(v, 4), 1), low4);
                const __m512i s = _mm512_permutexvar_epi16(idx[j], scales);
                for (int i = 0; i < X; i++)
                    iacc[i] = scaled_pairs(iacc[i], q, _mm512_loadu_si512(x0 + (int64_t)i * xs.k + 64 * j), s);
            }
            const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
            for (int i = 0; i < X; i++) {
                const float dx = xs.d[(int64_t)i * (xs.k / SUPER) + sb];
                const __m256i sums = _mm256_loadu_si256((const __m256i *)(xs.sums + (int64_t)i * (xs.k / 16) + sb * 16));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i]), _mm512_set1_ps(d * dx), acc[i]);
                min_acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins, sums)),
                                             _mm256_set1_ps(dmin * dx), min_acc[i]);
            }
        } else {   /* Q6_K: each half of 128 values, ql's 64 bytes' nibbles topped by qh's bit pairs */
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
            const __m512i scales = _mm512_castsi256_si512(sc16);
            const __m512i idx[4] = {idx0, idx1, idx2, idx3};
            for (int h = 0; h < 2; h++) {
                const __m512i l = _mm512_loadu_si512(b + 64 * h);
                const __m256i hq = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                const __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(hq), _mm256_srli_epi16(hq, 2), 1);
                const __m512i qa = _mm512_or_si512(_mm512_and_si512(l, low4),
                                                   _mm512_slli_epi16(_mm512_and_si512(hi, three), 4));
                const __m512i qb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low4),
                                                   _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hi, 4), three), 4));
                const __m512i sa = _mm512_permutexvar_epi16(idx[2 * h], scales);
                const __m512i sbv = _mm512_permutexvar_epi16(idx[2 * h + 1], scales);
                for (int i = 0; i < X; i++) {
                    const int8_t *xi = x0 + (int64_t)i * xs.k + 128 * h;
                    iacc[i] = scaled_pairs(iacc[i], qa, _mm512_loadu_si512(xi), sa);
                    iacc[i] = scaled_pairs(iacc[i], qb, _mm512_loadu_si512(xi + 64), sbv);
                }
            }
            const float d = f16_to_f32(b + 208);
            for (int i = 0; i < X; i++) {
                const float dx = xs.d[(int64_t)i * (xs.k / SUPER) + sb];
                const __m256i sums = _mm256_loadu_si256((const __m256i *)(xs.sums + (int64_t)i * (xs.k / 16) + sb * 16));
                const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5);   /* 32 * sc . sums */
                iacc[i] = _mm512_sub_epi32(iacc[i], _mm512_zextsi256_si512(offset));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i]), _mm512_set1_ps(d * dx), acc[i]);
            }
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
    const __m256i low4 = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
    __m256 acc[SUPER_TILE_X], min_acc[SUPER_TILE_X];
    for (int i = 0; i < X; i++) acc[i] = min_acc[i] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + (int64_t)sb * BLOCK_BYTES[type];
        __m256i iacc[SUPER_TILE_X];
        for (int i = 0; i < X; i++) iacc[i] = _mm256_setzero_si256();
        const int8_t *x0 = xs.q + (int64_t)sb * SUPER;
        if (type == Q4_K) {
            uint64_t sc, mn;
            q4k_scales_mins(b + 4, &sc, &mn);
            const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
            const __m128i m8 = _mm_cvtsi64_si128((long long)mn);
            const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
                const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                const __m256i s_lo = pick_pair(scales, 2 * j, 2 * j), s_hi = pick_pair(scales, 2 * j + 1, 2 * j + 1);
                for (int i = 0; i < X; i++) {
                    const int8_t *xi = x0 + (int64_t)i * xs.k + 64 * j;
                    iacc[i] = scaled_pairs(iacc[i], lo, _mm256_loadu_si256((const __m256i *)xi), s_lo);
                    iacc[i] = scaled_pairs(iacc[i], hi, _mm256_loadu_si256((const __m256i *)(xi + 32)), s_hi);
                }
            }
            const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
            for (int i = 0; i < X; i++) {
                const float dx = xs.d[(int64_t)i * (xs.k / SUPER) + sb];
                const __m256i sums = _mm256_loadu_si256((const __m256i *)(xs.sums + (int64_t)i * (xs.k / 16) + sb * 16));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i]), _mm256_set1_ps(d * dx), acc[i]);
                min_acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins, sums)),
                                             _mm256_set1_ps(dmin * dx), min_acc[i]);
            }
        } else {   /* Q6_K */
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
            for (int h = 0; h < 2; h++) {
                const __m256i scales = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                                         : _mm256_permute2x128_si256(sc16, sc16, 0x00);
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
                const __m256i hq = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                const __m256i q[4] = {   /* values 128h + 32n .. + 31 */
                    _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(hq, three), 4)),
                    _mm256_or_si256(_mm256_and_si256(l1, low4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hq, 2), three), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hq, 4), three), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hq, 6), three), 4))};
                for (int n = 0; n < 4; n++) {
                    const __m256i s = pick_pair(scales, 2 * n, 2 * n + 1);
                    for (int i = 0; i < X; i++)
                        iacc[i] = scaled_pairs(iacc[i], q[n], _mm256_loadu_si256(
                            (const __m256i *)(x0 + (int64_t)i * xs.k + 128 * h + 32 * n)), s);
                }
            }
            const float d = f16_to_f32(b + 208);
            for (int i = 0; i < X; i++) {
                const float dx = xs.d[(int64_t)i * (xs.k / SUPER) + sb];
                const __m256i sums = _mm256_loadu_si256((const __m256i *)(xs.sums + (int64_t)i * (xs.k / 16) + sb * 16));
                iacc[i] = _mm256_sub_epi32(iacc[i], _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i]), _mm256_set1_ps(d * dx), acc[i]);
            }
        }
    }
    for (int i = 0; i < X; i++) out[i] = hsum256(acc[i]) - hsum256(min_acc[i]);
}
#else
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
            uint8_t q[32];
            int32_t isum = 0, msum = 0;
            if (type == Q4_K) {
                for (int s = 0; s < 8; s++) {
                    int sc, mn, dot = 0;
                    k_scale_min(b + 4, s, &sc, &mn);
                    sub_values(type, b, s, q);
                    for (int j = 0; j < 32; j++) dot += q[j] * xq[sb * SUPER + s * 32 + j];
                    isum += sc * dot;
                    msum += mn * (sums[sb * 16 + 2 * s] + sums[sb * 16 + 2 * s + 1]);
                }
                acc += (float)isum * (f16_to_f32(b) * dx);
                min_acc += (float)msum * (f16_to_f32(b + 2) * dx);
            } else {
                const int8_t *sc = (const int8_t *)(b + 192);
                for (int s = 0; s < 8; s++) {
                    sub_values(type, b, s, q);
                    for (int half = 0; half < 2; half++) {
                        int dot = 0;
                        for (int j = 16 * half; j < 16 * half + 16; j++) dot += q[j] * xq[sb * SUPER + s * 32 + j];
                        isum += sc[2 * s + half] * (dot - 32 * sums[sb * 16 + 2 * s + half]);
                    }
                }
                acc += (float)isum * (f16_to_f32(b + 208) * dx);
            }
        }
        out[i] = acc - min_acc;
    }
}
#endif

/* the team's share of y[:, col0:col0 + n] (rows ldy apart) = x @ w^T for a Q4_K or Q6_K weight,
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
            if (type == Q4_K) { SUPER_CASES(Q4_K) } else { SUPER_CASES(Q6_K) }
            for (int i = 0; i < X; i++) store_out(y, io_bf16, (int64_t)(i0 + i) * ldy + col0 + r, out[i]);
        }
    }
}

#endif
