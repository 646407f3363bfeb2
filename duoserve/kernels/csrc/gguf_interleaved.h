/* Blocks of 32 with their rows interleaved sixteen to a group: fast mode's layout for Q4_0, Q4_1,
 * Q5_0, Q5_1 and Q8_0 weights (a type id with INTERLEAVED set; csrc/../gguf.py repacks a file's
 * blocks once at load).
 *
 * Row-major blocks give each weight row its own integer dot product of 32 values, summed across
 * a vector's lanes and then scaled: a float conversion, a product and an addition for every 32
 * multiply-adds of every (weight row, x row) pair, three float steps to each integer one. Here the
 * 16 rows of a group sit side by side, lane r of a 512-bit register holding four values of row r,
 * so that vpdpbusd against four bytes of x broadcast to every lane adds four products to each of
 * the 16 rows at once; eight of them cover a block, and the float steps are taken once per block
 * for all 16 rows (one conversion, one product of the rows' scales and x's, one fused add: lane r
 * accumulates row r, and no horizontal sum is left at the end). The weight registers are unpacked
 * once per block and used against up to TILE_XI rows of x. No software prefetch: a thread's
 * groups are one sequential stream, and the hardware's prefetcher alone read it fastest
 * (alternated calls on a Zen 4, one row of a [32768 x 4096] matrix: 31.6-36.7 GB/s, 29.5-32.5 with
 * prefetches 2-8 KB ahead).
 *
 * A group is 16 consecutive rows; its blocks follow one another along k (one sequential stream a
 * thread); each block of the group is, for the 16 rows together:
 *     Q4_0: d[16] (fp16), qs[4][16][4]              288 bytes (16 x 18)
 *     Q4_1: d[16], m[16], qs[4][16][4]              320 bytes (16 x 20)
 *     Q5_0: d[16], qh[16] (uint32), qs[4][16][4]    352 bytes (16 x 22)
 *     Q5_1: d[16], m[16], qh[16], qs[4][16][4]      384 bytes (16 x 24)
 *     Q8_0: d[16], qs[8][16][4] (int8)              544 bytes (16 x 34)
 * qs[c][r] are bytes 4c..4c+3 of row r's block as the file has them (low nibbles: values
 * 4c..4c+3, high nibbles: values 16 + 4c..), so a matrix keeps its size and its [n, bytes per
 * row] shape (n a multiple of 16). Q8_0's qs[t][r] are values 4t..4t+3.
 *
 * Arithmetic, for each (weight row, x row) pair and block in order, whatever the batch and the
 * instruction set: the block's integer dot product (exact; split sums of integers add up to the
 * same integer), then acc = fma(float(dot), d * dx, acc), and for Q4_1/Q5_1 acc = fma(m, dx *
 * sum(x), acc) (x's block sum from quantize_row). So a row's bits never depend on its batch, and
 * AVX-512, AVX2 and plain C give the same bits. Included by gguf_linear.c after its tables. */
#ifndef DUOSERVE_GGUF_INTERLEAVED_H
#define DUOSERVE_GGUF_INTERLEAVED_H

#define INTERLEAVED 16    /* a type id's flag: its rows interleaved in groups of GROUP */
#define GROUP 16

static inline int interleavable(int type) {
    return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == Q4_K || type == Q6_K;
}

/* the bytes of one row's block once interleaved: the file's, but Q4_K's, whose twelve bytes of
 * packed six-bit scales and mins become sixteen, a byte each (148 bytes for 144) */
static inline int il_block_bytes(int type) { return type == Q4_K ? 148 : BLOCK_BYTES[type]; }

/* a type id gguf_linear.c knows: a file's block type, or one of those interleaved */
static inline int known_type(int type) {
    const int base = type & ~INTERLEAVED;
    return base >= 0 && base <= LAST_TYPE && (type == base || (type == (base | INTERLEAVED) && interleavable(base)));
}

