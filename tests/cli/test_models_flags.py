"""``serve``'s models: --model NAME=PATH again, --models-dir, --models-config, each checked by name."""

from __future__ import annotations

import pytest

from duoserve.cli.args import build_parser
from duoserve.cli.commands import serve_plan
from duoserve.errors import ConfigError


def plan(*argv: str):
    return serve_plan(build_parser().parse_args(["serve", *argv]))


def test_one_model_is_served_as_always():
    server, config, _, _, limits = plan("--model", "smollm2-135m", "--max-model-len", "512")
    assert config.model.model == "smollm2-135m" and config.model.max_model_len == 512
    assert server.served_model_name == "smollm2-135m" and limits.models_max == 4 and limits.models_autoload


def test_named_models_keep_their_order_and_share_the_other_flags(tmp_path):
    gguf = tmp_path / "b.gguf"
    gguf.write_bytes(b"")
    _, specs, _, _, _ = plan("--model", "a=smollm2-135m", "--model", str(gguf), "--max-model-len", "256",
                             "--tool-call-parser", "hermes")
    assert [(s.name, s.engine_config.model.model, s.load_on_startup) for s in specs] == [
        ("a", "smollm2-135m", True), ("b", str(gguf), True)]
    assert all(s.engine_config.model.max_model_len == 256 for s in specs)
    assert all(s.server.tool_call_parser == "hermes" and s.server.served_model_name == s.name for s in specs)


def test_a_models_dir_names_files_and_folders_and_loads_them_when_asked(tmp_path):
    (tmp_path / "chat.gguf").write_bytes(b"")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "coder").mkdir()
    (tmp_path / "coder" / "coder-q4.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    _, specs, _, _, _ = plan("--models-dir", str(tmp_path), "--model", "chat=smollm2-135m")
    assert [(s.name, s.engine_config.model.model, s.load_on_startup) for s in specs] == [
        ("chat", "smollm2-135m", True), ("coder", str(tmp_path / "coder" / "coder-q4.gguf"), False),
        ("hf", str(tmp_path / "hf"), False)]


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_a_models_config_sets_each_models_own_flags(tmp_path, suffix):
    text = {".toml": '[a]\nmax-model-len = 128\nenable-prefix-caching = false\nreasoning-parser = "deepseek_r1"\n'
                     '[extra]\nmodel = "smollm2-135m"\nload-on-startup = true\ndtype = "float32"\n',
            ".yaml": "a:\n  max-model-len: 128\n  enable-prefix-caching: false\n  reasoning-parser: deepseek_r1\n"
                     "extra:\n  model: smollm2-135m\n  load-on-startup: true\n  dtype: float32\n"}[suffix]
    file = tmp_path / f"models{suffix}"
    file.write_text(text)
    _, specs, _, _, _ = plan("--model", "a=smollm2-135m", "--models-config", str(file), "--max-model-len", "256")
    a, extra = specs
    assert a.engine_config.model.max_model_len == 128 and not a.engine_config.cache.enable_prefix_caching
    assert a.server.reasoning_parser == "deepseek_r1"
    assert extra.name == "extra" and extra.load_on_startup and extra.engine_config.model.dtype == "float32"
    assert extra.engine_config.model.max_model_len == 256 and extra.server.reasoning_parser is None


@pytest.mark.parametrize("argv, field, needle", [
    (["--model", "a=smollm2-135m", "--model", "a=smollm2-135m"], "model", "a name given once"),
    (["--model", "a=smollm2-135m", "--served-model-name", "x"], "served_model_name", "unset with several"),
    (["--model", "bad name=smollm2-135m", "--model", "b=smollm2-135m"], "model", "letters, digits"),
    (["--models-dir", "/no/such/dir"], "models_dir", "an existing directory"),
    (["--model", "a=smollm2-135m", "--models-max", "0"], "models_max", "a positive number"),
    (["--sleep-idle-seconds", "0"], "sleep_idle_seconds", "a positive number"),
    (["--model", "a=smollm2-135m", "--model", "b=smollm2-135m", "--mode", "disaggregated", "--decode-addrs",
      "tcp://127.0.0.1:7100", "--prefill-addrs", "tcp://127.0.0.1:7101"], "model", "engines run elsewhere"),
])
def test_wrong_models_flags_are_refused_by_name(argv, field, needle):
    with pytest.raises(ConfigError) as err:
        plan(*argv)
    assert err.value.field == field and needle in str(err.value)


@pytest.mark.parametrize("text, field, needle", [
    ('[a]\nport = 9000\n', "models_config [a]", "an engine flag"),
    ('[a]\nmax-model-len = "lots"\n', "models_config [a]", "invalid"),
    ('[a]\ndtype = "float8"\n', "models_config [a]", "invalid choice"),
    ('[ghost]\nmax-model-len = 10\n', "models_config", "with a 'model' key"),
    ('a = 1\n', "models_config", "one section (table) per model"),
    ('[a\n', "models_config", "valid TOML or YAML"),
])
def test_wrong_models_config_keys_are_refused_by_section_and_key(tmp_path, text, field, needle):
    file = tmp_path / "models.toml"
    file.write_text(text)
    with pytest.raises(ConfigError) as err:
        plan("--model", "a=smollm2-135m", "--models-config", str(file))
    assert err.value.field == field and needle in str(err.value)
