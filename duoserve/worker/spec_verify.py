"""Check guessed tokens against the target's logits, without changing what the target would say.

A speculating request's forward gives target logits at ``1 + k`` positions: after its last
known token, and after each guess. Position ``j`` is what the target says should follow
guess ``j - 1``: the guesses are accepted left to right while they are what the target
draws, and the first position that disagrees (or the one after the last guess) gives the
target's own token. Every step thus yields between 1 and ``k + 1`` tokens.

*Point guesses* (n-gram lookup, or a draft model's greedy choice): the target draws at every
position exactly as it would without speculation (the same uniform, ``STREAM_DRAW`` of the
seed rule) and a guess is accepted when it equals that draw. The output is the target's own
token by token: the same as speculation off, seeded sampling included. (As a rejection
sampler this accepts a point guess x with probability p(x) and otherwise draws from p
without x, the residual.)

*Drawn guesses* (a draft model sampling from its distribution q): standard rejection sampling.
Guess x at position j is accepted when ``u * q(x) < p(x)`` (``u`` from ``STREAM_ACCEPT``);
the first rejected position draws from the residual ``max(p - q, 0)`` normalized, and when
all are accepted the position after the last draws from p. Each output token is then
distributed exactly as the target's p given the tokens before it.

Log-probabilities are always the target's, of the tokens kept.
"""

from __future__ import annotations

import torch

from duoserve.core.outputs import TokenLogprobs
from duoserve.worker.sampler import STREAM_ACCEPT, SamplingRow, draw_from, logprobs_of, probabilities, uniforms


def accept_point_guesses(guesses: list[int], target_tokens: list[int]) -> int:
    """How many leading guesses equal the target's draws at their positions."""
    accepted = 0
    while accepted < len(guesses) and guesses[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted


def rejection_sample(p: torch.Tensor, q: torch.Tensor, guesses: torch.Tensor, u_accept: torch.Tensor,
                     u_draw: torch.Tensor) -> tuple[int, int | None]:
    """p, q [k, vocab] (target, draft), guesses [k] drawn from q, uniforms [k] each.

    Returns (number accepted, the token drawn from the residual at the first rejected
    position, or None when all k were accepted).
    """
    k = guesses.shape[0]
    rows = torch.arange(k)
    p_guess, q_guess = p[rows, guesses].double(), q[rows, guesses].double()
    accepted_mask = u_accept * q_guess < p_guess  # u < p / q, with q > 0 where the draft drew
    rejected = (~accepted_mask).nonzero()
    if rejected.numel() == 0:
        return k, None
    at = int(rejected[0, 0])
    residual = (p[at] - q[at]).clamp_min_(0)
    if not residual.sum() > 0:  # p == q here: the residual is empty, and p itself is the answer
        residual = p[at]
    return at, int(draw_from(residual[None], u_draw[at:at + 1])[0])


def verify(logits: torch.Tensor, rows: list[SamplingRow], drawn: list[int], guesses: list[int],
           draft_probs: torch.Tensor | None, generator: torch.Generator | None, raw: torch.Tensor | None = None,
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One request's ``1 + k`` rows: target logits [1 + k, vocab] (a grammar's disallowed tokens
    at -inf; ``raw``, unmasked, for the log-probabilities), their sampling rows, the target's own
    draws at them, the k guesses and, for drawn guesses, the draft's distributions [k, vocab].
    Returns the tokens kept and their log-probabilities."""
    raw = logits if raw is None else raw
    if draft_probs is None or rows[0].params.greedy:
        accepted = accept_point_guesses(guesses, drawn)
        kept = drawn[:accepted + 1]
        return kept, logprobs_of(raw[:accepted + 1], rows[:accepted + 1], torch.tensor(kept))
    k = len(guesses)
    p = probabilities(logits[:k], rows[:k])
    u_draw = uniforms(rows[:k], generator)  # the residual draw uses the plain draw's uniform
    u_accept = uniforms(rows[:k], generator, STREAM_ACCEPT)
    accepted, replacement = rejection_sample(p, draft_probs, torch.tensor(guesses), u_accept, u_draw)
    kept = guesses[:accepted] + [drawn[k] if replacement is None else replacement]
    count = len(kept)
    return kept, logprobs_of(raw[:count], rows[:count], torch.tensor(kept))
