"""BlockStream (chat deltas as content blocks / output items) and the error shapes by API."""

from __future__ import annotations

import json

import pytest

from duoserve.entrypoints.blocks import BlockKind, BlockStream
from duoserve.entrypoints.errors import error_response


def test_deltas_become_blocks_that_add_up_to_the_answer():
    stream = BlockStream()
    deltas = [{"reasoning_content": "Think"}, {"reasoning_content": "ing."}, {"content": "The "},
              {"content": "answer."},
              {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
              {"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": ""}}]},
              {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}]
    events = [e for d in deltas for e in stream.feed([d])] + stream.close()
    assert [(e.kind, e.block.index) for e in events] == [
        ("start", 0), ("delta", 0), ("delta", 0), ("stop", 0), ("start", 1), ("delta", 1), ("delta", 1), ("stop", 1),
        ("start", 2), ("delta", 2), ("delta", 2), ("stop", 2), ("start", 3), ("delta", 3), ("stop", 3)]
    assert [(b.kind, b.text, b.call_id, b.name) for b in stream.blocks] == [
        (BlockKind.REASONING, "Thinking.", None, None), (BlockKind.TEXT, "The answer.", None, None),
        (BlockKind.TOOL_CALL, '{"x": 1}', "call_a", "f"), (BlockKind.TOOL_CALL, "{}", "call_b", "g")]
    assert stream.close() == []


def test_empty_pieces_open_no_block():
    stream = BlockStream()
    assert stream.feed([{"content": ""}, {"reasoning_content": ""}, {}]) == [] and stream.close() == []


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (413, "request_too_large"),
                                          (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error")])
def test_errors_take_the_shape_of_the_callers_api(status, kind):
    anthropic = json.loads(error_response(status, "why", param="p", path="/v1/messages").body)
    assert anthropic == {"type": "error", "error": {"type": kind, "message": "why (p)"}}
    openai = json.loads(error_response(status, "why", param="p", path="/v1/responses").body)
    assert set(openai["error"]) == {"message", "type", "param", "code"} and openai["error"]["param"] == "p"


def test_how_each_api_says_an_answer_ended():
    from duoserve.entrypoints.serving_anthropic import stop_reason
    from duoserve.entrypoints.serving_responses import ResponsesServing
    from duoserve.outputs import CompletionOutput

    assert stop_reason("stop", 2, ["END"], has_calls=False) == ("end_turn", None)   # the eos token
    assert stop_reason("stop", "END", ["END"], has_calls=False) == ("stop_sequence", "END")
    assert stop_reason("length", None, None, has_calls=False) == ("max_tokens", None)
    assert stop_reason("stop", None, None, has_calls=True) == ("tool_use", None)      # a named call
    assert stop_reason("tool_calls", None, None, has_calls=True) == ("tool_use", None)
    for reason, status in (("stop", "completed"), ("length", "incomplete"), ("error", "failed"), ("abort", "failed")):
        done = ResponsesServing._finished({"id": "resp_1"}, None, [], CompletionOutput(
            0, token_ids=[1, 2], finish_reason=reason, error="drained"), 5, 2, {})
        assert done["status"] == status and done["usage"]["output_tokens"] == 2
        assert (done["error"] is not None) == (status == "failed")
        assert (done["incomplete_details"] == {"reason": "max_output_tokens"}) == (status == "incomplete")
