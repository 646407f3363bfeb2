"""The contract objects of one engine step: scheduler -> runner -> scheduler -> frontend."""

from __future__ import annotations

from dataclasses import dataclass, field

from duoserve.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request          # the runner reads its tokens and sampling params (same process)
    start: int                # num_computed_tokens before this step: position of the first new token
    num_new_tokens: int       # tokens whose KV this step computes
    block_ids: list[int]      # the request's whole block table after allocation
    sample: bool              # the chunk ends at the last known token: sample the next one
    num_samples: int = 1      # n rows to sample (the first token of an n > 1 prompt), else 1
    prompt_logprobs: bool = False  # return log-probabilities of this chunk's prompt tokens
    # speculative decoding: tokens guessed after the last known one, computed in this step too
    # (the last num_spec_tokens of num_new_tokens); a draft model's are filled in by the runner
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_tokens: int = 0

    @property
    def num_known_tokens(self) -> int:
        """New tokens of this step that are the request's own (not guesses)."""
        return self.num_new_tokens - self.num_spec_tokens

    def drop_guesses(self, keep: int) -> None:
        """Keep only the first ``keep`` guesses (the runner found fewer)."""
        self.num_new_tokens -= self.num_spec_tokens - keep
        self.num_spec_tokens = keep
        del self.spec_token_ids[keep:]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]   # one-token (decode) requests first, then prefill chunks
    num_batched_tokens: int             # sum of num_new_tokens
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    preempted_ids: list[str] = field(default_factory=list)
    # decode role: KV that arrived from a prefill engine, to write before the forward
    kv_inserts: list[tuple[str, list[int], object]] = field(default_factory=list)  # (request id, blocks, KV)
    # blocks found in the shared KV store, to write before the forward: (block id, (K, V) per layer)
    block_loads: list[tuple[int, object]] = field(default_factory=list)
    # swap space: (KV block, swap block) to copy out, then (swap block, KV block) to copy in,
    # both before the forward (a block swapped out this step may be handed to another request)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's, its rank, and the top N."""
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RunnerOutput:
    # request id -> new token(s): n samples of a first token, or a speculating request's accepted
    # guesses followed by the target's own next token
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # per sampled token
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # per prompt token
    # structured outputs: per sampled token, whether the request's grammar is complete after it
    grammar_ended: dict[str, list[bool]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)   # request id -> why it cannot go on (its grammar)
    pooled: dict[str, list[float]] = field(default_factory=dict)   # request id -> its embedding (not normalised)


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    # position of new_token_ids[0] among the request's outputs: with a handoff, the prefill
    # and decode engines both report the first token and the frontend keeps one of them
    position: int = 0
    finish_reason: str | None = None   # stop, length, abort, error
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    # TTFT stages measured by this engine, once per request: queue and prefill with the first
    # token; transfer and admit on a decode engine's first output after a handoff
    stages: dict[str, float] | None = None
    pooled: list[float] | None = None   # an embedding request's pooled hidden state, with its finish

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
