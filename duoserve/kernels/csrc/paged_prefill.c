/* Paged attention for runs of query tokens: a prompt chunk (or a speculative check) of one
 * sequence, whose token i sees the first first_len + i keys of one block table.
 *
 * The decode kernel (paged_decode.c) takes a token at a time: for every key it reads the key's
 * row and sums a dot product across a vector for each query head, so a 128-token prompt reads
 * each key row up to 128 times and pays a horizontal sum per (token, head, key). Here a run's
 * rows, its (token, query head) pairs of one KV head, go sixteen to a tile, one per vector lane:
 * each key row is read once per tile and broadcast against the tile's sixteen queries, scores
 * come out sixteen rows at a time with no horizontal sums, and the softmax runs online (a
 * running maximum and sum per row, as flash attention does) over blocks of sixteen keys.
 *
 * With a bfloat16 cache and AVX512-BF16 the dot products are the CPU's bf16 pair products
 * summed into float32 (q and the probabilities rounded to bf16, as a bf16 matmul would; the
 * accumulation in float32); with a float32 cache, float32 FMAs. Other CPUs, head sizes other
 * than 64 and 128, and runs shorter than MIN_RUN tokens take the decode kernel, and so does
 * every row unless tiles are switched on (tiles_on below says why they are off by default).
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MIN_RUN 3   /* shorter runs: the decode kernel is as fast (benchmarks/prefill_attention.py) */

/* Groups the rows of one call (each a query token over its own block table and length) into
 * runs: consecutive rows of one table whose lengths grow by one. Runs of MIN_RUN or more rows
 * go to run_first / run_count, every other row to singles. Returns the number of runs. */
int paged_find_runs(const int64_t *block_tables, const int64_t *seq_lens, int num_rows, int max_blocks,
                    int block_size, int *run_first, int *run_count, int *singles, int *num_singles) {
    int runs = 0, single = 0;
    for (int first = 0; first < num_rows;) {
        int end = first + 1;
        while (end < num_rows && seq_lens[end] == seq_lens[end - 1] + 1 && seq_lens[end - 1] > 0) {
            /* the blocks the shorter row reads must be the longer row's */
            int64_t used = (seq_lens[end - 1] + block_size - 1) / block_size;
            if (memcmp(block_tables + (int64_t)end * max_blocks, block_tables + (int64_t)(end - 1) * max_blocks,
                       sizeof(int64_t) * used) != 0)
                break;
            end++;
        }
        if (end - first >= MIN_RUN) {
            run_first[runs] = first;
            run_count[runs++] = end - first;
        } else {
            for (int r = first; r < end; r++) singles[single++] = r;
        }
        first = end;
    }
    *num_singles = single;
    return runs;
}

#if defined(__AVX512F__)
#include <immintrin.h>

#define LANES 16
#define MAX_DIM 128
#define NEG (-1e30f)   /* a masked score: finite, since -ffast-math assumes no infinities */

/* A tile computes a row with other arithmetic than the decode kernel (an online softmax over
 * blocks of sixteen keys, against two passes over the row's scores), so with tiles on a token's
 * attention depends on whether its prompt chunk, prefix-cache hit or speculative check left it
 * in a run of MIN_RUN rows: the same prompt could answer differently batched than alone. Off
 * unless paged_set_tiled_prefill(1): kernels/build.py calls it as it loads a library with this
 * file, from DUOSERVE_TILED_PREFILL (duoserve/envs.py). */
static int tiled_prefill = 0;

void paged_set_tiled_prefill(int on) { tiled_prefill = on; }

static int tiles_on(void) { return tiled_prefill; }

int paged_prefill_supported(int head_dim, int is_bf16) {
#if !defined(__AVX512BF16__)
    if (is_bf16) return 0;
#endif
    return (head_dim == 64 || head_dim == 128) && tiles_on();
}

/* 2^x for x <= 0: x = n + f with |f| <= 1/2, 2^f by its Taylor polynomial (relative error
 * below 2e-8), scaled by 2^n; anything under -126 gives ~0 (the caller masks what must be 0). */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5252734e-5f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-4f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One tile's rows: lane l is row row0 + l of the (token, query head) pairs of one KV head of a
 * run (the last row repeated where the tile is short); their lengths and where their q and
 * output rows are. */
