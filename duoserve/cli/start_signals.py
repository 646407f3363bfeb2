"""SIGTERM and SIGINT to ``duoserve serve`` while its engines start (load, build kernels,
compile), before uvicorn takes the signals over.

The first signal cancels the start: the supervisor stops every engine (a launched engine
that is still starting stops at once on SIGTERM) and waits for their processes before the
server goes on to exit, so no engine outlives it even for a moment. A second signal does
not wait: it kills the launched engines and exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from duoserve.frontend.engine_client import EngineClient

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

logger = logging.getLogger("duoserve.api")


@contextmanager
def stop_start_on_signal(clients: Callable[[], list[EngineClient]]) -> Iterator[list[int]]:
    """Within the block (run by the task that starts the engines, ``clients()`` those started so
    far), the first SIGTERM/SIGINT cancels that task; yields the signals received. The handlers
    before it come back after."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    received: list[int] = []

    def on_signal(signum: int, frame) -> None:
        received.append(signum)
        if len(received) == 1:
            logger.warning("%s while the engines start: stopping them", signal.Signals(signum).name)
            loop.call_soon_threadsafe(task.cancel)
            return
        for client in clients():   # a second signal: nothing waits any more
            if client.process is not None and client.process.pid is not None:
                try:
                    os.kill(client.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        os._exit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
