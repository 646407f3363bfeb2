/* Fast mode's Q4_K and Q6_K with their rows interleaved sixteen to a group (the layout:
 * gguf_interleaved.h), against x quantized per super-block of 256 (gguf_superblocks.h's
 * SuperRows: one scale per 256, the integer sum of each run of 16).
 *
 * As for the blocks of 32, lane r of a register holds four values of row r, and vpdpbusd against
 * four bytes of x broadcast adds four products to each of the 16 rows: eight give a sub-block's
 * (Q4_K, 32 values) integer dot product per row, four a run's (Q6_K, 16 values). Each is then
 * multiplied by its row's integer scale (vpmulld, 16 rows at once) and summed as integers over the
 * super-block, so that a super-block costs one float step per row (two with Q4_K's mins), taken
 * for 16 rows at once:
 *     Q4_K: acc = fma(isum, d * dx, acc), macc = fma(msum, dmin * dx, macc), out = acc - macc
 *           isum = sum_s sc[s] (q_s . x_s), msum = sum_s mn[s] (sum of x_s)
 *     Q6_K: acc = fma(isum, d * dx, acc), isum = sum_r sc[r] (q_r . x_r - 32 sum of x_r)
 * The integers are exact and the float steps the same for every (row, x row) pair in every tile
 * and on every path (AVX-512 VNNI, AVX2, plain C: the same bits), so a row's result never depends
 * on its batch. Included by gguf_linear.c after gguf_superblocks.h. */
#ifndef DUOSERVE_GGUF_INTERLEAVED_K_H
#define DUOSERVE_GGUF_INTERLEAVED_K_H

/* plain C: the reference the vector paths equal */
static inline void ilk_group_portable(int type, const uint8_t *group, int nsb, SuperRows xs, int X,
                                      float out[][GROUP]) {
    const int bytes = GROUP * il_block_bytes(type);
    for (int r = 0; r < GROUP; r++)
        for (int i = 0; i < X; i++) {
            float acc = 0.0f, macc = 0.0f;
            for (int sb = 0; sb < nsb; sb++) {
                const uint8_t *blk = group + (int64_t)sb * bytes;
                const int8_t *xq = xs.q + (int64_t)i * xs.k + sb * SUPER;
                const int16_t *sums = xs.sums + (int64_t)i * (xs.k / 16) + sb * 16;
                const float dx = xs.d[(int64_t)i * (xs.k / SUPER) + sb];
                int32_t isum = 0, msum = 0;
                if (type == Q4_K) {
                    for (int s = 0; s < 8; s++) {
                        int dot = 0;
                        for (int j = 32 * s; j < 32 * s + 32; j++) dot += il_kvalue(type, blk, r, j) * xq[j];
                        isum += blk[K_SCALES + s * GROUP + r] * dot;
                        msum += blk[K_MINS + s * GROUP + r] * (sums[2 * s] + sums[2 * s + 1]);
                    }
                    acc = fmaf((float)isum, f16_to_f32(blk + 2 * r) * dx, acc);
                    macc = fmaf((float)msum, f16_to_f32(blk + 2 * GROUP + 2 * r) * dx, macc);
                } else {
                    for (int run = 0; run < 16; run++) {
                        int dot = -32 * sums[run];
                        for (int j = 16 * run; j < 16 * run + 16; j++) dot += il_kvalue(type, blk, r, j) * xq[j];
                        isum += (int8_t)blk[K6_SCALES + run * GROUP + r] * dot;
                    }
                    acc = fmaf((float)isum, f16_to_f32(blk + 2 * r) * dx, acc);
                }
            }
            out[i][r] = acc - macc;
        }
}

#if defined(IL_512)
#define TILE_XK 4

static inline __m512i ilk_bcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Q6_K's runs a, 4 + a, 8 + a, 12 + a (value groups t = c + 16 f, c = 4a..4a + 3): each c's three
 * chunks read in order, four weight registers from them, four sums a row of x */
