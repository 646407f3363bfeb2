"""One validated configuration tree.

Every value is checked when its dataclass is built; a ``ConfigError`` names the
field, the value and what is allowed. The tree is frozen: values found at run time
(number of KV blocks, eos ids) live in separate objects, and what ``auto`` means on this
machine (device, dtype) is asked in ``duoserve.platform``: this module imports no torch and
probes no hardware, so the API process builds and checks configs cheaply.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from dataclasses import dataclass, field
from typing import Any

from duoserve.errors import ConfigError
from duoserve.flags import flag

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
QUANTIZATIONS = ("auto", "none", "gguf", "int8")
GGUF_MODES = ("fast", "exact")


class Role(str, enum.Enum):
    """An engine's part in serving: both steps of a request, or one side of a disaggregated pair.
    What each role puts into an engine is built in one place, ``duoserve.engine.role_parts``."""
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:   # as its value's, so that a member and its string are one key
        return hash(self.value)


ROLES = tuple(role.value for role in Role)
DEFAULT_MODEL_ALIAS = "smollm2-135m"


def parse_device(value: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if value in ("auto", "cpu", "cuda"):
        return value
    if value.startswith("cuda:") and value[5:].isdigit():
        return value
    raise ConfigError("device", value, "one of auto, cpu, cuda, cuda:N")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None          # HF directory, .gguf file, alias, or None for the default model
    dtype: str = "auto"               # auto = bfloat16 on a GPU or a CPU with native bf16, else float32
    device: str = "auto"              # auto = cuda when a GPU is visible, else cpu
    # dtype and device auto are resolved where the model runs: duoserve.platform
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0
    quantization: str = "auto"        # auto = gguf for a quantized GGUF file on CPU, else none
    gguf_mode: str = "fast"           # fast: 8-bit activations, integer dots; exact: float32 products
    chat_template: str | None = None  # a Jinja chat template or a file holding one; None = the model's own

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError("quantization", self.quantization, f"one of {', '.join(QUANTIZATIONS)}")
        if self.gguf_mode not in GGUF_MODES:
            raise ConfigError("gguf_mode", self.gguf_mode, f"one of {', '.join(GGUF_MODES)}")
        parse_device(self.device)
        if not isinstance(self.hf_overrides, dict):
            raise ConfigError("hf_overrides", self.hf_overrides,
                              'a JSON object of config.json keys, e.g. {"eos_token_id": [2, 32000]}')
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError("max_model_len", self.max_model_len, "a positive number of tokens")


DEFAULT_BLOCK_SIZE = 16
DEFAULT_CPU_KV_CACHE_GIB = 1.0     # the CPU pool's size without --kv-cache-memory, at most ...
DEFAULT_CPU_KV_SEQUENCES = 4       # ... this many whole-context sequences (llama.cpp's four slots)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
# A decode engine's step budget under --prefill-device auto (DisaggConfig.decode_scheduler): a long
# prompt placed there goes in chunks its decodes ride in, as colocated, each a turn's length or less;
# chunks of 192-512 prefill alike on a CPU (BENCHMARKS.md, session 26)
AUTO_DECODE_STEP_TOKENS = 192
# The step budget under --scheduling-policy priority or fair: a request that outranks the running
# ones waits for the step in progress, so these policies keep steps short; a server past its
# capacity served as many tokens a second at 256 as at 512 (BENCHMARKS.md, session 33)
LATENCY_STEP_TOKENS = 256
LATENCY_STEP_MS = 100.0   # priority: a step's target length, about what an outranking arrival waits for
DEFAULT_MAX_NUM_SEQS = 128


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: float | None = None      # GiB; None = 1 GiB on CPU, a fraction of free memory on GPU
    gpu_memory_utilization: float = 0.9       # fraction of free GPU memory for KV when kv_cache_memory is None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"              # auto = the model dtype
    swap_space: float = 0.0                   # GiB of host memory for the KV of preempted requests; 0: none

    def __post_init__(self) -> None:
        size = self.block_size
        if not isinstance(size, int) or size < 1 or size > 256 or size & (size - 1):
            raise ConfigError("block_size", size, "a power of two from 1 to 256")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory", self.kv_cache_memory, "a positive number of GiB")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization", self.gpu_memory_utilization, "a fraction in (0, 1]")
        if self.kv_cache_dtype not in DTYPES:
            raise ConfigError("kv_cache_dtype", self.kv_cache_dtype, f"one of {', '.join(DTYPES)}")
        if not self.swap_space >= 0:
            raise ConfigError("swap_space", self.swap_space, "a number of GiB >= 0 (0: no swap space)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int | None = None  # None: 512 with chunked prefill (256 unless fcfs), else max_model_len
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    enable_chunked_prefill: bool = True
    # fcfs: arrival order; priority: a request's priority (lower first) orders the queues and preempts;
    # fair: priority first, then each tenant's tokens served over its weight (core/fair_share.py)
    policy: str = "fcfs"
    tenant_weights: tuple[tuple[str, float], ...] = ()   # (tenant, weight) under fair; others weigh 1
    # a step's target length in ms (its token budget paced to it, core/step_pacer.py); None: 100 under
    # priority, off under fcfs and fair (where it measured worse: BENCHMARKS.md, session 34); 0: off
    max_step_ms: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError("scheduling_policy", self.policy, f"one of {', '.join(SCHEDULING_POLICIES)}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens", self.max_num_batched_tokens, "a positive number of tokens")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", self.max_num_seqs, "a positive number of sequences")
        if isinstance(self.tenant_weights, dict):   # LLM(tenant_weights={"alice": 2})
            object.__setattr__(self, "tenant_weights", tuple(self.tenant_weights.items()))
        for tenant, weight in self.tenant_weights:
            if not (isinstance(weight, (int, float)) and 0 < weight < 1e9) or not tenant:
                raise ConfigError("tenant_weights", f"{tenant}={weight}", "tenant=weight pairs, each weight > 0")
        if self.max_step_ms is not None and not (self.max_step_ms >= 0 and math.isfinite(self.max_step_ms)):
            raise ConfigError("max_step_ms", self.max_step_ms, "a number of milliseconds, 0 for no pacing")
        if self.tenant_weights and self.policy != "fair":
            raise ConfigError("tenant_weights", parse_back(self.tenant_weights),
                              "unset unless --scheduling-policy fair (only fair share weighs tenants)")

    def check_priority(self, priority: int) -> None:
        """A request's priority other than 0 needs a policy that orders by it (vLLM's rule)."""
        if priority and self.policy == "fcfs":
            raise ConfigError("priority", priority, "0 unless the engine runs --scheduling-policy priority or "
                              "fair (fcfs serves in arrival order)")

    @property
    def step_seconds(self) -> float | None:
        """The pacer's target step length (None: steps are sized by tokens alone)."""
        ms = self.max_step_ms if self.max_step_ms is not None else (LATENCY_STEP_MS if self.policy == "priority" else 0)
        # without chunked prefill a prompt must fit one step: a paced budget could hold it back for good
        return ms / 1000 if ms and self.enable_chunked_prefill else None

    def token_budget(self, max_model_len: int) -> int:
        """The per-step token budget, checked against the context length."""
        budget = self.max_num_batched_tokens
        if budget is None:
            if not self.enable_chunked_prefill:
                return max_model_len
            return DEFAULT_MAX_NUM_BATCHED_TOKENS if self.policy == "fcfs" else LATENCY_STEP_TOKENS
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ConfigError(
                "max_num_batched_tokens", budget,
                f"at least max_model_len ({max_model_len}) when chunked prefill is off, or a prompt "
                "of full length could never be scheduled",
                "Enable chunked prefill, raise --max-num-batched-tokens or lower --max-model-len",
            )
        return budget


