"""Small factories for tests: tiny checkpoints and a one-sequence forward pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


def make_tiny_checkpoint(path: Path, kind: str, sharded: bool = False, seed: int = 0,
                         tokenizer_dir: Path | None = None, **overrides: Any) -> None:
    """Save a random transformers model of ``kind`` (llama, qwen2, qwen3, mistral, gemma3, gemma2, phi3, and the
    mixtures of experts mixtral, qwen2_moe, qwen3_moe: 4 experts, 2 a token) as safetensors.
    gemma3: a local layer with a sliding window of 8 (shorter than most test prompts) then a global one;
    gemma2 the same, with soft-caps small enough to change the scores and logits."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[kind]
    params = {**TINY_BASE, **overrides}
    if kind in ("qwen3", "gemma3", "gemma2", "qwen3_moe"):
        params.setdefault("head_dim", 16)
    if kind in ("mixtral", "qwen2_moe", "qwen3_moe"):   # 4 experts, 2 per token, smaller than the dense MLP
        params.setdefault("num_local_experts" if kind == "mixtral" else "num_experts", 4)
        params.setdefault("num_experts_per_tok", 2)
        if kind == "mixtral":
            params.setdefault("sliding_window", None)
        else:
            params.setdefault("moe_intermediate_size", 32)
    if kind == "qwen2_moe":
        params.setdefault("shared_expert_intermediate_size", 64)
    if kind == "phi3":   # special ids inside the tiny vocabulary (Phi-3's are 32000 and up)
        params.update(bos_token_id=params.get("bos_token_id", 1), eos_token_id=params.get("eos_token_id", 2),
                      pad_token_id=params.get("pad_token_id", 0))
    if kind == "qwen3_moe":
        params.setdefault("norm_topk_prob", True)
    if kind == "gemma2":
        params.setdefault("attn_logit_softcapping", 0.5)
        params.setdefault("final_logit_softcapping", 3.0)
    if kind in ("gemma3", "gemma2"):
        params.setdefault("query_pre_attn_scalar", 24)   # not head_dim, so the scale's source shows
        params.setdefault("sliding_window", 8)
        params.setdefault("layer_types", ["sliding_attention", "full_attention"] * (params["num_hidden_layers"] // 2))
    config = config_cls(**params)
    if kind in ("gemma3", "gemma2"):
        config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # widen the init so logits are not all near zero
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma scales by 1 + weight
                p.uniform_(-0.5, 0.5) if kind.startswith("gemma") else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08 if p.dim() == 2 else 0.05)
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "5GB")


def hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def forward_one(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Full-sequence logits [n, vocab] of one prompt through the paged-attention model."""
    from duoserve.model.attention import AttentionMetadata

    arch = model.arch
    n = len(token_ids)
    num_blocks = (n + block_size - 1) // block_size
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    dtype = model.dtype
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(arch.num_layers)]
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], block_size)
    hidden = model(torch.tensor(token_ids), torch.arange(n), caches, meta)
    return model.compute_logits(hidden)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list]:
    """transformers' greedy continuation (eos ignored) and its per-step logits."""
    model.generation_config.eos_token_id = None  # never stop early, never suppress eos
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [s[0] for s in out.scores]


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.log_softmax(logits.float(), -1).topk(2).values
    return (top[0] - top[1]).item()


def assert_same_greedy(got: list[int], want: list[int], step_logits, label: str = "") -> None:
    """Identical greedy tokens, or a first divergence at a near-tie (top-2 log-prob gap < 1e-3), reported."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            gap = top2_gap(step_logits[i])
            assert gap < 1e-3, f"{label}: token {i} differs ({a} vs {b}) with top-2 gap {gap:.2e}"
            print(f"{label}: near-tie divergence at token {i} (gap {gap:.2e}), accepted")
            return
    assert len(got) == len(want), f"{label}: {len(got)} tokens vs {len(want)}"


def assert_pool_whole(engine_or_llm) -> None:
    """No request left, every KV block free again (cached blocks count as free), the swap space
    empty: what every engine test must leave behind. Takes an ``LLM`` or an ``EngineCore``."""
    engine = getattr(engine_or_llm, "engine", engine_or_llm)
    pool = engine.kv.pool
    assert not engine.has_unfinished() and not engine.scheduler.requests, \
        f"requests left in the engine: {sorted(engine.scheduler.requests)}"
    assert pool.num_free_blocks == pool.num_blocks, f"{pool.num_blocks - pool.num_free_blocks} blocks leaked"
    swap = engine.scheduler.swap   # a SwapSource: the swap space and its cost model
    if swap is not None:
        assert swap.space.usage == 0.0, f"swap space {swap.space.usage:.0%} used after the test"


def wait_for_store_writes(*engines, timeout: float = 5.0) -> None:
    """Wait until each engine's KV tiers' writers have written everything queued."""
    import time

    for engine in engines:
        for store in engine.store.stores:
            deadline = time.monotonic() + timeout
            while not store.writes.empty() and time.monotonic() < deadline:
                time.sleep(0.01)
    time.sleep(0.1)


RERANK_WORDS = ("the a sea sky fox dog cat moon sun rise fall quick brown lazy jumps over what is where are animals "
                "near peru llama camel panda bear china tide tides day pulled by and of to in . , ?").split()


def make_tiny_cross_encoder(path: Path, kind: str = "bert", seed: int = 0) -> None:
    """A random BERT (or XLM-RoBERTa) sequence classifier of one label with its tokenizer, as a
    sentence-transformers CrossEncoder loads it: a reranker."""
    import transformers

    letters = "abcdefghijklmnopqrstuvwxyz"
    if kind == "bert":
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *RERANK_WORDS, *letters, *(f"##{c}" for c in letters)]
        tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(words)}, model_max_length=128)
        config = transformers.BertConfig(pad_token_id=0, type_vocab_size=2)
        model_cls = transformers.BertForSequenceClassification
    else:
        pieces = ["<s>", "<pad>", "</s>", "<unk>", *(f"\u2581{w}" for w in RERANK_WORDS), *letters, "\u2581", "<mask>"]
        tokenizer = transformers.XLMRobertaTokenizer(vocab=[(p, -float(i)) for i, p in enumerate(pieces)],
                                                     model_max_length=126)
        words = pieces
        config = transformers.XLMRobertaConfig(pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
        model_cls = transformers.XLMRobertaForSequenceClassification
    config.update(dict(vocab_size=len(words), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, max_position_embeddings=128, num_labels=1))
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():   # wide enough that the scores spread
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "LayerNorm.weight" in name else p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


YES_NO_SPECIALS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")


def make_tiny_yes_no_reranker(path: Path, seed: int = 0) -> None:
    """A random tiny Qwen3 causal LM whose byte-level tokenizer has Qwen's chat markers and the
    words "yes" and "no" as tokens: a Qwen3-Reranker-style yes/no reranker once served with
    ``classifier_from_token``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(YES_NO_SPECIALS))
    backend.add_tokens(["yes", "no"])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tokenizer.save_pretrained(path)
    make_tiny_checkpoint(path, "qwen3", seed=seed, vocab_size=backend.get_vocab_size(),
                         eos_token_id=backend.token_to_id("<|im_end|>"), bos_token_id=None)
