"""Flags to the config tree: each function turns one ``argparse`` namespace into validated
``duoserve.config`` dataclasses (their fields declare their flags: ``duoserve.flags``), raising
the ``ConfigError`` of a wrong combination of flags before anything loads."""

from __future__ import annotations

import argparse

from duoserve.config import DEFAULT_MODEL_ALIAS, ClusterConfig, DisaggConfig, EngineConfig, Role
from duoserve.engine_args import EngineArgs
from duoserve.entrypoints.server_config import ModelsConfig, ServerConfig
from duoserve.errors import ConfigError
from duoserve.flags import values_from_args


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineArgs.from_cli_args(args).create_engine_config()


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    cluster = ClusterConfig(**values_from_args(ClusterConfig, args))
    if cluster.routing == "kv-events" and getattr(args, "kv_events_endpoint", None) is None:
        raise ConfigError("routing", "kv-events", "prefix routing on the engines' KV events needs engines that "
                          "publish them: give --kv-events-endpoint too")
    return cluster


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server's flags; the name clients use is the model's where none is given."""
    values = values_from_args(ServerConfig, args)
    values["served_model_name"] = values["served_model_name"] or args.model or DEFAULT_MODEL_ALIAS
    return ServerConfig(**values)


def disagg_config_from_args(args: argparse.Namespace) -> DisaggConfig | None:
    placed = {"num_prefill_engines": args.num_prefill_engines, "num_decode_engines": args.num_decode_engines,
              "prefill_addrs": args.prefill_addrs, "decode_addrs": args.decode_addrs}
    if args.mode != "disaggregated":
        for name, value in placed.items():
            if value is not None:
                raise ConfigError(name, value, "only with --mode disaggregated (colocated runs one engine)")
        return None
    for role in (Role.PREFILL, Role.DECODE):
        if placed[f"{role}_addrs"] is not None and placed[f"num_{role}_engines"] is not None:
            raise ConfigError(f"num_{role}_engines", placed[f"num_{role}_engines"],
                              f"unset when --{role}-addrs names the engines (their count is the list's)")
    return DisaggConfig(**values_from_args(DisaggConfig, args))


def models_config_from_args(args: argparse.Namespace) -> ModelsConfig:
    return ModelsConfig(**values_from_args(ModelsConfig, args))