static inline int has_min(int type) { return type == Q4_1 || type == Q5_1; }
static inline int has_fifth_bits(int type) { return type == Q5_0 || type == Q5_1; }

/* byte offsets inside a group's block: the scales, the mins, the fifth bits, the values */
static inline int il_mins(int type) { (void)type; return 2 * GROUP; }
static inline int il_fifth(int type) { return has_min(type) ? 4 * GROUP : 2 * GROUP; }
static inline int il_values(int type) { return il_fifth(type) + (has_fifth_bits(type) ? 4 * GROUP : 0); }

/* the file's offsets inside one row's block: its mins, fifth bits and values */
static inline int file_values(int type) { return type == Q8_0 ? 2 : type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8; }
static inline int file_fifth(int type) { return type == Q5_0 ? 2 : 4; }

/* ---- the K-quants' groups (one super-block of 256 values of 16 rows):
 *     Q4_K: d[16], dmin[16] (fp16), sc[8][16], mn[8][16] (the sub-blocks' six-bit scales and mins,
 *           a byte each), qs[4][8][16][4]: pair p of sub-blocks, bytes 4c..4c+3 of row r's 32
 *           (low nibbles: values 64p + 4c.., sub-block 2p; high: 64p + 32 + 4c.., sub-block 2p + 1)
 *     Q6_K: d[16], sc[16][16] (int8, one per run of 16 values), then for c = 0..15 three chunks of
 *           [16][4] bytes read one after the other: the low four bits of values 4c.. (low nibbles)
 *           and 64 + 4c.. (high), of 128 + 4c.. and 192 + 4c.., and the top two bits of the same
 *           four groups (bit pairs 0-3)
 * Values 4t..4t + 3 of the 16 rows make one register, as for the blocks of 32. */
#define K_SCALES 64      /* Q4_K: offsets of sc, mn, qs */
#define K_MINS 192
#define K_QS 320
#define K6_SCALES 32     /* Q6_K: offsets of sc and of the chunks */
#define K6_CHUNKS 288

/* value j (0..255) of a Q6_K super-block in the file's layout: its six bits, and where they sit */
static inline int q6k_value(const uint8_t *b, int j) {
    const int half = j / 128, l = j % 32, g = (j % 128) / 32;
    const uint8_t ql = b[64 * half + l + (g & 1 ? 32 : 0)], qh = b[128 + 32 * half + l];
    return ((g >> 1 ? ql >> 4 : ql) & 15) | ((qh >> (2 * g)) & 3) << 4;
}

static inline void q6k_set_value(uint8_t *b, int j, int q) {
    const int half = j / 128, l = j % 32, g = (j % 128) / 32;
    uint8_t *ql = b + 64 * half + l + (g & 1 ? 32 : 0), *qh = b + 128 + 32 * half + l;
    *ql = (uint8_t)(g >> 1 ? (*ql & 0x0f) | (q & 15) << 4 : (*ql & 0xf0) | (q & 15));
    *qh = (uint8_t)((*qh & ~(3 << (2 * g))) | ((q >> 4) & 3) << (2 * g));
}

/* the file's scale of Q6_K run r (values 16r..16r + 15) */
static inline int q6k_run_scale(int r) {
    const int j = 16 * r, half = j / 128, l = j % 32, g = (j % 128) / 32;
    return 8 * half + l / 16 + 2 * g;
}