struct tile {
    const float *q[LANES];
    float *out[LANES];
    int lens[LANES];
    int rows, max_len;
};

static void tile_rows(struct tile *t, const float *q, float *out, int first_len, int row0, int rows, int group,
                      int kv_head, int num_heads, int head_dim) {
    t->rows = rows;
    for (int l = 0; l < LANES; l++) {
        int r = row0 + (l < rows ? l : rows - 1);
        int token = r / group, head = kv_head * group + r % group;
        int64_t at = ((int64_t)token * num_heads + head) * head_dim;
        t->q[l] = q + at;
        t->out[l] = out + at;
        t->lens[l] = first_len + token;
    }
    t->max_len = t->lens[LANES - 1];
}

/* Scores s[16] (lanes: rows) of keys j0..j0+15 -> their probabilities under the running max m
 * and sum l of each row; returns the factor that rescales what was summed before. */
static inline __m512 online_softmax(__m512 *s, int j0, __m512i lens, float scale_log2, __m512 *m, __m512 *l) {
    __mmask16 visible[LANES];
    __m512 scale = _mm512_set1_ps(scale_log2), neg = _mm512_set1_ps(NEG), top = *m;
    for (int j = 0; j < LANES; j++) {
        visible[j] = _mm512_cmplt_epi32_mask(_mm512_set1_epi32(j0 + j), lens);
        s[j] = _mm512_mask_mul_ps(neg, visible[j], s[j], scale);
        top = _mm512_max_ps(top, s[j]);
    }
    __m512 alpha = exp2_ps(_mm512_sub_ps(*m, top)), sum = _mm512_setzero_ps();
    for (int j = 0; j < LANES; j++) {
        s[j] = _mm512_maskz_mov_ps(visible[j], exp2_ps(_mm512_sub_ps(s[j], top)));
        sum = _mm512_add_ps(sum, s[j]);
    }
    *l = _mm512_fmadd_ps(*l, alpha, sum);
    *m = top;
    return alpha;
}

/* ot [head_dim][16] (lanes: rows) divided by each row's sum, to the rows' outputs */
static void store_rows(const struct tile *t, float *ot, __m512 l, int head_dim) {
    __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    for (int d = 0; d < head_dim; d++)
        _mm512_storeu_ps(ot + d * LANES, _mm512_mul_ps(_mm512_loadu_ps(ot + d * LANES), inv));
    for (int l = 0; l < t->rows; l++)
        for (int d = 0; d < head_dim; d++) t->out[l][d] = ot[d * LANES + l];
}

/* element index of key j's row of KV head h */
static inline int64_t key_row(const int64_t *table, int j, int block_size, int num_kv_heads, int h, int head_dim) {
    int64_t slot = table[j / block_size] * block_size + j % block_size;
    return (slot * num_kv_heads + h) * head_dim;
}

/* The 16 keys' (or values') rows of j0.. (rows past the tile's last key repeat its first: their
 * probabilities are 0) copied side by side: buf[j * row_elems + ...]. */
static inline void gather_rows(const void *cache, int elem_bytes, const int64_t *table, int j0, int count,
                               int block_size, int num_kv_heads, int h, int head_dim, char *buf) {
    size_t bytes = (size_t)head_dim * elem_bytes;
    for (int j = 0; j < LANES; j++) {
        int64_t at = key_row(table, j0 + (j < count ? j : 0), block_size, num_kv_heads, h, head_dim);
        memcpy(buf + j * bytes, (const char *)cache + at * elem_bytes, bytes);
    }
}

