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
from dataclasses import dataclass, field
from typing import Any

from duoserve.core.outputs import TokenLogprobs
from duoserve.sampling_params import SamplingParams


@dataclass
class KVTransfer:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_total_tokens: int | None
    arrival_time: float
    first_token: int
    sample_index: int
    keys: list[Any]       # per layer [num_prompt_tokens, num_kv_heads, head_dim] tensors
    values: list[Any]
    first_logprobs: TokenLogprobs | None = None
    # the prompt's log-probabilities when they were asked for: the decode engine restates them
    # with the first token, so the frontend has them whichever engine's output comes first
    prompt_logprobs: list[TokenLogprobs] | None = None
    sent_at: float = field(default_factory=time.monotonic)

    received_at: float | None = None   # set by the decode end when the transfer lands
    peer: str | None = None            # the decode engine it goes to (between processes)
    peer_instance: str | None = None   # ... and that engine's incarnation

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