static inline __attribute__((always_inline)) void q6k_runs_512(const uint8_t *blk, const int8_t *xq, int64_t xk,
                                                               const int16_t *sums, int64_t sums_k, int a,
                                                               const int X, __m512i isum[TILE_XK]) {
    const __m512i low4 = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
    __m512i dot[4][TILE_XK];
    for (int f = 0; f < 4; f++)
        for (int i = 0; i < X; i++) dot[f][i] = _mm512_set1_epi32(-32 * sums[i * sums_k + 4 * f + a]);
    for (int c = 4 * a; c < 4 * a + 4; c++) {
        const uint8_t *chunks = blk + K6_CHUNKS + 3 * c * 64;
        const __m512i lo = _mm512_loadu_si512(chunks), hi = _mm512_loadu_si512(chunks + 64);
        const __m512i top = _mm512_loadu_si512(chunks + 128);
        __m512i w[4];
        w[0] = _mm512_or_si512(_mm512_and_si512(lo, low4), _mm512_slli_epi16(_mm512_and_si512(top, three), 4));
        w[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), low4),
                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, 2), three), 4));
        w[2] = _mm512_or_si512(_mm512_and_si512(hi, low4), _mm512_and_si512(top, _mm512_set1_epi8(0x30)));
        w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(hi, 4), low4),
                               _mm512_and_si512(_mm512_srli_epi16(top, 2), _mm512_set1_epi8(0x30)));
        for (int f = 0; f < 4; f++)
            for (int i = 0; i < X; i++) dot[f][i] = _mm512_dpbusd_epi32(dot[f][i], w[f], ilk_bcast(xq + i * xk + 4 * (c + 16 * f)));
    }
    for (int f = 0; f < 4; f++) {
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + K6_SCALES + (4 * f + a) * GROUP)));
        for (int i = 0; i < X; i++) isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(dot[f][i], sc));
    }
}

/* one group against X rows of x: acc[i] - macc[i], lane r = row r's sum for x row i */
static inline __attribute__((always_inline)) void ilk_group_512(int type, const uint8_t *group, int nsb,
                                                                SuperRows xs, const int X, float out[][GROUP]) {
    const int bytes = GROUP * il_block_bytes(type);
    const int64_t sums_k = xs.k / 16;
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc[TILE_XK], macc[TILE_XK];
    for (int i = 0; i < X; i++) acc[i] = macc[i] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = group + (int64_t)sb * bytes;
        const int8_t *xq = xs.q + sb * SUPER;
        const int16_t *sums = xs.sums + sb * 16;
        __m512i isum[TILE_XK], msum[TILE_XK];
        for (int i = 0; i < X; i++) isum[i] = msum[i] = _mm512_setzero_si512();
        if (type == Q4_K) {
            for (int p = 0; p < 4; p++) {   /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
                __m512i lo[TILE_XK], hi[TILE_XK];
                for (int i = 0; i < X; i++) lo[i] = hi[i] = _mm512_setzero_si512();
                for (int c = 0; c < 8; c++) {
                    const __m512i raw = _mm512_loadu_si512(blk + K_QS + (p * 8 + c) * 64);
                    const __m512i wl = _mm512_and_si512(raw, low4), wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                    for (int i = 0; i < X; i++) {
                        const int8_t *x = xq + (int64_t)i * xs.k + 64 * p + 4 * c;
                        lo[i] = _mm512_dpbusd_epi32(lo[i], wl, ilk_bcast(x));
                        hi[i] = _mm512_dpbusd_epi32(hi[i], wh, ilk_bcast(x + 32));
                    }
                }
                const __m512i sl = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + K_SCALES + 2 * p * GROUP)));
                const __m512i sh = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + K_SCALES + (2 * p + 1) * GROUP)));
                for (int i = 0; i < X; i++)
                    isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(lo[i], sl),
                                                                         _mm512_mullo_epi32(hi[i], sh)));
            }
            for (int s = 0; s < 8; s++) {
                const __m512i mn = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + K_MINS + s * GROUP)));
                for (int i = 0; i < X; i++) {
                    const int16_t *si = sums + i * sums_k;
                    msum[i] = _mm512_add_epi32(msum[i], _mm512_mullo_epi32(mn, _mm512_set1_epi32(si[2 * s] + si[2 * s + 1])));
                }
            }
        } else {
            q6k_runs_512(blk, xq, xs.k, sums, sums_k, 0, X, isum);
            q6k_runs_512(blk, xq, xs.k, sums, sums_k, 1, X, isum);
            q6k_runs_512(blk, xq, xs.k, sums, sums_k, 2, X, isum);
            q6k_runs_512(blk, xq, xs.k, sums, sums_k, 3, X, isum);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        for (int i = 0; i < X; i++) {
            const float dx = xs.d[(int64_t)i * (xs.k / SUPER) + sb];
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[i]);
            if (type == Q4_K) {
                const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2 * GROUP)));
                macc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum[i]), _mm512_mul_ps(dmin, _mm512_set1_ps(dx)), macc[i]);
            }
        }
    }
    for (int i = 0; i < X; i++) _mm512_storeu_ps(out[i], _mm512_sub_ps(acc[i], macc[i]));
}
#elif defined(IL_256)
#define TILE_XK 2