/* A float32 tile: N16 vectors of 16 per head row (constant where inlined, so the loops unroll) */
static inline void tile_f32(const struct tile *t, const float *k_cache, const float *v_cache, const int64_t *table,
                            int block_size, int num_kv_heads, int h, float scale_log2, const int N16) {
    const int D = 16 * N16;
    float qt[MAX_DIM * LANES], ot[MAX_DIM * LANES], kv[LANES * MAX_DIM];
    for (int l = 0; l < LANES; l++)
        for (int d = 0; d < D; d++) qt[d * LANES + l] = t->q[l][d];
    memset(ot, 0, sizeof(float) * D * LANES);
    __m512i lens = _mm512_loadu_si512(t->lens);
    __m512 m = _mm512_set1_ps(NEG), l = _mm512_setzero_ps(), s[LANES];
    for (int j0 = 0; j0 < t->max_len; j0 += LANES) {
        int count = t->max_len - j0 < LANES ? t->max_len - j0 : LANES;
        gather_rows(k_cache, 4, table, j0, count, block_size, num_kv_heads, h, D, (char *)kv);
        for (int j = 0; j < LANES; j++) s[j] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            __m512 qd = _mm512_loadu_ps(qt + d * LANES);
            for (int j = 0; j < LANES; j++) s[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kv[j * D + d]), s[j]);
        }
        __m512 alpha = online_softmax(s, j0, lens, scale_log2, &m, &l);
        gather_rows(v_cache, 4, table, j0, count, block_size, num_kv_heads, h, D, (char *)kv);
        for (int d = 0; d < D; d++) {
            __m512 o = _mm512_mul_ps(_mm512_loadu_ps(ot + d * LANES), alpha);
            for (int j = 0; j < LANES; j++) o = _mm512_fmadd_ps(s[j], _mm512_set1_ps(kv[j * D + d]), o);
            _mm512_storeu_ps(ot + d * LANES, o);
        }
    }
    store_rows(t, ot, l, D);
}

#if defined(__AVX512BF16__)
/* A bfloat16 tile: q and probabilities as bf16 pairs, each dot product two bf16 products a lane.
 * Its loop is tile_f32's with other arithmetic; one function branching on a constant dtype
 * measured slower than the two apart (BENCHMARKS.md, "Figures that were comments"), so they
 * stay apart. */
static inline void tile_bf16(const struct tile *t, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *table, int block_size, int num_kv_heads, int h, float scale_log2,
                             const int N16) {
    const int D = 16 * N16, PAIRS = D / 2;
    /* qt[p][lane]: the lane's q[2p], q[2p+1]; vp[k][d]: values 2k and 2k+1 of dim d */
    uint32_t qt[MAX_DIM / 2 * LANES], kb[LANES * MAX_DIM / 2], vp[LANES / 2 * MAX_DIM];
    uint16_t vb[LANES * MAX_DIM];
    float ot[MAX_DIM * LANES];
    for (int l = 0; l < LANES; l++)
        for (int p = 0; p < PAIRS; p++)
            qt[p * LANES + l] = f32_to_bf16(t->q[l][2 * p]) | (uint32_t)f32_to_bf16(t->q[l][2 * p + 1]) << 16;
    memset(ot, 0, sizeof(float) * D * LANES);
    /* dst[2i] = x[i], dst[2i + 1] = x[16 + i]: two vectors of 16 bf16 interleaved into pairs */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i lens = _mm512_loadu_si512(t->lens);
    __m512 m = _mm512_set1_ps(NEG), l = _mm512_setzero_ps(), s[LANES];
    for (int j0 = 0; j0 < t->max_len; j0 += LANES) {
        int count = t->max_len - j0 < LANES ? t->max_len - j0 : LANES;
        gather_rows(k_cache, 2, table, j0, count, block_size, num_kv_heads, h, D, (char *)kb);
        for (int j = 0; j < LANES; j++) s[j] = _mm512_setzero_ps();
        for (int p = 0; p < PAIRS; p++) {
            __m512bh qp = (__m512bh)_mm512_loadu_si512(qt + p * LANES);
            for (int j = 0; j < LANES; j++)
                s[j] = _mm512_dpbf16_ps(s[j], qp, (__m512bh)_mm512_set1_epi32((int)kb[j * PAIRS + p]));
        }
        __m512 alpha = online_softmax(s, j0, lens, scale_log2, &m, &l);
        gather_rows(v_cache, 2, table, j0, count, block_size, num_kv_heads, h, D, (char *)vb);
        for (int k = 0; k < LANES / 2; k++)
            for (int c = 0; c < N16; c++) {
                __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vb + 2 * k * D + 16 * c)));
                __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vb + (2 * k + 1) * D + 16 * c)));
                _mm512_storeu_si512(vp + k * D + 16 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        __m512bh pp[LANES / 2];
        for (int k = 0; k < LANES / 2; k++)
            pp[k] = (__m512bh)_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(s[2 * k + 1], s[2 * k]));
        for (int d = 0; d < D; d++) {
            __m512 o = _mm512_mul_ps(_mm512_loadu_ps(ot + d * LANES), alpha);
            for (int k = 0; k < LANES / 2; k++)
                o = _mm512_dpbf16_ps(o, pp[k], (__m512bh)_mm512_set1_epi32((int)vp[k * D + d]));
            _mm512_storeu_ps(ot + d * LANES, o);
        }
    }
    store_rows(t, ot, l, D);
}
#endif