SPEC_METHODS = ("ngram", "draft")
# tokens guessed a step, by method (BENCHMARKS.md, speculative decoding): a lookup's guesses cost
# nothing to make, a draft's cost a forward each, and the target checks up to 6 tokens (1 + 5) at
# the price of one on the CPU (cpu_linear.SMALL_M)
DEFAULT_NUM_SPECULATIVE_TOKENS = {"ngram": 4, "draft": 5}
# the most running requests a step speculates with, by method (measured, BENCHMARKS.md): a draft's
# forwards stop paying beyond 4 streams here; a lookup's checks still paid at 32
DEFAULT_SPEC_DISABLE_BATCH_SIZE = {"ngram": 32, "draft": 4}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses ``num_speculative_tokens`` tokens, the target checks them
    in one forward. ``ngram`` looks the last ``ngram_max``..``ngram_min`` tokens up in the request's own
    tokens; ``draft`` runs ``model`` (quantized as ``quantization``) beside the target."""
    method: str = "ngram"
    num_speculative_tokens: int | None = None   # None: the method's default
    ngram_min: int = 2
    ngram_max: int = 4
    model: str | None = None             # draft: HF directory, .gguf file or alias (None: the target's file)
    quantization: str = "auto"           # of the draft: auto = gguf for a quantized GGUF file on CPU
    gguf_mode: str = "fast"
    disable_batch_size: int | None = None  # no speculation in a step with more running; None: by method

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError("speculative_method", self.method, f"one of {', '.join(SPEC_METHODS)}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS[self.method])
        if self.disable_batch_size is None:
            object.__setattr__(self, "disable_batch_size", DEFAULT_SPEC_DISABLE_BATCH_SIZE[self.method])
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ConfigError("num_speculative_tokens", k, "a number of tokens from 1 to 16")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError("ngram_min", self.ngram_min, f"from 1 to ngram_max ({self.ngram_max})")
        if self.ngram_max > 64:
            raise ConfigError("ngram_max", self.ngram_max, "at most 64 tokens")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError("speculative_quantization", self.quantization, f"one of {', '.join(QUANTIZATIONS)}")
        if self.gguf_mode not in GGUF_MODES:
            raise ConfigError("speculative_gguf_mode", self.gguf_mode, f"one of {', '.join(GGUF_MODES)}")
        if self.disable_batch_size < 1:
            raise ConfigError("speculative_disable_batch_size", self.disable_batch_size,
                              "a positive number of sequences")
        if self.method == "ngram" and self.model is not None:
            raise ConfigError("speculative_model", self.model, "unset with --speculative-method ngram "
                              "(a draft model is --speculative-method draft)")

    @classmethod
    def from_value(cls, value: "dict[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """``LLM(speculative_config=...)``: None, a SpeculativeConfig, or a dict of its fields."""
        if value is None or isinstance(value, cls):
            return value
        names = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in names:
                raise ConfigError("speculative_config", key, f"keys among {', '.join(names)}")
        return cls(**value)


DEFAULT_KV_STORE_TTL = 3600
DEFAULT_KV_STORE_TIMEOUT_MS = 50


@dataclass(frozen=True)
class KVStoreConfig:
    """A shared KV tier (``--kv-store redis://...``): full blocks by content, shared by every engine
    of the same model, layout and salt. ``timeout_ms`` bounds one round trip and a request's time
    with the tier; after ``breaker_errors`` errors in a row the tier is left alone for
    ``breaker_cooldown`` seconds."""
    url: str
    ttl: int = DEFAULT_KV_STORE_TTL           # seconds a block lives after its last write or hit
    timeout_ms: float = DEFAULT_KV_STORE_TIMEOUT_MS
    write_queue: int = 256                    # blocks waiting to be written; more are dropped (counted)
    breaker_errors: int = 3
    breaker_cooldown: float = 5.0
    required: bool = False                    # refuse to start when the store does not answer

    def __post_init__(self) -> None:
        scheme, sep, rest = self.url.partition("://")
        if scheme not in ("redis", "rediss") or not sep or not rest.split("/")[0].rpartition("@")[2]:
            raise ConfigError("kv_store", self.url, "a Redis URL: redis://[:password@]host:port/db or rediss://...")
        if not isinstance(self.ttl, int) or self.ttl < 1:
            raise ConfigError("kv_store_ttl", self.ttl, "a positive number of seconds")
        if not self.timeout_ms > 0:
            raise ConfigError("kv_store_timeout", self.timeout_ms, "a positive number of milliseconds")
        if self.write_queue < 1:
            raise ConfigError("kv_store_write_queue", self.write_queue, "a positive number of blocks")


DEFAULT_KV_DISK_BYTES = 16 << 30
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: str | int) -> int:
    """``16G``, ``512M``, ``1048576`` -> bytes (binary units, an optional trailing B or iB)."""
    if isinstance(value, int):
        return value
    text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _SIZE_UNITS else ""
    try:
        return int(float(text[:len(text) - len(unit)]) * _SIZE_UNITS[unit])
    except (ValueError, OverflowError):
        raise ConfigError("kv_disk_bytes", value, "a size in bytes: 1073741824, 512M, 16G") from None


@dataclass(frozen=True)
class KVDiskConfig:
    """A KV tier on disk (``--kv-disk-path DIR``): the shared store's block records as files, kept
    across restarts, at most ``max_bytes`` of them (the least recently used go first). The same
    limits as the Redis tier's bound a request's time with it and its write queue."""
    path: str
    max_bytes: int = DEFAULT_KV_DISK_BYTES
    timeout_ms: float = 250.0              # a request's time with the tier: this per batch of reads it takes
    write_queue: int = 1024                # blocks waiting to be written; more are dropped (counted)
    breaker_errors: int = 3
    breaker_cooldown: float = 5.0
    required: bool = False                 # refuse to start when the directory cannot be written

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("kv_disk_path", self.path, "a directory (created if missing)")
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ConfigError("kv_disk_path", self.path, "a directory (this is a file)")
        if not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ConfigError("kv_disk_bytes", self.max_bytes, "a positive number of bytes (1073741824, 512M, 16G)")


@dataclass(frozen=True)
class KVEventsConfig:
    """Where an engine publishes its prefix cache's KV events (``duoserve.kv.events``)."""
    endpoint: str                        # a ZeroMQ PUB endpoint to bind: tcp://*:5557
    replay_endpoint: str | None = None   # a ROUTER endpoint answering replay requests

    def __post_init__(self) -> None:
        for name, value in (("kv_events_endpoint", self.endpoint), ("kv_events_replay_endpoint",
                                                                    self.replay_endpoint)):
            tcp_port = value is not None and value.startswith("tcp://") and value.rpartition(":")[2].isdigit()
            if value is not None and not (tcp_port or value.startswith("ipc://")):
                raise ConfigError(name, value, "a ZeroMQ endpoint to bind: tcp://*:PORT or ipc://PATH")

    def for_engine(self, index: int) -> "KVEventsConfig":
        """Engine ``index`` of a deployment binds the ports plus its index (an ipc path: the path
        with ``-index`` after it, from the second engine on)."""
        def offset(endpoint: str | None) -> str | None:
            if endpoint is None or index == 0:
                return endpoint
            if endpoint.startswith("ipc://"):
                return f"{endpoint}-{index}"
            head, _, port = endpoint.rpartition(":")
            return f"{head}:{int(port) + index}"
        return KVEventsConfig(offset(self.endpoint), offset(self.replay_endpoint))


@dataclass(frozen=True)
class TurnsConfig:
    """An engine's place in its host's core turns (``duoserve.engine.cpu_turns``): set by the
    launcher where prefill and decode engines share the same cores, never by users."""
    path: str              # the shared file the launcher created
    slot: int              # this engine's slot in it
    quantum: float = 0.4   # prefill: seconds on the cores before a waiting decode step's turn (--prefill-turn)


DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 64


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters computed per request (``duoserve.worker.lora``): those loaded at start, by name,
    and how many and how large an engine holds."""
    modules: tuple[tuple[str, str], ...] = ()   # (name, PEFT folder or GGUF adapter file), loaded at start
    max_loras: int = DEFAULT_MAX_LORAS           # adapters loaded at once: one more unloads the least recently used
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK   # a larger rank is refused

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError("max_loras", self.max_loras, "a positive number of adapters")
        if self.max_lora_rank < 1:
            raise ConfigError("max_lora_rank", self.max_lora_rank, "a positive rank")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ConfigError("lora_modules", names, "adapters of different names")
        if len(names) > self.max_loras:
            raise ConfigError("lora_modules", names, f"at most --max-loras ({self.max_loras}) adapters")


def parse_lora_modules(value, field_name: str) -> tuple[tuple[str, str], ...]:
    """``["a=/p/a", "b=/p/b"]`` (the flag's words), a dict, or vLLM's JSON form
    ``{"name": "a", "path": "/p/a"}`` -> (("a", "/p/a"), ("b", "/p/b"))."""
    import json

    if value is None:
        return ()
    items = list(value.items()) if isinstance(value, dict) else list(value if isinstance(value, (list, tuple))
                                                                         else [value])
    pairs = []
    for item in items:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except json.JSONDecodeError:
                raise ConfigError(field_name, item, "name=path, or JSON with name and path") from None
        if isinstance(item, dict):
            item = (item.get("name"), item.get("path"))
        elif isinstance(item, str):
            name, sep, path = item.partition("=")
            item = (name, path) if sep else (None, None)
        name, path = item
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise ConfigError(field_name, value, "adapters as name=path (a PEFT folder or a GGUF adapter file), "
                              'or JSON {"name": ..., "path": ...}')
        pairs.append((name, path))
    return tuple(pairs)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None   # torch threads of the engine process; None = all cores
    role: Role = Role.COLOCATED
    cpus: tuple[int, ...] | None = None  # pin the engine process to these CPUs
    kv_lease_timeout: float = 30.0   # prefill role: seconds leased KV waits for the decode side's ack
    compile: bool = False            # compile the model step with torch.compile (CPU); else eager + C++ decode step
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    kv_store: KVStoreConfig | None = None         # None: no shared KV tier
    kv_disk: KVDiskConfig | None = None           # None: no KV tier on disk
    kv_events: KVEventsConfig | None = None       # None: no KV events published
    shutdown_timeout: float = 30.0   # a launched engine's SIGTERM gives its requests this long (serve's flag)
    turns: TurnsConfig | None = None # cores shared with engines of the other role (launcher.py)
    lora: LoRAConfig | None = None   # None: no adapters (--enable-lora or --lora-modules turn them on)

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads", self.num_threads, "a positive number of threads")
        if self.role not in ROLES:
            raise ConfigError("role", self.role, f"one of {', '.join(ROLES)}")
        object.__setattr__(self, "role", Role(self.role))   # given as a string: the member
        if self.kv_lease_timeout <= 0:
            raise ConfigError("kv_lease_timeout", self.kv_lease_timeout, "a positive number of seconds")
        if self.shutdown_timeout < 0:
            raise ConfigError("shutdown_timeout", self.shutdown_timeout, "a number of seconds, 0 or more")


PREFILL_DEVICES = ("cpu", "cuda", "gpu", "auto")
KV_TRANSPORTS = ("shm", "tcp")
CORE_SHARINGS = ("turns", "split")   # launched CPU engines of both roles on this host (launcher.py)


def parse_cpu_list(value: str | None, field_name: str) -> tuple[int, ...] | None:
    """``0``, ``0-1``, ``0,2`` -> a tuple of CPU ids."""
    if value is None or value == "":
        return None
    cpus: list[int] = []
    try:
        for part in value.split(","):
            low, _, high = part.partition("-")
            cpus.extend(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ConfigError(field_name, value, "a CPU list like 0, 0-1 or 0,2") from None
    return tuple(cpus)


def check_engine_address(address: str, field_name: str) -> str:
    """``tcp://HOST:PORT`` (or ``ipc://PATH`` on one host)."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if not sep or scheme not in ("tcp", "ipc") or not rest or (scheme == "tcp" and not (host and port.isdigit())):
        raise ConfigError(field_name, address, "an engine address like tcp://HOST:PORT (or ipc://PATH on one host)")
    return address


def parse_tenant_weights(value: str | None, field_name: str) -> tuple[tuple[str, float], ...]:
    """``"alice=2,bob=0.5"`` -> (("alice", 2.0), ("bob", 0.5))."""
    pairs = []
    for item in (value or "").split(","):
        if not item.strip():
            continue
        tenant, sep, weight = item.strip().rpartition("=")
        try:
            pairs.append((tenant, float(weight)))
        except ValueError:
            raise ConfigError(field_name, value, "tenant=weight pairs, comma-separated (alice=2,bob=1)") from None
        if not sep or not tenant:
            raise ConfigError(field_name, value, "tenant=weight pairs, comma-separated (alice=2,bob=1)")
    return tuple(pairs)


def parse_back(weights: tuple[tuple[str, float], ...]) -> str:
    return ",".join(f"{tenant}={weight:g}" for tenant, weight in weights)


def parse_address_list(value: str | None, field_name: str) -> tuple[str, ...]:
    """``tcp://h1:p1,tcp://h2:p2`` -> a tuple of checked addresses."""
    if not value:
        return ()
    return tuple(check_engine_address(a.strip(), field_name) for a in value.split(",") if a.strip())


@dataclass(frozen=True)
class DisaggConfig:
    """How a disaggregated deployment is laid out (``--mode disaggregated``): engines to launch or join.
    Each flagged field is its ``duoserve serve`` flag (duoserve.flags)."""
    FLAG_GROUP = (
        "disaggregated serving (--mode disaggregated)",
        "Engines launched on this host share its cores: unless one of --prefill-threads, --decode-threads, "
        "--prefill-cpus or --decode-cpus is given, every engine uses every core and the roles take turns "
        "(--core-sharing turns: a decode step waits at most --prefill-turn for a prompt), or decode engines "
        "are pinned to the first half of the cores and prefill engines to the rest (--core-sharing split; "
        "2 cores: prefill on CPU 1, decode on CPU 0). With --prefill-device cuda the CPU engines are not pinned.")
    prefill_device: str = flag(
        "cpu", "where prompts are prefilled: on a prefill engine on that device (cpu, cuda/gpu), or auto: each "
        "where its predicted time to first token is lowest, on a CPU prefill engine or on its decode engine "
        f"(whose steps then hold at most {AUTO_DECODE_STEP_TOKENS} prompt tokens unless --max-num-batched-tokens "
        "is given); before any rate is measured, --max-prefill-len decides", choices=PREFILL_DEVICES)
    max_prefill_len: int = flag(
        512, "auto placement before rates are measured: prompts of at most this many tokens on a prefill engine "
        "(longer ones on the decode engine)", parse=int)
    prefill_threads: int | None = flag(None, "torch threads of each prefill engine", parse=int,
                                       default_help="its share of the cores, see above")
    decode_threads: int | None = flag(None, "torch threads of each decode engine", parse=int,
                                      default_help="its share of the cores")
    prefill_cpus: tuple[int, ...] | None = flag(None, "pin the prefill engines to these CPUs: 0, 0-1, 0,2",
                                                convert=parse_cpu_list,
                                                default_help="see above")
    decode_cpus: tuple[int, ...] | None = flag(None, "pin the decode engines to these CPUs",
                                               convert=parse_cpu_list,
                                               default_help="see above")
    core_sharing: str = flag(
        "turns", "how launched engines of both roles share this host's cores: every core, in turns, or split "
        "between the roles", choices=CORE_SHARINGS)
    # turns: seconds a prompt holds the cores while a decode step waits; each turn costs the prompt
    # a decode step, so shorter turns lengthen the first tokens (BENCHMARKS.md, session 25)
    prefill_turn: float = flag(0.4, "turns: seconds a prompt step keeps the cores while a decode step waits",
                               parse=float)
    kv_transport: str = flag("shm", "how KV moves between the engines: shared memory (same host) or TCP",
                             choices=KV_TRANSPORTS)
    kv_lease_timeout: float = flag(30.0, "seconds a prefill engine keeps KV for an unacknowledged handoff",
                                   parse=float)
    prefill_block_size: int | None = None  # None = the decode engine's (KV is re-blocked either way)
    prefill_max_num_batched_tokens: int | None = flag(
        None, "token budget of one prefill-engine step; smaller chunks let a short prompt overtake a long one "
        "sooner", parse=int, default_help="--max-num-batched-tokens")
    # engines this frontend launches, when no addresses are given (None on the command line: not given)
    num_prefill_engines: int = flag(1, "prefill engines to launch on this host", parse=int, cli_default=None)
    num_decode_engines: int = flag(1, "decode engines to launch on this host", parse=int, cli_default=None)
    prefill_addrs: tuple[str, ...] = flag(
        (), "use running prefill engines instead (`duoserve prefill --listen ADDR`): tcp://h1:p1,...",
        convert=parse_address_list, cli_default=None, default_help="none")
    decode_addrs: tuple[str, ...] = flag(
        (), "use running decode engines instead (`duoserve decode --listen ADDR`): tcp://h2:p2,...",
        convert=parse_address_list, cli_default=None, default_help="none")
    engine_host: str = flag("127.0.0.1", "where launched engines listen when they use TCP; must be reachable "
                            "from remote engines")
    auth_key_file: str | None = None  # the deployment's CURVE key (duoserve.transport.auth); None: $DUOSERVE_AUTH_KEY*
    insecure_no_auth: bool = False    # launched engines may listen beyond loopback without a key

    def __post_init__(self) -> None:
        if self.core_sharing not in CORE_SHARINGS:
            raise ConfigError("core_sharing", self.core_sharing, f"one of {', '.join(CORE_SHARINGS)}")
        if not self.prefill_turn > 0:
            raise ConfigError("prefill_turn", self.prefill_turn, "a positive number of seconds")
        for name in ("num_prefill_engines", "num_decode_engines"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "a positive number of engines")
        for name in ("prefill_addrs", "decode_addrs"):
            for address in getattr(self, name):
                check_engine_address(address, name)
        if self.prefill_block_size is not None:
            CacheConfig(block_size=self.prefill_block_size)  # same rule, same error
        if self.prefill_max_num_batched_tokens is not None and self.prefill_max_num_batched_tokens < 1:
            raise ConfigError("prefill_max_num_batched_tokens", self.prefill_max_num_batched_tokens,
                              "a positive number of tokens")
        if self.prefill_device not in PREFILL_DEVICES:
            raise ConfigError("prefill_device", self.prefill_device, f"one of {', '.join(PREFILL_DEVICES)}")
        if self.max_prefill_len < 1:
            raise ConfigError("max_prefill_len", self.max_prefill_len, "a positive number of tokens")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ConfigError("kv_transport", self.kv_transport, f"one of {', '.join(KV_TRANSPORTS)}")
        if self.kv_lease_timeout <= 0:
            raise ConfigError("kv_lease_timeout", self.kv_lease_timeout, "a positive number of seconds")

    @property
    def splits_cores_by_default(self) -> bool:
        """No threads or CPUs given for either role, and prefills run on the CPU: the launcher
        splits this host's cores between the engines it launches."""
        given = (self.prefill_threads, self.decode_threads, self.prefill_cpus, self.decode_cpus)
        return all(v is None for v in given) and self.prefill_device in ("cpu", "auto")

    def decode_scheduler(self, scheduler: SchedulerConfig) -> SchedulerConfig:
        """A decode engine's scheduler: under ``--prefill-device auto`` with no budget given, its
        steps hold at most ``AUTO_DECODE_STEP_TOKENS`` prompt tokens: a long prompt placed on it
        goes in chunks its decodes ride in, each stalling them no longer than a turn."""
        if (self.prefill_device == "auto" and scheduler.max_num_batched_tokens is None
                and scheduler.enable_chunked_prefill):
            return dataclasses.replace(scheduler, max_num_batched_tokens=AUTO_DECODE_STEP_TOKENS)
        return scheduler

    def engine_configs(self, base: EngineConfig) -> tuple[EngineConfig, EngineConfig]:
        """(prefill, decode) engine configs derived from the decode engine's ``base``."""
        device = {"gpu": "cuda", "auto": "cpu"}.get(self.prefill_device, self.prefill_device)
        cache = base.cache
        if self.prefill_block_size is not None:
            cache = dataclasses.replace(cache, block_size=self.prefill_block_size)
        scheduler = base.scheduler
        if self.prefill_max_num_batched_tokens is not None:
            scheduler = dataclasses.replace(scheduler, max_num_batched_tokens=self.prefill_max_num_batched_tokens)
        prefill = dataclasses.replace(base, role=Role.PREFILL, num_threads=self.prefill_threads,
                                      cpus=self.prefill_cpus, kv_lease_timeout=self.kv_lease_timeout,
                                      model=dataclasses.replace(base.model, device=device), cache=cache,
                                      scheduler=scheduler, speculative=None)  # first tokens only
        decode = dataclasses.replace(base, role=Role.DECODE, num_threads=self.decode_threads, cpus=self.decode_cpus,
                                     scheduler=self.decode_scheduler(base.scheduler))
        return prefill, decode


CLUSTERS = ("local", "ray")
ROUTINGS = ("prefix", "least-loaded", "kv-events")   # frontend/router.py


@dataclass(frozen=True)
class ClusterConfig:
    """Where a frontend's engines run (``--cluster``): launched on this host (or joined at
    ``--prefill-addrs``/``--decode-addrs``), or Ray actors placed on a cluster's nodes by their
    ``duoserve_prefill``/``duoserve_decode`` resources (``duoserve.frontend.ray_cluster``). Each
    flagged field is its ``duoserve serve`` flag (duoserve.flags)."""
    FLAG_GROUP = (
        "cluster (--cluster ray)",
        "Engines as Ray actors, placed on the nodes that advertise duoserve_prefill / duoserve_decode resources "
        "(`duoserve ray-node`), found again by name by every frontend, restarted by Ray when a node dies. "
        "They outlive the frontends: `duoserve ray-stop` removes them.")
    num_engines: int = flag(
        1, "colocated engines to launch on this host, each on its share of the cores; a request whose engine goes "
        "down goes on on another (with --mode disaggregated use --num-decode-engines)", parse=int)
    routing: str = flag(
        "prefix", "which of several engines of a role takes a request: prefix, the one with the fewest prompt "
        "tokens to compute before its first token (its queue, plus the part of this prompt its prefix cache "
        "probably lacks), none 4 requests busier than the least loaded; least-loaded, the one with the fewest "
        "queued; kv-events, as prefix but knowing what each engine caches from its KV events (needs "
        "--kv-events-endpoint)", choices=ROUTINGS)
    kind: str = flag("local", "launch the engines on this host, or place them on a Ray cluster", choices=CLUSTERS,
                     name="cluster")
    ray_address: str | None = flag(
        None, "the cluster to join: HOST:PORT, or auto for the one `ray start` runs here",
        default_help="start a Ray instance on this host with the resources of the engines asked for")
    ray_namespace: str = flag("duoserve", "one deployment's engines are the named actors of this namespace")
    auth_key_file: str | None = None  # the deployment key; None: $DUOSERVE_AUTH_KEY*, else the engines' own

    def __post_init__(self) -> None:
        if self.kind not in CLUSTERS:
            raise ConfigError("cluster", self.kind, f"one of {', '.join(CLUSTERS)}")
        if self.routing not in ROUTINGS:
            raise ConfigError("routing", self.routing, f"one of {', '.join(ROUTINGS)}")
        if not isinstance(self.num_engines, int) or self.num_engines < 1:
            raise ConfigError("num_engines", self.num_engines, "a positive number of engines")
        if self.kind == "ray" and self.num_engines != 1:
            raise ConfigError("num_engines", self.num_engines, "1 with --cluster ray (use --num-decode-engines)")
        if not self.ray_namespace or not self.ray_namespace.replace("-", "").replace("_", "").isalnum():
            raise ConfigError("ray_namespace", self.ray_namespace, "letters, digits, '-' and '_'")
        if self.kind == "local" and self.ray_address is not None:
            raise ConfigError("ray_address", self.ray_address, "only with --cluster ray")
