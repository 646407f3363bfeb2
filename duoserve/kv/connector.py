"""KV connectors: how a prefill engine hands a request and its KV to a decode engine.

A connector has two ends, each declared here as a Protocol the engines are written against. The
prefill end (``KVSender``) ``send``s a ``KVTransfer`` and later receives the decode side's
acknowledgement (``poll_acks``), which lets it free the leased blocks. The decode end
(``KVReceiver``) receives transfers (``poll_transfers``) and ``acknowledge``s each once its KV is
in place. ``InProcessConnector`` is both ends in one process (``KVConnector``: tests); the ZeroMQ
ends between processes and hosts (``duoserve.kv.zmq_connector``) carry the same transfer in the
wire format (``duoserve.kv.wire``) and are also ``PeerSockets``: the engine's loop polls them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from duoserve.messages import TransferMeta


@dataclass
class KVTransfer:
    meta: TransferMeta    # the request, its first token and the decode engine it is for: what travels ahead
    keys: list[Any]       # per layer [num_prompt_tokens, num_kv_heads, head_dim] tensors
    values: list[Any]
    received_at: float | None = None   # set by the decode end when the transfer lands
    peer: str | None = None            # the decode engine it goes to (between processes)

    @property
    def request_id(self) -> str:
        return self.meta.request_id

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@runtime_checkable
class KVSender(Protocol):
    """A prefill engine's end of a connector."""
    last_transfer: tuple[int, float]   # the latest send's bytes and seconds (the metrics)

    def send(self, transfer: KVTransfer) -> None:
        """Ship ``transfer`` to its decode engine (``transfer.peer``); raises when it cannot."""

    def poll_acks(self) -> list[str]:
        """The request ids the decode side has taken since the last call: their leases can go."""

    def sweep(self, max_age: float) -> int:
        """Free what unacknowledged transfers older than ``max_age`` seconds hold; how many."""


@runtime_checkable
class KVReceiver(Protocol):
    """A decode engine's end of a connector."""

    def poll_transfers(self) -> list[KVTransfer]:
        """The transfers that arrived since the last call, each stamped ``received_at``."""

    def acknowledge(self, request_id: str) -> None:
        """Tell the sender its KV of ``request_id`` is in place (or will not be used)."""


@runtime_checkable
class KVConnector(KVSender, KVReceiver, Protocol):
    """Both ends in one object (one process)."""


@runtime_checkable
class PeerSockets(Protocol):
    """An end between processes: its sockets join the engine's poll; closed when the engine ends."""

    def sockets(self) -> list:
        """The ZeroMQ sockets whose messages the engine's loop reads (to ``receive``)."""

    def close(self) -> None:
        ...


class InProcessConnector:
    """Both ends in one process (a ``KVConnector``): queues, no copies. For tests and
    single-process setups."""

    def __init__(self) -> None:
        self._transfers: deque[KVTransfer] = deque()
        self._acks: deque[str] = deque()
        self.last_transfer: tuple[int, float] = (0, 0.0)   # nothing is copied: no time to report

    # prefill end
    def send(self, transfer: KVTransfer) -> None:
        self._transfers.append(transfer)

    def poll_acks(self) -> list[str]:
        acks, self._acks = list(self._acks), deque()
        return acks

    def sweep(self, max_age: float) -> int:
        return 0   # nothing outlives a transfer here (the ZeroMQ connector's segments can)

    # decode end
    def poll_transfers(self) -> list[KVTransfer]:
        transfers, self._transfers = list(self._transfers), deque()
        for transfer in transfers:
            transfer.received_at = time.monotonic()
        return transfers

    def acknowledge(self, request_id: str) -> None:
        self._acks.append(request_id)
