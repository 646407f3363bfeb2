"""LoRA adapters per request: duoserve's greedy tokens against transformers + PEFT on the same
seeded adapters, mixed batches against each request alone, and the prefix cache kept apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from duoserve import LLM, LoRARequest, SamplingParams
from duoserve.errors import ConfigError
from duoserve.model.lora import LoRALoadError
from tests.helpers import assert_pool_whole, assert_same_greedy, hf_greedy, hf_model

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 12, 64, 31, 8, 2, 90, 14, 15, 16, 200, 7], [7, 7, 8, 200, 31],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
MAX_TOKENS = 10
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_tiny_lora(base: Path, out: Path, seed: int, targets: list[str] = ALL_TARGETS, rank: int = 8,
                   alpha: int = 16, rslora: bool = False) -> Path:
    """A PEFT adapter on ``base`` with seeded random A and B (PEFT zeroes B: nothing would show)."""
    from peft import LoraConfig, get_peft_model

    model = hf_model(base)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                  lora_dropout=0.0, use_rslora=rslora))
    seed_lora_weights(peft_model, seed, 0.15)
    peft_model.save_pretrained(out)
    return out


def seed_lora_weights(peft_model, seed: int, scale: float) -> None:
    """Every A and B of a PEFT model drawn from a seeded normal times ``scale``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


@pytest.fixture(scope="module")
def base(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {"a": make_tiny_lora(base, root / "a", 1), "b": make_tiny_lora(base, root / "b", 2, ["q_proj", "v_proj"]),
            "c": make_tiny_lora(base, root / "c", 3, ["o_proj", "down_proj", "up_proj"], rank=4, rslora=True),
            "d": make_tiny_lora(base, root / "d", 4, rank=16, alpha=8)}


def peft_reference(base: Path, adapter: Path | None, prompt: list[int]) -> tuple[list[int], list]:
    from peft import PeftModel

    model = hf_model(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    return hf_greedy(model, prompt, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(base, adapters):
    return LLM(model=str(base), dtype="float32", kv_cache_memory=0.05,
               lora_modules=[f"{name}={path}" for name, path in adapters.items()])


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def tokens(llm: LLM, prompts, lora) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)]


@pytest.mark.parametrize("name", ["a", "b", "c", "d", None])
def test_greedy_tokens_equal_transformers_with_peft(llm, base, adapters, name):
    lora = None if name is None else LoRARequest(name)
    for prompt, got in zip(PROMPTS, tokens(llm, PROMPTS, lora)):
        want, logits = peft_reference(base, adapters.get(name), prompt)
        assert_same_greedy(got, want, logits, f"adapter {name}")
    assert_pool_whole(llm)


def test_the_adapters_change_the_answer(llm):
    answers = {name: tokens(llm, PROMPTS[:1], None if name is None else LoRARequest(name))[0]
               for name in ("a", "b", "c", "d", None)}
    assert len({tuple(t) for t in answers.values()}) == 5


def test_a_batch_mixing_four_adapters_and_the_base_equals_each_alone(llm):
    names = ["a", "b", "c", "d", None]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [None if n is None else LoRARequest(n) for _ in PROMPTS for n in names]
    alone = [tokens(llm, [p], lora)[0] for p, lora in zip(prompts, loras)]
    together = tokens(llm, prompts, loras)
    assert together == alone
    assert_pool_whole(llm)


def test_one_adapters_kv_never_serves_another_or_the_base(llm):
    prompt = [list(range(40, 80))]   # 40 tokens: two full blocks of 16 to find again
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def cached(lora) -> int:
        (out,) = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)
        return out.num_cached_tokens

    assert cached(LoRARequest("a")) == 0
    assert cached(LoRARequest("b")) == 0      # the same prompt under b: no hit
    assert cached(None) == 0                  # nor for the base
    assert cached(LoRARequest("a")) == 32     # a's own: its two full blocks
    assert cached(LoRARequest("b")) == 32


def test_bad_adapters_are_refused_by_reason(llm, base, adapters, tmp_path, tiny_dir):
    with pytest.raises(LoRALoadError, match="rank 16, over --max-lora-rank 8"):
        LLM(model=str(base), dtype="float32", kv_cache_memory=0.05, enable_lora=True, max_lora_rank=8).generate(
            PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("d", 1, str(adapters["d"])))
    other = make_tiny_lora(tiny_dir("llama", hidden_size=96), tmp_path / "other", 5)
    with pytest.raises(LoRALoadError, match="another base model"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 1, str(other)))
    with pytest.raises(LoRALoadError, match="no PEFT folder or GGUF file"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(tmp_path / "none")))
    with pytest.raises(ConfigError, match="not loaded"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("never"))
    assert sorted(llm.engine.runner.lora.adapters) == ["a", "b", "c", "d"]   # nothing half-loaded
    assert tokens(llm, PROMPTS[:1], LoRARequest("a"))   # and it serves on


