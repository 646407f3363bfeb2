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

constexpr int64_t SMALL_M_F32 = 6, SMALL_M_BF16 = 4;  // as dense.SMALL_M

// whether oneDNN runs bf16 here: it refuses to on a CPU without AVX-512 (torch's own check)
bool onednn_runs_bf16() {
    const std::optional<c10::OperatorHandle> check =
        c10::Dispatcher::singleton().findSchema({"mkldnn::_is_mkldnn_bf16_supported", ""});
    if (!check) return false;
    torch::jit::Stack stack;
    check->callBoxed(&stack);
    return stack[0].toBool();
}

// x @ w^T with oneDNN's linear over a plain weight (faster than at::linear in float32, BENCHMARKS.md),
// or at::linear where oneDNN is missing or cannot run the dtype
at::Tensor dense_linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias = {}) {
    static const std::optional<c10::OperatorHandle> onednn =
        c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    static const bool bf16 = onednn_runs_bf16();
    if (!onednn || (w.scalar_type() == at::kBFloat16 && !bf16)) return at::linear(x, w, bias);
    torch::jit::Stack stack{x, w, bias ? c10::IValue(*bias) : c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), c10::IValue()};
    onednn->callBoxed(&stack);
    return stack[0].toTensor();
}

at::Tensor linear(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    const at::ScalarType dtype = weight.scalar_type();
    const int64_t n = weight.size(0), k = weight.size(1), m = x.numel() / k;
    const int64_t small = dtype == at::kFloat ? SMALL_M_F32 : dtype == at::kBFloat16 ? SMALL_M_BF16 : 0;
    if (m > small || x.scalar_type() != dtype || !weight.is_contiguous()) return dense_linear(x, weight, bias);
    const at::Tensor rows = x.contiguous();
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor y = at::empty(sizes, x.options());
    const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
    small_m_linear(rows.data_ptr(), weight.data_ptr(), b.defined() ? b.data_ptr() : nullptr, y.data_ptr(),
                   dtype == at::kBFloat16, (int)m, (int)n, (int)k, at::get_num_threads());
    return y;
}

// x [..., k] @ W^T (+ bias) over W packed by packed_linear.c (dense.pack_linear_weight)
at::Tensor packed_linear_op(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias,
                            int64_t n) {
    const at::ScalarType dtype = packed.scalar_type();
    const int64_t k = x.size(-1), m = x.numel() / k;
    const at::Tensor rows = x.to(dtype).contiguous();
    const at::Tensor b = bias ? bias->to(dtype).contiguous() : at::Tensor();
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor y = at::empty(sizes, x.options().dtype(dtype));
    const int status = packed_linear(rows.data_ptr(), packed.data_ptr(), b.defined() ? b.data_ptr() : nullptr,
                                     y.data_ptr(), dtype == at::kBFloat16, (int)m, (int)n, (int)k,
                                     at::get_num_threads());
    TORCH_CHECK(status == 0, "packed_linear cannot run ", dtype, " weights with k=", k, " on this build");
    return y;
}

at::Tensor gguf_linear(const at::Tensor &x, const at::Tensor &blocks, int64_t type_id, int64_t cols,
                       c10::string_view mode) {
    const at::ScalarType dtype = x.scalar_type();
    if ((dtype != at::kFloat && dtype != at::kBFloat16) || !x.is_contiguous())
        return gguf_linear(x.to(at::kFloat).contiguous(), blocks, type_id, cols, mode).to(dtype);
    TORCH_CHECK(blocks.is_contiguous() && blocks.scalar_type() == at::kByte, "gguf_linear: blocks must be uint8");
    const int64_t n = blocks.size(0), m = x.numel() / cols;
    const bool bf16 = dtype == at::kBFloat16;
    const int threads = at::get_num_threads();
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor y = at::empty(sizes, x.options());
    auto fn = mode == "exact" ? gguf_linear_exact : gguf_linear_fast;
    const int status = fn(x.data_ptr(), blocks.data_ptr<uint8_t>(), (int)type_id, (int)m, (int)n, (int)cols,
                          y.data_ptr(), bf16, threads);
    TORCH_CHECK(status == 0, "gguf_linear: kernel error ", status);
    return y;
}

