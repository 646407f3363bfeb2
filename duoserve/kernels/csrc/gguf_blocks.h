/* The block types of GGUF as gguf_linear.c reads them: for each type its values and bytes per
 * block, and how to read 32 consecutive values of a block (sub-block `sub`) as unsigned integers
 * q[32] (`sub_values`, or `sub_values_vec` in one 256-bit register) with a scale and an offset
 * for each half of 16 (`sub_scales`):
 *     w[j] = scale[j / 16] * q[j] + offset[j / 16]
 * exact in float32 for every type, so that the reference dequantization's arithmetic is kept.
 * The one table of the types is GGUF_BLOCK_TYPES below: Python reads it from this file
 * (duoserve/gguf_types.py) for its own table, the dequantizers' keys and the flags' help. A new
 * type is a row of it and its cases in sub_scales, sub_values and sub_values_vec, all in this file
 * (gguf_superblocks.h's fast path for K-quants is an option a type may take later, in
 * takes_superblock_rows). Included by gguf_linear.c alone, after its includes. */
#ifndef DUOSERVE_GGUF_BLOCKS_H
#define DUOSERVE_GGUF_BLOCKS_H

/* X(name, id, values per block, bytes per block, bias, half scales, offsets, ...), the macro's
 * further arguments passed on to X:
 *   bias: the weight is scale * (q - bias) for a stored unsigned q (the signed types; Q8_0's
 *         int8 read unsigned is q - 128), 0 where it is scale * q + offset (a min per block);
 *   half scales: 1 where each half of 16 values of a sub-block of 32 has its own scale;
 *   offsets: how many offsets (mins) a sub-block of 32 has, 1 or 2 (each half its own). */
#define GGUF_BLOCK_TYPES(X, ...) \
    X(Q4_0, 0, 32, 18, 8, 0, 1, __VA_ARGS__) \
    X(Q4_1, 1, 32, 20, 0, 0, 1, __VA_ARGS__) \
    X(Q8_0, 2, 32, 34, 128, 0, 1, __VA_ARGS__) \
    X(Q4_K, 3, 256, 144, 0, 0, 1, __VA_ARGS__) \
    X(Q5_K, 4, 256, 176, 0, 0, 1, __VA_ARGS__) \
    X(Q6_K, 5, 256, 210, 32, 1, 1, __VA_ARGS__) \
    X(Q5_0, 6, 32, 22, 16, 0, 1, __VA_ARGS__) \
    X(Q5_1, 7, 32, 24, 0, 0, 1, __VA_ARGS__) \
    X(Q2_K, 8, 256, 84, 0, 1, 2, __VA_ARGS__) \
    X(Q3_K, 9, 256, 110, 4, 1, 1, __VA_ARGS__) \
    X(IQ4_NL, 10, 32, 18, 128, 0, 1, __VA_ARGS__)

#define TYPE_ID(name, id, values, bytes, bias, half, offsets, ...) name = id,
#define TYPE_ONE(name, id, values, bytes, bias, half, offsets, ...) + 1
enum { GGUF_BLOCK_TYPES(TYPE_ID, _) BLOCK_TYPE_COUNT = 0 GGUF_BLOCK_TYPES(TYPE_ONE, _) };
#define LAST_TYPE (BLOCK_TYPE_COUNT - 1)   /* ids run 0..LAST_TYPE */

#define TYPE_VALUES(name, id, values, bytes, bias, half, offsets, ...) [id] = values,
#define TYPE_BYTES(name, id, values, bytes, bias, half, offsets, ...) [id] = bytes,
static const int BLOCK_VALUES[] = {GGUF_BLOCK_TYPES(TYPE_VALUES, _)};
static const int BLOCK_BYTES[] = {GGUF_BLOCK_TYPES(TYPE_BYTES, _)};

