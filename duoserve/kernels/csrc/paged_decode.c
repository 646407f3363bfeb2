/* Paged-attention decode for the CPU: one query token per sequence.
 *
 * Reads each sequence's K and V straight from their blocks, once, in address order: a
 * cache row holds every KV head of one token side by side, so a work item takes a
 * sequence's whole row (all its KV heads) and streams through its blocks; the hardware
 * prefetchers then see one sequential run per block instead of one strided run per KV
 * head. Work items are sequences when there are enough of them to keep every thread
 * busy, else (sequence, KV head) pairs (a single stream still uses every thread).
 * Two passes per item: scores and their softmax, then the weighted sum of values.
 *
 * With AVX-512 and a head size of 64 or 128, each KV head runs in registers (its query
 * heads' q and output rows stay in vector registers, bf16 rows are widened in registers),
 * walks its blocks without a division per token, and prefetches the next block's rows
 * while it reads this block's: blocks lie anywhere in the cache, and the hardware
 * prefetchers stop at each boundary. Other shapes and CPUs take the portable loop.
 *
 * A call's rows that are a prompt chunk's consecutive tokens (one block table, lengths growing
 * by one) go to the tiled kernel of paged_prefill.c instead, in the same parallel region.
 *
 * A layer with a sliding window (Gemma's local layers) attends over each row's last `window`
 * keys only (Hugging Face's rule: key j is seen from position i when i - window < j <= i); one
 * whose scores are soft-capped (Gemma 2) caps each scaled score, cap * tanh(s / cap). Both run
 * every row in the decode kernel (the tiled one neither windows nor caps).
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* the tiled kernel for runs of a prompt chunk's tokens (paged_prefill.c) */
int paged_prefill_supported(int head_dim, int is_bf16);
int paged_find_runs(const int64_t *block_tables, const int64_t *seq_lens, int num_rows, int max_blocks,
                    int block_size, int *run_first, int *run_count, int *singles, int *num_singles);
void paged_prefill_team(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                        const int64_t *block_tables, const int64_t *seq_lens, float *out, const int *run_first,
                        const int *run_count, int num_runs, int num_heads, int num_kv_heads, int head_dim,
                        int block_size, int max_blocks, float scale);

/* Heads [kv_begin, kv_end) of token t's row, as float32: a pointer into the cache, or (bf16)
 * into ``row`` after conversion. The returned pointer addresses KV head kv_begin. */
static inline const float *cache_row(const void *cache, int is_bf16, const int64_t *table, int t, int kv_begin,
                                     int kv_end, int num_kv_heads, int head_dim, int block_size, float *row) {
    int64_t slot = table[t / block_size] * block_size + t % block_size;
    int64_t index = (slot * num_kv_heads + kv_begin) * head_dim;
    if (!is_bf16) return (const float *)cache + index;
    const uint16_t *src = (const uint16_t *)cache + index;
    int width = (kv_end - kv_begin) * head_dim;
    for (int d = 0; d < width; d++) row[d] = bf16_to_f32(src[d]);
    return row;
}

/* KV heads [kv_begin, kv_end) of one sequence. q, out: this sequence's [num_heads, head_dim];
 * scores: [heads in range, seq_len]; row: [num_kv_heads * head_dim] scratch. */
/* a scaled score, soft-capped where the layer caps them (cap > 0) */
static inline float capped(float dot, float scale, float cap) {
    float s = dot * scale;
    return cap > 0.0f ? cap * tanhf(s / cap) : s;
}

