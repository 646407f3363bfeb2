"""Stored responses: what ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``, its
``input_items`` and background responses read.

A response is stored unless the request says ``store: false`` (OpenAI's default), in memory, the
newest ``capacity`` of them (an older one is forgotten: ``previous_response_id`` naming it is
then a 400 ``previous_response_not_found``). Each keeps the conversation before it (``history``),
so a chain of responses stays readable when its first links are forgotten.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_CAPACITY = 1000
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


@dataclass
class StoredResponse:
    response: dict                    # the response object, as GET shows it now
    input_items: list[dict]           # this turn's input, each with its id
    history: list[dict]               # the items of the conversation before it
    task: asyncio.Task | None = field(default=None, repr=False)   # a background response's work

    def conversation(self) -> list[dict]:
        """Every item a response following this one sees first."""
        return self.history + self.input_items + self.response.get("output", [])


def with_ids(items: list[dict]) -> list[dict]:
    """Input items as ``input_items`` lists them: each with an id (messages get ``msg_...``)."""
    out = []
    for item in items:
        item = dict(item)
        kind = item.get("type", "message")
        item.setdefault("type", kind)
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if kind == "message":
            item.setdefault("status", "completed")
        item.setdefault("id", f"{_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}")
        out.append(item)
    return out


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._responses[stored.response["id"]] = stored
        self._responses.move_to_end(stored.response["id"])
        while len(self._responses) > self.capacity:
            _, old = self._responses.popitem(last=False)
            if old.task is not None:
                old.task.cancel()

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is not None and stored.task is not None:
            stored.task.cancel()
        return stored is not None

    def __len__(self) -> int:
        return len(self._responses)
