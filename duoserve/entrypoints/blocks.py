"""A streamed chat answer as a sequence of blocks, for the surfaces that stream blocks rather
than chat deltas (Anthropic's content blocks, the Responses API's output items).

``ChatServing.pieces`` gives OpenAI-shaped deltas: ``{"reasoning_content"}``, ``{"content"}``, and
``{"tool_calls": [...]}`` (a call's index, id and name first, then its arguments). ``BlockStream``
turns them into block events: a block of one kind is opened, fed pieces, and closed when another
kind (or another call) begins or the answer ends. The blocks' texts add up to the finished
answer that ``ChatServing.answer`` reads back, so a streamed answer reassembles to the other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BlockKind(enum.Enum):
    REASONING = "reasoning"
    TEXT = "text"
    TOOL_CALL = "tool_call"


@dataclass
class Block:
    kind: BlockKind
    index: int                  # its place among the answer's blocks
    text: str = ""              # the reasoning, the text, or a call's arguments (JSON) so far
    call_id: str | None = None  # a tool call's
    name: str | None = None     # a tool call's function
    item_id: str | None = None  # the id a surface gives it (the Responses API's output item)


@dataclass(frozen=True)
class BlockEvent:
    kind: str                   # start, delta, stop
    block: Block
    piece: str = ""             # a delta's new text


class BlockStream:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.current: Block | None = None

    def feed(self, deltas: list[dict]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._append(BlockKind.REASONING, delta["reasoning_content"])
            if delta.get("content"):
                events += self._append(BlockKind.TEXT, delta["content"])
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                if call.get("id") is not None:   # a new call: its own block
                    events += self._open(BlockKind.TOOL_CALL, call_id=call["id"], name=function.get("name"))
                if function.get("arguments"):
                    events += self._append(BlockKind.TOOL_CALL, function["arguments"])
        return events

    def close(self) -> list[BlockEvent]:
        """The answer ended: close the open block."""
        if self.current is None:
            return []
        block, self.current = self.current, None
        return [BlockEvent("stop", block)]

    def _open(self, kind: BlockKind, call_id: str | None = None, name: str | None = None) -> list[BlockEvent]:
        events = self.close()
        self.current = Block(kind, len(self.blocks), call_id=call_id, name=name)
        self.blocks.append(self.current)
        return events + [BlockEvent("start", self.current)]

    def _append(self, kind: BlockKind, piece: str) -> list[BlockEvent]:
        events = [] if self.current is not None and self.current.kind is kind else self._open(kind)
        self.current.text += piece
        return events + [BlockEvent("delta", self.current, piece)]
