"""Which decoding requests speculate this step, and how many tokens: the proposer's side of
speculative decoding that needs no tensors.

A decoding request normally computes one token a step (its last sampled one). Speculating,
it computes that token and ``k`` guessed ones after it in the same forward; the target's
logits at those ``1 + k`` positions tell how many guesses were right (the runner verifies,
``duoserve.worker.spec_verify``), and every right guess is a step saved.

``ngram`` guesses here, at planning time (prompt lookup: the request's last n tokens found
earlier in its own prompt and output, and the tokens that followed them there). ``draft``
reserves the slots and the runner fills them from the draft model before the target runs.
A request speculates only when it is decoding, the step has at most ``disable_batch_size``
running requests (a batch that large is compute-bound on a CPU: checking guesses costs more
than it saves), and its guesses cannot run past ``max_tokens`` or the context.
"""

from __future__ import annotations

from array import array

from duoserve.config import SpeculativeConfig
from duoserve.core.request import Request


def propose_ngram(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (from ``ngram_max`` down to ``ngram_min`` tokens long) found in ``tokens``; [] if none.

    The search runs over the tokens as 4-byte words with ``bytes.rfind`` (C speed): a hit not on
    a word boundary is skipped.
    """
    length = len(tokens)
    if length < ngram_min + 1:
        return []
    data = array("i", tokens).tobytes()
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = data[4 * (length - n):]
        end = 4 * (length - 1)   # an occurrence must end before the last token: not the suffix itself
        while True:
            at = data.rfind(suffix, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return tokens[start:start + k]
            end = at + len(suffix) - 1
    return []


class SpeculationPolicy:
    """Decides each decoding request's guesses for one step (``ngram``) or how many slots the
    draft model fills (``draft``), and counts what the verification accepted."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_steps = 0               # verifications (one per request per step with guesses)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_by_position = [0] * config.num_speculative_tokens

    def enabled_for_step(self, num_running: int) -> bool:
        return num_running <= self.config.disable_batch_size

    def max_guesses(self, request: Request, budget: int) -> int:
        """How many tokens a decoding request may guess: k, cut so that even all of them accepted
        plus the token after stay within ``max_tokens``, the context, and this step's budget."""
        k = min(self.config.num_speculative_tokens, budget - 1)
        params = request.params
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - request.num_output_tokens - 1)
        if request.max_total_tokens is not None:
            k = min(k, request.max_total_tokens - request.num_tokens - 1)
        return max(k, 0)

    def guesses(self, request: Request, budget: int) -> tuple[list[int], int]:
        """(ngram guesses, or [] for the runner's draft model to fill; number of guesses)."""
        k = self.max_guesses(request, budget)
        if k == 0:
            return [], 0
        if self.config.method == "draft":
            return [], k
        all_tokens = request.prompt_token_ids + request.output_token_ids
        found = propose_ngram(all_tokens, self.config.ngram_min, self.config.ngram_max, k)
        return found, len(found)

    def record(self, num_guesses: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_guesses
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_by_position[position] += 1
