"""Engine supervision: bring a deployment's engines up, watch them, bring them back.

One task per engine. Engines this frontend launches or places are started first and must
come up (``start``: a failure stops them all and is raised); engines that run elsewhere
are waited for in the background, logged, and retried for as long as it takes. Each task
then reads its engine's batches: stats are kept here (health), outputs are passed up to
the ``EngineEvents`` listener (``AsyncEngine``), which serves the requests. When an engine
dies the listener hears ``engine_down`` (it fails the requests the engine held) and the
engine is relaunched, or reconnected if it runs elsewhere, while the others serve on; a
launched engine that fails ``RESTART_ATTEMPTS`` relaunches in a row stays down. Once
``begin_stop`` was called nothing is relaunched.

Every engine must serve the model the first one serves (they exchange KV): one that
serves another is refused by name (``refused``) and stopped.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Protocol

from duoserve.core.outputs import EngineCoreOutput
from duoserve.frontend.engine_client import EngineClient, EngineDeadError
from duoserve.frontend.placement import Rates
from duoserve.frontend.launcher import (engine_running, kill_engine, remove_socket, remove_turns_file, signal_engine,
                                       spawn_engine, stop_engine_server)
from duoserve.frontend.tokenizer_preload import preload as preload_tokenizer
from duoserve.heap import release_free_memory
from duoserve.messages import EngineStats
from duoserve.model.fingerprint import describe_difference

logger = logging.getLogger(__name__)
RESTART_ATTEMPTS = 3       # a launched engine that fails this many relaunches in a row stays down
REMOTE_WAIT_S = 10.0       # a remote engine is asked again (and logged) this often until it answers


def call_hooks(hooks: list[Callable], *args) -> None:
    """Metrics and logging hooks: an error in one is logged, never passed on to the serving path."""
    for hook in hooks:
        try:
            hook(*args)
        except Exception:
            logger.exception("a metrics hook failed (ignored)")


def model_difference(a: EngineClient, b: EngineClient) -> str | None:
    """What differs between two engines' models (they would exchange KV), or None."""
    return describe_difference(a.name, a.ready.fingerprint, b.name, b.ready.fingerprint)


async def start_engine(client: EngineClient, timeout: float = 300.0) -> None:
    """Launch the engine (if this frontend launches it), connect and wait for EngineReady."""
    if client.launched:
        spawn_engine(client)
    await client.connect(timeout)
    if client.launched:
        stop_engine_server()


async def restart_engine(client: EngineClient, timeout: float = 300.0) -> None:
    """Relaunch a launched engine, or reconnect to a remote one (it must be running again)."""
    kill_engine(client)
    await start_engine(client, timeout)


