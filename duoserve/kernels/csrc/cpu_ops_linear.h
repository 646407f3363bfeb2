/* Part of cpu_ops.cpp, included by it alone inside its anonymous namespace (one C++ file against
 * torch's headers, built once): the linear ops: linear (the small-row C kernel or oneDNN),
 * packed_linear, gguf_linear. */
#ifndef DUOSERVE_CPU_OPS_LINEAR_H
#define DUOSERVE_CPU_OPS_LINEAR_H
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

#endif
