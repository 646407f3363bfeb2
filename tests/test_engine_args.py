"""Every engine flag from one place: the CLI, ``LLM(...)`` and the config tree agree on names
and defaults because all three come from ``EngineArgs``."""

from __future__ import annotations


import pytest

from duoserve.cli.args import build_parser
from duoserve.cli.configs import engine_config_from_args
from duoserve.config import EngineConfig, SpeculativeConfig
from duoserve.engine_args import EngineArgs
from duoserve.errors import ConfigError


def test_the_defaults_are_the_config_trees():
    assert EngineArgs().create_engine_config() == EngineConfig()


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "x"], ["prefill", "--listen", "ipc:///tmp/x"],
                                     ["decode", "--listen", "ipc:///tmp/x"]])
def test_every_command_with_engine_flags_has_every_field_with_its_default(command):
    args = build_parser().parse_args(command)
    expected = EngineArgs()
    assert EngineArgs.from_cli_args(args) == expected
    assert engine_config_from_args(args) == expected.create_engine_config()


def test_a_flag_reaches_the_tree_under_its_field_name():
    args = build_parser().parse_args(["serve", "--max-model-len", "300", "--no-enable-prefix-caching",
                                      "--kv-cache-dtype", "bfloat16", "--speculative-method", "ngram",
                                      "--ngram-max", "6", "--hf-overrides", '{"eos_token_id": 3}'])
    config = engine_config_from_args(args)
    assert config.model.max_model_len == 300 and config.model.hf_overrides == {"eos_token_id": 3}
    assert config.cache.enable_prefix_caching is False and config.cache.kv_cache_dtype == "bfloat16"
    assert config.speculative == SpeculativeConfig(method="ngram", ngram_max=6)


def test_speculation_is_given_one_way():
    with pytest.raises(ConfigError) as err:
        EngineArgs(speculative_method="ngram", speculative_config={"method": "ngram"}).create_engine_config()
    assert str(err.value).startswith("speculative_config={'method': 'ngram'} is not allowed: unset when "
                                     "speculative_method is given")
    assert EngineArgs(speculative_config={"method": "ngram", "ngram_min": 1}).create_engine_config().speculative == \
        SpeculativeConfig(method="ngram", ngram_min=1)


def test_llm_refuses_an_unknown_keyword_by_name():
    from duoserve import LLM

    with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens_per_step'"):
        LLM(max_tokens_per_step=4)