/* the first key a row of seq_len keys sees: its last `window` keys, or all (window 0) */
static inline int first_key(int seq_len, int window) {
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

/* each of num_heads rows of n scores (n apart) replaced by its softmax */
static void softmax_rows(float *scores, int num_heads, int n) {
    for (int h = 0; h < num_heads; h++) {
        float *s = scores + (int64_t)h * n;
        float max = -INFINITY, sum = 0.0f;
        for (int t = 0; t < n; t++) max = s[t] > max ? s[t] : max;
        for (int t = 0; t < n; t++) { s[t] = expf(s[t] - max); sum += s[t]; }
        float inv = 1.0f / sum;
        for (int t = 0; t < n; t++) s[t] *= inv;
    }
}

static void attend(const float *q, const void *k_cache, const void *v_cache, int is_bf16, const int64_t *table,
                   int seq_len, int start, int kv_begin, int kv_end, int group, int num_kv_heads, int head_dim,
                   int block_size, float scale, float cap, float *scores, float *row, float *out) {
    int num_heads = (kv_end - kv_begin) * group, n = seq_len - start;
    const float *qs = q + (int64_t)kv_begin * group * head_dim;
    float *os = out + (int64_t)kv_begin * group * head_dim;
    for (int t = start; t < seq_len; t++) {
        const float *k = cache_row(k_cache, is_bf16, table, t, kv_begin, kv_end, num_kv_heads, head_dim,
                                   block_size, row);
        for (int h = 0; h < num_heads; h++) {
            const float *qh = qs + (int64_t)h * head_dim;
            const float *kh = k + (int64_t)(h / group) * head_dim;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
            scores[(int64_t)h * n + t - start] = capped(dot, scale, cap);
        }
    }
    softmax_rows(scores, num_heads, n);
    memset(os, 0, sizeof(float) * (size_t)num_heads * head_dim);
    for (int t = start; t < seq_len; t++) {
        const float *v = cache_row(v_cache, is_bf16, table, t, kv_begin, kv_end, num_kv_heads, head_dim,
                                   block_size, row);
        for (int h = 0; h < num_heads; h++) {
            float p = scores[(int64_t)h * n + t - start];
            const float *vh = v + (int64_t)(h / group) * head_dim;
            float *o = os + (int64_t)h * head_dim;
            for (int d = 0; d < head_dim; d++) o[d] += p * vh[d];
        }
    }
}

#ifdef __AVX512F__
#include <immintrin.h>

static inline void load_row16(const void *cache, int is_bf16, int64_t index, int n16, __m512 *dst) {
    for (int j = 0; j < n16; j++) {
        if (is_bf16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + index + 16 * j));
            dst[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        } else {
            dst[j] = _mm512_loadu_ps((const float *)cache + index + 16 * j);
        }
    }
}

/* The next block lies anywhere in the cache, where the hardware prefetchers do not follow. */
static inline void prefetch_row(const void *cache, int is_bf16, int64_t index, int bytes) {
    const char *p = (const char *)cache + index * (is_bf16 ? 2 : 4);
    for (int offset = 0; offset < bytes; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T0);
}

/* One KV head of one sequence, its GROUP query heads' q and output rows in registers (N16 vectors
 * of 16 floats per head): two passes over the head's rows, no scratch copy of them. Inlined with
 * constant GROUP and N16, the loops unroll into register code. */
/* element index of KV head kv_head of the first token of the block holding token t0 */
static inline int64_t block_row(const int64_t *table, int t0, int block_size, int num_kv_heads, int kv_head,
                                int head_dim) {
    return (table[t0 / block_size] * block_size * num_kv_heads + kv_head) * head_dim;
}

