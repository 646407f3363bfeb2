"""Reasoning models: ``serve --reasoning-parser`` splits a chat answer's thinking from its content.

``deepseek_r1`` (DeepSeek-R1 and its distills): the template opens ``<think>`` in the prompt, so
everything before ``</think>`` is reasoning, and an answer cut before it is reasoning only.
``qwen3``: the model writes ``<think>...</think>`` itself; an answer without ``</think>`` (thinking
off: ``chat_template_kwargs: {"enable_thinking": false}``) is content only. vLLM's names; the
reasoning goes out as ``reasoning_content``, beside ``content``, in answers and stream deltas.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of an answer: what comes before ``</think>`` and after it (the
    newlines around the tags dropped). An answer cut before ``</think>`` is reasoning only; for
    qwen3, an answer that does not begin with ``<think>`` is content only."""
    if parser == "qwen3" and not text.startswith(START):
        return None, text or None
    end = text.find(END)
    if end < 0:
        return text.removeprefix(START).strip("\n") or None, None
    return text[:end].removeprefix(START).strip("\n") or None, text[end + len(END):].lstrip("\n") or None


class ReasoningStream:
    """One streamed choice: the reasoning and content of each new piece of text, so that the
    pieces add up to ``split_reasoning`` of the whole. What could be the start of a tag (and the
    newlines before ``</think>``) is held back until the next piece tells."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ["", ""]        # reasoning and content sent so far

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) to send for ``delta``."""
        self.text += delta
        view = self.text if finished else self.text[:len(self.text) - self._held()]
        reasoning, content = split_reasoning(self.parser, view)
        pieces = []
        for k, whole in enumerate((reasoning or "", content or "")):
            sent = self.sent[k]
            piece = whole[len(sent):] if whole.startswith(sent) else ""
            self.sent[k] = sent + piece
            pieces.append(piece)
        return pieces[0], pieces[1]

    def _held(self) -> int:
        text = self.text
        if START.startswith(text):
            return len(text)               # it may yet open with <think>
        if self.parser == "qwen3" and not text.startswith(START) or END in text:
            return 0
        partial = next((k for k in range(min(len(END) - 1, len(text)), 0, -1) if text.endswith(END[:k])), 0)
        before = text[:len(text) - partial]
        return partial + len(before) - len(before.rstrip("\n"))