// rows [num_tokens, num_kv_heads, head_dim] (each token's heads side by side; any stride between
// tokens) written to the cache's slots, converted to its dtype: what index_copy_ did, without its
// ~4 us of dispatch
void write_rows(const at::Tensor &rows, at::Tensor &cache, const at::Tensor &slot_mapping) {
    const int64_t num_tokens = rows.size(0), width = rows.size(1) * rows.size(2), num_slots = cache.numel() / width;
    const at::Tensor src = rows.scalar_type() == cache.scalar_type() && rows.stride(2) == 1 &&
                                   rows.stride(1) == rows.size(2)
                               ? rows : rows.to(cache.scalar_type()).contiguous();
    const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
    const int64_t *slot = slots.data_ptr<int64_t>();
    const size_t bytes = width * cache.element_size();
    const char *from = static_cast<const char *>(src.data_ptr());
    char *to = static_cast<char *>(cache.data_ptr());
    for (int64_t t = 0; t < num_tokens; t++)   // all checked before any is written
        TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "decode_attention: slot ", slot[t], " outside the cache's ",
                    num_slots);
    for (int64_t t = 0; t < num_tokens; t++)
        std::memcpy(to + slot[t] * bytes, from + t * src.stride(0) * src.element_size(), bytes);
}

// q: [num_seqs, num_heads, head_dim]; k, v: [num_seqs, num_kv_heads, head_dim] (one new token a
// sequence), written into the caches [num_blocks, block_size, num_kv_heads, head_dim] at
// slot_mapping; -> [num_seqs, num_heads * head_dim] in q's dtype. window: the keys a row sees
// (0: all); cap: the scores' soft cap (0: none)
at::Tensor decode_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, at::Tensor k_cache,
                            at::Tensor v_cache, const at::Tensor &slot_mapping, const at::Tensor &block_tables,
                            const at::Tensor &seq_lens, double scale, int64_t window, double cap) {
    const at::ScalarType cache_dtype = k_cache.scalar_type();
    TORCH_CHECK(cache_dtype == at::kFloat || cache_dtype == at::kBFloat16, "decode_attention: a float32 or "
                "bfloat16 cache");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous() &&
                seq_lens.is_contiguous() && block_tables.scalar_type() == at::kLong &&
                seq_lens.scalar_type() == at::kLong, "decode_attention: contiguous caches, int64 tables and lengths");
    const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
    const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    TORCH_CHECK(k.size(0) == num_seqs && slot_mapping.numel() == num_seqs && k.size(1) == num_kv_heads &&
                k.size(2) == head_dim && v.sizes() == k.sizes(), "decode_attention: one new key and value a sequence");
    write_rows(k, k_cache, slot_mapping);
    write_rows(v, v_cache, slot_mapping);
    const at::Tensor q32 = q.to(at::kFloat).contiguous();
    at::Tensor out = at::empty_like(q32);
    const int status = paged_decode_attention(
        q32.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), cache_dtype == at::kBFloat16,
        block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(), (int)num_seqs,
        (int)num_heads, (int)num_kv_heads, (int)head_dim, (int)block_size, (int)block_tables.size(1), (float)scale,
        (int)window, (float)cap, at::get_num_threads());
    TORCH_CHECK(status == 0, "decode_attention: out of memory for the kernel's scratch");
    return out.view({num_seqs, num_heads * head_dim}).to(q.scalar_type());
}

// What duoserve::paged_attention reads during one forward of a compiled model: its caches and the
// step's slots and per-token tables and lengths, by the model's context handle (ops.py).
// Set by duoserve::attention_step before the forward and cleared after it, so no tensor is held
// between steps.
struct DecodeStep {
    std::vector<at::Tensor> k_caches, v_caches;
    at::Tensor slot_mapping, block_tables, seq_lens;
    std::vector<double> scales, caps;
    std::vector<int64_t> windows;
};
std::mutex decode_steps_mutex;
std::unordered_map<int64_t, DecodeStep> decode_steps;

void attention_step(int64_t context, at::TensorList k_caches, at::TensorList v_caches,
                    const std::optional<at::Tensor> &slot_mapping, const std::optional<at::Tensor> &block_tables,
                    const std::optional<at::Tensor> &seq_lens, c10::ArrayRef<double> scales,
                    c10::IntArrayRef windows, c10::ArrayRef<double> caps) {
    std::lock_guard<std::mutex> lock(decode_steps_mutex);
    if (!slot_mapping) {
        decode_steps.erase(context);
        return;
    }
    TORCH_CHECK(block_tables && seq_lens && k_caches.size() == v_caches.size() && k_caches.size() == scales.size() &&
                    windows.size() == scales.size() && caps.size() == scales.size(),
                "attention_step: tables, lengths, and a cache pair, a scale, a window and a cap for every layer");
    decode_steps[context] = DecodeStep{k_caches.vec(), v_caches.vec(), *slot_mapping, *block_tables, *seq_lens,
                                       scales.vec(), caps.vec(), windows.vec()};
}

