"""One model as the server serves it: its spec (``ModelSpec``), and while loaded its engine group
with the API surfaces of the base and of each LoRA adapter (``ServedModel``).

A LoRA adapter is a model name too (vLLM's convention): its surfaces are the base's over an
``AdapterEngine``, which names the adapter in every request it starts and counts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

from duoserve.config import EngineConfig
from duoserve.entrypoints.responses_store import ResponseStore
from duoserve.entrypoints.server_config import ServerConfig
from duoserve.entrypoints.serving import OpenAIServing
from duoserve.entrypoints.serving_anthropic import AnthropicServing
from duoserve.entrypoints.serving_chat import ChatServing
from duoserve.entrypoints.serving_embeddings import EmbeddingServing
from duoserve.entrypoints.serving_responses import ResponsesServing
from duoserve.entrypoints.serving_score import ScoreServing
from duoserve.frontend.async_engine import AsyncEngine
from duoserve.worker.memory import rss_bytes


@dataclass(frozen=True)
class ModelSpec:
    """One model the server can serve: its name in requests, its engines' config, its own
    parsers and pooling (``server``), and whether it loads before the port opens."""
    name: str
    engine_config: EngineConfig
    server: ServerConfig
    load_on_startup: bool = True


class Surfaces:
    """Every API surface over one engine group, answering as one model: the base, or one of its
    LoRA adapters (``AdapterEngine``)."""

    def __init__(self, name: str, engine, server: ServerConfig, store: ResponseStore) -> None:
        self.engine = engine
        self.openai = OpenAIServing(engine, name)
        self.chat = ChatServing(self.openai, server.tool_call_parser, server.reasoning_parser)
        self.anthropic = AnthropicServing(self.chat)
        self.responses = ResponsesServing(self.chat, store)
        self.embeddings = EmbeddingServing(self.openai, server.pooling)
        self.scores = ScoreServing(self.openai)


class AdapterEngine:
    """An engine group seen through one LoRA adapter (vLLM's convention: the adapter's name is a
    model): every request it starts is the adapter's; everything else is the engine group's."""

    def __init__(self, engine: AsyncEngine, adapter: str) -> None:
        self._engine, self.adapter = engine, adapter
        self.waiting = self.running = 0   # its requests in flight: before and after their first output

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(self, prompt, params, request_id: str, **kwargs):
        self.waiting += 1
        started = False
        try:
            async with contextlib.aclosing(self._engine.generate(
                    prompt, dataclasses.replace(params, lora_name=self.adapter), request_id, **kwargs)) as outputs:
                async for out in outputs:
                    if not started:
                        started = True
                        self.waiting, self.running = self.waiting - 1, self.running + 1
                    yield out
        finally:
            if started:
                self.running -= 1
            else:
                self.waiting -= 1


class ServedModel:
    """One loaded model: its engine group, and the surfaces of the base and of each adapter."""

    def __init__(self, spec: ModelSpec, engine: AsyncEngine, store: ResponseStore) -> None:
        self.spec, self.engine, self.store = spec, engine, store
        self.surfaces: dict[str | None, Surfaces] = {None: Surfaces(spec.name, engine, spec.server, store)}
        self.leases = 0   # requests between asking for the model and handing their streams to it

    def surface(self, adapter: str | None) -> Surfaces:
        if adapter not in self.surfaces:
            self.surfaces[adapter] = Surfaces(adapter, AdapterEngine(self.engine, adapter), self.spec.server,
                                              self.store)
        return self.surfaces[adapter]

    @property
    def busy(self) -> bool:
        return self.leases > 0 or self.engine.num_unfinished > 0

    def resident_bytes(self) -> int:
        """The resident size of the engine processes this server launched for the model."""
        return sum(rss_bytes(c.process.pid) for c in self.engine.clients
                   if c.process is not None and c.process.pid is not None)
