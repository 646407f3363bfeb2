// The CPU kernels of the ops duoserve::linear, duoserve::packed_linear, duoserve::gguf_linear,
// duoserve::decode_attention and duoserve::paged_attention in C++, over the C functions of
// small_m_linear.c, packed_linear.c, gguf_linear.c and paged_decode.c.
//
// Each computes what its Python kernel computes (`linear_any_m` in dense.py, `gguf_linear`
// in gguf.py; those are registered by ops.py when this file cannot be built):
// - linear: up to SMALL_M rows with the bandwidth-bound C kernel, more with oneDNN's linear;
// - packed_linear: the C kernel over a weight packed at load, for any number of rows;
// - gguf_linear: straight from the blocks at every row count (one arithmetic per mode).
// - decode_attention: a decode step's attention of one layer (`CAttention` in attention.py
//   when every sequence decodes one token): the new keys and values written to their slots,
//   then the C decode kernel over each sequence's blocks.
// - paged_attention: a compiled model's attention op; in an announced step (attention_step:
//   every token a row over its own causal context, prompt tokens included) decode_attention
//   with no Python, else the Python kernel.
// - rms_norm, rotary, silu_mul (Gemma's offset_rms_norm, gelu_tanh_mul): a layer's small ops over glue.c, the functions decode_step.c
//   calls, one op call in compiled and eager steps alike (glue.py).
// - decode_model, decode_step: a model handed over once, then each of its steps of decodes run
//   whole by decode_step.c (worker/fused_decode.py).
// Their code is in four parts by kind of op, included into this one file (cpu_ops_linear.h,
// cpu_ops_attention.h, cpu_ops_decode_step.h, cpu_ops_layer.h): one compile against torch's
// headers, which cost most of the build, rather than one for each part.
// What they save is Python: a decode step calls one of them for every linear layer and every
// layer's attention, and each call through Python costs ~5 us per torch op it makes, 1-2 ms a
// step for the default model.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "decode_step.h"
#include "glue.h"
#include "lora.h"

extern "C" {
int gguf_linear_exact(const void *x, const uint8_t *w, int type, int m, int n, int k, void *y, int io_bf16,
                      int num_threads);
int gguf_linear_fast(const void *x, const uint8_t *w, int type, int m, int n, int k, void *y, int io_bf16,
                     int num_threads);
int64_t gguf_row_bytes(int type, int k);
int small_m_linear(const void *x, const void *w, const void *bias, void *y, int is_bf16, int m, int n, int k,
                   int num_threads);
int packed_linear(const void *x, const void *packed, const void *bias, void *y, int is_bf16, int m, int n, int k,
                  int num_threads);
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out, int num_seqs,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                           float scale, int window, float cap, int num_threads);
}

namespace {

#include "cpu_ops_linear.h"
#include "cpu_ops_attention.h"
#include "cpu_ops_decode_step.h"
#include "cpu_ops_layer.h"

}  // namespace

TORCH_LIBRARY_IMPL(duoserve, CPU, m) {
    m.impl("linear", &linear);
    m.impl("packed_linear", &packed_linear_op);
    m.impl("gguf_linear", &gguf_linear);
    m.impl("decode_attention", &decode_attention);
    m.impl("paged_attention", &paged_attention);
    m.impl("decode_step", &decode_step_op);
    m.impl("lora_rows", &lora_rows_op);
    m.impl("rms_norm", &rms_norm_op);
    m.impl("rotary", &rotary_op);
    m.impl("silu_mul", &silu_mul_op);
    m.impl("offset_rms_norm", &offset_rms_norm_op);
    m.impl("gelu_tanh_mul", &gelu_tanh_mul_op);
    m.impl("moe_route", &moe_route_op);
    m.impl("shared_expert_add", &shared_expert_add_op);
    m.impl("expert_add", &expert_add_op);
}

TORCH_LIBRARY_IMPL(duoserve, CatchAll, m) {
    m.impl("attention_step", &attention_step);
    m.impl("decode_model", &decode_model);
    m.impl("decode_model_release", &decode_model_release);
    m.impl("decode_model_moe", &decode_model_moe);
}
