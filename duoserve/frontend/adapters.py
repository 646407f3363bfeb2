"""LoRA adapters loaded and unloaded while serving, on every engine of a deployment.

``AdapterChanges.change`` sends ``ChangeAdapter`` to each engine that is up and waits for each
one's answer, an output under the operation's own id (taken out of the outputs before they reach
any request). The adapters loaded so far are kept, so that an engine launched again (or coming up
later) is given them before it serves: every engine computes every adapter the server lists.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from duoserve import messages as msg
from duoserve.core.outputs import EngineCoreOutput
from duoserve.errors import DuoserveError
from duoserve.frontend.engine_client import EngineClient, EngineDeadError

logger = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 120.0   # an engine reads an adapter's files in well under this


class AdapterChangeError(DuoserveError):
    """An adapter change an engine refused: ``in_use`` when requests use the adapter."""

    def __init__(self, message: str, in_use: bool = False) -> None:
        super().__init__(message)
        self.in_use = in_use


class AdapterChanges:
    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}   # adapter -> path, as loaded while serving
        self.waiting: dict[str, asyncio.Future] = {}

    async def change(self, clients: list[EngineClient], name: str, path: str | None) -> None:
        """Load (path) or unload (None) the adapter on every engine in ``clients`` that is up."""
        futures = []
        loop = asyncio.get_running_loop()
        for client in clients:
            if not client.is_up():
                continue
            op_id = f"lora-{uuid.uuid4().hex}"
            self.waiting[op_id] = future = loop.create_future()
            futures.append((client, op_id, future))
            try:
                client.send(msg.ChangeAdapter(op_id, name, path))
            except EngineDeadError as exc:
                future.set_result(EngineCoreOutput(op_id, [], finish_reason="error", error=str(exc)))
        try:
            answers = await asyncio.wait_for(asyncio.gather(*(f for _, _, f in futures)), ANSWER_TIMEOUT_S)
        except asyncio.TimeoutError:
            late = [client.name for client, _, future in futures if not future.done()]
            raise AdapterChangeError(f"{', '.join(late)} did not answer within {ANSWER_TIMEOUT_S:.0f}s") from None
        finally:
            for _, op_id, _ in futures:
                self.waiting.pop(op_id, None)
        refused = [(client, out) for (client, _, _), out in zip(futures, answers) if out.finish_reason != "stop"]
        if refused:
            client, out = refused[0]
            raise AdapterChangeError(f"{client.name}: {out.error}", in_use=out.finish_reason == "abort")
        if path is None:
            self.loaded.pop(name, None)
        else:
            self.loaded[name] = path

    def take_answers(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The outputs that are not answers to a change (those resolve their waiters)."""
        if not self.waiting:
            return outputs
        rest = []
        for out in outputs:
            future = self.waiting.get(out.request_id)
            if future is None:
                rest.append(out)
            elif not future.done():
                future.set_result(out)
        return rest

    def engine_up(self, client: EngineClient) -> None:
        """Give an engine that came up the adapters loaded while serving (fire and forget: it
        reads them before the requests sent after)."""
        for name, path in self.loaded.items():
            lora = client.config.lora if client.config is not None else None
            if lora is not None and (name, path) in lora.modules:
                continue
            logger.info("loading LoRA adapter %s on %s, which came up after it was loaded", name, client.name)
            client.send(msg.ChangeAdapter(f"lora-{uuid.uuid4().hex}", name, path))
