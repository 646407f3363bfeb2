"""Where a prompt is prefilled under ``--prefill-device auto``: the option with the lowest predicted
time to first token, from rates the engines measure as they run.

Two options per request: its decode engine prefills it itself (``local``), or a prefill engine
does and hands the KV over (``remote``). Each engine reports, in its stats, the prompt tokens a
second of its steps that compute prompts (waits for a turn on shared cores included) by the
step's prompt tokens, the time of a step of decodes alone by its decodes
(``core.rates``: ``PROMPT_SIZES``, ``BATCH_SIZES``), and (a prefill engine) the seconds per
prompt token of reading and sending the KV. The frontend knows each engine's backlog: the prompt
tokens of the requests it placed there that have no first token yet, less what it expected each
engine's prefix cache to hold. With ``m`` of the prompt's ``n`` tokens probably cached on an
engine (the router's prefix map), that engine computes ``n - m`` of them, in steps of
``min(backlog + n - m, step budget)`` tokens (queued prompts fill a step; each engine's own
budget: under ``auto`` a decode engine's is 192, ``config.AUTO_DECODE_STEP_TOKENS``, so that a
long prompt placed there goes in chunks its decodes ride in), at that size's ``rate``. Then

- remote: ``(backlog + n - m) / rate + n * handoff``
- local: ``(backlog + n - m) / rate + decode step`` (of the decode engine's requests and this
  one), plus ``turn_wait`` while the prefill engine has a backlog and the roles take turns on
  shared cores (the decode engine's step waits for its turn); offered only when the step that
  computes it (with the prompts queued there before it, at most the step budget) takes no
  longer than ``max_stall`` (twice ``--prefill-turn``: what a decode step may wait for a prompt
  on shared cores, and its own prompts): a prompt computed on a decode engine holds up every
  decode there for that long, and prompts queued there go in one step.

A decode engine computes its prompts in arrival order; a prefill engine takes the shortest
remaining prompt first (``core.roles.PrefillOnly``), so its backlog, for a prompt of ``u``
uncached tokens, is what goes before it (the router counts it): the prompts queued there of at
most ``u`` tokens, and of the longer ones at most the step under way.

An engine that has not measured a rate yet is assumed to run at the other role's measured one
(the same model on the same kind of cores); when neither has, the fixed threshold decides
(``--max-prefill-len``: shorter prompts remote). A prefix map's wrong guess makes a prediction err
short (the blocks were evicted) or long (another frontend's prompt filled them in the meantime).
"""

from __future__ import annotations

from dataclasses import dataclass

from duoserve.core.rates import BATCH_SIZES, PROMPT_SIZES, lookup


@dataclass(frozen=True)
class Rates:
    """One engine's measured rates (0, or none: not measured yet)."""
    prefill_tokens_per_s: tuple[float, ...] = ()   # by a step's prompt tokens (PROMPT_SIZES)
    decode_step_s: tuple[float, ...] = ()          # by a step's decodes (BATCH_SIZES)
    handoff_s_per_token: float = 0.0

    def prefill_rate(self, step_tokens: int) -> float:
        """Prompt tokens a second in steps of ``step_tokens`` (0: none measured)."""
        return lookup(self.prefill_tokens_per_s, PROMPT_SIZES, step_tokens)

    def decode_step(self, decodes: int) -> float:
        """Seconds of a step of ``decodes`` decodes alone (0: none measured)."""
        return lookup(self.decode_step_s, BATCH_SIZES, decodes)


@dataclass(frozen=True)
class Choice:
    remote: bool                   # prefill on a prefill engine (else on the decode engine)
    predicted: float | None        # seconds to first token; None: the threshold decided


def choose(num_tokens: int, local: Rates, local_backlog: int, remote: Rates | None, remote_backlog: int,
           step_budget: int, max_stall: float, max_prefill_len: int, turn_wait: float = 0.0,
           local_cached: int = 0, remote_cached: int = 0, local_decodes: int = 1,
           remote_budget: int | None = None) -> Choice:
    """Local or remote for a prompt of ``num_tokens`` (``remote`` None: no prefill engine up), of
    which ``local_cached`` and ``remote_cached`` are probably in either engine's prefix cache;
    ``local_decodes``: the decode engine's requests with this one; ``step_budget`` and
    ``remote_budget`` (None: the same): the prompt tokens of a decode and a prefill engine's step."""
    local_tokens, remote_tokens = num_tokens - local_cached, num_tokens - remote_cached
    local_step = min(local_backlog + local_tokens, step_budget)
    local_rate = local.prefill_rate(local_step) or (remote.prefill_rate(local_step) if remote else 0.0)
    local_ttft = None
    if local_rate > 0 and local_step / local_rate <= max_stall:
        local_ttft = (local_backlog + local_tokens) / local_rate + local.decode_step(local_decodes)
        if remote_backlog:
            local_ttft += turn_wait
    if remote is None:
        return Choice(False, local_ttft)
    remote_step = min(remote_backlog + remote_tokens, remote_budget or step_budget)
    remote_rate = remote.prefill_rate(remote_step) or local.prefill_rate(remote_step)
    if remote_rate <= 0:
        return Choice(num_tokens <= max_prefill_len, None)
    remote_ttft = (remote_backlog + remote_tokens) / remote_rate + num_tokens * remote.handoff_s_per_token
    if local_ttft is not None and local_ttft < remote_ttft:
        return Choice(False, local_ttft)
    return Choice(True, remote_ttft)
