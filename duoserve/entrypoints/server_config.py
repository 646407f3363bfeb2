"""The API server's configuration (``duoserve serve``'s server flags), each field declaring its
flag (``duoserve.flags``). Light: the command's parser imports it without the web stack."""

from __future__ import annotations

import re
from dataclasses import dataclass

from duoserve import envs
from duoserve.errors import ConfigError
from duoserve.entrypoints.reasoning import REASONING_PARSERS
from duoserve.entrypoints.tool_formats import TOOL_CALL_PARSERS
from duoserve.flags import flag
from duoserve.sampling_params import EMBEDDING_POOLINGS

MODES = ("colocated", "disaggregated")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    FLAG_GROUP = ("server", None)
    # where the server listens, who may call it, and how many engines serve it
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(8000, "port to listen on", parse=int)
    served_model_name: str | None = flag(None, "the model name clients use",
                                         default_help="the --model value, or smollm2-135m")
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' on every route but /health; several "
                               "keys, comma-separated, are each a tenant (--scheduling-policy fair)",
                               cli_default=lambda: envs.DUOSERVE_API_KEY, default_help="$DUOSERVE_API_KEY, or none")
    mode: str = flag("colocated", "one engine doing prefill and decode, or separate engines", choices=MODES)
    # admission, request size, shutdown and the HTTP server's logs
    max_queue_len: int | None = flag(None, "requests in flight beyond which new ones get 429", parse=int,
                                     default_help="no limit")
    max_waiting_per_tenant: int | None = flag(
        None, "requests of one tenant waiting for their first token beyond which its new ones get 429 with "
        "Retry-After", parse=int, default_help="no limit")
    max_waiting: int | None = flag(None, "requests waiting for their first token beyond which new ones get 429 "
                                   "with Retry-After", parse=int, default_help="no limit")
    max_request_bytes: int = flag(1 << 20, "largest request body accepted, larger gets 413", parse=int)
    tool_call_parser: str | None = flag(
        None, "how the model writes tool calls, for tool_choice 'auto' (vLLM's names; hermes: <tool_call> JSON, "
        "fenced or bare)", choices=TOOL_CALL_PARSERS,
        default_help="the one the model's chat template speaks (a template without tools gets llama.cpp's generic "
        "JSON format: README, Tool calls)")
    reasoning_parser: str | None = flag(
        None, "split a reasoning model's <think>...</think> from its answer into reasoning_content (vLLM's names)",
        choices=REASONING_PARSERS, default_help="none")
    pooling: str | None = flag(
        None, "how /v1/embeddings pools a prompt's final hidden states: the last token's, or the mean of all",
        choices=EMBEDDING_POOLINGS, default_help="what the model file says (GGUF pooling_type, sentence-transformers' "
        "Pooling config), else last, as for a causal model")
    shutdown_timeout: float = flag(30.0, "seconds in-flight requests get to finish on SIGTERM/SIGINT", parse=float)
    otlp_traces_endpoint: str | None = flag(
        None, "export a span per request (OpenTelemetry's GenAI attributes; queue, prefill, KV handoff and decode "
        "as child spans) over OTLP/HTTP to this URL, e.g. http://collector:4318/v1/traces", default_help="off")
    uvicorn_log_level: str = flag("info", "log level of the HTTP server's own messages", choices=UVICORN_LOG_LEVELS)
    access_log: bool = flag(True, "log every HTTP request", parse=bool)

    def __post_init__(self) -> None:
        for name in ("max_queue_len", "max_waiting_per_tenant", "max_waiting"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(name, value, "a positive number of requests, or unset for no limit")


# a model's name in requests and in --model NAME=PATH: what llama.cpp's router and Ollama accept
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclass(frozen=True)
class ModelsConfig:
    """Several models behind one server (``--model NAME=PATH`` again, ``--models-dir``), loaded
    when asked for and unloaded past ``--models-max`` or once idle (``duoserve.entrypoints.model_registry``)."""
    FLAG_GROUP = ("models", "Several models behind one server: give --model NAME=PATH once per model, or "
                  "--models-dir; a request picks one by its 'model' field")
    models_dir: str | None = flag(None, "serve every .gguf file and Hugging Face folder in this directory, each "
                                  "named by its file (without .gguf) or folder; loaded when first asked for",
                                  default_help="none")
    models_config: str | None = flag(
        None, "per-model settings: a TOML or YAML file, one section (table) per model name, whose keys are engine "
        "flags (max-model-len = 4096), tool-call-parser, reasoning-parser, pooling, model (its path) and "
        "load-on-startup", default_help="none")
    models_max: int = flag(4, "models loaded at once: loading one more first unloads the least recently used",
                           parse=int)
    models_autoload: bool = flag(True, "load a model that is not loaded when a request asks for it (else 400 until "
                                 "POST /models/load)", parse=bool)
    sleep_idle_seconds: float | None = flag(
        None, "end a model's engines once it served nothing for this long (its weights and KV freed); the next "
        "request for it starts them again, /health does not", parse=float, default_help="never")

    def __post_init__(self) -> None:
        if self.models_max < 1:
            raise ConfigError("models_max", self.models_max, "a positive number of models")
        if self.sleep_idle_seconds is not None and not self.sleep_idle_seconds > 0:
            raise ConfigError("sleep_idle_seconds", self.sleep_idle_seconds, "a positive number of seconds")
