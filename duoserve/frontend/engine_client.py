"""The frontend's side of an engine that runs in its own process.

``EngineProcessClient`` starts the process (``duoserve.engine.process``), waits for
``EngineReady``, and then plays the ``EngineHandle`` part for ``Frontend``: requests
and aborts go out as messages, outputs come back through ``recv``. The tokenizer
arrives in ``EngineReady``, so this process never loads the model.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import uuid

import msgspec
import zmq
import zmq.asyncio

from duoserve.config import EngineConfig
from duoserve.core.request import Request
from duoserve.engine import messages as msg
from duoserve.engine.process import engine_main
from duoserve.errors import DuoserveError
from duoserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT = 30.0  # an engine that is alive but silent this long (it sends stats every second) is stuck


class EngineDeadError(DuoserveError):
    """The engine process exited or could not start."""


class EngineProcessClient:
    def __init__(self, config: EngineConfig, name: str = "engine-0", handoff: dict | None = None) -> None:
        self.config = config
        self.name = name
        self.handoff = handoff
        base = os.path.join(tempfile.gettempdir(), f"duoserve-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._paths = [f"{base}-in", f"{base}-out"]
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._to_engine = self._sync_ctx.socket(zmq.PUSH)
        self._to_engine.bind(f"ipc://{self._paths[0]}")
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._from_engine.bind(f"ipc://{self._paths[1]}")
        self.process: multiprocessing.process.BaseProcess | None = None
        self.ready: msg.EngineReady | None = None
        self.tokenizer: Tokenizer | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self, timeout: float = 300.0) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=engine_main, name=f"duoserve-{self.name}", daemon=True,
            args=(msgspec.msgpack.encode(self.config), f"ipc://{self._paths[0]}", f"ipc://{self._paths[1]}",
                  logging.getLogger().getEffectiveLevel() or logging.INFO, self.handoff))
        self.process.start()
        message = await self._recv(timeout, waiting_for="EngineReady")
        if isinstance(message, msg.EngineFailed):
            await self.shutdown()
            raise EngineDeadError(f"{self.name} failed to start: {message.error}")
        if not isinstance(message, msg.EngineReady):
            raise EngineDeadError(f"{self.name} sent {type(message).__name__} before EngineReady")
        self.ready = message
        if message.tokenizer_json is not None:
            from tokenizers import Tokenizer as HFTokenizer

            self.tokenizer = Tokenizer(HFTokenizer.from_str(message.tokenizer_json),
                                       bos_token_id=message.bos_token_id,
                                       eos_token_ids=tuple(message.eos_token_ids),
                                       chat_template=message.chat_template, add_bos_token=message.add_bos_token)

    async def restart(self, timeout: float = 300.0) -> None:
        """Start a fresh engine process on the same addresses (the old one is dead)."""
        if self.process is not None and self.process.is_alive():
            self.process.kill()
        if self.process is not None:
            self.process.join(timeout=5)
        while await self._from_engine.poll(timeout=0):  # whatever the dead one left unread
            await self._from_engine.recv()
        self.ready = None
        await self.start(timeout)

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def is_up(self) -> bool:
        """Alive and past its EngineReady: it can take requests."""
        return self.ready is not None and self.is_alive()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to stop, then make sure it has: no child process is left behind."""
        if self.process is not None and self.process.is_alive():
            try:
                self._send(msg.Shutdown())
            except zmq.ZMQError:
                pass
            deadline = asyncio.get_running_loop().time() + timeout
            while self.process.is_alive() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            if self.process.is_alive():
                logger.warning("%s did not stop in %.0fs: killing it", self.name, timeout)
                self.process.kill()
            self.process.join(timeout=5)
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._ctx.term()
        self._sync_ctx.term()
        for path in self._paths:
            if os.path.exists(path):
                os.unlink(path)

    # ---- EngineHandle -------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.ready.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.ready.eos_token_ids)

    def _send(self, message: msgspec.Struct) -> None:
        try:
            self._to_engine.send(msg.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:  # no engine on the other end (it died or is restarting)
            raise EngineDeadError(f"{self.name} is not connected") from None

    def add_request(self, request: Request) -> None:
        self._send(msg.AddRequest(request.request_id, request.prompt_token_ids, request.params,
                                  list(request.eos_token_ids), request.max_total_tokens or self.max_model_len,
                                  request.arrival_time))

    def abort(self, request_id: str) -> None:
        self._send(msg.AbortRequest(request_id))

    def finish_stopped(self, request_id: str) -> None:
        self._send(msg.FinishStopped(request_id))

    def release(self, request_id: str) -> None:
        self._send(msg.ReleaseRequest(request_id))

    # ---- outputs ------------------------------------------------------------------------

    async def recv(self) -> msg.EngineOutputs:
        """The next batch of outputs; raises EngineDeadError if the engine dies or falls silent."""
        message = await self._recv(HEARTBEAT_TIMEOUT, waiting_for="outputs")
        if isinstance(message, msg.EngineFailed):
            raise EngineDeadError(f"{self.name} failed: {message.error}")
        return message

    async def _recv(self, timeout: float, waiting_for: str) -> msg.FromEngine:
        waited = 0.0
        while True:
            if await self._from_engine.poll(timeout=500):
                return msg.decode_from_engine(await self._from_engine.recv())
            waited += 0.5
            if not self.is_alive():
                code = None if self.process is None else self.process.exitcode
                raise EngineDeadError(f"{self.name} exited (exit code {code}) while waiting for {waiting_for}")
            if waited >= timeout:
                raise EngineDeadError(f"{self.name} sent nothing for {timeout:.0f}s while waiting for {waiting_for}")