// one layer's attention inside a compiled graph: an announced step straight to decode_attention
// (each token a row), any other through the Python kernel (duoserve::paged_attention_any)
at::Tensor paged_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t context,
                           int64_t layer) {
    const DecodeStep *step = nullptr;
    {
        std::lock_guard<std::mutex> lock(decode_steps_mutex);
        auto found = decode_steps.find(context);
        if (found != decode_steps.end()) step = &found->second;  // stays until this forward ends
    }
    if (step) {
        TORCH_CHECK(layer >= 0 && layer < (int64_t)step->k_caches.size(), "paged_attention: no layer ", layer);
        return decode_attention(q, k, v, step->k_caches[layer], step->v_caches[layer], step->slot_mapping,
                                step->block_tables, step->seq_lens, step->scales[layer], step->windows[layer],
                                step->caps[layer]);
    }
    static const auto any = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("duoserve::paged_attention_any", "")
                                .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t,
                                                  int64_t)>();
    return any.call(q, k, v, context, layer);
}

// A model whose whole decode step runs in decode_step.c, by its context handle: the packed
// weights, norms, caches and rotary tables of every layer, set once (duoserve::decode_model) and
// kept alive here for the model's life.
struct DecodeModel {
    std::vector<at::Tensor> tensors;   // what the pointers below point into
    std::vector<decode_layer> layers;
    std::deque<decode_moe> moes;                          // routed layers' MLPs (decode_model_moe):
    std::deque<std::vector<decode_linear>> expert_linears;  // deques, so the layers' pointers stay put
    decode_shape shape;
    const void *final_norm, *embedding;
    const float *cos[2], *sin[2];   // global and local layers' rotary tables
    int64_t max_positions, num_slots, vocab;
    at::ScalarType dtype;
};
std::mutex decode_models_mutex;
std::unordered_map<int64_t, DecodeModel> decode_models;

// Pointers into the tensors a DecodeModel keeps alive, each checked as it is taken.
struct DecodeTensors {
    DecodeModel &model;
    at::TensorList blocks;          // every block projection's runs, in order
    c10::IntArrayRef block_types;
    bool exact;
    size_t next_block = 0;

    void *ptr(const at::Tensor &t) {   // an activation-dtype tensor, or nullptr where empty
        if (!t.defined() || t.numel() == 0) return nullptr;
        TORCH_CHECK(t.is_contiguous() && t.scalar_type() == model.dtype, "decode_model: contiguous tensors of ",
                    model.dtype, ", not ", t.scalar_type());
        model.tensors.push_back(t);
        return t.data_ptr();
    }

    const uint8_t *bytes(const at::Tensor &t, int64_t type, int64_t k) {   // [rows, bytes per row] blocks
        TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kByte && t.dim() == 2 &&
                    t.size(1) == gguf_row_bytes((int)type, (int)k), "decode_model: GGUF blocks of type ", type,
                    " as contiguous uint8 [rows, bytes of ", k, " values]");
        model.tensors.push_back(t);
        return t.data_ptr<uint8_t>();
    }

    // a projection [n, k]: packed (no runs), or the next `count` block tensors, n rows in all
    decode_linear linear(const at::Tensor &packed, int64_t count, int64_t n, int64_t k) {
        decode_linear w{};
        if (count == 0) {
            TORCH_CHECK(packed.numel() > 0, "decode_model: a projection with neither packed weights nor blocks");
            w.packed = ptr(packed);
            return w;
        }
        TORCH_CHECK(count <= MAX_RUNS && next_block + count <= blocks.size(), "decode_model: at most ", MAX_RUNS,
                    " runs a projection, each with its blocks");
        int64_t rows = 0;
        for (int64_t r = 0; r < count; r++, next_block++) {
            w.types[r] = (int)block_types[next_block];
            w.blocks[r] = bytes(blocks[next_block], block_types[next_block], k);
            w.rows[r] = (int)blocks[next_block].size(0);
            rows += w.rows[r];
        }
        TORCH_CHECK(rows == n, "decode_model: a projection's runs hold ", rows, " rows, not ", n);
        w.num_runs = (int)count;
        w.exact = exact;
        return w;
    }
};

