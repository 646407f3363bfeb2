"""Stored responses: what ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``, its
``input_items`` and background responses read.

A response is stored unless the request says ``store: false`` (OpenAI's default): in memory, the
newest ``capacity`` of them (an older one is forgotten: ``previous_response_id`` naming it is
then a 400 ``previous_response_not_found``), or, with the shared KV tier configured
(``--kv-store redis://...``), in that Redis too (``RedisResponseStore``: every server sharing it
reads the others' responses, and they outlive a restart for ``RESPONSE_TTL``). Each keeps the
conversation before it (``history``), so a chain of responses stays readable when its first links
are forgotten. A background response's work is the server's own; Redis holds what it has so far.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 1000
RESPONSE_TTL = 30 * 24 * 3600   # seconds a response stays in Redis (OpenAI keeps them 30 days)
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

    def save(self, stored: StoredResponse) -> None:
        """A stored response changed in place (a background response moved on): memory has it."""

    def __len__(self) -> int:
        return len(self._responses)


class RedisResponseStore(ResponseStore):
    """Responses in Redis (``duoserve:response:<id>``, JSON, ``RESPONSE_TTL``), the newest
    ``capacity`` also in memory (and a background one's work). An unreachable Redis is logged
    and the memory answers alone: a response is never refused for the tier's sake."""

    PREFIX = "duoserve:response:"

    def __init__(self, url: str, capacity: int = DEFAULT_CAPACITY, timeout: float = 1.0) -> None:
        import redis

        super().__init__(capacity)
        self.redis = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)

    def put(self, stored: StoredResponse) -> None:
        super().put(stored)
        self._write(stored)

    def save(self, stored: StoredResponse) -> None:
        """Write a stored response again (a background response that moved on)."""
        self._write(stored)

    def _write(self, stored: StoredResponse) -> None:
        record = {"response": stored.response, "input_items": stored.input_items, "history": stored.history}
        try:
            self.redis.set(self.PREFIX + stored.response["id"], json.dumps(record), ex=RESPONSE_TTL)
        except Exception as exc:   # redis' errors and timeouts
            logger.warning("response %s not written to Redis: %s", stored.response["id"], exc)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = super().get(response_id)
        if stored is not None:
            return stored
        try:
            raw = self.redis.get(self.PREFIX + response_id)
        except Exception as exc:
            logger.warning("response %s not read from Redis: %s", response_id, exc)
            return None
        if raw is None:
            return None
        record = json.loads(raw)
        return StoredResponse(record["response"], record["input_items"], record["history"])

    def delete(self, response_id: str) -> bool:
        here = super().delete(response_id)
        try:
            return bool(self.redis.delete(self.PREFIX + response_id)) or here
        except Exception as exc:
            logger.warning("response %s not deleted from Redis: %s", response_id, exc)
            return here
