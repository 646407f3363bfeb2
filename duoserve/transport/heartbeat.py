"""ZeroMQ heartbeats on every socket between a frontend and its engines, and between engines.

They run in ZeroMQ's I/O thread, so an engine busy in a long step never looks dead,
while a vanished host or a cut connection is dropped within ``HEARTBEAT_TIMEOUT_MS``
(the frontend sees the drop through a socket monitor). Torch-free: the API process uses it.
"""

from __future__ import annotations

import zmq

HEARTBEAT_MS = 500           # ping a silent connection this often...
HEARTBEAT_TIMEOUT_MS = 3000  # ...and drop it when no pong comes back in time


def keep_alive(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    return sock
