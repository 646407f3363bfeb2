"""A request inside an engine, and the state machine it moves through.

A request's tokens are its prompt followed by its outputs. The engine computes KV
for them left to right; ``num_computed_tokens`` says how far it has got::

    | prompt ............................ | outputs ...... |
    |<----- num_computed_tokens ----->|   (this step's chunk)
                                      ^ next token whose KV is computed

When ``num_computed_tokens`` reaches ``num_tokens`` the last logits are fresh and
a new token is sampled, which makes ``num_tokens`` one larger again.
"""

from __future__ import annotations

import enum
import time
from duoserve.errors import InvalidRequestError
from duoserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    WAITING_FOR_KV = "waiting_for_kv"
    KV_LEASED = "kv_leased"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})
_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}

S = RequestStatus
_UNFINISHED = [s for s in RequestStatus if s not in _FINISHED]
# from -> the states it may move to (ARCHITECTURE.md, "Request lifecycle")
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    S.WAITING: frozenset({S.PREFILLING, S.WAITING_FOR_KV}),
    S.PREFILLING: frozenset({S.PREFILLING, S.RUNNING, S.KV_LEASED, S.WAITING,
                             S.FINISHED_STOPPED, S.FINISHED_LENGTH}),
    S.RUNNING: frozenset({S.WAITING, S.SWAPPED, S.FINISHED_STOPPED, S.FINISHED_LENGTH}),
    S.WAITING_FOR_KV: frozenset({S.RUNNING}),
    S.KV_LEASED: frozenset({S.FINISHED_STOPPED}),
    S.SWAPPED: frozenset({S.RUNNING}),
}
for _state in _UNFINISHED:
    TRANSITIONS[_state] = TRANSITIONS[_state] | {S.FINISHED_ABORTED, S.FINISHED_ERROR}


class Request:
    """One sequence being generated. ``sample_index`` tells the samples of an ``n > 1`` prompt apart."""

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "params", "sample_index",
                 "status", "num_computed_tokens", "num_cached_tokens", "arrival_time", "eos_token_ids",
                 "max_total_tokens", "error", "block_hashes", "num_preemptions", "first_scheduled_time",
                 "prompt_logprobs", "num_draft_computed", "swap_block_ids", "transferred_kv", "grammar",
                 "pool_sum", "num_charged_prompt_tokens", "last_served")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), max_total_tokens: int | None = None,
                 sample_index: int = 0, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.sample_index = sample_index
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0       # prompt tokens found in the prefix cache at first schedule
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.eos_token_ids = eos_token_ids
        self.max_total_tokens = max_total_tokens  # the context length: prompt + outputs never exceed it
        self.error: str | None = None
        self.block_hashes: list[bytes] = []      # digests of this request's full blocks, in order
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        # log-probabilities of the prompt tokens scored so far, while this request still owes them
        # to its caller (None once delivered, or when nobody asked: other samples, handed-over KV)
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None and sample_index == 0 else None
        # speculative decoding with a draft model: tokens whose KV the draft holds (in the same blocks)
        self.num_draft_computed = 0
        self.swap_block_ids: list[int] = []   # SWAPPED: where its KV waits in the swap space
        self.transferred_kv: object = None    # WAITING_FOR_KV: the KV a prefill engine sent, until written
        self.grammar: object = None           # structured outputs: this sample's matcher (structured.cache)
        self.pool_sum: object = None          # a mean-pooled embedding: its chunks' hidden states summed (runner's)
        self.num_charged_prompt_tokens = 0    # fair share: prompt tokens charged to its tenant (not again)
        self.last_served = 0                  # the scheduler's running count of services when it last gave it tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    def take_prompt_logprobs(self) -> list | None:
        """The complete prompt log-probabilities, handed over once (None afterwards)."""
        entries, self.prompt_logprobs = self.prompt_logprobs, None
        return entries

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def move_to(self, new_status: RequestStatus) -> None:
        """Change state, refusing any transition the lifecycle table does not allow."""
        if new_status not in TRANSITIONS.get(self.status, frozenset()):
            raise InvalidRequestError(
                f"request {self.request_id}: cannot move from {self.status.name} to {new_status.name}"
            )
        self.status = new_status

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens})")