/* the table's other columns as functions of a type (folded where the type is a constant) */
#define TYPE_BIAS(name, id, values, bytes, bias, half, offsets, ...) case name: return bias;
#define TYPE_HALF(name, id, values, bytes, bias, half, offsets, ...) case name: return half;
#define TYPE_OFFSETS(name, id, values, bytes, bias, half, offsets, ...) case name: return offsets;
static inline __attribute__((always_inline)) int type_bias(int type) {
    switch (type) { GGUF_BLOCK_TYPES(TYPE_BIAS, _) default: return 0; }
}
static inline __attribute__((always_inline)) int half_scales(int type) {
    switch (type) { GGUF_BLOCK_TYPES(TYPE_HALF, _) default: return 0; }
}
static inline __attribute__((always_inline)) int type_offsets(int type) {
    switch (type) { GGUF_BLOCK_TYPES(TYPE_OFFSETS, _) default: return 1; }
}

/* `switch (type)` over every block type, M(arg, T) the code for type T as a constant; the callers
 * have checked the type (known_type), so that no other case is laid out */
#define TYPE_CASE_EACH(name, id, values, bytes, bias, half, offsets, M, arg) case name: M(arg, name) break;
#define EACH_TYPE(M, arg) switch (type) { GGUF_BLOCK_TYPES(TYPE_CASE_EACH, M, arg) default: __builtin_unreachable(); }

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000 | (man << 13);          /* inf, nan */
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13); /* normal */
    else if (man == 0) bits = sign;                                     /* zero */
    else {                                                              /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* the six-bit scale and min of sub-block s (0..7) of a Q4_K/Q5_K super-block */
static inline void k_scale_min(const uint8_t *p, int s, int *sc, int *mn) {
    if (s < 4) {
        *sc = p[s] & 63;
        *mn = p[s + 4] & 63;
    } else {
        *sc = (p[s + 4] & 0x0f) | ((p[s - 4] >> 6) << 4);
        *mn = (p[s + 4] >> 4) | ((p[s] >> 6) << 4);
    }
}

/* the six-bit scale j (0..15) of a Q3_K super-block, unsigned (the stored value + 32): its low four
 * bits are a nibble of bytes 0..7, its top two a pair of bits of bytes 8..11 */
static inline int q3k_scale(const uint8_t *p, int j) {
    int low = j < 8 ? p[j] & 0x0f : p[j - 8] >> 4;
    return low | (((p[8 + (j & 3)] >> (2 * (j >> 2))) & 3) << 4);
}

/* IQ4_NL's sixteen values (ggml's kvalues_iq4nl) + 128: a nibble's unsigned integer */
static const uint8_t IQ4_NL_VALUES[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

/* the scale and offset of each half of 16 values of sub-block `sub` (32 values) of a block */
static inline __attribute__((always_inline)) void sub_scales(int type, const uint8_t *b, int sub, float scale[2], float offset[2]) {
    switch (type) {
    case Q4_0:
    case Q8_0:
    case IQ4_NL: {
        float d = f16_to_f32(b);
        scale[0] = scale[1] = d;
        /* Q8_0: int8 read as uint8 - 128; IQ4_NL: its table's value + 128 */
        offset[0] = offset[1] = (type == Q4_0 ? -8.0f : -128.0f) * d;
        break;
    }
    case Q5_0: {
        float d = f16_to_f32(b);
        scale[0] = scale[1] = d;
        offset[0] = offset[1] = -16.0f * d;
        break;
    }
    case Q4_1:
    case Q5_1:
        scale[0] = scale[1] = f16_to_f32(b);
        offset[0] = offset[1] = f16_to_f32(b + 2);
        break;
    case Q4_K:
    case Q5_K: {
        int sc, mn;
        k_scale_min(b + 4, sub, &sc, &mn);
        scale[0] = scale[1] = f16_to_f32(b) * (float)sc;
        offset[0] = offset[1] = -(f16_to_f32(b + 2) * (float)mn);
        break;
    }
    case Q2_K: {  /* per 16 values a byte: a four-bit scale (low nibble) and min (high) */
        float d = f16_to_f32(b + 80), dmin = f16_to_f32(b + 82);
        for (int h = 0; h < 2; h++) {
            scale[h] = d * (float)(b[2 * sub + h] & 0x0f);
            offset[h] = -(dmin * (float)(b[2 * sub + h] >> 4));
        }
        break;
    }
    case Q3_K: {  /* per 16 values a six-bit scale stored + 32; values stored + 4 */
        float d = f16_to_f32(b + 108);
        for (int h = 0; h < 2; h++) {
            scale[h] = d * (float)(q3k_scale(b + 96, 2 * sub + h) - 32);
            offset[h] = -4.0f * scale[h];
        }
        break;
    }
    default: {  /* Q6_K: one int8 scale per 16 values */
        float d = f16_to_f32(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192) + sub * 2;
        for (int h = 0; h < 2; h++) {
            scale[h] = d * (float)sc[h];
            offset[h] = -32.0f * scale[h];
        }
        break;
    }
    }
}

/* Where the 32 values of sub-block `sub` sit. Q4_0/Q4_1: 16 bytes, low nibbles then high.
 * Q5_0/Q5_1: the same, after 4 bytes qh whose bit j is value j's fifth bit.
 * Q8_0: 32 int8. Q4_K: 32 bytes shared by sub-blocks 2i (low nibbles) and 2i+1 (high).
 * Q5_K: the same plus bit `sub` of 32 bytes qh. Q6_K: each half of 128 values holds four runs
 * of 32, the low or high nibble of ql[0:32] or ql[32:64], topped with two bits of qh.
 * Q2_K: each half of 128 values holds four runs of 32, the bit pairs 0-1, 2-3, 4-5, 6-7 of its 32
 * bytes of qs (at 16). Q3_K: the same pairs (qs at 32), topped with bit `sub` of 32 bytes hmask (at 0). */
#define TWO_BIT_RUN(type, b, sub) ((b) + ((type) == Q2_K ? 16 : 32) + ((sub) / 4) * 32)
#define NIBBLES(type, b) ((b) + ((type) == Q4_0 ? 2 : (type) == Q4_1 ? 4 : (type) == Q5_0 ? 6 : 8))
#define FIFTH_BITS(type, b) ((b) + ((type) == Q5_0 ? 2 : 4))

/* values [32 * sub, 32 * sub + 32) of one block as unsigned integers (portable) */
static inline __attribute__((always_inline)) void sub_values(int type, const uint8_t *b, int sub, uint8_t q[32]) {
    switch (type) {
    case Q4_0:
    case Q4_1: {
        const uint8_t *qs = NIBBLES(type, b);
        for (int j = 0; j < 16; j++) { q[j] = qs[j] & 0x0f; q[j + 16] = qs[j] >> 4; }
        break;
    }
    case Q5_0:
    case Q5_1: {
        const uint8_t *qs = NIBBLES(type, b), *qh = FIFTH_BITS(type, b);
        for (int j = 0; j < 16; j++) {
            q[j] = (qs[j] & 0x0f) | (((qh[j / 8] >> (j % 8)) & 1) << 4);
            q[j + 16] = (qs[j] >> 4) | (((qh[2 + j / 8] >> (j % 8)) & 1) << 4);
        }
        break;
    }
    case Q8_0:
        for (int j = 0; j < 32; j++) q[j] = (uint8_t)(b[2 + j] ^ 0x80);
        break;
    case IQ4_NL:   /* Q4_0's nibbles at byte 2, each an index into the table of sixteen values */
        for (int j = 0; j < 16; j++) { q[j] = IQ4_NL_VALUES[b[2 + j] & 0x0f]; q[j + 16] = IQ4_NL_VALUES[b[2 + j] >> 4]; }
        break;
    case Q4_K:
    case Q5_K: {
        int shift = (sub & 1) * 4;
        const uint8_t *qs = b + (type == Q4_K ? 16 : 48) + (sub / 2) * 32, *qh = b + 16;
        for (int j = 0; j < 32; j++)
            q[j] = ((qs[j] >> shift) & 0x0f) | (type == Q5_K ? ((qh[j] >> sub) & 1) << 4 : 0);
        break;
    }
    case Q6_K: {
        int half = sub / 4, run = sub % 4;
        const uint8_t *ql = b + half * 64 + (run & 1) * 32, *qh = b + 128 + half * 32;
        for (int j = 0; j < 32; j++) q[j] = ((ql[j] >> ((run >> 1) * 4)) & 0x0f) | (((qh[j] >> (run * 2)) & 3) << 4);
        break;
    }
    case Q2_K:
    case Q3_K: {
        const uint8_t *qs = TWO_BIT_RUN(type, b, sub);
        for (int j = 0; j < 32; j++)
            q[j] = ((qs[j] >> (2 * (sub % 4))) & 3) | (type == Q3_K ? ((b[j] >> sub) & 1) << 2 : 0);
        break;
    }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#define VEC_AVX2 1     /* sub_values_vec: AVX2 instructions only */
#endif
#if defined(VEC_AVX2) && defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define VECTOR 1       /* the float paths in 512-bit registers */
#endif

#ifdef VEC_AVX2
/* the sum of a register's 8 floats */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 bits (little-endian bytes) -> 32 bytes, byte j 0x10 where bit j is set, else 0 */
static inline __m256i fifth_bits_vec(const uint8_t *qh) {
    int32_t bits;
    memcpy(&bits, qh, 4);
    /* byte j takes byte j / 8 of the bits (each 128-bit lane holds all four), then tests bit j % 8 */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

/* the same 32 values in one register */
static inline __attribute__((always_inline)) __m256i sub_values_vec(int type, const uint8_t *b, int sub) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    switch (type) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
        __m128i v = _mm_loadu_si128((const __m128i *)NIBBLES(type, b));
        __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
        __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
        return type == Q5_0 || type == Q5_1 ? _mm256_or_si256(q, fifth_bits_vec(FIFTH_BITS(type, b))) : q;
    }
    case Q8_0:
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
    case IQ4_NL: {   /* the nibbles as Q4_0's, then each looked up in the table (one shuffle) */
        __m128i v = _mm_loadu_si128((const __m128i *)(b + 2));
        __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
        __m256i index = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
        __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));
        return _mm256_shuffle_epi8(table, index);
    }
    case Q4_K:
    case Q5_K: {
        __m256i v = _mm256_loadu_si256((const __m256i *)(b + (type == Q4_K ? 16 : 48) + (sub / 2) * 32));
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, (sub & 1) * 4), low4);
        if (type == Q5_K) {
            __m256i h = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)), sub),
                                         _mm256_set1_epi8(1));
            q = _mm256_or_si256(q, _mm256_slli_epi16(h, 4));
        }
        return q;
    }
    case Q2_K:
    case Q3_K: {
        __m256i v = _mm256_loadu_si256((const __m256i *)TWO_BIT_RUN(type, b, sub));
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (sub % 4)), _mm256_set1_epi8(3));
        if (type == Q3_K) {
            __m256i h = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)b), sub),
                                         _mm256_set1_epi8(1));
            q = _mm256_or_si256(q, _mm256_slli_epi16(h, 2));
        }
        return q;
    }
    default: {  /* Q6_K */
        int half = sub / 4, run = sub % 4;
        __m256i l = _mm256_loadu_si256((const __m256i *)(b + half * 64 + (run & 1) * 32));
        __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + half * 32));
        l = _mm256_and_si256(_mm256_srli_epi16(l, (run >> 1) * 4), low4);
        h = _mm256_and_si256(_mm256_srli_epi16(h, run * 2), _mm256_set1_epi8(3));
        return _mm256_or_si256(l, _mm256_slli_epi16(h, 4));
    }
    }
}

#endif

#endif