static inline void attend_head(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                               const int64_t *table, int seq_len, int start, int kv_head, int num_kv_heads,
                               int block_size, float scale, float cap, float *scores, float *out, const int GROUP,
                               const int N16) {
    __m512 qv[GROUP * N16], acc[GROUP * N16], row[N16];
    int head_dim = 16 * N16;
    int64_t stride = (int64_t)num_kv_heads * head_dim;  /* between two tokens' rows of one block */
    int row_bytes = head_dim * (is_bf16 ? 2 : 4);
    const int n = seq_len - start, skip = start % block_size;   /* keys seen; of the first block, those before start */
    for (int i = 0; i < GROUP * N16; i++) qv[i] = _mm512_loadu_ps(q + 16 * i);
    for (int t0 = start - skip; t0 < seq_len; t0 += block_size) {  /* block by block: no division per token */
        int64_t first = block_row(table, t0, block_size, num_kv_heads, kv_head, head_dim);
        int count = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        int64_t next = t0 + block_size < seq_len ?
            block_row(table, t0 + block_size, block_size, num_kv_heads, kv_head, head_dim) : -1;
        for (int i = t0 < start ? skip : 0; i < count; i++) {
            if (next >= 0) prefetch_row(k_cache, is_bf16, next + i * stride, row_bytes);
            load_row16(k_cache, is_bf16, first + i * stride, N16, row);
            for (int g = 0; g < GROUP; g++) {
                __m512 dot = _mm512_mul_ps(qv[g * N16], row[0]);
                for (int j = 1; j < N16; j++) dot = _mm512_fmadd_ps(qv[g * N16 + j], row[j], dot);
                scores[g * n + t0 + i - start] = capped(_mm512_reduce_add_ps(dot), scale, cap);
            }
        }
    }
    softmax_rows(scores, GROUP, n);
    for (int i = 0; i < GROUP * N16; i++) acc[i] = _mm512_setzero_ps();
    for (int t0 = start - skip; t0 < seq_len; t0 += block_size) {
        int64_t first = block_row(table, t0, block_size, num_kv_heads, kv_head, head_dim);
        int count = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        int64_t next = t0 + block_size < seq_len ?
            block_row(table, t0 + block_size, block_size, num_kv_heads, kv_head, head_dim) : -1;
        for (int i = t0 < start ? skip : 0; i < count; i++) {
            if (next >= 0) prefetch_row(v_cache, is_bf16, next + i * stride, row_bytes);
            load_row16(v_cache, is_bf16, first + i * stride, N16, row);
            for (int g = 0; g < GROUP; g++) {
                __m512 p = _mm512_set1_ps(scores[g * n + t0 + i - start]);
                for (int j = 0; j < N16; j++) acc[g * N16 + j] = _mm512_fmadd_ps(p, row[j], acc[g * N16 + j]);
            }
        }
    }
    for (int i = 0; i < GROUP * N16; i++) _mm512_storeu_ps(out + 16 * i, acc[i]);
}

/* The register path for the shapes it has instances for (returns 1), else 0. */
static int attend_fast(const float *q, const void *k_cache, const void *v_cache, int is_bf16, const int64_t *table,
                       int seq_len, int start, int kv_begin, int kv_end, int group, int num_kv_heads, int head_dim,
                       int block_size, float scale, float cap, float *scores, float *out) {
#define HEADS(G, N)                                                                                          \
    for (int h = kv_begin; h < kv_end; h++)                                                                  \
        attend_head(q + (int64_t)h * group * head_dim, k_cache, v_cache, is_bf16, table, seq_len, start, h,  \
                    num_kv_heads, block_size, scale, cap, scores, out + (int64_t)h * group * head_dim, G, N); \
    return 1;
    if (head_dim == 64) {
        switch (group) {
            case 1: HEADS(1, 4) case 2: HEADS(2, 4) case 3: HEADS(3, 4) case 4: HEADS(4, 4)
            case 5: HEADS(5, 4) case 6: HEADS(6, 4) case 7: HEADS(7, 4) case 8: HEADS(8, 4)
        }
    } else if (head_dim == 128) {
        switch (group) {
            case 1: HEADS(1, 8) case 2: HEADS(2, 8) case 3: HEADS(3, 8) case 4: HEADS(4, 8)
        }
    }
#undef HEADS
    return 0;
}
#else
static int attend_fast(const float *q, const void *k_cache, const void *v_cache, int is_bf16, const int64_t *table,
                       int seq_len, int start, int kv_begin, int kv_end, int group, int num_kv_heads, int head_dim,
                       int block_size, float scale, float cap, float *scores, float *out) {
    return 0;
}
#endif

