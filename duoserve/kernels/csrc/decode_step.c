/* A whole decode step of a Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3) or of
 * Gemma 2 and 3, over packed weights or GGUF blocks, in one OpenMP parallel region: one new token
 * for each of a batch of sequences.
 *
 * What it replaces is not arithmetic but the time between kernels. At one sequence the compiled
 * step (Inductor's graph calling duoserve::packed_linear and duoserve::paged_attention) spends
 * ~1 ms a step outside its weights: ~150 op calls through the dispatcher, their output tensors
 * allocated and freed, the graph's small kernels each forking the threads, all on the main
 * thread while the other waits. Here the threads stay in one region and meet at barriers (~0.2 us
 * each, ten a layer): the linear layers are packed_linear.c's blocks shared out as before, or
 * gguf_linear.c's team entries over the file's blocks (a fused projection whose parts have
 * different block types computed part by part into its columns), the attention is
 * paged_decode.c's kernel, and the glue between them (RMSNorm, rotary, the new K/V written to
 * their slots, residual adds, SiLU * up; Qwen3's q/k norms) is glue.c's functions, the same the
 * ops of eager and compiled steps call, so a row computes to the same bits on either path.
 *
 * Gemma (shape.gemma) differs as gemma.py does: its embedding rows times sqrt(hidden) (rounded to
 * the model dtype first), every norm times (1 + weight), four to a layer (the attention's and the
 * MLP's outputs normed before their residual adds), tanh-GELU * up, and local layers with their
 * own rope table and a sliding window; Gemma 2 soft-caps the scores. The window and the cap are
 * paged_decode.c's, the kernel every other path's windowed layers run.
 *
 * The arithmetic is the model's (llama.py, layers.py), in float32 within each step of a layer; in
 * bfloat16 each step's result is stored in bfloat16 as the model stores it: a norm (its float32
 * result rounded before its weight is applied, as RMSNorm does), a projection, rotary (cos/sin
 * rounded to the model dtype, as eager does) and SiLU * up (each rounded once, as the compiled
 * graph does), a residual add. Float32 models are float32 throughout. A GGUF projection is
 * gguf_linear's output in the model dtype, then its bias added and rounded again, as
 * GGUFLinear computes `y + bias`; a GGUF embedding's rows are dequantized as GGUFEmbedding's.
 *
 * Caller (csrc/cpu_ops.cpp): ids [m] the new tokens (checked against the vocabulary); x [m, hidden]
 * scratch for the residual stream; out [m, hidden] the final norm's output; all activations in
 * the model dtype, weights packed (packed_linear.c) in it or GGUF blocks, caches
 * [slots, num_kv_heads, head_dim] in it; positions and slots checked; cos_tables and sin_tables
 * [2] the rotary tables of global (0) and local (1) layers, float32 [positions, head_dim] each.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "decode_step.h"
#include "glue.h"
#include "gguf_team.h"
#include "lora.h"

#define MAX_HEAD_DIM 512   /* decode_step() refuses larger heads */

void packed_linear_team(const void *x, const void *packed, const void *bias, void *y, int is_bf16, int m, int n,
                        int k);
int packed_linear_supported(int is_bf16);
void paged_decode_team(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                       const int64_t *block_tables, const int64_t *seq_lens, float *out, const int *rows,
                       int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                       float scale, int window, float cap, int num_threads, int *failed);

