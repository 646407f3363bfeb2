/* What decode_step.c computes over (a model handed over once: cpu_ops.cpp's decode_model and
 * decode_model_moe fill these) and its entry point, for both files. */
#ifndef DUOSERVE_DECODE_STEP_H
#define DUOSERVE_DECODE_STEP_H

#include <stdint.h>

#define MAX_RUNS 4         /* block runs of a projection (fused_decode.py refuses more) */

#ifdef __cplusplus
extern "C" {
#endif

/* a projection: packed weights, or runs of GGUF blocks whose outputs sit side by side (a fused
 * projection of parts of different block types) */
struct decode_linear {
    const void *packed;                   /* packed_linear.c's layout, or NULL for blocks */
    const uint8_t *blocks[MAX_RUNS];      /* [rows[r], bytes per row] each */
    int types[MAX_RUNS], rows[MAX_RUNS];  /* gguf_blocks.h's type ids */
    int num_runs, exact;                  /* exact: gguf_linear_exact's arithmetic, else fast */
};

/* a mixture of experts' MLP (SparseMoE): its router, each expert's gate_up and down, and Qwen2-MoE's
 * shared expert with its one-value gate (shared_inter 0: none) */
struct decode_moe {
    struct decode_linear router, shared_gate_up, shared_down, shared_gate;
    const struct decode_linear *gate_up, *down;   /* [num_experts] each */
    int num_experts, top_k, renormalize, inter, shared_inter;
    int64_t *expert_tokens;                       /* [num_experts]: tokens each has served (SparseMoE's) */
};

struct decode_layer {
    const void *input_norm, *post_norm;                    /* [hidden]: before attention, before the MLP */
    const void *attn_out_norm, *mlp_out_norm;              /* [hidden] (Gemma's sandwich) or NULL */
    const void *q_norm, *k_norm;                           /* [head_dim] (Qwen3, Gemma 3) or NULL */
    struct decode_linear qkv, o_proj, gate_up, down;
    const void *qkv_bias;                                  /* [q + 2 kv] or NULL */
    void *k_cache, *v_cache;                               /* [slots, num_kv_heads, head_dim] */
    float scale, cap;                                      /* cap: the scores' soft cap, or 0 */
    int window, local;                                     /* window: keys seen, or 0; local: its rope table */
    const struct decode_moe *moe;                          /* a routed MLP in place of gate_up and down, or NULL */
};

struct decode_shape {
    int hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, is_bf16;
    float eps;
    int embed_type;        /* the embedding's GGUF block type, or -1: packed as a linear weight */
    int gemma;             /* Gemma's norms, MLP and scaled embedding */
    float embed_scale;     /* Gemma's sqrt(hidden), in the model dtype */
};

int decode_step(const struct decode_layer *layers, int num_layers, const void *final_norm,
                const struct decode_shape *s, const float *const *cos_tables, const float *const *sin_tables,
                const void *embedding, const int64_t *ids, void *x, void *out,
                const int64_t *positions, const int64_t *slots, const int64_t *block_tables,
                const int64_t *seq_lens, int m, int max_blocks, int num_threads, const int64_t *row_adapter,
                const int64_t *lora_tables);   /* LoRA rows (lora.h), or NULLs */

#ifdef __cplusplus
}
#endif

#endif
