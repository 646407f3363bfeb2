"""Engine configuration errors: the field, the value and what is allowed, in the message."""

from __future__ import annotations

import pytest

from duoserve import LLM
from duoserve.config import CacheConfig, SchedulerConfig
from duoserve.errors import ConfigError, InvalidInputError
from duoserve import SamplingParams


@pytest.mark.parametrize("size", [0, 3, 48, 512])
def test_block_size_power_of_two(size):
    with pytest.raises(ConfigError) as err:
        CacheConfig(block_size=size)
    assert str(err.value) == f"block_size={size} is not allowed: a power of two from 1 to 256"


def test_budget_below_context_without_chunking():
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(max_num_batched_tokens=256, enable_chunked_prefill=False).token_budget(512)
    assert str(err.value).startswith(
        "max_num_batched_tokens=256 is not allowed: at least max_model_len (512) when chunked prefill is off")
    assert SchedulerConfig(max_num_batched_tokens=256).token_budget(512) == 256
    assert SchedulerConfig().token_budget(8192) == 512


def test_kv_budget_too_small_for_an_asked_context(tiny_dir):
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_dir()), dtype="float32", kv_cache_memory=0.0001, max_model_len=512)
    # tiny llama: 512 bytes a token, 512 tokens -> 32 blocks of 16 tokens = 262144 bytes; 0.0001 GiB holds 13 blocks
    assert str(err.value) == (
        "kv_cache_memory=0.0001 is not allowed: a context whose KV cache fits: one 512-token sequence needs "
        "0.0002441 GiB of KV cache, more than the 0.0001 GiB given. Give --max-model-len 208 or "
        "--kv-cache-memory 0.0003")


def test_the_models_context_is_capped_at_what_a_given_pool_holds(tiny_dir):
    """No --max-model-len: the engine starts with the context its pool holds, as llama.cpp would."""
    llm = LLM(str(tiny_dir()), dtype="float32", kv_cache_memory=0.0001)
    assert llm.engine.max_model_len == 208 and llm.engine.memory["kv_pool"]["sizing"].startswith(
        "max_model_len capped at 208 tokens")
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
               .outputs[0].token_ids) == 4


def test_max_model_len_over_model_limit(tiny_dir):
    with pytest.raises(ConfigError, match=r"max_model_len=4096 is not allowed: at most the model's "
                                          r"max_position_embeddings \(512\)"):
        LLM(str(tiny_dir()), max_model_len=4096)


def test_sampling_params_errors():
    with pytest.raises(ConfigError, match=r"^temperature=-1 is not allowed: a number >= 0 \(0 is greedy\)$"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match=r"^top_p=0 is not allowed: a number in \(0, 1\]$"):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError, match=r"^logprobs=21 is not allowed: an integer in \[0, 20\]$"):
        SamplingParams(logprobs=21)
    with pytest.raises(ConfigError, match=r"^n=0 is not allowed"):
        SamplingParams(n=0)


def test_bad_prompts_are_refused_and_lose_nothing(tiny_dir):
    llm = LLM(str(tiny_dir()), kv_cache_memory=0.01, max_model_len=64)
    with pytest.raises(InvalidInputError, match="the prompt is empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(InvalidInputError, match=r"token id 999 is out of range: ids are integers in \[0, 256\)"):
        llm.generate([[1, 999]], use_tqdm=False)
    with pytest.raises(InvalidInputError, match="the prompt has 64 tokens, but the context length"):
        llm.generate([[1] * 64], use_tqdm=False)
    with pytest.raises(InvalidInputError, match="this model has no tokenizer"):
        llm.generate(["text"], use_tqdm=False)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 61 and out[0].outputs[0].finish_reason == "length"
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


def test_bad_prompt_in_a_batch_leaves_nothing_behind(tiny_dir):
    llm = LLM(str(tiny_dir()), kv_cache_memory=0.01)
    with pytest.raises(InvalidInputError):
        llm.generate([[1, 2], [3, 4], [1, 999]], use_tqdm=False)
    assert not llm.engine.has_unfinished() and not llm.frontend.states
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].finish_reason


