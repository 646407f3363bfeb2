"""What a caller gets back: one RequestOutput per prompt, one CompletionOutput per sample."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from duoserve.core.outputs import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None    # stop, length, abort, error
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    delta_text: str = ""                # text added since the previous snapshot (streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    pooled: list[float] | None = None   # an embedding request's pooled hidden state (SamplingParams.pooling)

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    @property
    def embedding(self) -> list[float] | None:
        """The pooled hidden state, L2-normalised (what /v1/embeddings returns); None if not asked."""
        if self.pooled is None:
            return None
        norm = math.sqrt(math.fsum(x * x for x in self.pooled))
        return [x / norm for x in self.pooled] if norm > 0 else list(self.pooled)
