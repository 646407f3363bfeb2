"""Flags to the config tree: each function turns one ``argparse`` namespace into validated
``duoserve.config`` dataclasses, raising the ``ConfigError`` of a wrong combination of flags
before anything loads."""

from __future__ import annotations

import argparse

from duoserve.config import ClusterConfig, DisaggConfig, EngineConfig, parse_address_list, parse_cpu_list
from duoserve.engine_args import EngineArgs
from duoserve.errors import ConfigError


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineArgs.from_cli_args(args).create_engine_config()


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(kind=args.cluster, ray_address=args.ray_address, ray_namespace=args.ray_namespace,
                         auth_key_file=args.auth_key_file, num_engines=args.num_engines,
                         routing=args.routing)


def disagg_config_from_args(args: argparse.Namespace) -> DisaggConfig | None:
    placed = {"num_prefill_engines": args.num_prefill_engines, "num_decode_engines": args.num_decode_engines,
              "prefill_addrs": args.prefill_addrs, "decode_addrs": args.decode_addrs}
    if args.mode != "disaggregated":
        for name, value in placed.items():
            if value is not None:
                raise ConfigError(name, value, "only with --mode disaggregated (colocated runs one engine)")
        return None
    for role in ("prefill", "decode"):
        if placed[f"{role}_addrs"] is not None and placed[f"num_{role}_engines"] is not None:
            raise ConfigError(f"num_{role}_engines", placed[f"num_{role}_engines"],
                              f"unset when --{role}-addrs names the engines (their count is the list's)")
    return DisaggConfig(prefill_device=args.prefill_device, max_prefill_len=args.max_prefill_len,
                        prefill_threads=args.prefill_threads, decode_threads=args.decode_threads,
                        prefill_cpus=parse_cpu_list(args.prefill_cpus, "prefill_cpus"),
                        decode_cpus=parse_cpu_list(args.decode_cpus, "decode_cpus"),
                        kv_transport=args.kv_transport, kv_lease_timeout=args.kv_lease_timeout,
                        prefill_max_num_batched_tokens=args.prefill_max_num_batched_tokens,
                        num_prefill_engines=1 if args.num_prefill_engines is None else args.num_prefill_engines,
                        num_decode_engines=1 if args.num_decode_engines is None else args.num_decode_engines,
                        prefill_addrs=parse_address_list(args.prefill_addrs, "prefill_addrs"),
                        decode_addrs=parse_address_list(args.decode_addrs, "decode_addrs"),
                        engine_host=args.engine_host, auth_key_file=args.auth_key_file,
                        insecure_no_auth=args.insecure_no_auth, core_sharing=args.core_sharing,
                        prefill_turn=args.prefill_turn)