static void interleave_kblock(int type, const uint8_t *const src[GROUP], uint8_t *dst) {
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *b = src[r];
        if (type == Q4_K) {
            memcpy(dst + 2 * r, b, 2);
            memcpy(dst + 2 * GROUP + 2 * r, b + 2, 2);
            for (int s = 0; s < 8; s++) {
                int sc, mn;
                k_scale_min(b + 4, s, &sc, &mn);
                dst[K_SCALES + s * GROUP + r] = (uint8_t)sc;
                dst[K_MINS + s * GROUP + r] = (uint8_t)mn;
            }
            for (int p = 0; p < 4; p++)
                for (int c = 0; c < 8; c++) memcpy(dst + K_QS + ((p * 8 + c) * GROUP + r) * 4, b + 16 + 32 * p + 4 * c, 4);
        } else {   /* Q6_K */
            memcpy(dst + 2 * r, b + 208, 2);
            for (int run = 0; run < 16; run++) dst[K6_SCALES + run * GROUP + r] = b[192 + q6k_run_scale(run)];
            for (int j = 0; j < 256; j++) {   /* value group t = c + 16 f */
                const int q = q6k_value(b, j), t = j / 4, c = t % 16, f = t / 16, at = 4 * r + j % 4;
                uint8_t *low = dst + K6_CHUNKS + (3 * c + f / 2) * 4 * GROUP + at;
                uint8_t *high = dst + K6_CHUNKS + (3 * c + 2) * 4 * GROUP + at;
                *low = (uint8_t)(f % 2 ? (*low & 0x0f) | (q & 15) << 4 : (*low & 0xf0) | (q & 15));
                *high = (uint8_t)((*high & ~(3 << (2 * f))) | (q >> 4) << (2 * f));
            }
        }
    }
}

/* value j of lane r of an interleaved K-quant group (unsigned: Q6_K's stored + 32) */
static inline int il_kvalue(int type, const uint8_t *blk, int r, int j) {
    const int t = j / 4, at = 4 * r + j % 4;
    if (type == Q4_K) {
        const int p = j / 64, c = (j % 32) / 4, high = (j % 64) >= 32;
        return (blk[K_QS + (p * 8 + c) * 4 * GROUP + at] >> (high ? 4 : 0)) & 15;
    }
    const int c = t % 16, f = t / 16;
    const int low = (blk[K6_CHUNKS + (3 * c + f / 2) * 4 * GROUP + at] >> (f % 2 ? 4 : 0)) & 15;
    return low | ((blk[K6_CHUNKS + (3 * c + 2) * 4 * GROUP + at] >> (2 * f)) & 3) << 4;
}

static void deinterleave_kblock(int type, const uint8_t *src, int r, uint8_t *b) {
    if (type == Q4_K) {
        memcpy(b, src + 2 * r, 2);
        memcpy(b + 2, src + 2 * GROUP + 2 * r, 2);
        uint8_t *p = b + 4;
        for (int s = 0; s < 4; s++) {   /* k_scale_min's packing, undone */
            const int sc = src[K_SCALES + s * GROUP + r], mn = src[K_MINS + s * GROUP + r];
            const int sc4 = src[K_SCALES + (s + 4) * GROUP + r], mn4 = src[K_MINS + (s + 4) * GROUP + r];
            p[s] = (uint8_t)(sc | (sc4 >> 4) << 6);
            p[s + 4] = (uint8_t)(mn | (mn4 >> 4) << 6);
            p[s + 8] = (uint8_t)((sc4 & 15) | (mn4 & 15) << 4);
        }
        for (int j = 0; j < 128; j++) {   /* byte j of qs: value 64 (j / 32) + j % 32, and that + 32 */
            const int v = 64 * (j / 32) + j % 32;
            b[16 + j] = (uint8_t)(il_kvalue(type, src, r, v) | il_kvalue(type, src, r, v + 32) << 4);
        }
        return;
    }
    memcpy(b + 208, src + 2 * r, 2);
    for (int run = 0; run < 16; run++) b[192 + q6k_run_scale(run)] = src[K6_SCALES + run * GROUP + r];
    for (int j = 0; j < 256; j++) q6k_set_value(b, j, il_kvalue(type, src, r, j));
}

