/* The small ops between a layer's linears, one row (or one head, one chunk) at a time: RMSNorm
 * with the residual add before it, rotary, SiLU * up.
 *
 * Both the ops duoserve::rms_norm, duoserve::rotary and duoserve::silu_mul (cpu_ops.cpp; what
 * eager and compiled steps call) and the C++ decode step (decode_step.c) call these functions, and
 * with the same boundaries (a whole row of a norm, a whole head of rotary, the same 64-column
 * chunks of SiLU): one compiled copy of each loop, so a row computes to the same bits on every
 * path whatever the compiler does with -ffast-math (its sum order, its vector exp). Where the
 * activations are quantized (GGUF fast mode) a moved last bit can move a rounding, then a token;
 * this is what lets a GGUF model's decode steps run in decode_step.c.
 *
 * The arithmetic is the model's (model/layers.py): a norm in float32, its result rounded to the
 * model dtype before its weight is applied, as RMSNorm does (Gemma's: times 1 + weight in float32,
 * rounded once); rotate-half with cos/sin rounded to the model dtype, as eager does; SiLU * up
 * rounded once; Gemma's tanh-GELU rounded, then times up. In float32 every rounding is none.
 * A mixture of experts' routing (softmax, top-k) and the adds of its experts' outputs are here
 * too, for the same reason: which experts a token takes must not depend on the path.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "glue.h"

static inline float load(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int bf) {
    if (bf) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

static inline float rounded(float v, int bf) { return bf ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* x += add (unless add is NULL, stored in the model dtype), then out = RMSNorm(x) * weight; a row of n */
void glue_add_norm_row(void *x, const void *add, const void *weight, void *out, int n, float eps, int bf) {
    if (add)
        for (int i = 0; i < n; i++) store(x, i, load(x, i, bf) + load(add, i, bf), bf);
    float sum = 0.f;
    for (int i = 0; i < n; i++) {
        const float v = load(x, i, bf);
        sum += v * v;
    }
    const float r = 1.f / sqrtf(sum / (float)n + eps);
    for (int i = 0; i < n; i++) store(out, i, rounded(load(x, i, bf) * r, bf) * load(weight, i, bf), bf);
}

/* out = x * cos + swap_halves(x) * sin over one head of d (sin's first half negated, as
 * RotaryEmbedding keeps it); cos and sin in float32, rounded to the model dtype here */
void glue_rotate_head(const void *x, const float *cos, const float *sin, void *out, int d, int bf) {
    const int half = d / 2;
    for (int i = 0; i < d; i++) {
        const float swapped = load(x, i < half ? i + half : i - half, bf);
        store(out, i, load(x, i, bf) * rounded(cos[i], bf) + swapped * rounded(sin[i], bf), bf);
    }
}

/* act[lo:hi] = SiLU(gate[lo:hi]) * up[lo:hi] for chunk c (lo = 64 c) of one row: gate_up_row holds
 * gate then up, inter columns each */
void glue_silu_mul_chunk(const void *gate_up_row, void *act_row, int inter, int c, int bf) {
    const int lo = c * GLUE_CHUNK, hi = lo + GLUE_CHUNK < inter ? lo + GLUE_CHUNK : inter;
    float g[GLUE_CHUNK], u[GLUE_CHUNK];
    for (int i = lo; i < hi; i++) {
        g[i - lo] = load(gate_up_row, i, bf);
        u[i - lo] = load(gate_up_row, inter + i, bf);
    }
    for (int i = 0; i < hi - lo; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    for (int i = lo; i < hi; i++) store(act_row, i, g[i - lo], bf);
}

/* out = RMSNorm(x) * (1 + weight), in float32, rounded once to the model dtype (Gemma's norm) */
void glue_offset_norm_row(const void *x, const void *weight, void *out, int n, float eps, int bf) {
    float sum = 0.f;
    for (int i = 0; i < n; i++) {
        const float v = load(x, i, bf);
        sum += v * v;
    }
    const float r = 1.f / sqrtf(sum / (float)n + eps);
    for (int i = 0; i < n; i++) store(out, i, load(x, i, bf) * r * (1.f + load(weight, i, bf)), bf);
}

/* act[lo:hi] = gelu_tanh(gate[lo:hi]) * up[lo:hi] for chunk c of one row (Gemma's MLP), the GELU
 * rounded to the model dtype before the product, as the eager ops round it */
void glue_gelu_tanh_mul_chunk(const void *gate_up_row, void *act_row, int inter, int c, int bf) {
    const int lo = c * GLUE_CHUNK, hi = lo + GLUE_CHUNK < inter ? lo + GLUE_CHUNK : inter;
    for (int i = lo; i < hi; i++) {
        const float g = load(gate_up_row, i, bf);
        const float gelu = 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
        store(act_row, i, rounded(gelu, bf) * load(gate_up_row, inter + i, bf), bf);
    }
}

/* A token's experts (a mixture of experts' routing, SparseMoE.route): the softmax of its router
 * logits in float32, the top_k largest (the lower index first among equals) with their
 * probabilities, divided by their sum where renormalize, stored in the model dtype. */
void glue_moe_route_row(const void *logits, int num_experts, int top_k, int renormalize, int bf, int64_t *chosen,
                        void *weights) {
    float probs[GLUE_MAX_EXPERTS], top[GLUE_MAX_EXPERTS], max = -INFINITY, sum = 0.f;
    for (int e = 0; e < num_experts; e++) {
        probs[e] = load(logits, e, bf);
        if (probs[e] > max) max = probs[e];
    }
    for (int e = 0; e < num_experts; e++) sum += probs[e] = expf(probs[e] - max);
    for (int e = 0; e < num_experts; e++) probs[e] /= sum;
    float kept = 0.f;
    char taken[GLUE_MAX_EXPERTS] = {0};
    for (int j = 0; j < top_k; j++) {
        int best = -1;   /* the first untaken one at least: NaN logits still give an expert in range */
        for (int e = 0; e < num_experts; e++)
            if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
        chosen[j] = best;
        top[j] = probs[best];
        kept += top[j];
        taken[best] = 1;
    }
    for (int j = 0; j < top_k; j++) store(weights, j, renormalize ? top[j] / kept : top[j], bf);
}

/* out += rounded(y * weight), a row of n: one chosen expert's output added to its token's MLP
 * output as SparseMoE does it (the product rounded to the model dtype, then the sum) */
void glue_expert_add_row(void *out, const void *y, float weight, int n, int bf) {
    for (int i = 0; i < n; i++) {
        volatile float product = rounded(load(y, i, bf) * weight, bf);   /* volatile: never fused into an FMA */
        store(out, i, load(out, i, bf) + product, bf);
    }
}

/* out += sigmoid(gate) * shared, a row of n: Qwen2-MoE's shared expert behind its one-value gate,
 * the sigmoid, the product and the sum each rounded to the model dtype */
void glue_shared_expert_add_row(void *out, const void *gate, const void *shared, int n, int bf) {
    const float g = rounded(1.f / (1.f + expf(-load(gate, 0, bf))), bf);
    for (int i = 0; i < n; i++) {
        volatile float product = rounded(g * load(shared, i, bf), bf);
        store(out, i, load(out, i, bf) + product, bf);
    }
}