static inline float load(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int bf) {
    if (bf) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* every row of x (rows shared by the threads): x += add (unless add is NULL), then
 * out = RMSNorm(x) * weight */
static void add_norm_rows(void *x, const void *add, const void *weight, void *out, int m, int n, float eps, int bf) {
    const int64_t row = (int64_t)n * (bf ? 2 : 4);
    #pragma omp for schedule(static)
    for (int t = 0; t < m; t++)
        glue_add_norm_row((char *)x + t * row, add ? (const char *)add + t * row : NULL, weight,
                          (char *)out + t * row, n, eps, bf);
}

/* Gemma: every row of x (rows shared by the threads): x += add normed by add_norm (unless add is
 * NULL; normed into out, then added in the model dtype), then out = its norm times (1 + weight) */
static void gemma_add_norm_rows(void *x, const void *add, const void *add_norm, const void *weight, void *out, int m,
                                int n, float eps, int bf) {
    const int64_t row = (int64_t)n * (bf ? 2 : 4);
    #pragma omp for schedule(static)
    for (int t = 0; t < m; t++) {
        void *xt = (char *)x + t * row, *ot = (char *)out + t * row;
        if (add) {
            glue_offset_norm_row((const char *)add + t * row, add_norm, ot, n, eps, bf);
            for (int i = 0; i < n; i++) store(xt, i, load(xt, i, bf) + load(ot, i, bf), bf);
        }
        glue_offset_norm_row(xt, weight, ot, n, eps, bf);
    }
}

/* x += add normed (Gemma's sandwich), then out = the next norm of x: Llama's or Gemma's */
static void residual_norm(void *x, const void *add, const void *add_norm, const void *weight, void *out, int m,
                          const struct decode_shape *s) {
    if (s->gemma) gemma_add_norm_rows(x, add, add_norm, weight, out, m, s->hidden, s->eps, s->is_bf16);
    else add_norm_rows(x, add, weight, out, m, s->hidden, s->eps, s->is_bf16);
}

/* each row's query and key heads normed (Qwen3's q/k norms, where the layer has them) and rotated,
 * as the ops do it in eager steps (glue.c), queries to q [m, num_heads, head_dim] float32, keys and
 * values to their cache slots */
static void rotate_and_store(const void *qkv, const int64_t *positions, const float *cos_table,
                             const float *sin_table, const int64_t *slots, const struct decode_layer *layer,
                             const struct decode_shape *s, float *q, int m) {
    const int bf = s->is_bf16, d = s->head_dim, elem = bf ? 2 : 4;
    const int heads = s->num_heads + s->num_kv_heads, width = (heads + s->num_kv_heads) * d;
    const int64_t kv_width = (int64_t)s->num_kv_heads * d;
    #pragma omp for schedule(static) collapse(2)
    for (int t = 0; t < m; t++)
        for (int h = 0; h < heads; h++) {
            const float *cos = cos_table + positions[t] * d, *sin = sin_table + positions[t] * d;
            const char *src = (const char *)qkv + ((int64_t)t * width + (int64_t)h * d) * elem;
            const int is_key = h >= s->num_heads;
            const void *norm = is_key ? layer->k_norm : layer->q_norm;
            float normed[MAX_HEAD_DIM], rotated[MAX_HEAD_DIM];   /* room for d values of either dtype */
            if (norm && s->gemma) {
                glue_offset_norm_row(src, norm, normed, d, s->eps, bf);
                src = (const char *)normed;
            } else if (norm) {   /* (x is written only where there is an add) */
                glue_add_norm_row((void *)src, NULL, norm, normed, d, s->eps, bf);
                src = (const char *)normed;
            }
            if (is_key) {
                const int64_t dst = slots[t] * kv_width + (int64_t)(h - s->num_heads) * d;
                glue_rotate_head(src, cos, sin, (char *)layer->k_cache + dst * elem, d, bf);
                /* the value head beside this key head, unrotated */
                const int64_t v_src = (int64_t)t * width + (int64_t)(heads + h - s->num_heads) * d;
                memcpy((char *)layer->v_cache + dst * elem, (const char *)qkv + v_src * elem, (size_t)d * elem);
            } else {
                glue_rotate_head(src, cos, sin, rotated, d, bf);
                float *dst = q + ((int64_t)t * s->num_heads + h) * d;
                for (int i = 0; i < d; i++) dst[i] = load(rotated, i, bf);
            }
        }
}

/* act [m, inter] = SiLU(gate) * up (Gemma: tanh-GELU(gate) * up), from gate_up [m, 2 * inter];
 * chunks of columns shared by the threads */
static void gate_mul(const void *gate_up, void *act, int m, int inter, int bf, int gelu) {
    const int chunks = (inter + GLUE_CHUNK - 1) / GLUE_CHUNK, elem = bf ? 2 : 4;
    void (*chunk)(const void *, void *, int, int, int) = gelu ? glue_gelu_tanh_mul_chunk : glue_silu_mul_chunk;
    #pragma omp for schedule(static) collapse(2)
    for (int t = 0; t < m; t++)
        for (int c = 0; c < chunks; c++)
            chunk((const char *)gate_up + (int64_t)t * 2 * inter * elem, (char *)act + (int64_t)t * inter * elem,
                  inter, c, bf);
}

/* Gemma: x [m, hidden] *= its embedding scale, in the model dtype */
static void scale_rows(void *x, float scale, int m, int hidden, int bf) {
    #pragma omp for schedule(static)
    for (int t = 0; t < m; t++)
        for (int i = 0; i < hidden; i++)
            store(x, (int64_t)t * hidden + i, load(x, (int64_t)t * hidden + i, bf) * scale, bf);
}

/* y [m, n] = x [m, k] @ w^T (+ bias), shared by the team. From blocks: x's rows converted and
 * quantized once for every run, each run's output into its columns, then the bias added to the
 * stored output (GGUFLinear's `y + bias`: a second rounding in bfloat16). */
static void linear_team(const struct decode_linear *w, const void *bias, const void *x, void *y, int m, int n, int k,
                        int bf, const struct gguf_rows *rows, int *failed) {
    if (w->packed) {
        packed_linear_team(x, w->packed, bias, y, bf, m, n, k);
        return;
    }
    int super = 0;   /* x per super-block too where a run's type takes it */
    for (int r = 0; r < w->num_runs; r++) super |= gguf_takes_superblock_rows(w->types[r]);
    gguf_rows_team(x, bf, m, k, w->exact, super, rows);
    for (int r = 0, col = 0; r < w->num_runs; col += w->rows[r], r++)
        gguf_matmul_team(rows, x, bf, w->exact, w->blocks[r], w->types[r], m, w->rows[r], k, y, n, col, failed);
    if (bias) {
        #pragma omp for schedule(static)
        for (int t = 0; t < m; t++)
            for (int i = 0; i < n; i++)
                store(y, (int64_t)t * n + i, load(y, (int64_t)t * n + i, bf) + load(bias, i, bf), bf);
    }
}

/* x [m, hidden] = the embedding rows of ids, read from the table's packed copy (packed_linear.c's
 * layout: row id in block id / 48, column id % 48, its values 48 apart, in pairs for bfloat16), as
 * PackedEmbedding reads them */
static void embed_rows(const int64_t *ids, const void *packed, int bf, int hidden, void *x, int m) {
    #pragma omp for schedule(static)
    for (int t = 0; t < m; t++) {
        const int64_t block = ids[t] / 48, column = ids[t] % 48;
        if (bf) {
            const uint16_t *src = (const uint16_t *)packed + block * 48 * hidden;
            uint16_t *row = (uint16_t *)x + (int64_t)t * hidden;
            for (int i = 0; i < hidden; i++) row[i] = src[((int64_t)(i / 2) * 48 + column) * 2 + i % 2];
        } else {
            const float *src = (const float *)packed + block * 48 * hidden;
            float *row = (float *)x + (int64_t)t * hidden;
            for (int i = 0; i < hidden; i++) row[i] = src[(int64_t)i * 48 + column];
        }
    }
}

/* x [m, hidden] = the embedding rows of ids dequantized from GGUF blocks, as GGUFEmbedding (the
 * rows of a tied head's interleaved blocks too) */
static void embed_block_rows(const int64_t *ids, const uint8_t *blocks, const struct decode_shape *s, void *x, int m,
                             int *failed) {
    const int elem = s->is_bf16 ? 2 : 4;
    #pragma omp for schedule(static)
    for (int t = 0; t < m; t++)
        if (gguf_dequantize_row_of(s->embed_type, blocks, ids[t], s->hidden, (char *)x + (int64_t)t * s->hidden * elem,
                                   s->is_bf16) != 0) {
            #pragma omp atomic write
            *failed = 1;
        }
}

/* scratch of the routed MLPs of a step of m rows */
struct moe_scratch {
    void *logits, *weights, *x, *gate_up, *act, *y, *shared_gate_up, *shared_act, *shared_y, *gate;
    int64_t *chosen;
    int *picks, *counts, *offsets;
};

/* the largest routed MLP of the model: experts, top k, expert and shared expert widths (0s: none) */
struct moe_dims {
    int experts, k, inter, shared;
};

static struct moe_dims largest_moe(const struct decode_layer *layers, int num_layers) {
    struct moe_dims d = {0, 0, 0, 0};
    for (int l = 0; l < num_layers; l++) {
        const struct decode_moe *e = layers[l].moe;
        if (!e) continue;
        if (e->num_experts > d.experts) d.experts = e->num_experts;
        if (e->top_k > d.k) d.k = e->top_k;
        if (e->inter > d.inter) d.inter = e->inter;
        if (e->shared_inter > d.shared) d.shared = e->shared_inter;
    }
    return d;
}

/* moe_scratch's pieces for m rows from `at` (at == NULL: only their size); returns the bytes */
static size_t moe_scratch_take(char *at, struct moe_dims d, int m, int hidden, int elem, struct moe_scratch *w) {
    if (!d.experts) return 0;
    const size_t sizes[14] = {(size_t)m * d.experts * elem, (size_t)m * d.k * elem, (size_t)m * d.k * 8,
                              (size_t)m * d.k * 4, (size_t)d.experts * 4, (size_t)d.experts * 4,
                              (size_t)m * hidden * elem, (size_t)m * 2 * d.inter * elem, (size_t)m * d.inter * elem,
                              (size_t)m * hidden * elem, (size_t)m * 2 * d.shared * elem, (size_t)m * d.shared * elem,
                              (size_t)m * hidden * elem, (size_t)m * elem};
    void **slots[14] = {&w->logits, &w->weights, (void **)&w->chosen, (void **)&w->picks, (void **)&w->counts,
                        (void **)&w->offsets, &w->x, &w->gate_up, &w->act, &w->y, &w->shared_gate_up,
                        &w->shared_act, &w->shared_y, &w->gate};
    size_t total = 0;
    for (int i = 0; i < 14; i++) {
        if (at) *slots[i] = at + total;
        total += (sizes[i] + 63) / 64 * 64;
    }
    return total;
}

/* y [m, hidden] = the routed MLP of x [m, hidden] (SparseMoE.forward): each row's experts chosen
 * (glue.c's routing), the picks grouped by expert in row order, each chosen expert run once over
 * its rows (the others never read) and its weighted output added to them in expert order, then
 * the shared expert behind its gate. Every thread runs this; the routing is one thread's. */
static void moe_mlp(const struct decode_moe *e, const void *x, void *y, int m, const struct decode_shape *s,
                    const struct moe_scratch *w, const struct gguf_rows *rows, int *failed) {
    const int bf = s->is_bf16, elem = bf ? 2 : 4, hidden = s->hidden, k = e->top_k, inter = e->inter;
    const int64_t row = (int64_t)hidden * elem;
    linear_team(&e->router, NULL, x, w->logits, m, e->num_experts, hidden, bf, rows, failed);
    #pragma omp single
    {
        for (int t = 0; t < m; t++)
            glue_moe_route_row((const char *)w->logits + (int64_t)t * e->num_experts * elem, e->num_experts, k,
                               e->renormalize, bf, w->chosen + (int64_t)t * k, (char *)w->weights + (int64_t)t * k * elem);
        for (int ex = 0; ex < e->num_experts; ex++) w->counts[ex] = 0;
        for (int p = 0; p < m * k; p++) w->counts[w->chosen[p]]++;
        for (int ex = 0, at = 0; ex < e->num_experts; at += w->counts[ex], ex++) {
            w->offsets[ex] = at;
            e->expert_tokens[ex] += w->counts[ex];
        }
        for (int p = 0; p < m * k; p++) w->picks[w->offsets[w->chosen[p]]++] = p;   /* stable: rows in order */
        for (int ex = 0; ex < e->num_experts; ex++) w->offsets[ex] -= w->counts[ex];
        memset(y, 0, (size_t)m * row);
    }
    for (int ex = 0; ex < e->num_experts; ex++) {
        const int count = w->counts[ex];
        if (count == 0) continue;   /* an expert no row chose is never read */
        const int *picks = w->picks + w->offsets[ex];
        #pragma omp for schedule(static)
        for (int i = 0; i < count; i++) memcpy((char *)w->x + i * row, (const char *)x + (picks[i] / k) * row, row);
        linear_team(&e->gate_up[ex], NULL, w->x, w->gate_up, count, 2 * inter, hidden, bf, rows, failed);
        gate_mul(w->gate_up, w->act, count, inter, bf, 0);
        linear_team(&e->down[ex], NULL, w->act, w->y, count, hidden, inter, bf, rows, failed);
        #pragma omp for schedule(static)
        for (int i = 0; i < count; i++)
            glue_expert_add_row((char *)y + (picks[i] / k) * row, (const char *)w->y + i * row,
                                load(w->weights, picks[i], bf), hidden, bf);
    }
    if (e->shared_inter) {
        linear_team(&e->shared_gate_up, NULL, x, w->shared_gate_up, m, 2 * e->shared_inter, hidden, bf, rows, failed);
        gate_mul(w->shared_gate_up, w->shared_act, m, e->shared_inter, bf, 0);
        linear_team(&e->shared_down, NULL, w->shared_act, w->shared_y, m, hidden, e->shared_inter, bf, rows, failed);
        linear_team(&e->shared_gate, NULL, x, w->gate, m, 1, hidden, bf, rows, failed);
        #pragma omp for schedule(static)
        for (int t = 0; t < m; t++)
            glue_shared_expert_add_row((char *)y + t * row, (const char *)w->gate + (int64_t)t * elem,
                                       (const char *)w->shared_y + t * row, hidden, bf);
    }
}

static int any_packed(const struct decode_layer *layers, int num_layers) {
    for (int l = 0; l < num_layers; l++)
        if (layers[l].qkv.packed || layers[l].o_proj.packed || layers[l].gate_up.packed || layers[l].down.packed ||
            (layers[l].moe && (layers[l].moe->router.packed || layers[l].moe->shared_gate.packed)))
            return 1;
    return 0;
}

/* Returns 0; -1 when this build cannot run packed weights of that dtype; -2 when scratch memory
 * could not be allocated (x and the caches may then hold part of the step). */
int decode_step(const struct decode_layer *layers, int num_layers, const void *final_norm,
                const struct decode_shape *s, const float *const *cos_tables, const float *const *sin_tables,
                const void *embedding, const int64_t *ids, void *x, void *out,
                const int64_t *positions, const int64_t *slots, const int64_t *block_tables,
                const int64_t *seq_lens, int m, int max_blocks, int num_threads, const int64_t *row_adapter,
                const int64_t *lora_tables) {
    const int bf = s->is_bf16, elem = bf ? 2 : 4, hidden = s->hidden, inter = s->intermediate;
    const int q_size = s->num_heads * s->head_dim, qkv_size = q_size + 2 * s->num_kv_heads * s->head_dim;
    if ((any_packed(layers, num_layers) && !packed_linear_supported(bf)) || s->head_dim > MAX_HEAD_DIM) return -1;
    /* x's rows for the block projections: converted and quantized, at most the widest input */
    const struct moe_dims moe_dims = largest_moe(layers, num_layers);
    int widest = hidden > inter ? (hidden > q_size ? hidden : q_size) : (inter > q_size ? inter : q_size);
    if (moe_dims.inter > widest) widest = moe_dims.inter;
    if (moe_dims.shared > widest) widest = moe_dims.shared;
    struct gguf_rows rows;
    if (gguf_rows_alloc(&rows, m, widest, 1, 1) != 0) return -2;
    /* activations: qkv, q and attention out (float32), attention out (model dtype), o / down out,
     * gate_up, act */
    const size_t bytes = (size_t)m * ((size_t)qkv_size * elem + (size_t)q_size * 8 + (size_t)q_size * elem +
                                      (size_t)hidden * elem + (size_t)3 * inter * elem) + 64 * 7 +
                         (row_adapter ? (size_t)m * LORA_MAX_STACKED * 4 : 0);
    struct moe_scratch moe = {0};
    const size_t moe_bytes = moe_scratch_take(NULL, moe_dims, m, hidden, elem, &moe);
    char *scratch = malloc(bytes + moe_bytes);
    if (!scratch) {
        gguf_rows_free(&rows);
        return -2;
    }
    char *at = scratch;
#define TAKE(n) (at += ((size_t)(n) + 63) / 64 * 64, at - ((size_t)(n) + 63) / 64 * 64)
    void *qkv = TAKE((size_t)m * qkv_size * elem);
    float *q = (float *)TAKE((size_t)m * q_size * 4);
    float *attn32 = (float *)TAKE((size_t)m * q_size * 4);
    void *attn = bf ? (void *)TAKE((size_t)m * q_size * elem) : (void *)attn32;
    void *proj = TAKE((size_t)m * hidden * elem);
    void *gate_up = TAKE((size_t)m * 2 * inter * elem);
    void *act = TAKE((size_t)m * inter * elem);
    float *xa = row_adapter ? (float *)TAKE((size_t)m * LORA_MAX_STACKED * 4) : NULL;   /* LoRA rows' A x */
#undef TAKE
    moe_scratch_take(scratch + bytes, moe_dims, m, hidden, elem, &moe);
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        if (s->embed_type >= 0) embed_block_rows(ids, embedding, s, x, m, &failed);
        else embed_rows(ids, embedding, bf, hidden, x, m);
        if (s->gemma) scale_rows(x, s->embed_scale, m, hidden, bf);
        residual_norm(x, NULL, NULL, layers[0].input_norm, out, m, s);  /* out: the normed rows */
        for (int l = 0; l < num_layers; l++) {
            const struct decode_layer *layer = &layers[l];
            linear_team(&layer->qkv, layer->qkv_bias, out, qkv, m, qkv_size, hidden, bf, &rows, &failed);
            if (row_adapter)
                lora_rows_team(row_adapter, lora_tables, l * 4 + 0, out, qkv, m, hidden, qkv_size, bf, xa,
                               LORA_MAX_STACKED);
            rotate_and_store(qkv, positions, cos_tables[layer->local], sin_tables[layer->local], slots, layer, s, q,
                             m);
            paged_decode_team(q, layer->k_cache, layer->v_cache, bf, block_tables, seq_lens, attn32, NULL, m,
                              s->num_heads, s->num_kv_heads, s->head_dim, s->block_size, max_blocks, layer->scale,
                              layer->window, layer->cap, num_threads, &failed);
            if (bf) {
                #pragma omp for schedule(static)
                for (int t = 0; t < m; t++)
                    for (int i = 0; i < q_size; i++)
                        store(attn, (int64_t)t * q_size + i, attn32[(int64_t)t * q_size + i], 1);
            }
            linear_team(&layer->o_proj, NULL, attn, proj, m, hidden, q_size, bf, &rows, &failed);
            if (row_adapter)
                lora_rows_team(row_adapter, lora_tables, l * 4 + 1, attn, proj, m, q_size, hidden, bf, xa,
                               LORA_MAX_STACKED);
            residual_norm(x, proj, layer->attn_out_norm, layer->post_norm, out, m, s);
            if (layer->moe) {
                moe_mlp(layer->moe, out, proj, m, s, &moe, &rows, &failed);
            } else {
                linear_team(&layer->gate_up, NULL, out, gate_up, m, 2 * inter, hidden, bf, &rows, &failed);
                if (row_adapter)
                    lora_rows_team(row_adapter, lora_tables, l * 4 + 2, out, gate_up, m, hidden, 2 * inter, bf, xa,
                                   LORA_MAX_STACKED);
                gate_mul(gate_up, act, m, inter, bf, s->gemma);
                linear_team(&layer->down, NULL, act, proj, m, hidden, inter, bf, &rows, &failed);
                if (row_adapter)
                    lora_rows_team(row_adapter, lora_tables, l * 4 + 3, act, proj, m, inter, hidden, bf, xa,
                                   LORA_MAX_STACKED);
            }
            residual_norm(x, proj, layer->mlp_out_norm, l + 1 < num_layers ? layers[l + 1].input_norm : final_norm,
                          out, m, s);
        }
    }
    free(scratch);
    gguf_rows_free(&rows);
    return failed ? -2 : 0;
}
