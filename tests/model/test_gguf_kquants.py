"""Q2_K and Q3_K files (the small downloads of 7B-8B models): a tiny Llama written with gguf's writer
in those types computes what transformers computes from the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from duoserve import LLM, SamplingParams
from duoserve.config import ModelConfig
from duoserve.kernels.linear import GGUFLinear
from duoserve.worker.backends import load_model
from tests.helpers import assert_pool_whole, assert_same_greedy, forward_one, hf_greedy
from tests.model.kquants import QUANTIZERS
from tests.model.test_gguf import PROMPT, write_gguf

# rows of whole super-blocks (256 values) for every projection
K_QUANT_TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("type_name", list(QUANTIZERS))
def test_test_quantizer_round_trips(type_name):
    """The tests' quantizer gives blocks that gguf dequantizes close to the input (so the files below
    are the checkpoint, quantized, and not noise)."""
    x = np.random.default_rng(3).standard_normal((16, 512)).astype(np.float32)
    back = quants.dequantize(QUANTIZERS[type_name](x), GGMLQuantizationType[type_name])
    assert np.corrcoef(x.ravel(), back.ravel())[0, 1] > 0.94


@pytest.fixture(scope="module", params=list(QUANTIZERS))
def k_quant_file(request, tiny_dir, tmp_path_factory):
    """(type, the file, transformers' model loaded from it)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("kquant") / f"tiny-{request.param}.gguf"
    write_gguf(tiny_dir(kind="llama", **K_QUANT_TINY), out, request.param)
    hf = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32).eval()
    return request.param, out, hf


def test_file_logits_equal_transformers(k_quant_file):
    """Dequantized at load, and computed from the blocks in exact mode: transformers' logits within
    1e-4; fast mode (8-bit activations) close to them."""
    type_name, path, hf = k_quant_file
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    assert want.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    dense = load_model(ModelConfig(model=str(path), dtype="float32", quantization="none"))
    assert (forward_one(dense.model, PROMPT) - want).abs().max().item() < 1e-4
    exact = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf", gguf_mode="exact"))
    linears = [m for m in exact.model.modules() if isinstance(m, GGUFLinear)]
    assert {p.type_name for m in linears for p in m.parts} == {type_name}
    assert (forward_one(exact.model, PROMPT) - want).abs().max().item() < 1e-4
    fast = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf", gguf_mode="fast"))
    got = forward_one(fast.model, PROMPT)
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.05


def test_file_greedy_tokens_equal_transformers(k_quant_file):
    """Through the engine, from the blocks (exact mode), chunked: transformers' greedy tokens."""
    type_name, path, hf = k_quant_file
    prompts = [PROMPT, PROMPT[:5], list(range(40, 110))]
    llm = LLM(str(path), dtype="float32", quantization="gguf", gguf_mode="exact", kv_cache_memory=0.01,
              max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            want, scores = hf_greedy(hf, prompt, 16)
            assert_same_greedy(out.outputs[0].token_ids, want, scores, f"{type_name} prompt of {len(prompt)}")
    assert_pool_whole(llm)
