"""KV connectors: how a prefill engine hands a request and its KV to a decode engine.

A connector has two ends. The prefill end ``send``s a ``KVTransfer`` and later
receives the decode side's acknowledgement (``poll_acks``), which lets it free the
leased blocks. The decode end receives transfers (``poll_transfers``) and
``acknowledge``s each once its KV is in place. ``InProcessConnector`` joins two
engines of one process (tests); transports between processes and hosts carry the
same transfer in the wire format (``duoserve.kv.wire``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

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


class InProcessConnector:
    """Both ends in one process: queues, no copies. For tests and single-process setups."""

    def __init__(self) -> None:
        self._transfers: deque[KVTransfer] = deque()
        self._acks: deque[str] = deque()

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
