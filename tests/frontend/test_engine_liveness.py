"""Liveness is judged from the process, not from answers: an engine whose process runs and
whose ZeroMQ I/O thread answers heartbeats is slow, not dead, however long its step; a
frozen one (SIGSTOP) is found by its unanswered heartbeats within the documented time
(``HEARTBEAT_TIMEOUT_MS``, checked every ``POLL_S``: "within ~4 s").

The engine here is a stand-in process (no model, no torch): a ROUTER socket with the
engines' heartbeat settings that answers the hello, then runs one "step" that holds the GIL
in a Python loop for longer than the heartbeat time-out, then sends outputs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from duoserve.frontend import engine_client
from duoserve.frontend.engine_client import POLL_S, EngineClient, EngineDeadError
from duoserve.transport.heartbeat import HEARTBEAT_TIMEOUT_MS

STAND_IN = """
import sys, time, zmq
from duoserve import messages as msg
from duoserve.transport.heartbeat import keep_alive

sock = keep_alive(zmq.Context().socket(zmq.ROUTER))
sock.bind(sys.argv[1])
identity, _ = sock.recv_multipart()
sock.send_multipart([identity, msg.encode(msg.EngineReady(
    role="colocated", instance_id="stand-in", fingerprint={}, max_model_len=16, vocab_size=8, eos_token_ids=[0],
    num_blocks=1, block_size=16, model_path="-", tokenizer_json=None, bos_token_id=None, add_bos_token=False,
    chat_template=None))])
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:   # one long step: only ZeroMQ's own I/O thread runs meanwhile
    pass
sock.send_multipart([identity, msg.encode(msg.EngineOutputs([]))])
time.sleep(600)
"""


def _stand_in(step_s: float) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{tempfile.gettempdir()}/duoserve-liveness-{uuid.uuid4().hex[:8]}"
    return subprocess.Popen([sys.executable, "-c", STAND_IN, address, str(step_s)]), address


def _stop(proc: subprocess.Popen, address: str) -> None:
    """The stand-in killed, and its socket file with it (a killed process leaves it in /tmp)."""
    proc.kill()
    proc.wait()
    Path(address.removeprefix("ipc://")).unlink(missing_ok=True)


async def _connected(address: str) -> EngineClient:
    client = EngineClient("stand-in", address)
    await client.connect(timeout=60)
    return client


def test_a_step_longer_than_every_timeout_is_slow_not_dead(monkeypatch):
    """A 6 s step (twice the heartbeat time-out, six times the silence time-out): the engine
    is reported slow while it runs, never dead, and answers again after it."""
    monkeypatch.setattr(engine_client, "SILENCE_TIMEOUT", 1.0)
    step_s = 2 * HEARTBEAT_TIMEOUT_MS / 1000
    proc, address = _stand_in(step_s)

    async def main():
        client = await _connected(address)
        slow_seen = []

        async def watch():
            while True:
                slow_seen.append(client.slow_since is not None)
                await asyncio.sleep(0.1)

        watcher = asyncio.ensure_future(watch())
        start = time.monotonic()
        try:
            batch = await client.recv()   # raises EngineDeadError if the engine were taken for dead
        finally:
            watcher.cancel()
        waited = time.monotonic() - start
        client.close()
        return batch, waited, any(slow_seen), client.slow_since

    try:
        batch, waited, was_slow, slow_after = asyncio.run(main())
    finally:
        _stop(proc, address)
    assert batch.outputs == []
    assert waited >= step_s - 1.0, f"the step's outputs came after {waited:.1f}s: the step was not that long"
    assert was_slow and slow_after is None, "slow while silent, and no longer once it answered"


def test_a_frozen_engine_is_dead_within_the_heartbeat_timeout():
    """SIGSTOP: its process still exists, but nothing answers heartbeats; the client finds it
    dead after the heartbeat time-out and before that plus two polls and a second."""
    proc, address = _stand_in(600)
    bound = HEARTBEAT_TIMEOUT_MS / 1000 + 2 * POLL_S + 1.0

    async def main():
        client = await _connected(address)
        await asyncio.sleep(0.5)   # into the stand-in's step: heartbeats answered, outputs none yet
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="the connection to .* dropped"):
            await client.recv()
        found = time.monotonic() - start
        client.close()
        return found

    try:
        found = asyncio.run(main())
    finally:
        _stop(proc, address)
    assert HEARTBEAT_TIMEOUT_MS / 1000 - 0.5 <= found <= bound, f"found dead after {found:.2f}s"
    print(f"a frozen engine was found dead {found:.2f}s after SIGSTOP (bound {bound:.1f}s)")
