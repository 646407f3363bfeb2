"""SamplingParams: how one prompt's completions are drawn, what they must match, when they stop."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from duoserve.errors import ConfigError

MAX_LOGPROBS = 20
MAX_N = 128        # samples per prompt (OpenAI's limit): a request cannot ask for unbounded work
MAX_STOP = 256     # stop strings, each checked against every new token's text
INT64 = 2 ** 63    # integers cross process boundaries as msgpack's 64-bit ones
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
MAX_LOGIT_BIAS = 300   # entries of logit_bias (OpenAI's limit) and, likewise bounded, of allowed_token_ids
MAX_ALLOWED_TOKENS = 65536
MAX_TENANT_CHARS = 256   # a tenant names a metrics label: an OpenAI user field is at most this
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What every completion must match: exactly one of a JSON schema (``json``, a dict or its
    text), any JSON object (``json_object``), a regular expression, one of a list of strings
    (``choice``) or a grammar (``grammar``: Lark, or llama.cpp's GBNF). vLLM's names.

    ``param`` is the request field it came from, named in errors (the API sets it).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):   # one text per schema (the key order kept: properties are
            # generated in it): the grammar cache's key, and hashable
            object.__setattr__(self, "json", json.dumps(self.json, separators=(",", ":")))
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice) if isinstance(self.choice, list) else self.choice)
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ConfigError(self.param, given or None, f"exactly one of {', '.join(STRUCTURED_KINDS)}")
        kind = given[0]
        value = getattr(self, kind)
        ok = {"json": isinstance(value, str), "json_object": value is True,
              "regex": isinstance(value, str) and value != "",
              "choice": isinstance(value, tuple) and 0 < len(value) <= MAX_STOP and all(
                  isinstance(c, str) and c for c in value),
              "grammar": isinstance(value, str) and value.strip() != ""}[kind]
        if not ok:
            allowed = {"json": "a JSON schema (an object, or its text)", "json_object": "true",
                       "regex": "a non-empty regular expression", "grammar": "a non-empty Lark or GBNF grammar",
                       "choice": f"a list of 1 to {MAX_STOP} non-empty strings"}[kind]
            raise ConfigError(f"{self.param}.{kind}", value, allowed)

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (not where the request said it)."""
        return (self.kind, getattr(self, self.kind))


