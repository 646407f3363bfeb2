"""Request bodies as OpenAI's API description allows them: nulls meaning the default, the
edge values it permits, and the limits duoserve adds (each refusal names its field)."""

from __future__ import annotations

import pytest

from duoserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from duoserve.errors import ConfigError
from duoserve.sampling_params import SamplingParams


def test_null_means_the_default_where_the_field_has_no_null_of_its_own():
    body = CompletionRequest.model_validate({"prompt": "x", "stream": None, "echo": None, "n": None,
                                             "max_tokens": None, "top_p": None})
    assert (body.stream, body.echo, body.n) == (False, False, 1)
    assert body.max_tokens is None, "max_tokens has a null of its own: up to the context length"
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "function", "content": None}],
                                                 "logprobs": None})
    assert chat.logprobs is False and chat.messages[0].text() == ""


def test_prompt_is_required_but_may_be_null():
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"model": "m"})
    assert CompletionRequest.model_validate({"prompt": None}).prompts() == ["<|endoftext|>"]


def test_edge_values_of_the_description():
    zero = CompletionRequest.model_validate({"prompt": "x", "top_p": 0}).sampling_params(4)
    assert (zero.top_p, zero.top_k) == (1.0, 1), "top_p 0: the most likely token alone"
    tiny = CompletionRequest.model_validate({"prompt": "x", "top_p": 5e-324}).sampling_params(4)
    assert (tiny.top_p, tiny.top_k) == (1.0, 1), "a subnormal top_p is 0 in every process"
    seed = CompletionRequest.model_validate({"prompt": "x", "seed": -(2 ** 63) - 191}).sampling_params(4).seed
    assert -(2 ** 63) <= seed < 2 ** 63
    assert CompletionRequest.model_validate({"prompt": "x", "stop": ["", "a"]}).sampling_params(4).stop == ("a",)
    parts = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": None}, {"type": "text", "text": "hi"}]}]})
    assert parts.messages[0].text() == "hi"
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "assistant"}]}).messages[0].text() == ""


@pytest.mark.parametrize("message,words", [
    ({"role": "user"}, "a message with role 'user' needs 'content'"),
    ({"role": "system", "content": None}, "a message with role 'system' needs 'content'"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "content part type 'image_url' is not supported: this model reads 'text' parts only"),
])
def test_a_message_the_model_cannot_read_is_refused_by_name(message, words):
    with pytest.raises(ValueError, match=words):
        ChatCompletionRequest.model_validate({"messages": [message]})


@pytest.mark.parametrize("field,value,words", [
    ("n", 129, "[1, 128]"), ("stop", ["s"] * 257, "at most 256"), ("seed", 2 ** 63, "64-bit"),
    ("stop_token_ids", [2 ** 31], "[0, 2^31)"), ("top_k", 2 ** 70, "64-bit"),
])
def test_limits_name_their_field(field, value, words):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field and words in str(info.value)
    assert len(str(info.value)) < 400


def test_a_subnormal_float_is_zero_everywhere():
    params = SamplingParams(temperature=5e-324, min_p=1e-310)
    assert params.temperature == 0.0 and params.min_p == 0.0
    with pytest.raises(ConfigError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=5e-324)


@pytest.mark.parametrize("extra, refused", [
    ({}, None),
    ({"metadata": {"a": 1}, "store": True}, None),                     # changes nothing: accepted (logged)
    ({"response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}, None),
    ({"tool_choice": "auto", "logit_bias": {"42": 0}, "audio": None}, None),   # asks for nothing
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, None),  # implemented
    ({"logit_bias": {"42": -100}, "allowed_token_ids": [1], "structured_outputs": {"regex": "a"}}, None),
    ({"tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}, None),   # implemented
    ({"functions": [{"name": "f"}], "function_call": "auto"}, "function_call"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
def test_known_fields_not_implemented_are_named_unless_they_ask_for_nothing(extra, refused):
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **extra)
    assert body.not_implemented_field() == refused