/* one block of 16 rows (their blocks `src[r]`) -> its interleaved form at dst, and back */
static void interleave_block(int type, const uint8_t *const src[GROUP], uint8_t *dst) {
    if (type == Q4_K || type == Q6_K) {
        interleave_kblock(type, src, dst);
        return;
    }
    const int value_bytes = type == Q8_0 ? 32 : 16;
    for (int r = 0; r < GROUP; r++) {
        memcpy(dst + 2 * r, src[r], 2);
        if (has_min(type)) memcpy(dst + il_mins(type) + 2 * r, src[r] + 2, 2);
        if (has_fifth_bits(type)) memcpy(dst + il_fifth(type) + 4 * r, src[r] + file_fifth(type), 4);
        for (int c = 0; c < value_bytes / 4; c++)
            memcpy(dst + il_values(type) + c * 4 * GROUP + 4 * r, src[r] + file_values(type) + 4 * c, 4);
    }
}

static void deinterleave_block(int type, const uint8_t *src, int r, uint8_t *dst) {
    if (type == Q4_K || type == Q6_K) {
        deinterleave_kblock(type, src, r, dst);
        return;
    }
    const int value_bytes = type == Q8_0 ? 32 : 16;
    memcpy(dst, src + 2 * r, 2);
    if (has_min(type)) memcpy(dst + 2, src + il_mins(type) + 2 * r, 2);
    if (has_fifth_bits(type)) memcpy(dst + file_fifth(type), src + il_fifth(type) + 4 * r, 4);
    for (int c = 0; c < value_bytes / 4; c++)
        memcpy(dst + file_values(type) + 4 * c, src + il_values(type) + c * 4 * GROUP + 4 * r, 4);
}

/* row `row` of an interleaved matrix of k values a row, in the file's own block format */
static void deinterleave_row(int type, const uint8_t *w, int64_t row, int k, uint8_t *out) {
    const int blocks = k / BLOCK_VALUES[type], bytes = il_block_bytes(type);
    const uint8_t *group = w + (row / GROUP) * GROUP * (int64_t)blocks * bytes;
    for (int b = 0; b < blocks; b++)
        deinterleave_block(type, group + (int64_t)b * GROUP * bytes, (int)(row % GROUP),
                           out + (int64_t)b * BLOCK_BYTES[type]);
}

/* the weight value j of interleaved block `blk` of lane r, as an unsigned integer q with w = d * q + m
 * (m = -8 d, -16 d, -128 d for the signed types, as gguf_blocks.h reads them) */
static inline int il_value(int type, const uint8_t *blk, int r, int j) {
    const uint8_t *qs = blk + il_values(type);
    if (type == Q8_0) return (int)(int8_t)qs[(j / 4) * 4 * GROUP + 4 * r + j % 4];
    const int low = j < 16, c = (j % 16) / 4;
    int q = (qs[c * 4 * GROUP + 4 * r + j % 4] >> (low ? 0 : 4)) & 15;
    if (has_fifth_bits(type)) {
        const uint8_t *qh = blk + il_fifth(type) + 4 * r;
        const uint32_t bits = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        q |= (int)((bits >> j) & 1) << 4;
    }
    return q;
}

/* what the integer dot product starts from so that unsigned values q stand for q - 8 (Q4_0),
 * q - 16 (Q5_0), or, with AVX-512's q + 128 for Q8_0's int8, q: -bias * sum(x) */
static inline int il_bias(int type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0; }

/* ---- the arithmetic, in plain C: the reference every vector path must equal ---- */
static inline void il_group_portable(int type, const uint8_t *group, int blocks, const int8_t *xq, const float *dx,
                              const float *block_sums, const int16_t *isums, int k, int X, float acc[][GROUP]) {
    const int bytes = BLOCK_BYTES[type];
    for (int i = 0; i < X; i++)
        for (int r = 0; r < GROUP; r++) acc[i][r] = 0.0f;
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = group + (int64_t)b * GROUP * bytes;
        for (int r = 0; r < GROUP; r++) {
            const float d = f16_to_f32(blk + 2 * r), m = has_min(type) ? f16_to_f32(blk + il_mins(type) + 2 * r) : 0.0f;
            int q[32];
            for (int j = 0; j < 32; j++) q[j] = il_value(type, blk, r, j);
            for (int i = 0; i < X; i++) {
                const int8_t *xv = xq + (int64_t)i * k + b * 32;
                int dot = -il_bias(type) * isums[(int64_t)i * blocks + b];
                for (int j = 0; j < 32; j++) dot += q[j] * xv[j];
                const float scale = d * dx[(int64_t)i * blocks + b];
                acc[i][r] = fmaf((float)dot, scale, acc[i][r]);
                if (has_min(type)) acc[i][r] = fmaf(m, block_sums[(int64_t)i * blocks + b], acc[i][r]);
            }
        }
    }
}