async def stop_engine(client: EngineClient, timeout: float = 10.0) -> None:
    """Stop a launched engine (a remote one only aborts this frontend's requests) and close
    the connection; a launched engine still running after ``timeout`` seconds is killed."""
    client.say_shutdown()
    if client.launched and engine_running(client):
        if client.ready is None:   # still starting: it reads no message yet, but stops at once on SIGTERM
            signal_engine(client, signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + timeout
        while engine_running(client) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if engine_running(client):
            logger.warning("%s did not stop in %.0fs: killing it", client.name, timeout)
    elif client.connected:
        await asyncio.sleep(0.1)  # let the Shutdown leave before the socket closes
    kill_engine(client)
    client.close()
    remove_socket(client)


class EngineEvents(Protocol):
    """What the supervisor reports up, to the object that serves the requests."""

    def engine_up(self, client: EngineClient) -> None: ...
    def engine_outputs(self, client: EngineClient, outputs: list[EngineCoreOutput]) -> None: ...
    def engine_down(self, client: EngineClient, reason: str) -> None: ...
    def engines_lost(self, reason: str) -> None: ...


class EngineSupervisor:
    def __init__(self, decode_clients: list[EngineClient], prefill_clients: list[EngineClient],
                 events: EngineEvents) -> None:
        self.decode_clients = decode_clients
        self.prefill_clients = prefill_clients
        self.clients = [*prefill_clients, *decode_clients]
        self.events = events
        self.stats: dict[str, EngineStats] = {}
        self.refused: dict[str, str] = {}     # engine name -> why it was refused (another model)
        self.stopping = False                 # shutdown began: nothing is relaunched any more
        self.on_stats: list[Callable[[str, str, EngineStats], None]] = []   # (name, instance id, stats)
        self.on_engine_down: list[Callable[[str], None]] = []
        self._tasks: list[asyncio.Task] = []

    # ---- health -------------------------------------------------------------------------

    def all_up(self) -> bool:
        return all(c.is_up() for c in self.clients)

    def decode_up(self) -> bool:
        """A decode (or colocated) engine is up; without a prefill engine decode engines prefill."""
        return any(c.is_up() for c in self.decode_clients)

    def waiting_reason(self) -> str:
        waiting = [f"{c.name} at {c.address}" + (f" (refused: {self.refused[c.name]})" if c.name in self.refused else "")
                   for c in self.clients if not c.is_up()]
        return "waiting for " + ", ".join(waiting) if waiting else "starting"

    def check_model(self, client: EngineClient) -> None:
        """Every engine must serve the model the first one serves (they exchange KV)."""
        for other in self.clients:
            if other is not client and other.ready is not None:
                difference = model_difference(other, client)
                if difference is not None:
                    raise EngineDeadError(f"{other.name} and {client.name} serve different models ({difference})")

    # ---- start and stop -----------------------------------------------------------------

    async def start(self) -> None:
        """Start the engines this frontend launches or places (a failure stops all and is
        raised), then one task per engine: the others are connected to in the background."""
        managed = [c for c in self.clients if c.managed]
        try:
            launched = [c for c in managed if c.launched]
            for client in launched:
                spawn_engine(client)
            for model in {c.config.model.model for c in launched}:
                preload_tokenizer(model)   # parsed here while the engines load
            await asyncio.gather(*(client.connect() for client in managed))
            if launched:
                stop_engine_server()
            release_free_memory()   # the ready messages' tokenizer text, parsed and dropped
            for client in managed:
                self.check_model(client)
                self._engine_up(client)
        except BaseException:
            await asyncio.gather(*(stop_engine(client) for client in self.clients), return_exceptions=True)
            raise
        self._tasks = [asyncio.create_task(self._serve(c), name=f"duoserve-engine-{c.name}") for c in self.clients]

    def begin_stop(self) -> None:
        """Shutdown began: relaunch nothing from now on."""
        self.stopping = True

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(stop_engine(client, timeout) for client in self.clients))
        remove_turns_file(self.clients)

    # ---- one task per engine ------------------------------------------------------------

    def _engine_up(self, client: EngineClient) -> None:
        self.events.engine_up(client)
        if client in self.decode_clients:
            self._refresh_peers()

    def _refresh_peers(self) -> None:
        """A decode engine came (back) up, maybe at another address: prefill engines hear of it."""
        for prefill in self.prefill_clients:
            peers = prefill.current_peers()
            if peers != prefill.peers and prefill.is_up():
                logger.info("%s hands KV to %s from now on", prefill.name,
                            ", ".join(f"{n} at {a}" for n, a in peers.items()))
                try:
                    prefill.tell_peers(peers)
                except EngineDeadError:   # it went down meanwhile: it gets the peers when it comes back
                    pass

    async def _serve(self, client: EngineClient) -> None:
        """Connect (engines that run elsewhere), read outputs until the engine dies, report it
        down and bring it back; until shutdown."""
        if not client.is_up() and not await self._bring_back(client):
            return
        while not self.stopping:
            try:
                self.check_model(client)
            except EngineDeadError as exc:
                logger.error("refusing %s: %s", client.name, exc)
                self.refused[client.name] = str(exc)
                await stop_engine(client)
                return
            self.refused.pop(client.name, None)
            self._engine_up(client)
            try:
                await self._read_until_dead(client)
                return
            except EngineDeadError as exc:
                if self.stopping:
                    return
                self._engine_down(client, str(exc))
            if not await self._bring_back(client):
                if not self.decode_up():
                    self.events.engines_lost(f"{client.name} died and could not be restarted")
                return

    def _engine_down(self, client: EngineClient, reason: str) -> None:
        self.stats.pop(client.name, None)
        call_hooks(self.on_engine_down, client.name)
        self.events.engine_down(client, reason)   # (which reads whether it was draining)
        client.draining = False   # whatever comes back takes work

    async def _bring_back(self, client: EngineClient) -> bool:
        """Relaunch a launched engine (a few tries), or wait for a remote one for as long as it takes."""
        attempt = 0
        while not self.stopping:
            attempt += 1
            if not client.launched:
                logger.info("waiting for %s at %s", client.name, client.address)
            try:
                await restart_engine(client, timeout=300.0 if client.launched else REMOTE_WAIT_S)
            except EngineDeadError as exc:
                if client.launched:
                    logger.error("bringing back %s failed (attempt %d): %s", client.name, attempt, exc)
                else:
                    logger.info("%s does not answer yet: %s", client.name, exc)
            else:
                logger.info("%s is up (%s)", client.name, "relaunched" if client.launched else "connected")
                return not self.stopping
            if client.launched and attempt >= RESTART_ATTEMPTS:
                return False
            await asyncio.sleep(min(2.0 * attempt, 10.0) if client.launched else 1.0)
        return False

    async def _read_until_dead(self, client: EngineClient) -> None:
        instance_id = client.ready.instance_id
        while True:
            batch = await client.recv()
            if batch.stats is not None:
                self.stats[client.name] = batch.stats
                client.draining = batch.stats.draining
                client.rates = Rates(tuple(batch.stats.prefill_tokens_per_s), tuple(batch.stats.decode_step_s),
                                     batch.stats.handoff_s_per_token)
                call_hooks(self.on_stats, client.name, instance_id, batch.stats)
            if batch.outputs:
                self.events.engine_outputs(client, batch.outputs)