static inline __m256i ilk_bcast256(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* unsigned w (< 64) times signed x, four products a lane (exact without VNNI: a pair fits int16) */
static inline __m256i ilk_dot4(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i bytes_to_epi32(const uint8_t *p, int is_signed) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

static inline __attribute__((always_inline)) void q6k_runs_256(const uint8_t *blk, const int h, const int8_t *xq,
                                                               int64_t xk, const int16_t *sums, int64_t sums_k, int a,
                                                               const int X, __m256i isum[TILE_XK]) {
    const __m256i low4 = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3), top2 = _mm256_set1_epi8(0x30);
    __m256i dot[4][TILE_XK];
    for (int f = 0; f < 4; f++)
        for (int i = 0; i < X; i++) dot[f][i] = _mm256_set1_epi32(-32 * sums[i * sums_k + 4 * f + a]);
    for (int c = 4 * a; c < 4 * a + 4; c++) {
        const uint8_t *chunks = blk + K6_CHUNKS + 3 * c * 64 + 32 * h;
        const __m256i lo = _mm256_loadu_si256((const __m256i *)chunks);
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(chunks + 64));
        const __m256i top = _mm256_loadu_si256((const __m256i *)(chunks + 128));
        __m256i w[4];
        w[0] = _mm256_or_si256(_mm256_and_si256(lo, low4), _mm256_slli_epi16(_mm256_and_si256(top, three), 4));
        w[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), low4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(top, 2), three), 4));
        w[2] = _mm256_or_si256(_mm256_and_si256(hi, low4), _mm256_and_si256(top, top2));
        w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(hi, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(top, 2), top2));
        for (int f = 0; f < 4; f++)
            for (int i = 0; i < X; i++) dot[f][i] = ilk_dot4(dot[f][i], w[f], ilk_bcast256(xq + i * xk + 4 * (c + 16 * f)));
    }
    for (int f = 0; f < 4; f++) {
        const __m256i sc = bytes_to_epi32(blk + K6_SCALES + (4 * f + a) * GROUP + 8 * h, 1);
        for (int i = 0; i < X; i++) isum[i] = _mm256_add_epi32(isum[i], _mm256_mullo_epi32(dot[f][i], sc));
    }
}