#if defined(VECTOR) && defined(__AVX512VNNI__)
#define IL_512 1
#define TILE_XI 4   /* rows of x against one unpacked block: 4 sums, 8 weight registers, their inputs */

/* the fifth bits of each lane (bits shift..shift + 3 of row r's qh) as 0x10 in the bytes of its four
 * values: a table of the 16 patterns, one vpermd (which reads an index's low 4 bits) */
static inline __m512i fifth_bits_512(__m512i qh, int shift) {
    const __m512i spread = _mm512_setr_epi32(0x00000000, 0x00000010, 0x00001000, 0x00001010, 0x00100000,
                                             0x00100010, 0x00101000, 0x00101010, 0x10000000, 0x10000010,
                                             0x10001000, 0x10001010, 0x10100000, 0x10100010, 0x10101000,
                                             0x10101010);
    return _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, shift), spread);
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* one group against X rows of x: acc[i] lane r = row r's sum for x row i. Q8_0's int8 values are
 * read unsigned as q + 128 (the sum starting from -128 * sum(x)), the others' as stored. */
static inline __attribute__((always_inline)) void il_group_512(int type, const uint8_t *group, int blocks,
                                                               const int8_t *xq, const float *dx,
                                                               const float *block_sums, const int16_t *isums, int k,
                                                               const int X, __m512 acc[TILE_XI]) {
    const int bytes = BLOCK_BYTES[type], bias = type == Q8_0 ? 128 : il_bias(type);
    const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    for (int i = 0; i < X; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = group + (int64_t)b * GROUP * bytes, *qs = blk + il_values(type);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 m = has_min(type) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + il_mins(type))))
                                       : _mm512_setzero_ps();
        __m512i w[8];   /* w[t]: values 4t..4t + 3 (Q8_0); 4-bit types: w[c] 4c.., w[c + 4] 16 + 4c.. */
        if (type == Q8_0) {
            for (int t = 0; t < 8; t++) w[t] = _mm512_xor_si512(_mm512_loadu_si512(qs + 64 * t), flip);
        } else {
            const __m512i qh = has_fifth_bits(type) ? _mm512_loadu_si512(blk + il_fifth(type)) : _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                const __m512i raw = _mm512_loadu_si512(qs + 64 * c);
                w[c] = _mm512_and_si512(raw, low);
                w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                if (has_fifth_bits(type)) {
                    w[c] = _mm512_or_si512(w[c], fifth_bits_512(qh, 4 * c));
                    w[c + 4] = _mm512_or_si512(w[c + 4], fifth_bits_512(qh, 16 + 4 * c));
                }
            }
        }
        for (int i = 0; i < X; i++) {
            const int8_t *xv = xq + (int64_t)i * k + b * 32;
            __m512i even = _mm512_set1_epi32(-bias * isums[(int64_t)i * blocks + b]), odd = _mm512_setzero_si512();
            for (int t = 0; t < 8; t += 2) {   /* two chains of products, one integer sum */
                const int at0 = type == Q8_0 ? 4 * t : 2 * t, at1 = type == Q8_0 ? 4 * t + 4 : 2 * t + 16;
                const int w0 = type == Q8_0 ? t : t / 2, w1 = type == Q8_0 ? t + 1 : t / 2 + 4;
                even = _mm512_dpbusd_epi32(even, w[w0], bcast4(xv + at0));
                odd = _mm512_dpbusd_epi32(odd, w[w1], bcast4(xv + at1));
            }
            const __m512i dot = _mm512_add_epi32(even, odd);
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[(int64_t)i * blocks + b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i]);
            if (has_min(type)) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(block_sums[(int64_t)i * blocks + b]), acc[i]);
        }
    }
}
#elif defined(VEC_AVX2)
#define IL_256 1
#define TILE_XI 2   /* rows of x: 2 x 2 sums of 8 rows and their chains in 16 registers */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define IL_VNNI 1   /* Q8_0 read unsigned as q + 128, as above */
#endif