static void run_tile(const struct tile *t, const void *k_cache, const void *v_cache, int is_bf16,
                     const int64_t *table, int block_size, int num_kv_heads, int h, int head_dim, float scale_log2) {
#if defined(__AVX512BF16__)
    if (is_bf16) {
        if (head_dim == 64) tile_bf16(t, k_cache, v_cache, table, block_size, num_kv_heads, h, scale_log2, 4);
        else tile_bf16(t, k_cache, v_cache, table, block_size, num_kv_heads, h, scale_log2, 8);
        return;
    }
#endif
    if (head_dim == 64) tile_f32(t, k_cache, v_cache, table, block_size, num_kv_heads, h, scale_log2, 4);
    else tile_f32(t, k_cache, v_cache, table, block_size, num_kv_heads, h, scale_log2, 8);
}

/* The runs of one call, shared by the threads of the enclosing parallel region (orphaned
 * worksharing ending in its barrier). Run r: rows run_first[r].. of q and out
 * ([rows, num_heads, head_dim] float32), over the block table of its last row. Only for a
 * head size and cache dtype paged_prefill_supported() accepts. */
void paged_prefill_team(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                        const int64_t *block_tables, const int64_t *seq_lens, float *out, const int *run_first,
                        const int *run_count, int num_runs, int num_heads, int num_kv_heads, int head_dim,
                        int block_size, int max_blocks, float scale) {
    int group = num_heads / num_kv_heads, items = 0;
    for (int r = 0; r < num_runs; r++) items += num_kv_heads * ((run_count[r] * group + LANES - 1) / LANES);
    float scale_log2 = scale * 1.44269504f;   /* scores in base 2 */
    #pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items; item++) {
        int r = 0, i = item, tiles;
        for (;; r++) {
            tiles = (run_count[r] * group + LANES - 1) / LANES;
            if (i < num_kv_heads * tiles) break;
            i -= num_kv_heads * tiles;
        }
        int tile = tiles - 1 - i / num_kv_heads, h = i % num_kv_heads;   /* a run's longest contexts first */
        int first = run_first[r], rows = run_count[r] * group - tile * LANES;
        int64_t at = (int64_t)first * num_heads * head_dim;
        struct tile t;
        tile_rows(&t, q + at, out + at, (int)seq_lens[first], tile * LANES, rows < LANES ? rows : LANES, group, h,
                  num_heads, head_dim);
        const int64_t *table = block_tables + (int64_t)(first + run_count[r] - 1) * max_blocks;
        run_tile(&t, k_cache, v_cache, is_bf16, table, block_size, num_kv_heads, h, head_dim, scale_log2);
    }
}
#else
int paged_prefill_supported(int head_dim, int is_bf16) { return 0; }

void paged_set_tiled_prefill(int on) { (void)on; }

void paged_prefill_team(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                        const int64_t *block_tables, const int64_t *seq_lens, float *out, const int *run_first,
                        const int *run_count, int num_runs, int num_heads, int num_kv_heads, int head_dim,
                        int block_size, int max_blocks, float scale) {}
#endif
