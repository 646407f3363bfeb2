/* Part of cpu_ops.cpp, included by it alone inside its anonymous namespace (one C++ file against
 * torch's headers, built once): a layer's small ops: the norms, rotary, the gated MLP activations
 * and the experts' routing and sums. */
#ifndef DUOSERVE_CPU_OPS_LAYER_H
#define DUOSERVE_CPU_OPS_LAYER_H
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

#endif