/* acc + the products of unsigned w and signed x, four to each lane (exact: without VNNI a pair of
 * products fits vpmaddubsw's int16, Q8_0's signs moved onto x) */
static inline __attribute__((always_inline)) __m256i il_dot4(int type, __m256i acc, __m256i w, __m256i x) {
#ifdef IL_VNNI
    (void)type;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#else
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#endif
#else
    if (type == Q8_0) {
        x = _mm256_sign_epi8(x, w);
        w = _mm256_abs_epi8(w);
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

/* the fifth bits of each lane (bits shift..shift + 3) as 0x10 in the bytes of its four values:
 * the 4 bits times 0x00204081 put bit j at bit 8j (the other copies land on other bits) */
static inline __m256i fifth_bits_256(__m256i qh, int shift) {
    const __m256i v = _mm256_and_si256(_mm256_srli_epi32(qh, shift), _mm256_set1_epi32(15));
    const __m256i spread = _mm256_and_si256(_mm256_mullo_epi32(v, _mm256_set1_epi32(0x00204081)),
                                            _mm256_set1_epi32(0x01010101));
    return _mm256_slli_epi32(spread, 4);
}

static inline __m256i bcast4_256(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* one group against X rows of x: acc[h][i] lane r = row 8h + r's sum for x row i */
static inline __attribute__((always_inline)) void il_group_256(int type, const uint8_t *group, int blocks,
                                                               const int8_t *xq, const float *dx,
                                                               const float *block_sums, const int16_t *isums, int k,
                                                               const int X, __m256 acc[2][TILE_XI]) {
    const int bytes = BLOCK_BYTES[type];
#ifdef IL_VNNI
    const int bias = type == Q8_0 ? 128 : il_bias(type);
#else
    const int bias = il_bias(type);
#endif
    const __m256i low = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < X; i++) acc[h][i] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = group + (int64_t)b * GROUP * bytes, *qs = blk + il_values(type);
        for (int h = 0; h < 2; h++) {
            __m256i even[TILE_XI], odd[TILE_XI];
            for (int i = 0; i < X; i++) {
                even[i] = _mm256_set1_epi32(-bias * isums[(int64_t)i * blocks + b]);
                odd[i] = _mm256_setzero_si256();
            }
            if (type == Q8_0) {
                for (int t = 0; t < 8; t++) {
                    __m256i w = _mm256_loadu_si256((const __m256i *)(qs + 64 * t + 32 * h));
#ifdef IL_VNNI
                    w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
#endif
                    for (int i = 0; i < X; i++) {
                        const __m256i x = bcast4_256(xq + (int64_t)i * k + b * 32 + 4 * t);
                        if (t % 2) odd[i] = il_dot4(type, odd[i], w, x);
                        else even[i] = il_dot4(type, even[i], w, x);
                    }
                }
            } else {
                const __m256i qh = has_fifth_bits(type)
                    ? _mm256_loadu_si256((const __m256i *)(blk + il_fifth(type) + 32 * h)) : _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 64 * c + 32 * h));
                    __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    if (has_fifth_bits(type)) {
                        lo = _mm256_or_si256(lo, fifth_bits_256(qh, 4 * c));
                        hi = _mm256_or_si256(hi, fifth_bits_256(qh, 16 + 4 * c));
                    }
                    for (int i = 0; i < X; i++) {
                        const int8_t *xv = xq + (int64_t)i * k + b * 32;
                        even[i] = il_dot4(type, even[i], lo, bcast4_256(xv + 4 * c));
                        odd[i] = il_dot4(type, odd[i], hi, bcast4_256(xv + 16 + 4 * c));
                    }
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
            for (int i = 0; i < X; i++) {
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[(int64_t)i * blocks + b]));
                acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(even[i], odd[i])), scale, acc[h][i]);
                if (has_min(type)) {
                    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + il_mins(type) + 16 * h)));
                    acc[h][i] = _mm256_fmadd_ps(m, _mm256_set1_ps(block_sums[(int64_t)i * blocks + b]), acc[h][i]);
                }
            }
        }
    }
}
#endif