/* rows 8h..8h + 7 of one group against X rows of x */
static inline __attribute__((always_inline)) void ilk_half_256(int type, const uint8_t *group, int nsb, SuperRows xs,
                                                               const int h, const int X, float out[][GROUP]) {
    const int bytes = GROUP * il_block_bytes(type);
    const int64_t sums_k = xs.k / 16;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 acc[TILE_XK], macc[TILE_XK];
    for (int i = 0; i < X; i++) acc[i] = macc[i] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = group + (int64_t)sb * bytes;
        const int8_t *xq = xs.q + sb * SUPER;
        const int16_t *sums = xs.sums + sb * 16;
        __m256i isum[TILE_XK], msum[TILE_XK];
        for (int i = 0; i < X; i++) isum[i] = msum[i] = _mm256_setzero_si256();
        if (type == Q4_K) {
            for (int p = 0; p < 4; p++) {
                __m256i lo[TILE_XK], hi[TILE_XK];
                for (int i = 0; i < X; i++) lo[i] = hi[i] = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + K_QS + (p * 8 + c) * 64 + 32 * h));
                    const __m256i wl = _mm256_and_si256(raw, low4), wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    for (int i = 0; i < X; i++) {
                        const int8_t *x = xq + (int64_t)i * xs.k + 64 * p + 4 * c;
                        lo[i] = ilk_dot4(lo[i], wl, ilk_bcast256(x));
                        hi[i] = ilk_dot4(hi[i], wh, ilk_bcast256(x + 32));
                    }
                }
                const __m256i sl = bytes_to_epi32(blk + K_SCALES + 2 * p * GROUP + 8 * h, 0);
                const __m256i sh = bytes_to_epi32(blk + K_SCALES + (2 * p + 1) * GROUP + 8 * h, 0);
                for (int i = 0; i < X; i++)
                    isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(_mm256_mullo_epi32(lo[i], sl),
                                                                         _mm256_mullo_epi32(hi[i], sh)));
            }
            for (int s = 0; s < 8; s++) {
                const __m256i mn = bytes_to_epi32(blk + K_MINS + s * GROUP + 8 * h, 0);
                for (int i = 0; i < X; i++) {
                    const int16_t *si = sums + i * sums_k;
                    msum[i] = _mm256_add_epi32(msum[i], _mm256_mullo_epi32(mn, _mm256_set1_epi32(si[2 * s] + si[2 * s + 1])));
                }
            }
        } else {
            q6k_runs_256(blk, h, xq, xs.k, sums, sums_k, 0, X, isum);
            q6k_runs_256(blk, h, xq, xs.k, sums, sums_k, 1, X, isum);
            q6k_runs_256(blk, h, xq, xs.k, sums, sums_k, 2, X, isum);
            q6k_runs_256(blk, h, xq, xs.k, sums, sums_k, 3, X, isum);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
        for (int i = 0; i < X; i++) {
            const float dx = xs.d[(int64_t)i * (xs.k / SUPER) + sb];
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[i]);
            if (type == Q4_K) {
                const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * GROUP + 16 * h)));
                macc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum[i]), _mm256_mul_ps(dmin, _mm256_set1_ps(dx)), macc[i]);
            }
        }
    }
    for (int i = 0; i < X; i++) _mm256_storeu_ps(out[i] + 8 * h, _mm256_sub_ps(acc[i], macc[i]));
}
#else
#define TILE_XK 4
#endif

/* the team's share of y[:, col0:col0 + n] (rows ldy apart) for an interleaved Q4_K or Q6_K weight:
 * groups split over the threads */
static void il_super_matmul_team(int type, const uint8_t *w, SuperRows xs, int m, int n, int k, void *y, int io_bf16,
                                 int64_t ldy, int col0) {
    const int nsb = k / SUPER, groups = n / GROUP;
    const int64_t group_bytes = (int64_t)GROUP * nsb * il_block_bytes(type);
    #pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) {
        const uint8_t *group = w + g * group_bytes;
        for (int i0 = 0, X; i0 < m; i0 += X) {
            X = m - i0 >= TILE_XK ? TILE_XK : m - i0;
            const SuperRows xi = {xs.q + (int64_t)i0 * k, xs.d + (int64_t)i0 * nsb, xs.sums + (int64_t)i0 * (k / 16), k};
            float out[TILE_XK][GROUP];
#if defined(IL_512)
#define ILK(T, XC) ilk_group_512(T, group, nsb, xi, XC, out);
            if (type == Q4_K) {
                if (X == 4) { ILK(Q4_K, 4) } else if (X == 3) { ILK(Q4_K, 3) } else if (X == 2) { ILK(Q4_K, 2) } else { ILK(Q4_K, 1) }
            } else {
                if (X == 4) { ILK(Q6_K, 4) } else if (X == 3) { ILK(Q6_K, 3) } else if (X == 2) { ILK(Q6_K, 2) } else { ILK(Q6_K, 1) }
            }
#undef ILK
#elif defined(IL_256)
#define ILK(T, XC) ilk_half_256(T, group, nsb, xi, 0, XC, out); ilk_half_256(T, group, nsb, xi, 1, XC, out);
            if (type == Q4_K) {
                if (X == 2) { ILK(Q4_K, 2) } else { ILK(Q4_K, 1) }
            } else {
                if (X == 2) { ILK(Q6_K, 2) } else { ILK(Q6_K, 1) }
            }
#undef ILK
#else
            ilk_group_portable(type, group, nsb, xi, X, out);
#endif
            for (int i = 0; i < X; i++)
                for (int r = 0; r < GROUP; r++)
                    store_out(y, io_bf16, (int64_t)(i0 + i) * ldy + col0 + g * GROUP + r, out[i][r]);
        }
    }
}

#endif
