/* The small ops of glue.c, called by decode_step.c and cpu_ops.cpp alike (see glue.c). */
#ifndef DUOSERVE_GLUE_H
#define DUOSERVE_GLUE_H

#include <stdint.h>

#define GLUE_CHUNK 64   /* silu_mul's columns per call: every path splits a row the same way */
#define GLUE_MAX_EXPERTS 512   /* a router's outputs at most (moe_route refuses more) */

#ifdef __cplusplus
extern "C" {
#endif
void glue_add_norm_row(void *x, const void *add, const void *weight, void *out, int n, float eps, int bf);
void glue_rotate_head(const void *x, const float *cos, const float *sin, void *out, int d, int bf);
void glue_silu_mul_chunk(const void *gate_up_row, void *act_row, int inter, int c, int bf);
void glue_offset_norm_row(const void *x, const void *weight, void *out, int n, float eps, int bf);
void glue_gelu_tanh_mul_chunk(const void *gate_up_row, void *act_row, int inter, int c, int bf);
void glue_moe_route_row(const void *logits, int num_experts, int top_k, int renormalize, int bf, int64_t *chosen,
                        void *weights);
void glue_expert_add_row(void *out, const void *y, float weight, int n, int bf);
void glue_shared_expert_add_row(void *out, const void *gate, const void *shared, int n, int bf);
#ifdef __cplusplus
}
#endif

#endif
