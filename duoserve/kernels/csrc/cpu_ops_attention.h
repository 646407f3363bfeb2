/* Part of cpu_ops.cpp, included by it alone inside its anonymous namespace (one C++ file against
 * torch's headers, built once): the attention ops: the KV write, decode_attention, and the
 * compiled graph's paged_attention with attention_step announcing its steps. */
#ifndef DUOSERVE_CPU_OPS_ATTENTION_H
#define DUOSERVE_CPU_OPS_ATTENTION_H
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

#endif
