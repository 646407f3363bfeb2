"""Request bodies of the HTTP API (pydantic), and their mapping to SamplingParams.

Fields follow OpenAI's API plus the extras that vLLM clients send (``ignore_eos``,
``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``structured_outputs``,
``allowed_token_ids``...). A known field that would change the answer and that duoserve does
not implement (``NOT_IMPLEMENTED``: functions, audio, logits_processors, tools on completions...) is
refused by name unless its value asks for nothing; other unknown fields (``metadata``, ``store``...) change nothing here and are
accepted with a log warning.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.tool_formats import HERMES
from duoserve.entrypoints.tools import ToolPlan
from duoserve.errors import ConfigError
from duoserve.sampling_params import SamplingParams, StructuredOutputsParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's schema lets most fields be null, meaning "the default": an explicit null
        for a field that has no null value of its own takes the default."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and type(None) not in get_args(fields[k].annotation))}

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())

    def not_implemented_field(self) -> str | None:
        """The first field of ``NOT_IMPLEMENTED`` given a value that asks for something."""
        extra = self.model_extra or {}
        return next((name for name in sorted(extra)
                     if name in NOT_IMPLEMENTED and extra[name] is not None and not NOT_IMPLEMENTED[name](extra)), None)


def _never(_: dict) -> bool:
    return False


# OpenAI's and vLLM's fields that would change the answer, not implemented (yet): field -> whether
# the request's value (in the request's unknown fields) asks for nothing (a null always does)
NOT_IMPLEMENTED: dict[str, Callable[[dict], bool]] = {
    "tools": lambda f: f["tools"] == [],
    "tool_choice": lambda f: f["tool_choice"] == "none" or (f["tool_choice"] == "auto" and not f.get("tools")),
    "functions": lambda f: f["functions"] == [],
    "function_call": lambda f: f["function_call"] == "none" or (f["function_call"] == "auto" and not f.get("functions")),
    "modalities": lambda f: f["modalities"] == ["text"],
    "audio": _never, "prediction": _never, "web_search_options": _never,
    "guided_json": _never, "guided_regex": _never, "guided_choice": _never,
    "guided_grammar": _never, "logits_processors": _never,
    "truncate_prompt_tokens": _never, "max_tokens_per_doc": _never,   # a prompt past the context is a 400
}


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None   # the schema is enforced exactly whatever it says


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs``: one of json, regex, choice, grammar, json_object."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False        # there is no fallback: a grammar is enforced exactly or refused
    disable_any_whitespace: bool = False  # JSON is generated compact either way (duoserve.structured.grammar)


# vLLM's structured_outputs options that would loosen or reshape a grammar: refused when given
_STRUCTURED_NOT_IMPLEMENTED = ("disable_additional_properties", "whitespace_pattern", "structural_tag")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Body):
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None   # a tenant's prefix-cache and KV-store blocks are never another's
    priority: int = 0               # vLLM's: lower first under --scheduling-policy priority or fair
    # seconds it may wait for its first step (dropped after them: 503), none: as long as it takes
    timeout: float | None = Field(default=None, gt=0)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar the request asks for (response_format or structured_outputs), or None."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise ConfigError("structured_outputs", "(with response_format)",
                              "one of response_format and structured_outputs, not both")
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True, param="response_format")
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ConfigError("response_format.json_schema", None, "an object with a name and a schema "
                                  "when type is 'json_schema'")
            if fmt.json_schema.schema_ is None:   # OpenAI's schema is optional: any JSON object then
                return StructuredOutputsParams(json_object=True, param="response_format")
            return StructuredOutputsParams(json=fmt.json_schema.schema_, param="response_format.json_schema.schema")
        if so is None:
            return None
        extra = so.model_extra or {}
        refused = next((name for name in _STRUCTURED_NOT_IMPLEMENTED if extra.get(name) not in (None, False)), None)
        if refused is not None:
            raise ConfigError(f"structured_outputs.{refused}", extra[refused], "left out: not supported")
        return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=bool(so.json_object))

    def sampling_params(self, max_tokens: int | None, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        stop = [s for s in stop if s != ""]   # an empty stop string matches nothing: ignored
        top_p, top_k = (1.0 if self.top_p is None else self.top_p), self.top_k or 0
        seed = None if self.seed is None else (self.seed + 2 ** 63) % 2 ** 64 - 2 ** 63   # any integer: 64 bits of it
        if abs(top_p) < sys.float_info.min:   # 0 (OpenAI's API allows it; a subnormal is 0 too): the
            # smallest nucleus, the most likely token alone
            top_p, top_k = 1.0, 1
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=top_p, top_k=top_k,
            min_p=self.min_p or 0.0, seed=seed, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, cache_salt=self.cache_salt,
            structured_outputs=self.structured(), logit_bias=self.logit_bias,
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            bad_words=tuple(self.bad_words or ()), priority=self.priority, tenant=self.user or "",
            timeout=self.timeout,
        )


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]] | None   # required; null: OpenAI's default, a new document
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None   # only best_of == n: ranking extra samples is not implemented

    def prompts(self) -> list[str | list[int]]:
        """The four OpenAI prompt forms, as a list of text or token-id prompts."""
        p = "<|endoftext|>" if self.prompt is None else self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(_Body):
    type: str
    text: str | None = None    # text parts; the model reads no other kind


class CalledFunction(_Body):
    name: str
    arguments: str   # JSON text, as the answer gave it


class MessageToolCall(_Body):
    """An assistant's earlier call in the history (function calls only: OpenAI's custom tools are
    refused by the type's validation, not dropped)."""
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool", "function"]   # function: deprecated tool
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None   # an assistant's calls, rendered by the chat template
    tool_call_id: str | None = None                  # a tool message: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _content_the_model_can_read(self) -> "ChatMessage":
        """OpenAI's schema: only an assistant message (which then carries tool calls) or a
        deprecated function message may have null content; the model reads text parts only, so
        another kind is refused, not dropped."""
        if self.content is None and self.role not in ("assistant", "function"):
            raise ValueError(f"a message with role '{self.role}' needs 'content' (a string or a list of text parts)")
        for part in self.content if isinstance(self.content, list) else ():
            if part.type != "text":
                raise ValueError(f"content part type '{part.type}' is not supported: this model reads 'text' parts only")
        return self

    def for_template(self) -> dict:
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls is not None:
            message["tool_calls"] = [call.model_dump(include={"id", "type", "function"}) for call in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(part.text or "" for part in self.content if part.type == "text")
        return self.content or ""


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")   # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None   # the parameters' schema is enforced whole whatever it says


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False   # vLLM's: the answer goes on from a final assistant message
    chat_template_kwargs: dict[str, Any] | None = None   # extra variables for the template (enable_thinking...)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @classmethod
    def of_translated(cls, body: dict[str, Any]) -> "ChatCompletionRequest":
        """Another API's request translated into this one (Messages, Responses); a value this
        request refuses is a 400 naming where it sits here."""
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise APIError(400, f"invalid request: {where}: {first.get('msg')}", param=where or None) from exc

    def tool_plan(self, parser: str = HERMES, lazy: bool = True) -> ToolPlan:
        """What the request's tools ask for (``duoserve.entrypoints.tools``); refuses what cannot be served."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or ()]
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if tools else "none")
        if choice == "none":
            return ToolPlan("none", [])
        if not tools:
            raise ConfigError("tool_choice", choice if isinstance(choice, str) else choice.model_dump(),
                              "'none' when no tools are given")
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) < len(names):
            raise ConfigError("tools", names, "tools with distinct function names")
        if choice != "auto" and self.response_format is not None and self.response_format.type != "text":
            raise ConfigError("response_format", self.response_format.type,
                              "'text' when tool_choice asks for a call (the call has its own schema)")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ConfigError("tool_choice", choice.function.name, f"the name of a given tool ({', '.join(names)})")
            return ToolPlan("named", tools, choice.function.name, self.parallel_tool_calls)
        # auto under a response format: the format's grammar holds the answer, calls are only read
        formatted = self.response_format is not None and self.response_format.type != "text"
        return ToolPlan(choice, tools, None, self.parallel_tool_calls, parser, lazy and not formatted)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class ModelRequest(_Body):
    """POST /models/load and /models/unload (llama.cpp's router)."""
    model: str


class LoadLoRARequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's body; ``model``: the base, where the server has several)."""
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    model: str | None = None


class UnloadLoRARequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is vLLM's and means nothing here)."""
    lora_name: str
    lora_int_id: int | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class GenerateRequest(SamplingFields):
    model: str | None = None   # SGLang's has none: the server's one model, or which of several
    prompt: str | list[int]
    max_tokens: int | None = 16
    logprobs: int | None = None


class RerankDocument(BaseModel):
    text: str


class RerankRequest(_Body):
    """/v1/rerank, /v2/rerank, /rerank (vLLM's, Jina's and Cohere's): the documents by relevance."""
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None        # None or 0: every document
    return_documents: bool = True
    user: str | None = None
    priority: int = 0

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Body):
    """/score (vLLM's): text_1 against each text_2 (one to many), or pairwise (as many of each)."""
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None
    priority: int = 0


class EmbeddingRequest(_Body):
    """OpenAI's /v1/embeddings: one vector per input (text, or token ids)."""
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None   # shortening a vector needs a model trained for it: refused
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The four input forms, as a list of text or token-id prompts."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(x, int) for x in self.input):
            return [list(self.input)]
        return list(self.input)
