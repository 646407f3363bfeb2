"""Flags to the config tree: each function turns one ``argparse`` namespace into validated
``duoserve.config`` dataclasses, raising the ``ConfigError`` of a wrong combination of flags
before anything loads."""

from __future__ import annotations

import argparse

from duoserve.config import (CacheConfig, ClusterConfig, DisaggConfig, EngineConfig, KVStoreConfig, ModelConfig,
                             SchedulerConfig, SpeculativeConfig, parse_address_list, parse_cpu_list)
from duoserve.errors import ConfigError


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device, hf_overrides=args.hf_overrides,
                          max_model_len=args.max_model_len, seed=args.seed, quantization=args.quantization,
                          gguf_mode=args.gguf_mode),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                          gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
                          enable_prefix_caching=args.enable_prefix_caching, swap_space=args.swap_space),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs,
                                  enable_chunked_prefill=args.enable_chunked_prefill),
        num_threads=args.num_threads,
        enforce_eager=args.enforce_eager,
        speculative=speculative_config_from_args(args),
        kv_store=KVStoreConfig(args.kv_store, args.kv_store_ttl, args.kv_store_timeout,
                               required=args.kv_store_required) if args.kv_store else None,
    )


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    if args.speculative_method is None:
        if args.speculative_model is not None:
            raise ConfigError("speculative_method", None, "ngram or draft: --speculative-model needs "
                              "--speculative-method draft")
        return None
    return SpeculativeConfig(method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
                             ngram_min=args.ngram_min, ngram_max=args.ngram_max, model=args.speculative_model,
                             quantization=args.speculative_quantization, gguf_mode=args.speculative_gguf_mode,
                             disable_batch_size=args.speculative_disable_batch_size)


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(kind=args.cluster, ray_address=args.ray_address, ray_namespace=args.ray_namespace,
                         auth_key_file=args.auth_key_file, num_engines=args.num_engines)


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
                        insecure_no_auth=args.insecure_no_auth)
