"""Which models ``duoserve serve`` serves: one (``--model PATH``, as always), or several, each a
``ModelSpec`` with its own engine config.

Several come from ``--model NAME=PATH`` given again (loaded on start-up, in order), from
``--models-dir DIR`` (every ``.gguf`` file and Hugging Face folder in it, named by file or folder,
loaded when first asked for) and from ``--models-config FILE``: a TOML or YAML file with one
section per model name whose keys are the model's own flags (``max-model-len = 4096``), written
as on the command line and checked as they are. Every other flag is every model's.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
from pathlib import Path

from duoserve.cli.configs import engine_config_from_args
from duoserve.engine_args import EngineArgs
from duoserve.entrypoints.served_model import ModelSpec
from duoserve.entrypoints.server_config import MODEL_NAME, ServerConfig
from duoserve.errors import ConfigError
from duoserve.flags import add_flags, dest, flagged_fields

SERVER_KEYS = ("tool_call_parser", "reasoning_parser", "pooling")   # a model's own among the server's flags
SPECIAL_KEYS = ("model", "load_on_startup")


def several_models(args: argparse.Namespace) -> bool:
    given = getattr(args, "models_given", None) or []
    return bool(len(given) > 1 or any(_named(value)[0] for value in given) or args.models_dir
                or args.models_config)


def model_specs(args: argparse.Namespace, server: ServerConfig) -> list[ModelSpec]:
    """Every model the flags name, in order: --model first, then --models-dir, then sections of
    --models-config that name no model yet."""
    if args.served_model_name is not None:
        raise ConfigError("served_model_name", args.served_model_name, "unset with several models: each is named by "
                          "--model NAME=PATH, its file or folder in --models-dir, or its --models-config section")
    found: dict[str, tuple[str, bool]] = {}   # name -> (path, load on start-up)
    for value in getattr(args, "models_given", None) or []:
        name, path = _named(value)
        _add(found, name or _name_of(path), path, True, "model")
    if args.models_dir:
        for name, path in models_in(args.models_dir):
            _add(found, name, path, False, "models_dir")
    sections = read_models_config(args.models_config) if args.models_config else {}
    for name, section in sections.items():
        if name not in found:
            if "model" not in section:
                raise ConfigError("models_config", f"[{name}]", "a section for a model given by --model or "
                                  "--models-dir, or one with a 'model' key (its path)")
            _add(found, name, str(section["model"]), False, "models_config")
    if not found:
        raise ConfigError("models_dir", args.models_dir, "a directory holding .gguf files or Hugging Face folders")
    return [_spec(args, server, name, path, preload, sections.get(name, {}))
            for name, (path, preload) in found.items()]


def _named(value: str) -> tuple[str | None, str]:
    """``NAME=PATH`` -> (NAME, PATH); a plain path (or one that exists, '=' and all) -> (None, it)."""
    name, sep, path = value.partition("=")
    if not sep or os.path.exists(value) or "/" in name:
        return None, value
    return name, path


def _name_of(path: str) -> str:
    stem = Path(path.rstrip("/")).name
    return stem[:-len(".gguf")] if stem.endswith(".gguf") else stem


def _add(found: dict, name: str, path: str, preload: bool, field: str) -> None:
    if not MODEL_NAME.fullmatch(name):
        raise ConfigError(field, name, "a model name of letters, digits and . _ : - (up to 128)")
    if name in found:
        if field == "models_dir":   # given by --model already: that one wins
            return
        raise ConfigError(field, name, "a name given once: two models are named so")
    found[name] = (path, preload)


def models_in(directory: str) -> list[tuple[str, str]]:
    """(name, path) of every .gguf file, Hugging Face folder (config.json) and folder holding one
    .gguf file in ``directory``, by name."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError("models_dir", directory, "an existing directory")
    found = []
    for path in sorted(root.iterdir()):
        if path.is_file() and path.suffix == ".gguf":
            found.append((path.stem, str(path)))
        elif path.is_dir() and (path / "config.json").exists():
            found.append((path.name, str(path)))
        elif path.is_dir() and len(files := sorted(path.glob("*.gguf"))) == 1:
            found.append((path.name, str(files[0])))
    return found


def read_models_config(file: str) -> dict[str, dict]:
    """The file's sections: model name -> {key with underscores: value}."""
    try:
        text = Path(file).read_text()
    except OSError as exc:
        raise ConfigError("models_config", file, f"a readable TOML or YAML file ({exc.strerror})") from None
    try:
        if file.endswith(".toml"):
            import tomllib

            data = tomllib.loads(text)
        elif file.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError("models_config", file, "a file ending in .toml, .yaml or .yml")
    except ConfigError:
        raise
    except Exception as exc:   # the parser's own message says where
        raise ConfigError("models_config", file, f"valid TOML or YAML ({exc})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ConfigError("models_config", file, "one section (table) per model name, each of flag = value")
    return {str(name): {str(k).replace("-", "_"): v for k, v in section.items()} for name, section in data.items()}


class _SectionParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def _section_parser() -> tuple[_SectionParser, dict[str, str]]:
    """A parser of a model's own flags, and each key's flag."""
    parser = _SectionParser(add_help=False)
    EngineArgs.add_cli_args(parser)
    add_flags(parser, ServerConfig)
    options = {dest(f): "--" + dest(f).replace("_", "-") for f in flagged_fields(EngineArgs)}
    options.update({key: "--" + key.replace("_", "-") for key in SERVER_KEYS})
    return parser, options


def _spec(args: argparse.Namespace, server: ServerConfig, name: str, path: str, preload: bool,
          section: dict) -> ModelSpec:
    """The model's flags: the command line's, its path, then its section's keys on top."""
    parser, options = _section_parser()
    argv = []
    for key, value in section.items():
        if key in SPECIAL_KEYS:
            continue
        if key not in options:
            raise ConfigError(f"models_config [{name}]", key, "an engine flag (as --max-model-len: max-model-len), "
                              f"{', '.join(k.replace('_', '-') for k in SERVER_KEYS + SPECIAL_KEYS)}")
        if isinstance(value, bool):
            argv.append(options[key] if value else "--no-" + options[key][2:])
        else:
            argv += [options[key], str(value)]
    namespace = copy.copy(args)
    namespace.model = path
    try:
        parser.parse_args(argv, namespace=namespace)
    except ValueError as exc:
        raise ConfigError(f"models_config [{name}]", " ".join(argv), str(exc)) from None
    preload = bool(section.get("load_on_startup", preload))
    values = {key: getattr(namespace, key) for key in SERVER_KEYS}
    return ModelSpec(name, engine_config_from_args(namespace),
                     dataclasses.replace(server, served_model_name=name, **values), preload)