// per layer: input norm, post norm (before the MLP), attention-out and MLP-out norms (Gemma's, or
// empty tensors), q norm and k norm (or empty tensors), qkv, qkv bias (or an empty tensor), o,
// gate_up, down (packed, or empty tensors for blocks), k cache, v cache, in that order in `layers`;
// and its scale, window (0: none), score cap (0: none) and rope table (1: local_cos/local_sin, the
// local layers'); shape: hidden, heads, KV heads, head dim, intermediate; gemma: Gemma's norms,
// MLP and embedding scale (embed_scale, in the model dtype); the embedding table
// [vocab, hidden] packed as a linear layer's weight (PackedEmbedding), or its GGUF blocks [vocab,
// bytes per row] of type embed_type. A projection from GGUF blocks: its runs' blocks [rows, bytes
// per row] next in `blocks` and their type ids in `block_types`; `runs` gives each projection's
// number of runs (qkv, o, gate_up, down of every layer; 0: packed; -1 for gate_up and down: a
// routed layer, whose MLP decode_model_moe gives next), gguf_exact its mode.
void decode_model(int64_t context, at::TensorList layers, const at::Tensor &final_norm, const at::Tensor &cos,
                  const at::Tensor &sin, const at::Tensor &local_cos, const at::Tensor &local_sin,
                  const at::Tensor &embedding, int64_t vocab, c10::IntArrayRef shape, double eps,
                  c10::ArrayRef<double> scales, c10::IntArrayRef windows, c10::ArrayRef<double> caps,
                  c10::IntArrayRef local_layers, at::TensorList blocks, c10::IntArrayRef block_types,
                  c10::IntArrayRef runs, int64_t gguf_exact, int64_t embed_type, int64_t gemma, double embed_scale) {
    constexpr size_t PER_LAYER = 13;
    const size_t num_layers = scales.size();
    TORCH_CHECK(layers.size() == PER_LAYER * num_layers && num_layers > 0 && shape.size() == 5 &&
                    windows.size() == num_layers && caps.size() == num_layers && local_layers.size() == num_layers,
                "decode_model: thirteen tensors, a scale, a window, a cap and a rope table a layer, five sizes");
    TORCH_CHECK(runs.empty() || runs.size() == 4 * scales.size(), "decode_model: four run counts a layer");
    TORCH_CHECK(blocks.size() == block_types.size(), "decode_model: a type id for every block tensor");
    DecodeModel model;
    model.dtype = final_norm.scalar_type();
    TORCH_CHECK(model.dtype == at::kFloat || model.dtype == at::kBFloat16, "decode_model: float32 or bfloat16");
    for (const at::Tensor *table : {&cos, &sin, &local_cos, &local_sin})
        TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 2 &&
                        table->size(1) == shape[3] && table->size(0) == cos.size(0),
                    "decode_model: float32 cos and sin tables [positions, head_dim], global and local alike");
    model.shape = decode_shape{(int)shape[0], (int)shape[1], (int)shape[2], (int)shape[3], (int)shape[4], 0,
                               model.dtype == at::kBFloat16, (float)eps, (int)embed_type, (int)(gemma != 0),
                               (float)embed_scale};
    DecodeTensors take{model, blocks, block_types, gguf_exact != 0};
    const int64_t hidden = shape[0], q_size = shape[1] * shape[3], kv_size = shape[2] * shape[3], inter = shape[4];
    for (size_t l = 0; l < scales.size(); l++) {
        const at::Tensor *t = layers.data() + PER_LAYER * l;
        const int64_t *counts = runs.empty() ? nullptr : runs.data() + 4 * l;
        const at::Tensor &k_cache = t[11], &v_cache = t[12];
        TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == shape[2] &&
                    k_cache.size(3) == shape[3], "decode_model: caches [blocks, block_size, KV heads, head_dim]");
        model.shape.block_size = (int)k_cache.size(1);
        model.num_slots = k_cache.size(0) * k_cache.size(1);
        decode_layer layer{take.ptr(t[0]), take.ptr(t[1]), take.ptr(t[2]), take.ptr(t[3]), take.ptr(t[4]),
                           take.ptr(t[5])};
        TORCH_CHECK(gemma || !(layer.attn_out_norm || layer.mlp_out_norm), "decode_model: sandwich norms are Gemma's");
        TORCH_CHECK(!gemma || (layer.attn_out_norm && layer.mlp_out_norm), "decode_model: Gemma has four norms a layer");
        layer.qkv = take.linear(t[6], counts ? counts[0] : 0, q_size + 2 * kv_size, hidden);
        layer.qkv_bias = take.ptr(t[7]);
        layer.o_proj = take.linear(t[8], counts ? counts[1] : 0, hidden, q_size);
        if (!(counts && counts[2] < 0 && counts[3] < 0)) {   // -1, -1: routed (decode_model_moe gives its MLP)
            layer.gate_up = take.linear(t[9], counts ? counts[2] : 0, 2 * inter, hidden);
            layer.down = take.linear(t[10], counts ? counts[3] : 0, hidden, inter);
        }
        layer.k_cache = take.ptr(k_cache);
        layer.v_cache = take.ptr(v_cache);
        layer.scale = (float)scales[l];
        layer.cap = (float)caps[l];
        layer.window = (int)windows[l];
        layer.local = local_layers[l] != 0;
        model.layers.push_back(layer);
    }
    TORCH_CHECK(take.next_block == blocks.size(), "decode_model: block tensors left over");
    model.final_norm = take.ptr(final_norm);
    if (embed_type >= 0) {
        TORCH_CHECK(embedding.dim() == 2 && embedding.size(0) >= vocab, "decode_model: GGUF embedding blocks of ",
                    vocab, " rows");
        model.embedding = take.bytes(embedding, embed_type, hidden);
    } else {
        TORCH_CHECK(embedding.numel() >= vocab * hidden, "decode_model: an embedding table of ", vocab,
                    " rows of ", hidden);
        model.embedding = take.ptr(embedding);
    }
    model.vocab = vocab;
    for (const at::Tensor &table : {cos, sin, local_cos, local_sin}) model.tensors.push_back(table);
    model.cos[0] = cos.data_ptr<float>();
    model.sin[0] = sin.data_ptr<float>();
    model.cos[1] = local_cos.data_ptr<float>();
    model.sin[1] = local_sin.data_ptr<float>();
    model.max_positions = cos.size(0);
    std::lock_guard<std::mutex> lock(decode_models_mutex);
    decode_models[context] = std::move(model);
}

