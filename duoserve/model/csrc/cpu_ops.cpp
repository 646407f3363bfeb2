// The CPU kernels of the ops duoserve::linear, duoserve::packed_linear, duoserve::gguf_linear
// and duoserve::decode_attention in C++, over the C functions of small_m_linear.c,
// packed_linear.c, gguf_linear.c and paged_decode.c.
//
// Each computes what its Python kernel computes (`linear_any_m` in cpu_linear.py,
// `packed_linear` in quantized.py; those are registered when this file cannot be built):
// - linear: up to SMALL_M rows with the bandwidth-bound C kernel, more with oneDNN's linear;
// - packed_linear: the C kernel over a weight packed at load, for any number of rows;
// - gguf_linear: up to DIRECT_ROWS rows straight from the blocks, more rows dequantized a
//   slice at a time into a reused buffer and multiplied by oneDNN.
// - decode_attention: a decode step's attention of one layer (`paged_attention` in attention.py
//   when every sequence decodes one token): the new keys and values written to their slots,
//   then the C decode kernel over each sequence's blocks.
// What they save is Python: a decode step calls one of them for every linear layer and every
// layer's attention, and each call through Python costs ~5 us per torch op it makes, 1-2 ms a
// step for the default model.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

extern "C" {
int gguf_dequantize(const uint8_t *w, int type, int64_t n, int k, const int64_t *ids, int64_t count, void *out,
                    int out_bf16, int num_threads);
int gguf_linear_exact(const void *x, const uint8_t *w, int type, int m, int n, int k, void *y, int io_bf16,
                      int num_threads);
int gguf_linear_fast(const void *x, const uint8_t *w, int type, int m, int n, int k, void *y, int io_bf16,
                     int num_threads);
int small_m_linear(const void *x, const void *w, const void *bias, void *y, int is_bf16, int m, int n, int k,
                   int num_threads);
int packed_linear(const void *x, const void *packed, const void *bias, void *y, int is_bf16, int m, int n, int k,
                  int num_threads);
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out, int num_seqs,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                           float scale, int num_threads);
}

namespace {

constexpr int64_t DIRECT_ROWS = 8;       // as quantized.DIRECT_ROWS
constexpr int64_t SMALL_M_F32 = 6, SMALL_M_BF16 = 4;  // as cpu_linear.SMALL_M
constexpr int64_t SLICE_VALUES = 1 << 21;  // as quantized.SLICE_VALUES

at::Tensor &scratch(at::ScalarType dtype, int64_t numel) {
    static thread_local at::Tensor f32, bf16;
    at::Tensor &buffer = dtype == at::kBFloat16 ? bf16 : f32;
    if (!buffer.defined() || buffer.numel() < numel) buffer = at::empty({numel}, at::TensorOptions().dtype(dtype));
    return buffer;
}

// x @ w^T with oneDNN's linear over a plain weight (twice as fast as at::linear in float32 here,
// the same in bfloat16: cpu_linear.py measured it), or at::linear without oneDNN
at::Tensor dense_linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias = {}) {
    static const std::optional<c10::OperatorHandle> onednn =
        c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!onednn) return at::linear(x, w, bias);
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

// x [..., k] @ W^T (+ bias) over W packed by packed_linear.c (cpu_kernels.pack_linear_weight)
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
    if (m <= DIRECT_ROWS) {
        at::Tensor y = at::empty(sizes, x.options());
        auto fn = mode == "exact" ? gguf_linear_exact : gguf_linear_fast;
        int status = fn(x.data_ptr(), blocks.data_ptr<uint8_t>(), (int)type_id, (int)m, (int)n, (int)cols,
                        y.data_ptr(), bf16, threads);
        TORCH_CHECK(status == 0, "gguf_linear: kernel error ", status);
        return y;
    }
    const at::Tensor flat = x.reshape({m, cols});
    const int64_t step = std::max<int64_t>(1, SLICE_VALUES / cols);
    at::Tensor &buffer = scratch(dtype, std::min(step, n) * cols);
    const int64_t row_bytes = blocks.size(1);
    auto dense_rows = [&](int64_t start, int64_t stop) {
        at::Tensor dense = buffer.narrow(0, 0, (stop - start) * cols).view({stop - start, cols});
        gguf_dequantize(blocks.data_ptr<uint8_t>() + start * row_bytes, (int)type_id, stop - start, (int)cols,
                        nullptr, 0, dense.data_ptr(), bf16, threads);
        return dense;
    };
    if (step >= n) return dense_linear(flat, dense_rows(0, n)).view(sizes);
    at::Tensor y = at::empty({m, n}, x.options());
    for (int64_t start = 0; start < n; start += step) {
        const int64_t stop = std::min(start + step, n);
        y.narrow(1, start, stop - start).copy_(dense_linear(flat, dense_rows(start, stop)));
    }
    return y.view(sizes);
}

// q: [num_seqs, num_heads, head_dim]; k, v: [num_seqs, num_kv_heads, head_dim] (one new token a
// sequence), written into the caches [num_blocks, block_size, num_kv_heads, head_dim] at
// slot_mapping; -> [num_seqs, num_heads * head_dim] in q's dtype
at::Tensor decode_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, at::Tensor k_cache,
                            at::Tensor v_cache, const at::Tensor &slot_mapping, const at::Tensor &block_tables,
                            const at::Tensor &seq_lens, double scale) {
    const at::ScalarType cache_dtype = k_cache.scalar_type();
    TORCH_CHECK(cache_dtype == at::kFloat || cache_dtype == at::kBFloat16, "decode_attention: a float32 or "
                "bfloat16 cache");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous() &&
                seq_lens.is_contiguous() && block_tables.scalar_type() == at::kLong &&
                seq_lens.scalar_type() == at::kLong, "decode_attention: contiguous caches, int64 tables and lengths");
    const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
    const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    k_cache.view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, k.to(cache_dtype));
    v_cache.view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, v.to(cache_dtype));
    const at::Tensor q32 = q.to(at::kFloat).contiguous();
    at::Tensor out = at::empty_like(q32);
    const int status = paged_decode_attention(
        q32.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), cache_dtype == at::kBFloat16,
        block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(), (int)num_seqs,
        (int)num_heads, (int)num_kv_heads, (int)head_dim, (int)block_size, (int)block_tables.size(1), (float)scale,
        at::get_num_threads());
    TORCH_CHECK(status == 0, "decode_attention: out of memory for the kernel's scratch");
    return out.view({num_seqs, num_heads * head_dim}).to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(duoserve, CPU, m) {
    m.impl("linear", &linear);
    m.impl("packed_linear", &packed_linear_op);
    m.impl("gguf_linear", &gguf_linear);
    m.impl("decode_attention", &decode_attention);
}
