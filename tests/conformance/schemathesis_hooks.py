"""schemathesis hooks for duoserve (``SCHEMATHESIS_HOOKS=tests.conformance.schemathesis_hooks``).

Every generated body names the served model ($DUOSERVE_CONFORMANCE_MODEL, default
smollm2-135m), else nearly every case stops at a 404. Values the schema allows but no model
can serve (negative token counts, token ids outside the vocabulary) are brought into range,
and counts capped so a run stays short: the server refuses those with a 400 naming the
parameter, which test_hostile_input.py checks case by case. Content parts other than text
(images, audio, files, refusals) are left out for the same reason: the model reads text only;
so are the fields duoserve refuses by name as not implemented (``NOT_IMPLEMENTED``), custom
tool calls in the history, and the tools (a definition's name and schema, a choice naming a
tool, ``auto`` without a parser: hand cases and tests/entrypoints/test_tools.py). A
``json_schema`` response format keeps its shape with a schema that can be enforced (schemas
that cannot: hand cases); ``logit_bias`` maps ids into the vocabulary and biases into
[-100, 100].

The work of a request is bounded here, not its time: at most ``MAX_ITEMS`` prompts in a batch,
messages in a chat or parts in a message, ``MAX_TOKEN_IDS`` ids in a token prompt and
``MAX_CHARS`` characters in a text, and a few output tokens; so a run takes as long as its
number of examples says, whatever else shares the machine. Prompts near the context length
are hand cases too.
"""

from __future__ import annotations

import os

import schemathesis

from duoserve.entrypoints.protocol import NOT_IMPLEMENTED

MODEL = os.environ.get("DUOSERVE_CONFORMANCE_MODEL", "smollm2-135m")
VOCAB = int(os.environ.get("DUOSERVE_CONFORMANCE_VOCAB", "49152"))
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2, "best_of": 2}
MAX_ITEMS = 4
MAX_TOKEN_IDS = 64
MAX_CHARS = 256


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _prompt(prompt):
    """Token ids brought into the vocabulary; batches, token lists and texts cut to the caps."""
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [t % VOCAB for t in prompt[:MAX_TOKEN_IDS]]
    if isinstance(prompt, list):
        return [_prompt(p) for p in prompt[:MAX_ITEMS]]
    return _text(prompt)


def _text(value):
    return value[:MAX_CHARS] if isinstance(value, str) else value


def _messages(messages):
    """At most MAX_ITEMS messages of at most MAX_ITEMS parts, each text cut to MAX_CHARS."""
    if not isinstance(messages, list):
        return messages
    bounded = []
    for message in messages[:MAX_ITEMS]:
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, list):   # text parts only: another kind is a 400 naming it (a hand case)
                content = [{**p, "text": _text(p["text"])} for p in content[:MAX_ITEMS]
                           if isinstance(p, dict) and p.get("type") == "text" and "text" in p]
            message = {**message, "content": _text(content)} if "content" in message else message
            if isinstance(message.get("tool_calls"), list):   # custom tool calls: a 400 naming the type
                message["tool_calls"] = [c for c in message["tool_calls"][:MAX_ITEMS]
                                         if isinstance(c, dict) and c.get("type") == "function"]
        bounded.append(message)
    return bounded


# duoserve's own routes past OpenAI's subset (their schemas: the server's /openapi.json)
NEW_ROUTES = ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/embeddings")


def _new_route(path: str, body: dict) -> dict:
    """Anthropic's Messages, Responses and embeddings bodies bounded like the others."""
    body["model"] = MODEL
    body["stream"] = False
    for name in ("max_tokens", "max_output_tokens"):
        if path != "/v1/embeddings" and (name in body or path == "/v1/messages" and name == "max_tokens"):
            body[name] = min(max(int(body[name]), 1), CAPS["max_tokens"]) if _is_number(body.get(name)) else 8
    if path == "/v1/responses" and "max_output_tokens" not in body:
        body["max_output_tokens"] = CAPS["max_tokens"]
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:MAX_ITEMS]
    if isinstance(body.get("input"), (list, str)):
        body["input"] = _prompt(body["input"]) if path == "/v1/embeddings" else body["input"][:MAX_ITEMS]
    return body


@schemathesis.hook
def map_body(ctx, body):
    path = ctx.operation.path if ctx.operation is not None else ""
    if isinstance(body, dict) and path in NEW_ROUTES:
        return _new_route(path, body)
    if isinstance(body, dict):
        body["model"] = MODEL
        for name, cap in CAPS.items():
            if _is_number(body.get(name)):
                body[name] = min(max(int(body[name]), 1), cap)
        body.pop("suffix", None)   # insertion is not served: a 400 naming suffix (a hand case)
        for name in (*NOT_IMPLEMENTED, "tools", "tool_choice"):   # each a 400 naming it (hand cases)
            body.pop(name, None)
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            fmt["json_schema"]["schema"] = {"type": "object", "properties": {"a": {"type": "integer"}}}
        if isinstance(body.get("logit_bias"), dict):
            body["logit_bias"] = {str(int(k) % VOCAB): max(-100, min(100, v)) for k, v in body["logit_bias"].items()
                                  if k.isascii() and k.lstrip("-").isdigit() and _is_number(v)}
        if body.get("best_of") is not None:   # after n's cap
            body["best_of"] = body.get("n") if _is_number(body.get("n")) else 1   # only best_of == n is served
        if body.get("top_logprobs") is not None:
            body["logprobs"] = True   # as OpenAI, duoserve refuses top_logprobs without logprobs (a 400)
        # echo with logprobs: the first prompt token has no log-probability, null there as in
        # OpenAI's own answers and vLLM's, where the description allows numbers only
        body["echo"] = False
        body["stream"] = False   # chunks are checked against the stream schemas in test_hostile_input.py
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = CAPS["max_tokens"]   # else a chat runs to the end of the context
        if "prompt" in body:   # an empty batch ([]) is refused with a 400, as OpenAI does
            body["prompt"] = _prompt(body["prompt"]) if body["prompt"] != [] else ""
        if "messages" in body:
            body["messages"] = _messages(body["messages"])
    return body