// input_ids [m]: the step's new tokens (one a sequence); -> the final norm's output [m, hidden];
// every layer's new keys and values written to their slots
// a model's decode model forgotten (its runner is gone): the weights and caches it kept alive go
void decode_model_release(int64_t context) {
    std::lock_guard<std::mutex> lock(decode_models_mutex);
    decode_models.erase(context);
}

// a routed layer's MLP (model/moe.py's SparseMoE), given after decode_model: `weights` the router,
// every expert's gate_up, every expert's down, then with a shared expert (shared_inter > 0) its
// gate_up, down and one-row gate; each packed, or an empty tensor whose `runs` block tensors come
// next in `blocks` (as decode_model's). expert_tokens int64 [experts]: counted into, as SparseMoE.
void decode_model_moe(int64_t context, int64_t layer, at::TensorList weights, at::TensorList blocks,
                      c10::IntArrayRef block_types, c10::IntArrayRef runs, int64_t top_k, int64_t renormalize,
                      int64_t inter, int64_t shared_inter, const at::Tensor &expert_tokens, int64_t gguf_exact) {
    std::lock_guard<std::mutex> lock(decode_models_mutex);
    auto found = decode_models.find(context);
    TORCH_CHECK(found != decode_models.end(), "decode_model_moe: no model ", context, " (duoserve::decode_model)");
    DecodeModel &model = found->second;
    TORCH_CHECK(layer >= 0 && layer < (int64_t)model.layers.size() && !model.layers[layer].gate_up.packed &&
                    !model.layers[layer].gate_up.num_runs && !model.layers[layer].moe,
                "decode_model_moe: layer ", layer, " is not a routed layer waiting for its MLP");
    const int64_t experts = expert_tokens.numel(), n_weights = 1 + 2 * experts + (shared_inter > 0 ? 3 : 0);
    TORCH_CHECK(expert_tokens.scalar_type() == at::kLong && expert_tokens.is_contiguous() && experts > 0 &&
                    experts <= GLUE_MAX_EXPERTS && top_k > 0 && top_k <= experts && inter > 0,
                "decode_model_moe: 1 to ", GLUE_MAX_EXPERTS, " experts counted in int64, top_k of them");
    TORCH_CHECK((int64_t)weights.size() == n_weights && (int64_t)runs.size() == n_weights &&
                    blocks.size() == block_types.size(),
                "decode_model_moe: a router, two projections an expert, three for a shared expert, each's runs");
    DecodeTensors take{model, blocks, block_types, gguf_exact != 0};
    const int64_t hidden = model.shape.hidden;
    std::vector<decode_linear> &linears = model.expert_linears.emplace_back();
    linears.reserve(2 * experts);
    decode_moe moe{};
    moe.router = take.linear(weights[0], runs[0], experts, hidden);
    for (int64_t e = 0; e < experts; e++) linears.push_back(take.linear(weights[1 + e], runs[1 + e], 2 * inter, hidden));
    for (int64_t e = 0; e < experts; e++)
        linears.push_back(take.linear(weights[1 + experts + e], runs[1 + experts + e], hidden, inter));
    if (shared_inter > 0) {
        const int64_t at = 1 + 2 * experts;
        moe.shared_gate_up = take.linear(weights[at], runs[at], 2 * shared_inter, hidden);
        moe.shared_down = take.linear(weights[at + 1], runs[at + 1], hidden, shared_inter);
        moe.shared_gate = take.linear(weights[at + 2], runs[at + 2], 1, hidden);
    }
    TORCH_CHECK(take.next_block == blocks.size(), "decode_model_moe: block tensors left over");
    model.tensors.push_back(expert_tokens);
    moe.gate_up = linears.data();
    moe.down = linears.data() + experts;
    moe.num_experts = (int)experts;
    moe.top_k = (int)top_k;
    moe.renormalize = renormalize != 0;
    moe.inter = (int)inter;
    moe.shared_inter = (int)shared_inter;
    moe.expert_tokens = expert_tokens.data_ptr<int64_t>();
    model.layers[layer].moe = &model.moes.emplace_back(moe);
}

