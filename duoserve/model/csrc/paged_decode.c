/* Paged-attention decode for the CPU: one query token per sequence.
 *
 * Reads each sequence's K and V straight from their blocks, once (the torch path
 * gathers them into a contiguous copy first, which triples the memory traffic).
 * Work is split over (sequence, KV head) pairs; the query heads of one KV head share
 * each K and V row while it is in cache. Two passes per pair: scores and their
 * softmax, then the weighted sum of values.
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void load_row(const void *cache, int is_bf16, int64_t index, int head_dim, float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)cache + index;
        for (int d = 0; d < head_dim; d++) dst[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(dst, (const float *)cache + index, sizeof(float) * head_dim);
    }
}

/* Row t of one KV head in a cache: a pointer into it, or (bf16) into ``row`` after conversion. */
static inline const float *cache_row(const void *cache, int is_bf16, const int64_t *table, int t, int kv_head,
                                     int num_kv_heads, int head_dim, int block_size, float *row) {
    int64_t slot = table[t / block_size] * block_size + t % block_size;
    int64_t index = (slot * num_kv_heads + kv_head) * head_dim;
    if (!is_bf16) return (const float *)cache + index;
    load_row(cache, 1, index, head_dim, row);
    return row;
}

static void attend_one(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                       const int64_t *table, int seq_len, int kv_head, int group, int num_kv_heads,
                       int head_dim, int block_size, float scale, float *scores, float *row, float *out) {
    /* q: [group, head_dim] (this KV head's query heads); out: [group, head_dim]; scores: [group, seq_len] */
    for (int t = 0; t < seq_len; t++) {
        const float *k = cache_row(k_cache, is_bf16, table, t, kv_head, num_kv_heads, head_dim, block_size, row);
        for (int g = 0; g < group; g++) {
            const float *qg = q + g * head_dim;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; d++) dot += qg[d] * k[d];
            scores[g * seq_len + t] = dot * scale;
        }
    }
    for (int g = 0; g < group; g++) {
        float *s = scores + g * seq_len;
        float max = -INFINITY, sum = 0.0f;
        for (int t = 0; t < seq_len; t++) if (s[t] > max) max = s[t];
        for (int t = 0; t < seq_len; t++) { s[t] = expf(s[t] - max); sum += s[t]; }
        float inv = 1.0f / sum;
        for (int t = 0; t < seq_len; t++) s[t] *= inv;
        memset(out + g * head_dim, 0, sizeof(float) * head_dim);
    }
    for (int t = 0; t < seq_len; t++) {
        const float *v = cache_row(v_cache, is_bf16, table, t, kv_head, num_kv_heads, head_dim, block_size, row);
        for (int g = 0; g < group; g++) {
            float p = scores[g * seq_len + t];
            float *o = out + g * head_dim;
            for (int d = 0; d < head_dim; d++) o[d] += p * v[d];
        }
    }
}

/* q, out: [num_seqs, num_heads, head_dim] float32; block_tables: [num_seqs, max_blocks] int64;
 * seq_lens: [num_seqs] int64. Returns 0, or -1 when scratch memory could not be allocated. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           int max_blocks, float scale, int num_threads) {
    int group = num_heads / num_kv_heads;
    int max_len = max_blocks * block_size;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)group * max_len);
        float *row = malloc(sizeof(float) * head_dim);
        /* every thread must reach the worksharing loop, so a failed allocation only skips work */
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < num_seqs; b++) {
            for (int h = 0; h < num_kv_heads; h++) {
                if (!scores || !row) {
                    #pragma omp atomic write
                    failed = 1;
                    continue;
                }
                int64_t base = ((int64_t)b * num_heads + (int64_t)h * group) * head_dim;
                attend_one(q + base, k_cache, v_cache, is_bf16, block_tables + (int64_t)b * max_blocks,
                           (int)seq_lens[b], h, group, num_kv_heads, head_dim, block_size, scale,
                           scores, row, out + base);
            }
        }
        free(scores);
        free(row);
    }
    return failed ? -1 : 0;
}