/* the team's share of y[:, col0:col0 + n] (rows ldy apart) for an interleaved weight: groups
 * split over the threads */
static void il_matmul_team(int type, const uint8_t *w, const int8_t *xq, const float *dx, const float *block_sums,
                           const int16_t *isums, int m, int n, int k, void *y, int io_bf16, int64_t ldy, int col0) {
    const int blocks = k / 32, groups = n / GROUP;
    const int64_t group_bytes = (int64_t)GROUP * blocks * BLOCK_BYTES[type];
    #pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) {
        const uint8_t *group = w + g * group_bytes;
#if defined(IL_512) || defined(IL_256)
        for (int i0 = 0, X; i0 < m; i0 += X) {
            X = m - i0 >= TILE_XI ? TILE_XI : m - i0;
            const int8_t *xi = xq + (int64_t)i0 * k;
            const float *di = dx + (int64_t)i0 * blocks, *si = block_sums + (int64_t)i0 * blocks;
            const int16_t *ii = isums + (int64_t)i0 * blocks;
            float out[TILE_XI][GROUP];
#ifdef IL_512
            __m512 acc[TILE_XI];
#define IL_TYPE(XC, T) il_group_512(T, group, blocks, xi, di, si, ii, k, XC, acc);
#else
            __m256 acc[2][TILE_XI];
#define IL_TYPE(XC, T) il_group_256(T, group, blocks, xi, di, si, ii, k, XC, acc);
#endif
#define IL_X(XC) switch (type) { case Q4_0: IL_TYPE(XC, Q4_0) break; case Q4_1: IL_TYPE(XC, Q4_1) break; \
    case Q5_0: IL_TYPE(XC, Q5_0) break; case Q5_1: IL_TYPE(XC, Q5_1) break; default: IL_TYPE(XC, Q8_0) break; }
#ifdef IL_512
            if (X == 4) { IL_X(4) } else if (X == 3) { IL_X(3) } else if (X == 2) { IL_X(2) } else { IL_X(1) }
            for (int i = 0; i < X; i++) _mm512_storeu_ps(out[i], acc[i]);
#else
            if (X == 2) { IL_X(2) } else { IL_X(1) }
            for (int i = 0; i < X; i++) {
                _mm256_storeu_ps(out[i], acc[0][i]);
                _mm256_storeu_ps(out[i] + 8, acc[1][i]);
            }
#endif
#undef IL_X
#undef IL_TYPE
#else
        for (int i0 = 0, X; i0 < m; i0 += X) {
            X = m - i0 >= 4 ? 4 : m - i0;
            float out[4][GROUP];
            il_group_portable(type, group, blocks, xq + (int64_t)i0 * k, dx + (int64_t)i0 * blocks,
                              block_sums + (int64_t)i0 * blocks, isums + (int64_t)i0 * blocks, k, X, out);
#endif
            for (int i = 0; i < X; i++)
                for (int r = 0; r < GROUP; r++)
                    store_out(y, io_bf16, (int64_t)(i0 + i) * ldy + col0 + g * GROUP + r, out[i][r]);
        }
    }
}

#endif
