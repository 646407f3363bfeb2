"""Every engine flag written once: its name, type, default, help and choices.

``EngineArgs`` is an engine's configuration flat, as vLLM's ``EngineArgs`` is: the ``duoserve``
command's engine flags are made from its fields (``add_cli_args``: ``max_model_len`` is
``--max-model-len``), ``LLM(...)`` takes the same names as keywords, and
``create_engine_config`` builds the validated tree of ``duoserve.config`` from it (each
dataclass there checks its own values and names the field). Defaults are read off the config
dataclasses, never restated. A new engine flag is one field here and, where it lands in the
tree, one argument in ``create_engine_config`` (docs/architecture.md, "Flags").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from duoserve.config import (DEFAULT_CPU_KV_CACHE_GIB, DEFAULT_CPU_KV_SEQUENCES, DEFAULT_MAX_NUM_BATCHED_TOKENS,
                             LATENCY_STEP_MS, LATENCY_STEP_TOKENS,
                             DEFAULT_NUM_SPECULATIVE_TOKENS,
                             DEFAULT_SPEC_DISABLE_BATCH_SIZE, DTYPES, GGUF_MODES, QUANTIZATIONS, SCHEDULING_POLICIES,
                             SPEC_METHODS, parse_lora_modules, parse_size, parse_tenant_weights,
                             CacheConfig, EngineConfig, KVDiskConfig, KVEventsConfig, KVStoreConfig, LoRAConfig,
                             ModelConfig, SchedulerConfig, SpeculativeConfig)
from duoserve.errors import ConfigError
from duoserve.flags import add_flags, flag, values_from_args
from duoserve.gguf_types import block_type_names

MODEL_GROUP = "model and engine"
SPECULATIVE_GROUP = "speculative decoding (off unless --speculative-method is given)"
KV_STORE_GROUP = "shared KV store (off unless --kv-store is given)"
KV_DISK_GROUP = "KV tier on disk (off unless --kv-disk-path is given)"
KV_EVENTS_GROUP = "KV events for cluster routers (off unless --kv-events-endpoint is given)"
LORA_GROUP = "LoRA adapters (off unless --enable-lora or --lora-modules is given)"


def _spec_defaults(table: dict[str, int]) -> str:
    return ", ".join(f"{value} for {method}" for method, value in table.items())


@dataclass
class EngineArgs:
    # what to load and how to compute with it
    model: str | None = flag(
        ModelConfig.model, "a Hugging Face checkpoint directory, a .gguf file, or 'smollm2-135m'",
        default_help="the packaged SmolLM2-135M-Instruct")
    dtype: str = flag(
        ModelConfig.dtype, "weights and activations; auto = bfloat16 on a GPU or on a CPU with native bf16 "
        "(AVX512-BF16, AMX), else float32. float32 matches transformers exactly", choices=DTYPES)
    quantization: str = flag(
        ModelConfig.quantization, f"gguf: keep a GGUF file's quantized blocks ({block_type_names()}) in memory and compute from them (CPU); int8: quantize linear weights per output channel at "
        "load; none: dequantize to --dtype at load; auto = gguf for a quantized GGUF file on CPU, else none",
        choices=QUANTIZATIONS)
    gguf_mode: str = flag(
        ModelConfig.gguf_mode, "arithmetic of --quantization gguf for decode rows: fast quantizes activations to "
        "8 bits per block and uses integer dot products (llama.cpp's way); exact widens each block to float32 (the "
        "dequantized model's result up to summation order)", choices=GGUF_MODES)
    device: str = flag(ModelConfig.device, "cpu, cuda or cuda:N; auto = cuda if a GPU is visible, else cpu")
    max_model_len: int | None = flag(ModelConfig.max_model_len, "context length in tokens", parse=int,
                                     default_help="the model's max_position_embeddings")
    hf_overrides: dict[str, Any] = flag(
        help='JSON object of config values to mend, e.g. \'{"eos_token_id": [2, 32000]}\'', parse=json.loads,
        factory=dict, default_help="none")
    chat_template: str | None = flag(
        ModelConfig.chat_template, "the chat template (Jinja) for chats, or a file holding it: for a model file "
        "without one, or to replace its own (vLLM's flag)", default_help="the model file's")
    # the KV cache, the step's budget and the engine process
    block_size: int = flag(CacheConfig.block_size, "tokens per KV block, a power of two", parse=int)
    kv_cache_memory: float | None = flag(
        CacheConfig.kv_cache_memory, "KV cache budget in GiB", parse=float,
        default_help=f"{DEFAULT_CPU_KV_CACHE_GIB:g} on CPU (or {DEFAULT_CPU_KV_SEQUENCES} sequences of the whole "
                     "context where that is less), raised to hold one sequence of the whole context where "
                     "half of the available memory allows it (else, without --max-model-len, the context is capped "
                     "at what the pool holds, said at start); on GPU --gpu-memory-utilization of free memory")
    kv_cache_dtype: str = flag(
        CacheConfig.kv_cache_dtype, "KV cache element type; auto = the model dtype. bfloat16 halves the KV memory "
        "and the bytes decode attention reads", choices=DTYPES)
    gpu_memory_utilization: float = flag(CacheConfig.gpu_memory_utilization,
                                         "fraction of free GPU memory for the KV cache", parse=float)
    swap_space: float = flag(
        CacheConfig.swap_space, "GiB of host memory for the KV of preempted requests, copied out and back in when "
        "that costs less than recomputing them (pinned on a GPU; on a CPU a pool of its own, beside "
        "--kv-cache-memory)", parse=float, default_help="0, always recompute")
    enable_prefix_caching: bool = flag(CacheConfig.enable_prefix_caching,
                                       "reuse the KV of shared prompt prefixes", parse=bool)
    enable_chunked_prefill: bool = flag(SchedulerConfig.enable_chunked_prefill,
                                        "split long prompts across steps under the token budget", parse=bool)
    max_num_batched_tokens: int | None = flag(
        SchedulerConfig.max_num_batched_tokens, "token budget of one step", parse=int,
        default_help=f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} with chunked prefill ({LATENCY_STEP_TOKENS} under "
        "--scheduling-policy priority or fair: a step's length is what a request that outranks the running "
        "ones waits), else max_model_len")
    max_num_seqs: int = flag(SchedulerConfig.max_num_seqs, "most sequences in one step", parse=int)
    max_step_ms: float | None = flag(
        SchedulerConfig.max_step_ms, "a step's target length in ms: its token budget paced to it from the "
        "engine's measured tokens a second, the running requests served in turn past it (0: off)", parse=float,
        default_help=f"{LATENCY_STEP_MS:g} under --scheduling-policy priority (the most a request that outranks "
        "the running ones waits for the step in progress), off under fcfs and fair")
    scheduling_policy: str = flag(
        SchedulerConfig.policy, "fcfs: requests in arrival order; priority: by each request's priority (lower "
        "first, then arrival), a waiting request preempting running ones of a worse priority when the batch "
        "or the KV pool is full; fair: by priority, then by the tokens each tenant (API key or user field) has "
        "been served over its weight, preempting likewise", choices=SCHEDULING_POLICIES)
    tenant_weights: tuple[tuple[str, float], ...] = flag(
        SchedulerConfig.tenant_weights, "tenants' shares under --scheduling-policy fair, as tenant=weight pairs "
        "(alice=2,bob=1: alice is served twice bob's tokens when both wait)", convert=parse_tenant_weights,
        cli_default=None, default_help="every tenant weighs 1")
    num_threads: int | None = flag(EngineConfig.num_threads, "torch threads", parse=int, default_help="all cores")
    seed: int = flag(ModelConfig.seed, "seed for unseeded sampling", parse=int)
    compile: bool = flag(
        EngineConfig.compile, "compile the model step with torch.compile (CPU: the first start compiles for a "
        "minute or more, later ones read the cache in ~/.cache/duoserve/inductor); without it prompt steps run "
        "eagerly and steps of decodes in the C++ decode step", parse=bool)
    enforce_eager: bool = flag(
        False, "vLLM's flag, accepted: duoserve's model step is eager unless --compile is given", parse=bool)
    # speculative decoding
    speculative_method: str | None = flag(
        None, "ngram: guess from the request's own earlier tokens (prompt lookup); draft: guess with "
        "--speculative-model", choices=SPEC_METHODS, group=SPECULATIVE_GROUP, default_help="none")
    num_speculative_tokens: int | None = flag(
        SpeculativeConfig.num_speculative_tokens, "tokens guessed a step", parse=int, group=SPECULATIVE_GROUP,
        default_help=_spec_defaults(DEFAULT_NUM_SPECULATIVE_TOKENS))
    ngram_min: int = flag(SpeculativeConfig.ngram_min, "shortest suffix ngram looks up", parse=int,
                          group=SPECULATIVE_GROUP)
    ngram_max: int = flag(SpeculativeConfig.ngram_max, "longest suffix ngram looks up", parse=int,
                          group=SPECULATIVE_GROUP)
    speculative_model: str | None = flag(
        SpeculativeConfig.model, "the draft model: HF directory, .gguf file or alias", group=SPECULATIVE_GROUP,
        default_help="the target's own file, e.g. its GGUF blocks with --speculative-quantization gguf")
    speculative_quantization: str = flag(
        SpeculativeConfig.quantization, "how the draft computes; auto = gguf for a quantized GGUF file",
        choices=QUANTIZATIONS, group=SPECULATIVE_GROUP)
    speculative_gguf_mode: str = flag(SpeculativeConfig.gguf_mode, "the draft's GGUF kernels", choices=GGUF_MODES,
                                      group=SPECULATIVE_GROUP)
    speculative_disable_batch_size: int | None = flag(
        SpeculativeConfig.disable_batch_size, "no speculation in a step with more running requests than this (a "
        "larger batch is compute-bound on a CPU)", parse=int, group=SPECULATIVE_GROUP,
        default_help=_spec_defaults(DEFAULT_SPEC_DISABLE_BATCH_SIZE))
    speculative_config: dict[str, Any] | SpeculativeConfig | None = flag(
        None, "LLM(speculative_config=...): the speculative settings as one dict of SpeculativeConfig's fields",
        cli=False)
    # LoRA adapters
    enable_lora: bool = flag(False, "serve LoRA adapters (given later with POST /v1/load_lora_adapter); "
                             "--lora-modules turns it on too", parse=bool, group=LORA_GROUP)
    lora_modules: tuple[tuple[str, str], ...] = flag(
        (), "adapters loaded at start, each name=path (a PEFT folder or a GGUF adapter file) or vLLM's JSON "
        "{\"name\": ..., \"path\": ...}; a request names one in 'model'", convert=parse_lora_modules, nargs="+",
        cli_default=None, group=LORA_GROUP, default_help="none")
    max_loras: int = flag(LoRAConfig.max_loras, "adapters loaded at once: loading one more unloads the least "
                          "recently used that no request uses", parse=int, group=LORA_GROUP)
    max_lora_rank: int = flag(LoRAConfig.max_lora_rank, "the largest adapter rank loaded (a larger one is refused)",
                              parse=int, group=LORA_GROUP)
    # the shared KV store
    kv_store: str | None = flag(
        None, "redis://[:password@]host:port/db (or rediss://): full KV blocks shared by every engine of the same "
        "model, KV layout and cache salt; prompts found there skip their prefill", group=KV_STORE_GROUP,
        default_help="none")
    kv_store_ttl: int = flag(KVStoreConfig.ttl, "seconds a stored block lives after its last write or hit",
                             parse=int, group=KV_STORE_GROUP)
    kv_store_timeout: float = flag(
        KVStoreConfig.timeout_ms, "milliseconds per round trip to the store; past a request's budget it computes",
        parse=float, group=KV_STORE_GROUP)
    kv_store_required: bool = flag(
        KVStoreConfig.required, "refuse to start when the store does not answer", parse=bool, group=KV_STORE_GROUP,
        default_help="off: warn, naming it, and serve without it until it does")
    # the KV tier on disk
    kv_disk_path: str | None = flag(
        None, "a directory where full KV blocks are kept as files, across restarts (checksummed; the least "
        "recently used go first past --kv-disk-bytes); a prompt found there skips its prefill", group=KV_DISK_GROUP,
        default_help="none")
    kv_disk_bytes: int = flag(KVDiskConfig.max_bytes, "the most bytes of block files each engine keeps "
                              "(1073741824, 512M, 16G)",
                              parse=parse_size, group=KV_DISK_GROUP, default_help="16G")

    # KV events for cluster routers
    kv_events_endpoint: str | None = flag(
        None, "publish the prefix cache's KV events (vLLM's BlockStored/BlockRemoved/AllBlocksCleared, msgpack) "
        "on this ZeroMQ PUB endpoint; each engine binds the port plus its index", group=KV_EVENTS_GROUP,
        default_help="none")
    kv_events_replay_endpoint: str | None = flag(
        None, "a ZeroMQ ROUTER endpoint answering replay requests for missed event batches (port plus the "
        "engine's index, as above)", group=KV_EVENTS_GROUP, default_help="none")

    FLAG_GROUP = (MODEL_GROUP, None)   # the fields' group where they name none

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     actions: dict[str, type[argparse.Action]] | None = None) -> None:
        """One ``--flag`` per field (its groups in field order; ``actions``: ``add_flags``')."""
        add_flags(parser, cls, actions=actions)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**values_from_args(cls, args))

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def create_engine_config(self) -> EngineConfig:
        """The validated config tree (``ConfigError`` naming the field of a wrong value)."""
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype, device=self.device, hf_overrides=self.hf_overrides,
                              max_model_len=self.max_model_len, seed=self.seed, quantization=self.quantization,
                              gguf_mode=self.gguf_mode, chat_template=self.chat_template),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              kv_cache_dtype=self.kv_cache_dtype, enable_prefix_caching=self.enable_prefix_caching,
                              swap_space=self.swap_space),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      policy=self.scheduling_policy, tenant_weights=self.tenant_weights,
                                      max_num_seqs=self.max_num_seqs, max_step_ms=self.max_step_ms,
                                      enable_chunked_prefill=self.enable_chunked_prefill),
            num_threads=self.num_threads, compile=self._compile(), speculative=self._speculative(),
            kv_store=KVStoreConfig(self.kv_store, self.kv_store_ttl, self.kv_store_timeout,
                                   required=self.kv_store_required) if self.kv_store else None,
            kv_disk=KVDiskConfig(self.kv_disk_path, parse_size(self.kv_disk_bytes)) if self.kv_disk_path else None,
            kv_events=self._kv_events(), lora=self._lora())

    def _lora(self) -> LoRAConfig | None:
        modules = parse_lora_modules(self.lora_modules, "lora_modules")
        if not (self.enable_lora or modules):
            return None
        return LoRAConfig(modules, self.max_loras, self.max_lora_rank)

    def _kv_events(self) -> KVEventsConfig | None:
        if self.kv_events_endpoint is None:
            if self.kv_events_replay_endpoint is not None:
                raise ConfigError("kv_events_replay_endpoint", self.kv_events_replay_endpoint,
                                  "unset unless --kv-events-endpoint is given (it replays that stream)")
            return None
        return KVEventsConfig(self.kv_events_endpoint, self.kv_events_replay_endpoint)

    def _compile(self) -> bool:
        if self.compile and self.enforce_eager:
            raise ConfigError("enforce_eager", True, "unset with --compile (one asks for eager steps, the other "
                              "for a compiled one)")
        return self.compile

    def _speculative(self) -> SpeculativeConfig | None:
        """From the flat flags, or from ``speculative_config`` (not both)."""
        if self.speculative_config is not None:
            if self.speculative_method is not None:
                raise ConfigError("speculative_config", self.speculative_config,
                                  "unset when speculative_method is given (one or the other)")
            return SpeculativeConfig.from_value(self.speculative_config)
        if self.speculative_method is None:
            if self.speculative_model is not None:
                raise ConfigError("speculative_method", None, "ngram or draft: --speculative-model needs "
                                  "--speculative-method draft")
            return None
        return SpeculativeConfig(method=self.speculative_method, num_speculative_tokens=self.num_speculative_tokens,
                                 ngram_min=self.ngram_min, ngram_max=self.ngram_max, model=self.speculative_model,
                                 quantization=self.speculative_quantization, gguf_mode=self.speculative_gguf_mode,
                                 disable_batch_size=self.speculative_disable_batch_size)
