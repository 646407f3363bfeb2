"""schemathesis hooks for duoserve (``SCHEMATHESIS_HOOKS=tests.conformance.schemathesis_hooks``).

Every generated body names the served model ($DUOSERVE_CONFORMANCE_MODEL, default
smollm2-135m), else nearly every case stops at a 404. Values the schema allows but no model
can serve (negative token counts, token ids outside the vocabulary) are brought into range,
and counts capped so a run stays short: the server refuses those with a 400 naming the
parameter, which test_hostile_input.py checks case by case.
"""

from __future__ import annotations

import os

import schemathesis

MODEL = os.environ.get("DUOSERVE_CONFORMANCE_MODEL", "smollm2-135m")
VOCAB = int(os.environ.get("DUOSERVE_CONFORMANCE_VOCAB", "49152"))
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2, "best_of": 2}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _token_ids(prompt):
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [t % VOCAB for t in prompt]
    if isinstance(prompt, list):
        return [_token_ids(p) for p in prompt]
    return prompt


@schemathesis.hook
def map_body(ctx, body):
    if isinstance(body, dict):
        body["model"] = MODEL
        for name, cap in CAPS.items():
            if _is_number(body.get(name)):
                body[name] = min(max(int(body[name]), 1), cap)
        body.pop("suffix", None)   # insertion is not served: a 400 naming suffix (a hand case)
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
            body["prompt"] = _token_ids(body["prompt"]) if body["prompt"] != [] else ""
    return body
