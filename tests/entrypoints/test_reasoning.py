"""Reasoning parsers: a whole answer split into reasoning and content, and the streamed pieces
adding up to the same split at every chunking (no model)."""

from __future__ import annotations

import pytest

from duoserve.entrypoints.reasoning import ReasoningStream, split_reasoning

ANSWERS = ["<think>\nhmm, let me see\n\n</think>\n\nThe answer is 4.", "just content", "<think>cut short\n",
           "abc</think>xyz", "\n<think>x</think>y", "<thi", "</think>", "<think></think>\n", "a\n</thin",
           "x</think>\n\n", "<think>a < b, and </thing> is not the end</think>ok"]


def test_whole_answers():
    assert split_reasoning("deepseek_r1", "<think>\nplan\n</think>\n\nDone.") == ("plan", "Done.")
    assert split_reasoning("deepseek_r1", "plan</think>Done.") == ("plan", "Done.")      # <think> in the prompt
    assert split_reasoning("deepseek_r1", "still thinking") == ("still thinking", None)   # cut by max_tokens
    assert split_reasoning("qwen3", "<think>plan</think>Done.") == ("plan", "Done.")
    assert split_reasoning("qwen3", "Done, no thinking.") == (None, "Done, no thinking.")
    assert split_reasoning("qwen3", "plan</think>Done.") == (None, "plan</think>Done.")  # never opened


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", ANSWERS)
def test_streamed_pieces_add_up_to_the_whole_split(parser, text):
    for size in (1, 2, 3, 5, len(text) or 1):
        stream, reasoning, content = ReasoningStream(parser), "", ""
        pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, i == len(pieces) - 1)
            reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content or None) == split_reasoning(parser, text), size