# ---- other families, GGUF base weights, GGUF adapters ---------------------------------------

@pytest.mark.parametrize("kind", ["qwen2", "gemma3"])
def test_other_families_equal_transformers_with_peft(tiny_dir, tmp_path, kind):
    base = tiny_dir(kind)
    adapter = make_tiny_lora(base, tmp_path / kind, 7)
    llm = LLM(model=str(base), dtype="float32", kv_cache_memory=0.05, lora_modules=[f"x={adapter}"])
    for prompt, got in zip(PROMPTS, tokens(llm, PROMPTS, LoRARequest("x"))):
        want, logits = peft_reference(base, adapter, prompt)
        assert_same_greedy(got, want, logits, kind)
    assert tokens(llm, PROMPTS[:1], LoRARequest("x")) != tokens(llm, PROMPTS[:1], None)


def test_an_adapter_on_the_default_models_gguf_blocks_in_exact_mode_equals_peft(tmp_path):
    """The packaged Q4_1 file computed from its blocks (exact mode), an adapter trained on what
    transformers dequantizes from it: the same greedy tokens as transformers + PEFT."""
    import transformers
    from peft import LoraConfig, get_peft_model

    from duoserve.model.loader import default_model_path

    path = default_model_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    peft_model = get_peft_model(reference, LoraConfig(r=8, lora_alpha=16, target_modules=ALL_TARGETS))
    seed_lora_weights(peft_model, 11, 0.02)
    peft_model.save_pretrained(tmp_path / "smol-lora")
    llm = LLM(dtype="float32", quantization="gguf", gguf_mode="exact", kv_cache_memory=0.05,
              lora_modules=[f"s={tmp_path / 'smol-lora'}"])
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("The capital of France is")
    (got,) = tokens(llm, [prompt], LoRARequest("s"))
    want, logits = hf_greedy(peft_model.eval(), prompt, MAX_TOKENS)   # the adapter just saved, in PEFT
    assert_same_greedy(got, want, logits, "default model + adapter")
    assert got != tokens(llm, [prompt], None)[0]


GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def llama_cpp_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order for a llama GGUF (it permutes an adapter's B so)."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def write_gguf_adapter(peft_dir: Path, out: Path, arch: str, heads: tuple[int, int]) -> Path:
    """The adapter as llama.cpp's convert_lora_to_gguf.py writes it: general.type adapter,
    adapter.type lora, adapter.lora.alpha; blk.N.<tensor>.weight.lora_a [r, in] and .lora_b
    [out, r] in f32, Q and K's B rows permuted in a llama file. (Checked against the converter
    itself once: the same weights after our reading; BENCHMARKS.md has no figure for it.)"""
    import json

    import gguf
    from safetensors.torch import load_file

    alpha = json.loads((peft_dir / "adapter_config.json").read_text())["lora_alpha"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(alpha))
    for key, tensor in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        parts = key.split(".")   # base_model.model.model.layers.N.<block>.<proj>.lora_X.weight
        layer, proj, which = parts[4], parts[6], parts[7][-1].lower()
        if which == "b" and arch == "llama" and proj in ("q_proj", "k_proj"):
            tensor = llama_cpp_permute(tensor, heads[0] if proj == "q_proj" else heads[1])
        writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[proj]}.weight.lora_{which}", tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_gguf_adapter_equals_the_same_adapter_in_peft_form(tiny_dir, tmp_path, kind):
    from tests.helpers import TINY_BASE

    base = tiny_dir(kind)
    adapter = make_tiny_lora(base, tmp_path / "peft", 9)
    gguf_file = write_gguf_adapter(adapter, tmp_path / "adapter.gguf", kind,
                                   (TINY_BASE["num_attention_heads"], TINY_BASE["num_key_value_heads"]))
    llm = LLM(model=str(base), dtype="float32", kv_cache_memory=0.05,
              lora_modules=[f"peft={adapter}", f"gguf={gguf_file}"])
    assert tokens(llm, PROMPTS, LoRARequest("gguf")) == tokens(llm, PROMPTS, LoRARequest("peft"))
    peft, gguf_form = (llm.engine.runner.lora.adapters[n] for n in ("peft", "gguf"))
    for layer, update in peft.modules.items():
        assert torch.equal(update.a, gguf_form.modules[layer].a)
        assert all(torch.equal(p.b, g.b) for p, g in zip(update.slices, gguf_form.modules[layer].slices))