/* The work of one call shared by the threads of the enclosing parallel region (orphaned
 * worksharing, ending in its barrier; alone outside any region): the fused decode step
 * (decode_step.c) calls it inside its own region. rows: which of the call's rows to take
 * (num_seqs of them), or NULL for rows 0..num_seqs-1. window: the keys a row sees (0: all); cap:
 * the scores' soft cap (0: none). Sets *failed when scratch memory could not be allocated. */
void paged_decode_team(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                       const int64_t *block_tables, const int64_t *seq_lens, float *out, const int *rows,
                       int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                       float scale, int window, float cap, int num_threads, int *failed) {
    int group = num_heads / num_kv_heads;
    int max_len = max_blocks * block_size;
    /* enough sequences: one item each, whole rows; else one item per (sequence, KV head) */
    int heads_per_item = num_seqs >= 2 * num_threads ? num_kv_heads : 1;
    int items_per_seq = num_kv_heads / heads_per_item;
    int num_items = num_seqs * items_per_seq;
    float *scores = malloc(sizeof(float) * (size_t)heads_per_item * group * max_len);
    float *row = malloc(sizeof(float) * (size_t)num_kv_heads * head_dim);
    /* every thread must reach the worksharing loop, so a failed allocation only skips work */
    #pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < num_items; item++) {
        if (!scores || !row) {
            #pragma omp atomic write
            *failed = 1;
            continue;
        }
        int b = rows ? rows[item / items_per_seq] : item / items_per_seq;
        int kv_begin = (item % items_per_seq) * heads_per_item;
        int64_t base = (int64_t)b * num_heads * head_dim;
        const int64_t *table = block_tables + (int64_t)b * max_blocks;
        const int seq_len = (int)seq_lens[b], start = first_key(seq_len, window);
        if (!attend_fast(q + base, k_cache, v_cache, is_bf16, table, seq_len, start, kv_begin,
                         kv_begin + heads_per_item, group, num_kv_heads, head_dim, block_size, scale, cap, scores,
                         out + base))
            attend(q + base, k_cache, v_cache, is_bf16, table, seq_len, start, kv_begin, kv_begin + heads_per_item,
                   group, num_kv_heads, head_dim, block_size, scale, cap, scores, row, out + base);
    }
    free(scores);
    free(row);
}

/* q, out: [num_rows, num_heads, head_dim] float32; block_tables: [num_rows, max_blocks] int64;
 * seq_lens: [num_rows] int64: each row a query token over its own context; window and cap as
 * paged_decode_team's. Runs of a prompt
 * chunk's consecutive tokens go to the tiled kernel of paged_prefill.c, the other rows to the
 * decode kernel above, in one parallel region. Returns 0, or -1 when scratch memory could not
 * be allocated. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           int max_blocks, float scale, int window, float cap, int num_threads) {
    int failed = 0, num_runs = 0, num_singles = num_rows, windowed = 0;
    for (int r = 0; r < num_rows && window > 0; r++) windowed |= seq_lens[r] > window;
    int *runs = NULL;
    if (paged_prefill_supported(head_dim, is_bf16) && !windowed && cap <= 0.0f) {
        runs = malloc(sizeof(int) * 3 * (size_t)num_rows);   /* firsts, counts, single rows */
        if (!runs) return -1;
        num_runs = paged_find_runs(block_tables, seq_lens, num_rows, max_blocks, block_size, runs,
                                   runs + num_rows, runs + 2 * num_rows, &num_singles);
    }
    const int *singles = num_runs ? runs + 2 * num_rows : NULL;   /* NULL: every row */
    #pragma omp parallel num_threads(num_threads)
    {
        if (num_singles)
            paged_decode_team(q, k_cache, v_cache, is_bf16, block_tables, seq_lens, out, singles, num_singles,
                              num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, window, cap,
                              num_threads, &failed);
        if (num_runs)
            paged_prefill_team(q, k_cache, v_cache, is_bf16, block_tables, seq_lens, out, runs, runs + num_rows,
                               num_runs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale);
    }
    free(runs);
    return failed ? -1 : 0;
}
