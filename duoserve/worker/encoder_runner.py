"""The runner of a cross-encoder engine (``duoserve.model.encoder``): each scheduled request is a
whole (query, document) sequence; one forward computes them all, and each comes back with its
relevance score (``RunnerOutput.pooled``). There is no KV to keep: the scheduler's blocks are
bookkeeping only (the engine caps how many sequences and tokens a step takes by them)."""

from __future__ import annotations

import torch

from duoserve.core.outputs import RunnerOutput, SchedulerOutput
from duoserve.model.loader import LoadedModel


class EncoderRunner:
    kv_caches: list = []   # nothing to hand off, store or swap
    compiled = False
    drafter = None
    grammar_masks = None
    swap_bytes = 0
    swap_seconds = 0.0

    def __init__(self, loaded: LoadedModel, device: str) -> None:
        self.model = loaded.model
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        items = plan.scheduled
        for item in items:   # the engine admits a sequence whole (no chunking, no prefix cache)
            if item.start != 0 or item.num_new_tokens != item.request.num_prompt_tokens:
                raise RuntimeError(f"a cross-encoder computes a sequence whole: {item.request.request_id} was "
                                   f"scheduled for tokens {item.start} to {item.start + item.num_new_tokens}")
        lengths = [item.num_new_tokens for item in items]
        token_ids = [t for item in items for t in item.request.prompt_token_ids]
        positions = [p for length in lengths for p in range(length)]
        hidden = self.model(torch.tensor(token_ids, device=self.device), torch.tensor(positions, device=self.device),
                            lengths)
        output = RunnerOutput(sampled={})
        start = 0
        for item, length in zip(items, lengths):
            output.pooled[item.request.request_id] = [self.model.score(hidden[start:start + length]).item()]
            start += length
        return output

    @torch.inference_mode()
    def scratch_forward(self, num_tokens: int) -> None:
        """One sequence of ``num_tokens`` (what start measures of a step's temporary memory)."""
        self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                   torch.arange(num_tokens, device=self.device), [num_tokens])
