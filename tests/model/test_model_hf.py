"""The model computes what Hugging Face transformers computes, for every supported family."""

from __future__ import annotations

import pytest
import torch

from duoserve.config import ModelConfig
from duoserve.worker.backends import load_model
from tests.helpers import forward_one, hf_model

PROMPT = [5, 17, 200, 3, 99, 42, 42, 7, 128, 255, 0, 64, 31, 8, 150, 77, 23, 11, 90, 4]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}

CASES = {
    "llama": dict(kind="llama"),
    "llama-tied": dict(kind="llama", tie_word_embeddings=True),
    "llama3-rope": dict(kind="llama", rope_parameters=LLAMA3_ROPE),
    "llama-sharded": dict(kind="llama", sharded=True),
    "qwen2": dict(kind="qwen2"),
    "qwen2-sharded": dict(kind="qwen2", sharded=True),
    "qwen3": dict(kind="qwen3"),
    "qwen3-sharded-tied": dict(kind="qwen3", sharded=True, tie_word_embeddings=True),
    "mistral": dict(kind="mistral", sliding_window=None),
    "mistral-window": dict(kind="mistral", sliding_window=8),   # the prompt is longer than the window
    "llama-gelu": dict(kind="llama", hidden_act="gelu_pytorch_tanh"),  # the config's activation, not SiLU
    "gemma3": dict(kind="gemma3"),
    "gemma2": dict(kind="gemma2"),
    "mixtral": dict(kind="mixtral"),
    "qwen2-moe": dict(kind="qwen2_moe"),                        # a shared expert, weights not renormalized
    "qwen2-moe-dense-layer": dict(kind="qwen2_moe", mlp_only_layers=[0]),
    "qwen2-moe-sparse-step": dict(kind="qwen2_moe", num_hidden_layers=4, decoder_sparse_step=2),
    "qwen3-moe": dict(kind="qwen3_moe"),
    "qwen3-moe-one-expert": dict(kind="qwen3_moe", num_experts_per_tok=1),
    "gemma3-linear-rope": dict(kind="gemma3", num_hidden_layers=4, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_full_sequence_logits_match_transformers(tiny_dir, case):
    path = tiny_dir(**CASES[case])
    if CASES[case].get("sharded"):
        assert len(list(path.glob("*.safetensors"))) > 1, "the sharded case must really be sharded"
    ours = load_model(ModelConfig(model=str(path), dtype="float32"))
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([PROMPT])).logits[0]
    got = forward_one(ours.model, PROMPT)
    assert got.shape == ref.shape
    assert ref.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    assert (got - ref).abs().max().item() < 1e-4


def test_llama3_rope_scaling_changes_logits(tiny_dir):
    """The llama3 case is not vacuous: scaling moves the logits at these positions."""
    plain = load_model(ModelConfig(model=str(tiny_dir(kind="llama")), dtype="float32"))
    scaled = load_model(ModelConfig(model=str(tiny_dir(kind="llama", rope_parameters=LLAMA3_ROPE)),
                                    dtype="float32"))
    assert scaled.arch.rope.rope_type == "llama3"
    diff = (forward_one(plain.model, PROMPT) - forward_one(scaled.model, PROMPT)).abs().max()
    assert diff > 1e-3


def test_block_size_does_not_change_logits(tiny_dir):
    model = load_model(ModelConfig(model=str(tiny_dir(kind="qwen3")), dtype="float32")).model
    a = forward_one(model, PROMPT, block_size=4)
    b = forward_one(model, PROMPT, block_size=64)
    assert (a - b).abs().max().item() < 1e-5


def test_bfloat16_close_to_float32(tiny_dir):
    path = str(tiny_dir(kind="llama"))
    fp32 = forward_one(load_model(ModelConfig(model=path, dtype="float32")).model, PROMPT)
    bf16 = load_model(ModelConfig(model=path, dtype="bfloat16"))
    assert bf16.model.embed.weight.dtype == torch.bfloat16
    got = forward_one(bf16.model, PROMPT)
    assert got.dtype == torch.float32
    assert (got - fp32).abs().max().item() < 0.15
    assert (got.argmax(-1) == fp32.argmax(-1)).float().mean() > 0.8


def test_routing_ties_pick_the_experts_transformers_picks(tiny_dir):
    """A router of zeros ties every expert for every token: the experts chosen (and so the logits)
    are still transformers' (torch.topk's order among equals, on the same float32 softmax)."""
    import safetensors.torch

    path = tiny_dir(kind="qwen3_moe")
    tied = path.parent / "tied-router"
    if not tied.exists():
        import shutil

        shutil.copytree(path, tied)
        weights = safetensors.torch.load_file(str(tied / "model.safetensors"))
        for name in weights:
            if name.endswith("mlp.gate.weight"):
                weights[name] = torch.zeros_like(weights[name])
        safetensors.torch.save_file(weights, str(tied / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(ModelConfig(model=str(tied), dtype="float32"))
    moe = ours.model.layers[0].moe
    chosen, weights = moe.route(torch.randn(5, ours.arch.hidden_size))
    assert torch.equal(weights, torch.full((5, 2), 0.5))          # renormalized over two equal picks
    assert torch.equal(chosen, torch.topk(torch.full((5, 4), 0.25), 2).indices)
    with torch.no_grad():
        ref = hf_model(tied)(torch.tensor([PROMPT])).logits[0]
    assert (forward_one(ours.model, PROMPT) - ref).abs().max().item() < 1e-4


def test_only_the_chosen_experts_run_and_their_load_is_counted(tiny_dir):
    ours = load_model(ModelConfig(model=str(tiny_dir(kind="mixtral")), dtype="float32"))
    moe = ours.model.layers[1].moe
    ran = []
    for i, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda module, args, out, i=i: ran.append((i, args[0].shape[0])))
    x = torch.randn(3, ours.arch.hidden_size)
    chosen, _ = moe.route(x)
    before = moe.expert_tokens.clone()
    moe(x)
    picked = sorted(set(chosen.flatten().tolist()))
    assert [i for i, _ in ran] == picked, "each chosen expert runs once, the others never"
    assert [n for _, n in ran] == [int((chosen == i).sum()) for i in picked]
    assert (moe.expert_tokens - before).tolist() == [int((chosen == i).sum()) for i in range(4)]