# how an embedding pools the prompt's hidden states; "score": a reranker's relevance of the prompt
# (a cross-encoder's head, or a yes/no reranker's last-token logits), one number
EMBEDDING_POOLINGS = ("last", "mean")
POOLINGS = (*EMBEDDING_POOLINGS, "score")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated on construction.

    ``temperature == 0`` is greedy. With ``seed`` set, each draw depends only on
    (seed, output position, sample index), so the same request gives the same tokens
    whatever else shares its batch and whichever process samples it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16     # None: up to the context length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None     # top-N log-probabilities per sampled token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None   # blocks cached under one salt serve only requests with the same salt
    # the LoRA adapter computing this request (vLLM's LoRARequest, by name; None: the base model).
    # Its digest, the adapter's content, is the engine's to fill in: the prefix cache, the KV tiers
    # and the KV handoff key on it, so one adapter's KV never serves another's request
    lora_name: str | None = None
    lora_digest: str | None = None
    structured_outputs: StructuredOutputsParams | None = None   # a grammar every completion matches
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, in [-100, 100] (OpenAI's)
    allowed_token_ids: tuple[int, ...] | None = None   # only these may be drawn (vLLM's)
    bad_words: tuple[str, ...] = ()   # never generated (vLLM's): the frontend fills in their tokens below
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()   # a sequence's last token is banned after the rest
    # an embedding: the prompt's final hidden states pooled ("last" token, or "mean" of all), with no
    # token generated (max_tokens 0); "mean" takes no prefix-cache hit, so every position is computed
    pooling: str | None = None
    # scheduling, not sampling: lower goes first under --scheduling-policy priority or fair (vLLM's field)
    priority: int = 0
    # who asked, for --scheduling-policy fair's shares and the per-tenant caps and metrics (the
    # server fills it in: the API key's tenant, or the body's user field)
    tenant: str = ""
    # seconds the request may wait for its first step; past them it is dropped before any prompt
    # step (an error the server answers 503 with Retry-After). None: it waits as long as it takes
    timeout: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias is not None:   # "12": 5.0 (JSON's keys are text) -> 12: 5.0
            try:
                object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in dict(self.logit_bias).items()})
            except (TypeError, ValueError):
                raise ConfigError("logit_bias", self.logit_bias,
                                  "a map of token ids to numbers in [-100, 100]") from None
        if not isinstance(self.bad_words, tuple):
            object.__setattr__(self, "bad_words", (self.bad_words,) if isinstance(self.bad_words, str)
                               else tuple(self.bad_words or ()))
        if not isinstance(self.bad_words_token_ids, tuple) or not all(
                isinstance(ids, tuple) for ids in self.bad_words_token_ids):
            object.__setattr__(self, "bad_words_token_ids", tuple(tuple(ids) for ids in self.bad_words_token_ids))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        for name in FLOAT_FIELDS:   # a subnormal reads as 0 in a process whose CPU flushes denormals
            value = getattr(self, name)  # (the engine's C kernels set FTZ/DAZ): 0 everywhere, then
            if isinstance(value, float) and value != 0 and abs(value) < sys.float_info.min:
                object.__setattr__(self, name, 0.0)   # every process checks the same value
        self._validate()

    def _validate(self) -> None:
        checks = [
            ("n", self.n, isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"an integer in [1, {MAX_N}]"),
            ("temperature", self.temperature, self.temperature >= 0, "a number >= 0 (0 is greedy)"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0,
             "an integer >= 1, or 0 / -1 for no limit"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "a number in [-2, 2]"),
            ("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2,
             "a number in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "a number > 0"),
            ("max_tokens", self.max_tokens, self.max_tokens is None or self.max_tokens >= 0,
             "an integer >= 0, or None for up to the context length"),
            ("min_tokens", self.min_tokens, self.min_tokens >= 0 and (
                self.max_tokens is None or self.min_tokens <= self.max_tokens), "an integer in [0, max_tokens]"),
            ("logprobs", self.logprobs, self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"an integer in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs,
             self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"an integer in [0, {MAX_LOGPROBS}]"),
            ("seed", self.seed, self.seed is None or -INT64 <= self.seed < INT64, "a 64-bit signed integer, or None"),
            ("priority", self.priority, isinstance(self.priority, int) and -INT64 <= self.priority < INT64,
             "a 64-bit signed integer (lower goes first)"),
            ("tenant", self.tenant, isinstance(self.tenant, str) and len(self.tenant) <= MAX_TENANT_CHARS,
             f"a string of at most {MAX_TENANT_CHARS} characters"),
            ("timeout", self.timeout, self.timeout is None or (isinstance(self.timeout, (int, float))
                                                               and 0 < self.timeout < 1e9),
             "a number of seconds > 0, or None to wait as long as it takes"),
            ("top_k", self.top_k, self.top_k < INT64, "a 64-bit integer"),
            ("max_tokens", self.max_tokens, self.max_tokens is None or self.max_tokens < INT64, "a 64-bit integer"),
            ("min_tokens", self.min_tokens, self.min_tokens < INT64, "a 64-bit integer"),
            ("stop_token_ids", self.stop_token_ids, len(self.stop_token_ids) <= MAX_STOP and all(
                isinstance(t, int) and 0 <= t < 2 ** 31 for t in self.stop_token_ids),
             f"at most {MAX_STOP} token ids, each in [0, 2^31)"),
            ("stop", self.stop, len(self.stop) <= MAX_STOP and all(isinstance(s, str) and s for s in self.stop),
             f"at most {MAX_STOP} non-empty strings"),
            ("logit_bias", self.logit_bias, self.logit_bias is None or (
                len(self.logit_bias) <= MAX_LOGIT_BIAS and all(
                    0 <= t < 2 ** 31 and -100 <= b <= 100 for t, b in self.logit_bias.items())),
             f"at most {MAX_LOGIT_BIAS} token ids in [0, 2^31), each mapped to a number in [-100, 100]"),
            ("allowed_token_ids", self.allowed_token_ids, self.allowed_token_ids is None or (
                0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKENS and all(
                    isinstance(t, int) and 0 <= t < 2 ** 31 for t in self.allowed_token_ids)),
             f"a list of 1 to {MAX_ALLOWED_TOKENS} token ids, each in [0, 2^31)"),
            ("bad_words", self.bad_words, len(self.bad_words) <= MAX_STOP and all(
                isinstance(w, str) and w.strip() for w in self.bad_words), f"at most {MAX_STOP} non-empty words"),
            ("pooling", self.pooling, self.pooling is None or (self.pooling in POOLINGS and self.max_tokens == 0
                                                                and self.n == 1),
             f"one of {', '.join(POOLINGS)}, with max_tokens 0 and n 1 (an embedding generates nothing)"),
            ("cache_salt", self.cache_salt, self.cache_salt is None or (isinstance(self.cache_salt, str)
                                                                          and self.cache_salt != ""),
             "a non-empty string, or None"),
            ("lora_name", self.lora_name, self.lora_name is None or (isinstance(self.lora_name, str)
                                                                        and 0 < len(self.lora_name) <= 128),
             "an adapter's name (1 to 128 characters), or None for the base model"),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise ConfigError(name, value, allowed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_biases(self) -> bool:
        """logit_bias, allowed_token_ids or bad words: the logits change before sampling."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for ``LLM.generate(..., lora_request=...)`` (vLLM's ``LoRARequest``): its name and
    where its files are (a PEFT folder or a GGUF adapter file); loaded on first use. ``lora_int_id``
    is vLLM's and means nothing here."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