at::Tensor decode_step_op(int64_t context, const at::Tensor &input_ids, const at::Tensor &positions,
                          const at::Tensor &slot_mapping, const at::Tensor &block_tables, const at::Tensor &seq_lens) {
    const DecodeModel *model = nullptr;
    {
        std::lock_guard<std::mutex> lock(decode_models_mutex);
        auto found = decode_models.find(context);
        TORCH_CHECK(found != decode_models.end(), "decode_step: no model ", context, " (duoserve::decode_model)");
        model = &found->second;
    }
    const at::Tensor ids = input_ids.to(at::kLong).contiguous();
    const int64_t m = ids.numel();
    const at::Tensor pos = positions.to(at::kLong).contiguous(), slots = slot_mapping.to(at::kLong).contiguous();
    TORCH_CHECK(pos.numel() == m && slots.numel() == m && seq_lens.numel() == m && block_tables.size(0) == m &&
                block_tables.is_contiguous() && seq_lens.is_contiguous() &&
                block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
                "decode_step: a position, a slot, a table and a length a row");
    for (int64_t t = 0; t < m; t++) {
        const int64_t p = pos.data_ptr<int64_t>()[t], slot = slots.data_ptr<int64_t>()[t];
        const int64_t id = ids.data_ptr<int64_t>()[t];
        TORCH_CHECK(id >= 0 && id < model->vocab, "decode_step: token ", id, " outside the vocabulary of ",
                    model->vocab);
        TORCH_CHECK(p >= 0 && p < model->max_positions, "decode_step: position ", p, " outside the rotary table's ",
                    model->max_positions);
        TORCH_CHECK(slot >= 0 && slot < model->num_slots, "decode_step: slot ", slot, " outside the cache's ",
                    model->num_slots);
    }
    for (const decode_layer &layer : model->layers)
        TORCH_CHECK(layer.moe || layer.gate_up.packed || layer.gate_up.num_runs,
                    "decode_step: a routed layer without its experts (duoserve::decode_model_moe)");
    const auto options = at::TensorOptions().dtype(model->dtype);
    at::Tensor residual = at::empty({m, model->shape.hidden}, options);
    at::Tensor out = at::empty({m, model->shape.hidden}, options);
    const int status = decode_step(model->layers.data(), (int)model->layers.size(), model->final_norm, &model->shape,
                                   model->cos, model->sin, model->embedding, ids.data_ptr<int64_t>(),
                                   residual.data_ptr(), out.data_ptr(), pos.data_ptr<int64_t>(),
                                   slots.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(),
                                   seq_lens.data_ptr<int64_t>(), (int)m, (int)block_tables.size(1),
                                   at::get_num_threads());
    TORCH_CHECK(status == 0, status == -1 ? "decode_step: this build cannot run these packed weights"
                                          : "decode_step: out of memory for the step's scratch");
    return out;
}

// a layer's small ops over glue.c's functions, the ones decode_step.c calls, with the same
// boundaries (a row, a head, 64-column chunks): one arithmetic on every path. The ATen calls of
// model/layers.py serve what glue.c does not take (another dtype, a weight in another dtype).
bool glue_takes(const at::Tensor &x, const at::Tensor &other) {
    return (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && other.scalar_type() == x.scalar_type();
}

// a norm over glue.c's row function `row` (plain or Gemma's offset), else `fallback`'s ATen calls
template <typename Row, typename Fallback>
at::Tensor norm_rows(const at::Tensor &x, const at::Tensor &weight, double eps, Row row, Fallback fallback) {
    if (!glue_takes(x, weight) || weight.dim() != 1 || x.size(-1) != weight.size(0)) return fallback();
    const at::Tensor in = x.contiguous(), w = weight.contiguous();
    at::Tensor out = at::empty_like(in);
    const int64_t n = in.size(-1), rows = n ? in.numel() / n : 0, row_bytes = n * in.element_size();
    const int bf = in.scalar_type() == at::kBFloat16;
    char *src = static_cast<char *>(in.data_ptr()), *dst = static_cast<char *>(out.data_ptr());
    const void *wp = w.data_ptr();
    at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; t++) row(src + t * row_bytes, wp, dst + t * row_bytes, (int)n, (float)eps, bf);
    });
    return out;
}

