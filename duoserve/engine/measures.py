"""What an engine measures of its own steps and reports in its stats, beside ``EngineCore``'s step:
tokens computed and generated, the rates placement and the swap-or-recompute choice read
(moving averages by a step's size, ``core/rates.py``), and the stats message the frontend gets
(``EngineStats``: its gauges, the rates, the prefix cache's newest block hashes)."""

from __future__ import annotations

import time

from duoserve.core.outputs import EngineCoreOutput, SchedulerOutput
from duoserve.core.rates import BATCH_SIZES, PROMPT_SIZES, lookup, record
from duoserve.messages import EngineStats

CACHED_BLOCKS_INTERVAL = 1.0     # seconds between two reports of the cached block hashes, at least
CACHED_BLOCKS_REPORTED = 8192    # the newest this many (64 KiB in a stats message)


class EngineMeasures:
    """One engine's measures: its steps' (``swap``: the swap source whose cost model they keep
    current, or None; ``runner``: whose copies they time). It holds no reference to the engine
    (no cycle: an engine is freed as soon as it is dropped); ``stats`` is handed it."""

    def __init__(self, swap, runner) -> None:
        self.swap, self.runner = swap, runner
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        # measured (moving averages, 0 until measured), by a step's size (core/rates.py): stats
        self.prefill_tokens_per_s = [0.0] * len(PROMPT_SIZES)
        self.decode_step_s = [0.0] * len(BATCH_SIZES)
        self.reported_blocks = (-1, 0.0)   # (pool version, when) of the last cached-blocks report

    def count(self, plan: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        """A step's prompt tokens computed and tokens generated."""
        for item in plan.scheduled:
            computed_end = min(item.start + item.num_new_tokens, item.request.num_prompt_tokens)
            self.num_prompt_tokens += max(0, computed_end - item.start)
        self.num_generated_tokens += sum(len(o.new_token_ids) for o in outputs)

    def step_took(self, plan: SchedulerOutput, seconds: float) -> None:
        """Keep the measured rates current: prompt tokens a second (from steps that compute 32
        or more) and a step of decodes alone, each by the step's size (placement, in the stats);
        the swap-or-recompute choice's prefill tokens a second (from steps mostly of prompts) and
        copy bytes a second."""
        prompt_tokens = sum(i.num_known_tokens for i in plan.scheduled if i.num_known_tokens > 1)
        decodes = sum(1 for i in plan.scheduled if i.num_known_tokens == 1)
        if prompt_tokens >= PROMPT_SIZES[0]:
            # the prompts' own share of a step that also decodes: what a prompt adds to a step
            alone = lookup(self.decode_step_s, BATCH_SIZES, decodes) if decodes else 0.0
            own = max(seconds - alone, seconds / 2)
            record(self.prefill_tokens_per_s, PROMPT_SIZES, prompt_tokens, prompt_tokens / own)
        elif prompt_tokens == 0 and decodes and not plan.swap_in and not plan.swap_out:
            record(self.decode_step_s, BATCH_SIZES, decodes, seconds)
        swap = self.swap
        if swap is None:  # the rest only chooses between swap and recompute
            return
        cost = swap.cost
        if prompt_tokens >= 64 and not plan.swap_in and not plan.swap_out:
            cost.prefill_tokens_per_s = 0.8 * cost.prefill_tokens_per_s + 0.2 * prompt_tokens / seconds
        runner = self.runner
        if runner.swap_bytes and runner.swap_seconds:
            cost.copy_bytes_per_s = runner.swap_bytes / runner.swap_seconds

    def stats(self, core) -> EngineStats:
        """``core``'s stats: its gauges and counters, these measures."""
        pool, scheduler, handoff, store = core.kv.pool, core.scheduler, core.handoff, core.store
        masks = core.runner.grammar_masks
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(scheduler.waiting_for_kv),
            kv_cache_usage=pool.usage, num_blocks=pool.num_blocks,
            prefix_cache_queries=core.kv.num_queries, prefix_cache_hits=core.kv.num_hits,
            num_preemptions=scheduler.num_preemptions, num_generated_tokens=self.num_generated_tokens,
            num_swap_preemptions=scheduler.num_swap_preemptions, num_swapped=len(scheduler.swapped),
            swap_usage=core.swap.space.usage if core.swap is not None else 0.0,
            num_prompt_tokens=self.num_prompt_tokens, kv_transfer_bytes=handoff.num_transfer_bytes,
            kv_transfer_seconds=handoff.drain_transfer_seconds(), num_kv_leased=scheduler.num_leased,
            prefill_tokens_per_s=self.prefill_tokens_per_s, decode_step_s=self.decode_step_s,
            handoff_s_per_token=handoff.seconds_per_token, cached_blocks=self._cached_blocks(core.kv.pool),
            **self._spec_stats(core.speculation), **{k: v for tier in (store.stores if store is not None else ()) for k, v in tier.stats().items()},
            **(masks.stats() if masks is not None else {}))

    def _cached_blocks(self, pool) -> list[int] | None:
        """The prefix cache's block hashes for the stats, when they changed (at most once a
        CACHED_BLOCKS_INTERVAL); else None."""
        version, at = self.reported_blocks
        now = time.monotonic()
        if not pool.enable_caching or pool.version == version or now - at < CACHED_BLOCKS_INTERVAL:
            return None
        self.reported_blocks = (pool.version, now)
        newest = list(pool.cached)[-CACHED_BLOCKS_REPORTED:]   # the dict keeps the order they came in
        return [int.from_bytes(h[:8], "little") for h in newest]

    @staticmethod
    def _spec_stats(spec) -> dict:
        if spec is None:
            return {}
        return dict(spec_num_steps=spec.num_steps, spec_num_draft_tokens=spec.num_draft_tokens,
                    spec_num_accepted_tokens=spec.num_accepted_tokens,
                    spec_accepted_by_position=list(spec.accepted_by_position))