def test_config_imports_no_torch():
    """The API process builds configs: duoserve.config probes nothing and imports no torch."""
    import subprocess
    import sys

    code = "import sys, duoserve.config; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout == "False\n"


@pytest.mark.parametrize("native_bf16,dtype,want", [(True, "auto", "bfloat16"), (False, "auto", "float32"),
                                                    (True, "float32", "float32"), (False, "float16", "float16")])
def test_auto_dtype_on_a_cpu_follows_native_bf16(monkeypatch, native_bf16, dtype, want):
    from duoserve import platform
    from duoserve.config import ModelConfig

    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: native_bf16)
    assert platform.resolve_dtype(ModelConfig(dtype=dtype, device="cpu")) == want


def test_this_machine_resolves_auto():
    """Without AVX512-BF16 or AMX-BF16 in /proc/cpuinfo, auto on a CPU is float32."""
    from duoserve import platform
    from duoserve.config import ModelConfig

    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split())
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    assert platform.cpu_has_native_bf16() == native
    assert platform.resolve_dtype(ModelConfig(device="cpu")) == ("bfloat16" if native else "float32")


def test_a_missing_gpu_is_a_config_error():
    import torch

    from duoserve.config import ModelConfig
    from duoserve.platform import resolve_device

    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^device='cuda:99' is not allowed: cuda:0 to cuda:"):
            resolve_device(ModelConfig(device="cuda:99"))
    else:
        with pytest.raises(ConfigError, match=r"^device='cuda' is not allowed: cpu or auto: no CUDA device"):
            resolve_device(ModelConfig(device="cuda"))
    assert resolve_device(ModelConfig(device="cpu")) == "cpu"


def test_chat_template_given_as_text_or_file_and_refused_by_name(tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    (tmp_path / "chat.jinja").write_text(template)
    chat = [{"role": "user", "content": "hi"}]
    for given in (template, str(tmp_path / "chat.jinja")):
        tokenizer = LLM(kv_cache_memory=0.25, max_model_len=1024, chat_template=given).get_tokenizer()
        assert tokenizer.apply_chat_template(chat) == "[user] hi\n[assistant] "
    from duoserve.model.loader import read_chat_template

    assert read_chat_template(str(tmp_path / "chat.jinja")) == template
    with pytest.raises(ConfigError, match=r"^chat_template='/no/such.jinja' is not allowed: .*no such file"):
        read_chat_template("/no/such.jinja")
    with pytest.raises(ConfigError, match=r"^chat_template='\{% for %\}' is not allowed: a Jinja template"):
        read_chat_template("{% for %}")


def test_under_auto_placement_a_decode_engine_computes_prompts_in_short_steps():
    """--prefill-device auto: a prompt placed on a decode engine goes in steps of 192 tokens (its
    decodes ride in each, none stalls them for more than a turn); a prefill engine keeps the
    default budget, and a budget given applies to both."""
    from duoserve.config import (AUTO_DECODE_STEP_TOKENS, DEFAULT_MAX_NUM_BATCHED_TOKENS, DisaggConfig,
                                 EngineConfig, SchedulerConfig)

    def budgets(disagg: DisaggConfig, scheduler: SchedulerConfig = SchedulerConfig()) -> tuple[int, int]:
        prefill, decode = disagg.engine_configs(EngineConfig(scheduler=scheduler))
        return prefill.scheduler.token_budget(8192), decode.scheduler.token_budget(8192)

    assert AUTO_DECODE_STEP_TOKENS == 192
    assert budgets(DisaggConfig(prefill_device="auto")) == (DEFAULT_MAX_NUM_BATCHED_TOKENS, 192)
    assert budgets(DisaggConfig(prefill_device="cpu")) == (512, 512)
    assert budgets(DisaggConfig(prefill_device="auto"), SchedulerConfig(max_num_batched_tokens=300)) == (300, 300)
    assert budgets(DisaggConfig(prefill_device="auto", prefill_max_num_batched_tokens=1024)) == (1024, 192)