at::Tensor rms_norm_op(const at::Tensor &x, const at::Tensor &weight, double eps) {
    return norm_rows(
        x, weight, eps,
        [](char *in, const void *w, char *out, int n, float e, int bf) { glue_add_norm_row(in, nullptr, w, out, n, e, bf); },
        [&] {
            if (x.scalar_type() == at::kFloat) return at::rms_norm(x, weight.sizes(), weight, eps).contiguous();
            const at::Tensor normed = at::rms_norm(x.to(at::kFloat), weight.sizes(), c10::nullopt, eps);
            return (weight * normed.to(x.scalar_type())).contiguous();
        });
}

at::Tensor offset_rms_norm_op(const at::Tensor &x, const at::Tensor &weight, double eps) {
    return norm_rows(
        x, weight, eps,
        [](char *in, const void *w, char *out, int n, float e, int bf) { glue_offset_norm_row(in, w, out, n, e, bf); },
        [&] {
            const at::Tensor normed = at::rms_norm(x.to(at::kFloat), weight.sizes(), c10::nullopt, eps);
            return (normed * (weight.to(at::kFloat) + 1.0)).to(x.scalar_type()).contiguous();
        });
}

at::Tensor rotary_op(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin) {
    // x [tokens, heads, d]; cos, sin [tokens, 1, d] (RotaryEmbedding.cos_sin)
    const bool takes = glue_takes(x, cos) && x.dim() == 3 && cos.dim() == 3 && cos.size(0) == x.size(0) &&
                       cos.size(1) == 1 && cos.size(2) == x.size(2) && sin.sizes() == cos.sizes();
    if (!takes) {
        const int64_t half = x.size(-1) / 2;
        const at::Tensor swapped = at::cat({x.slice(-1, half), x.slice(-1, 0, half)}, -1);
        return at::addcmul(x * cos, swapped, sin).contiguous();
    }
    const at::Tensor in = x.contiguous();
    const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
    at::Tensor out = at::empty_like(in);
    const int64_t tokens = in.size(0), heads = in.size(1), d = in.size(2), head_bytes = d * in.element_size();
    const int bf = in.scalar_type() == at::kBFloat16;
    char *src = static_cast<char *>(in.data_ptr()), *dst = static_cast<char *>(out.data_ptr());
    const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
    at::parallel_for(0, tokens * heads, 32, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; i++) {
            const int64_t t = i / heads;
            glue_rotate_head(src + i * head_bytes, cp + t * d, sp + t * d, dst + i * head_bytes, (int)d, bf);
        }
    });
    return out;
}

// gate * up over glue.c's chunk function `chunk` (SiLU, Gemma's tanh-GELU), else `fallback`
template <typename Chunk, typename Fallback>
at::Tensor gated_chunks(const at::Tensor &gate_up, Chunk chunk, Fallback fallback) {
    if (!glue_takes(gate_up, gate_up) || gate_up.dim() < 1 || gate_up.size(-1) % 2) return fallback();
    const at::Tensor in = gate_up.contiguous();
    std::vector<int64_t> sizes = in.sizes().vec();
    const int64_t inter = sizes.back() / 2, rows = inter ? in.numel() / (2 * inter) : 0;
    sizes.back() = inter;
    at::Tensor out = at::empty(sizes, in.options());
    const int64_t chunks = (inter + GLUE_CHUNK - 1) / GLUE_CHUNK, elem = in.element_size();
    const int bf = in.scalar_type() == at::kBFloat16;
    const char *src = static_cast<const char *>(in.data_ptr());
    char *dst = static_cast<char *>(out.data_ptr());
    at::parallel_for(0, rows * chunks, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; i++) {
            const int64_t t = i / chunks;
            chunk(src + t * 2 * inter * elem, dst + t * inter * elem, (int)inter, (int)(i % chunks), bf);
        }
    });
    return out;
}

at::Tensor silu_mul_op(const at::Tensor &gate_up) {
    return gated_chunks(gate_up, glue_silu_mul_chunk, [&] {
        const auto halves = gate_up.chunk(2, -1);
        return (at::silu(halves[0]) * halves[1]).contiguous();
    });
}

at::Tensor gelu_tanh_mul_op(const at::Tensor &gate_up) {
    return gated_chunks(gate_up, glue_gelu_tanh_mul_chunk, [&] {
        const auto halves = gate_up.chunk(2, -1);
        return (at::gelu(halves[0], "tanh") * halves[1]).contiguous();
    });
}

