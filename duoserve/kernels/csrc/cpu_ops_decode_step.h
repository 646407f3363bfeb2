/* Part of cpu_ops.cpp, included by it alone inside its anonymous namespace (one C++ file against
 * torch's headers, built once): the C++ decode step: decode_model (a model handed over once),
 * decode_model_moe, decode_step. */
#ifndef DUOSERVE_CPU_OPS_DECODE_STEP_H
#define DUOSERVE_CPU_OPS_DECODE_STEP_H
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
                          const at::Tensor &slot_mapping, const at::Tensor &block_tables, const at::Tensor &seq_lens,
                          const at::Tensor &row_adapter, const at::Tensor &lora_tables) {
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
    const bool lora = row_adapter.numel() > 0;
    TORCH_CHECK(!lora || (row_adapter.numel() == m && row_adapter.scalar_type() == at::kLong &&
                          row_adapter.is_contiguous() && lora_tables.scalar_type() == at::kLong &&
                          lora_tables.is_contiguous()),
                "decode_step: an adapter index a row (int64, -1 for none) and int64 table addresses");
    for (int64_t t = 0; lora && t < m; t++) {
        const int64_t a = row_adapter.data_ptr<int64_t>()[t];
        TORCH_CHECK(a >= -1 && a < lora_tables.numel(), "decode_step: row ", t, "'s adapter ", a, " has no table");
    }
    const auto options = at::TensorOptions().dtype(model->dtype);
    at::Tensor residual = at::empty({m, model->shape.hidden}, options);
    at::Tensor out = at::empty({m, model->shape.hidden}, options);
    const int status = decode_step(model->layers.data(), (int)model->layers.size(), model->final_norm, &model->shape,
                                   model->cos, model->sin, model->embedding, ids.data_ptr<int64_t>(),
                                   residual.data_ptr(), out.data_ptr(), pos.data_ptr<int64_t>(),
                                   slots.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(),
                                   seq_lens.data_ptr<int64_t>(), (int)m, (int)block_tables.size(1),
                                   at::get_num_threads(), lora ? row_adapter.data_ptr<int64_t>() : nullptr,
                                   lora ? lora_tables.data_ptr<int64_t>() : nullptr);
    TORCH_CHECK(status == 0, status == -1 ? "decode_step: this build cannot run these packed weights"
                                          : "decode_step: out of memory for the step's scratch");
    return out;
}

/* y [m, out] += the LoRA updates of x [m, in]'s rows (lora.c), in place: the eager model's hook */
void lora_rows_op(const at::Tensor &y, const at::Tensor &x, const at::Tensor &row_adapter,
                  const at::Tensor &lora_tables, int64_t index) {
    TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0) && y.is_contiguous() && x.is_contiguous() &&
                y.scalar_type() == x.scalar_type() &&
                (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "lora_rows: x [m, in] and y [m, out], contiguous, both float32 or both bfloat16");
    TORCH_CHECK(row_adapter.numel() == x.size(0) && row_adapter.scalar_type() == at::kLong &&
                lora_tables.scalar_type() == at::kLong && row_adapter.is_contiguous() && lora_tables.is_contiguous(),
                "lora_rows: an adapter index a row (int64) and int64 table addresses");
    const int64_t *rows = row_adapter.data_ptr<int64_t>(), *tables = lora_tables.data_ptr<int64_t>();
    for (int64_t t = 0; t < x.size(0); t++)
        TORCH_CHECK(rows[t] >= -1 && rows[t] < lora_tables.numel(), "lora_rows: row ", t, " has no table");
    const int bf = x.scalar_type() == at::kBFloat16, m = (int)x.size(0), in = (int)x.size(1), out = (int)y.size(1);
    TORCH_CHECK(lora_rows(rows, tables, index, x.data_ptr(), y.data_ptr(), m, in, out, bf, at::get_num_threads()) == 0,
                "lora_rows: out of memory for its scratch");
}

#endif