// logits [tokens, experts] -> (chosen int64 [tokens, top_k], weights [tokens, top_k] in logits' dtype)
std::tuple<at::Tensor, at::Tensor> moe_route_op(const at::Tensor &logits, int64_t top_k, bool renormalize) {
    TORCH_CHECK(glue_takes(logits, logits) && logits.dim() == 2 && logits.size(1) <= GLUE_MAX_EXPERTS &&
                    top_k > 0 && top_k <= logits.size(1),
                "moe_route: float32 or bfloat16 logits [tokens, at most ", GLUE_MAX_EXPERTS, " experts], top_k of them");
    const at::Tensor in = logits.contiguous();
    const int64_t tokens = in.size(0), experts = in.size(1), elem = in.element_size();
    at::Tensor chosen = at::empty({tokens, top_k}, in.options().dtype(at::kLong));
    at::Tensor weights = at::empty({tokens, top_k}, in.options());
    const int bf = in.scalar_type() == at::kBFloat16;
    const char *src = static_cast<const char *>(in.data_ptr());
    char *w = static_cast<char *>(weights.data_ptr());
    int64_t *c = chosen.data_ptr<int64_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; t++)
            glue_moe_route_row(src + t * experts * elem, (int)experts, (int)top_k, renormalize, bf, c + t * top_k,
                               w + t * top_k * elem);
    });
    return {chosen, weights};
}

// out [tokens, hidden] + sigmoid(gate [tokens, 1]) * shared [tokens, hidden], a new tensor
at::Tensor shared_expert_add_op(const at::Tensor &out, const at::Tensor &gate, const at::Tensor &shared) {
    if (!(glue_takes(out, gate) && glue_takes(out, shared) && out.dim() == 2 && shared.sizes() == out.sizes() &&
          gate.dim() == 2 && gate.size(0) == out.size(0) && gate.size(1) == 1))
        return (out + at::sigmoid(gate) * shared).contiguous();
    at::Tensor result = out.contiguous().clone();
    const at::Tensor g = gate.contiguous(), y = shared.contiguous();
    const int64_t tokens = out.size(0), hidden = out.size(1), elem = out.element_size();
    const int bf = out.scalar_type() == at::kBFloat16;
    char *dst = static_cast<char *>(result.data_ptr());
    const char *gp = static_cast<const char *>(g.data_ptr()), *yp = static_cast<const char *>(y.data_ptr());
    at::parallel_for(0, tokens, 8, [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; t++)
            glue_shared_expert_add_row(dst + t * hidden * elem, gp + t * elem, yp + t * hidden * elem, (int)hidden, bf);
    });
    return result;
}

// out [tokens, hidden]: out[rows[i]] += rounded(y[i] * weights[i]) for each i in order (index_add_ of
// the weighted outputs of one expert), in place
void expert_add_op(const at::Tensor &out, const at::Tensor &rows, const at::Tensor &y, const at::Tensor &weights) {
    TORCH_CHECK(glue_takes(out, y) && glue_takes(out, weights) && out.is_contiguous() && out.dim() == 2 &&
                    y.dim() == 2 && y.size(1) == out.size(1) && rows.numel() == y.size(0) &&
                    weights.numel() == y.size(0) && rows.scalar_type() == at::kLong,
                "expert_add: out [tokens, hidden], a row index and a weight for each row of y");
    const at::Tensor r = rows.contiguous(), in = y.contiguous(), w = weights.to(at::kFloat).contiguous();
    const int64_t n = in.size(0), hidden = in.size(1), elem = in.element_size();
    const int bf = out.scalar_type() == at::kBFloat16;
    char *dst = static_cast<char *>(out.data_ptr());
    const char *src = static_cast<const char *>(in.data_ptr());
    for (int64_t i = 0; i < n; i++) {   // rows may repeat across experts, never within one: order kept
        const int64_t row = r.data_ptr<int64_t>()[i];
        TORCH_CHECK(row >= 0 && row < out.size(0), "expert_add: row ", row, " out of range");
        glue_expert_add_row(dst + row * hidden * elem, src + i * hidden * elem, w.data_ptr<float>()[i], (int)hidden, bf);
    }
}

}  // namespace

TORCH_LIBRARY_IMPL(duoserve, CPU, m) {
    m.impl("linear", &linear);
    m.impl("packed_linear", &packed_linear_op);
    m.impl("gguf_linear", &gguf_linear);
    m.impl("decode_attention", &decode_attention);
    m.impl("paged_attention", &paged_attention);
    m.impl("decode_step", &decode_step_op);
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
