"""Prometheus metrics and the periodic engine stats log line.

Latencies are measured in the frontend from each request's snapshots (arrival, first
token, every later token); engine-side figures (running, waiting, KV usage, prefix
cache) come from the engine's stats messages. The queue, running and KV-usage gauges are also
given per engine under vLLM's names (``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, labelled ``model_name`` and ``engine``), which the routers of
the Gateway API Inference Extension (llm-d, KServe) read by default. Counters that the engine keeps
cumulatively are advanced by the difference since the last stats message of the same
engine process: a relaunched or reconnected engine (a new instance id under the same name)
starts counting from zero again. A gauge of an engine that went down is cleared.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from duoserve.messages import EngineStats
from duoserve.outputs import RequestOutput

logger = logging.getLogger("duoserve.stats")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
STAGES = ("queue", "prefill", "transfer", "admit")


class ServerMetrics:
    def __init__(self, log_interval: float = 5.0, request_class: Callable[[str], Any] | None = None,
                 model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r, b = self.registry, _LATENCY_BUCKETS
        # for the series set from figures kept elsewhere (at each scrape): (counter, labels) -> the
        # total last counted, gauge -> the label sets it was given
        self._totals_seen: dict[tuple[Counter, tuple], int] = {}
        self._gauge_keys: dict[Gauge, set[tuple]] = {}
        self.model_name = model_name
        self._latencies(r, b)
        self._classes(r, b)
        self._router_gauges(r)
        # request id -> its class (.label: the tenant's label, .priority), while it is in flight
        self.request_class = request_class or (lambda request_id: None)
        self._engine_state(r)
        self._kv_store(r)
        self._structured_outputs(r)
        self._placement(r, b)
        self.log_interval = log_interval
        self._seen: dict[str, tuple[float, int]] = {}   # request id -> (last token time, tokens seen)
        self._engines: dict[str, EngineStats] = {}      # engine name -> its latest stats
        self._previous: dict[tuple[str, str], EngineStats] = {}  # (name, instance id) -> latest stats
        # engine -> (time, generated tokens, (verifications, accepted guesses)) at its last line
        self._log_marks: dict[str, tuple[float, int, tuple[int, int]]] = {}

    def _latencies(self, r: CollectorRegistry, b: tuple) -> None:
        """Latency histograms: per request and per stage."""
        self.ttft = Histogram("duoserve:time_to_first_token_seconds", "Time to first token", registry=r, buckets=b)
        self.tpot = Histogram("duoserve:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", registry=r, buckets=b)
        self.itl = Histogram("duoserve:inter_token_latency_seconds", "Time between consecutive tokens",
                             registry=r, buckets=b)
        self.e2e = Histogram("duoserve:e2e_request_latency_seconds", "Request latency, arrival to finish",
                             registry=r, buckets=b)
        self.stage = Histogram("duoserve:ttft_stage_seconds", "Time to first token by stage", ["stage"],
                               registry=r, buckets=b)
        self.kv_transfer = Histogram("duoserve:kv_transfer_seconds", "KV handoff time per request", registry=r,
                                     buckets=b)

    def _classes(self, r: CollectorRegistry, b: tuple) -> None:
        """Requests by class (tenant and priority, as the frontend sees them), and those refused."""
        labels = ["tenant", "priority"]
        self.class_waiting = Gauge("duoserve:class_requests_waiting", "Requests waiting for their first token, "
                                   "by tenant and priority", labels, registry=r)
        self.class_running = Gauge("duoserve:class_requests_running", "Requests past their first token, by tenant "
                                   "and priority", labels, registry=r)
        self.class_ttft = Histogram("duoserve:class_time_to_first_token_seconds", "Time to first token by tenant "
                                    "and priority", labels, registry=r, buckets=b)
        self.class_tokens = Counter("duoserve:class_tokens", "Tokens served by tenant and priority (kind: prompt "
                                    "or generation)", labels + ["kind"], registry=r)
        self.refused = Counter("duoserve:requests_refused", "Requests refused (429: tenant_waiting, "
                               "server_waiting, queue_full) or dropped past their timeout (503: timeout)",
                               ["reason"], registry=r)
        self.engine_tenant = Gauge("duoserve:engine_tenant_requests", "Requests placed on each engine by "
                                   "tenant (the router's count)", ["engine", "tenant"], registry=r)
        self.kv_events = Counter("duoserve:kv_event_batches_received", "KV event batches the router applied, per "
                                 "engine (--routing kv-events)", ["engine"], registry=r)

    def _advance(self, counter: Counter, totals: dict[tuple, int]) -> None:
        """A counter of totals kept elsewhere (labels -> total so far), moved by what each grew."""
        for labels, total in totals.items():
            key = (counter, labels)
            counter.labels(*labels).inc(total - self._totals_seen.get(key, 0))
            self._totals_seen[key] = total

    def _set_all(self, gauge: Gauge, values: dict[tuple, float]) -> None:
        """A gauge's every label set to ``values``; a label set given before and missing now, 0."""
        seen = self._gauge_keys.setdefault(gauge, set())
        for labels in seen - values.keys():
            gauge.labels(*labels).set(0)
        for labels, value in values.items():
            gauge.labels(*labels).set(value)
        seen.update(values)

    def observe_classes(self, counts: dict[tuple[str, str], tuple[int, int]], refused: dict[str, int]) -> None:
        """The frontend's requests by class and its refusals so far (called at each scrape)."""
        self._set_all(self.class_waiting, {key: waiting for key, (waiting, _) in counts.items()})
        self._set_all(self.class_running, {key: running for key, (_, running) in counts.items()})
        self._advance(self.refused, {(reason,): total for reason, total in refused.items()})

    def observe_kv_events(self, received: dict[str, int]) -> None:
        """The KV event batches this frontend applied, per engine, so far (``--routing kv-events``)."""
        self._advance(self.kv_events, {(engine,): total for engine, total in received.items()})

    def observe_tenant_load(self, counts: dict[tuple[str, str], int]) -> None:
        """The router's (engine, tenant label) -> requests placed (called at each scrape)."""
        self._set_all(self.engine_tenant, counts)

    def _router_gauges(self, r: CollectorRegistry) -> None:
        """Per engine, under the names cluster routers read (vLLM's): the same figures as
        duoserve's own gauges, which sum the engines."""
        labels = ["model_name", "engine"]
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests being computed (duoserve:"
                                  "num_requests_running, per engine)", labels, registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (duoserve:"
                                  "num_requests_waiting, per engine)", labels, registry=r)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use, 1 = full "
                                   "(duoserve:kv_cache_usage_ratio)", labels, registry=r)

    def _set_router_gauges(self, engine: str, stats: EngineStats | None) -> None:
        labels = (self.model_name, engine)
        self.vllm_running.labels(*labels).set(stats.num_running if stats else 0)
        self.vllm_waiting.labels(*labels).set(stats.num_waiting if stats else 0)
        self.vllm_kv_usage.labels(*labels).set(stats.kv_cache_usage if stats else 0.0)

    def _engine_state(self, r: CollectorRegistry) -> None:
        """What the engines report: requests by state, KV and swap usage, tokens, memory."""
        self.running = Gauge("duoserve:num_requests_running", "Requests being computed", registry=r)
        self.waiting = Gauge("duoserve:num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.leased = Gauge("duoserve:num_requests_kv_leased", "Prefilled requests whose KV a prefill engine "
                            "holds until the decode engine acknowledges it", registry=r)
        self.kv_usage = Gauge("duoserve:kv_cache_usage_ratio", "Fraction of KV blocks in use", ["engine"],
                              registry=r)
        self.prompt_tokens = Counter("duoserve:prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("duoserve:generation_tokens", "Tokens generated", registry=r)
        self.prefix_queries = Counter("duoserve:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache", registry=r)
        self.prefix_hits = Counter("duoserve:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=r)
        self.kv_transfer_bytes = Counter("duoserve:kv_transfer_bytes", "KV bytes handed between engines",
                                         registry=r)
        self.spec_drafts = Counter("duoserve:spec_decode_num_draft_tokens", "Tokens guessed by speculative "
                                   "decoding's proposer", registry=r)
        self.spec_accepted = Counter("duoserve:spec_decode_num_accepted_tokens", "Guessed tokens the target "
                                     "accepted", registry=r)
        self.spec_accepted_by_position = Counter("duoserve:spec_decode_num_accepted_tokens_per_pos",
                                                 "Accepted guesses by their position in a step's guesses (0: first)",
                                                 ["position"], registry=r)
        self.swapped = Gauge("duoserve:num_requests_swapped", "Preempted requests whose KV waits in the swap "
                             "space", registry=r)
        self.swap_usage = Gauge("duoserve:swap_usage_ratio", "Fraction of swap blocks in use", ["engine"],
                                registry=r)
        self.preemptions = Counter("duoserve:num_preemptions", "Requests preempted: their KV swapped out, or "
                                   "dropped to be recomputed", ["kind"], registry=r)
        self.memory = Gauge("duoserve:memory_bytes", "An engine's memory by kind, from its start-up report "
                            "(GET /v1/memory)", ["engine", "kind"], registry=r)

    def _kv_store(self, r: CollectorRegistry) -> None:
        """The KV tiers' traffic and breakers (the shared store in Redis, the tier on disk)."""
        self.tiers = {prefix: _TierMetrics(r, prefix, what) for prefix, what in
                      (("kv_store", "the shared KV store"), ("kv_disk", "the KV tier on disk"))}
        self.disk_stored = Gauge("duoserve:kv_disk_bytes_stored", "Bytes of block files the disk tier holds",
                                 ["engine"], registry=r)
        self.disk_evicted = Counter("duoserve:kv_disk_evicted", "Block files removed past --kv-disk-bytes, least "
                                    "recently used first", registry=r)
        self.disk_torn = Counter("duoserve:kv_disk_torn", "Half-written block files found at start (a process "
                                 "killed while writing) and removed", registry=r)

    def _structured_outputs(self, r: CollectorRegistry) -> None:
        """Grammars: requests, compiles and the masks' time."""
        self.structured_requests = Counter("duoserve:structured_output_requests", "Requests with a grammar "
                                           "(structured outputs), accepted or refused as not enforceable",
                                           ["result"], registry=r)
        self.grammars = Counter("duoserve:structured_output_grammars", "Grammars compiled by the engines, or "
                                "failed to compile", ["result"], registry=r)
        self.grammar_compile = Counter("duoserve:structured_output_compile_seconds", "Seconds the engines spent "
                                       "compiling grammars (off their step loops)", registry=r)
        self.mask_steps = Counter("duoserve:structured_output_mask_steps", "Engine steps that computed token "
                                  "masks", registry=r)
        self.mask_seconds = Counter("duoserve:structured_output_mask_seconds", "Seconds spent computing token "
                                    "masks (divided by mask_steps: the time a step spends on them)", registry=r)

    def _placement(self, r: CollectorRegistry, b: tuple) -> None:
        """Finished requests, where they ran, migrations and placement's predictions."""
        self.success = Counter("duoserve:request_success", "Finished requests", ["finish_reason"], registry=r)
        self.placements = Counter("duoserve:request_placements", "Requests by where they were prefilled and "
                                  "decoded (prefill_engine=local: on the decode engine itself)",
                                  ["prefill_engine", "decode_engine"], registry=r)
        self.migrations = Counter("duoserve:request_migrations", "Requests moved to another engine because "
                                  "theirs went down (cause: exited, failed, unreachable)", ["cause"], registry=r)
        self.migrated_tokens = Counter("duoserve:migration_restored_tokens", "Tokens (prompt and outputs so "
                                       "far) of migrated requests, computed again or found cached by the "
                                       "engine that took them", registry=r)
        self.migration_resume = Histogram("duoserve:migration_resume_seconds", "From a migration to the "
                                          "stream's next token", buckets=b, registry=r)
        self.predicted_ttft = Histogram("duoserve:placement_predicted_ttft_seconds", "Time to first token "
                                        "predicted where a prompt was placed (prefill=remote: on a prefill "
                                        "engine, local: on its decode engine)", ["prefill"], buckets=b, registry=r)
        self.prediction_error = Histogram("duoserve:placement_ttft_error_seconds", "Measured minus predicted "
                                          "time to first token of placed prompts", ["prefill"], registry=r,
                                          buckets=(-5, -2, -1, -0.5, -0.2, -0.1, -0.05, 0, 0.05, 0.1, 0.2, 0.5,
                                                   1, 2, 5))

    def observe_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        arrival = out.metrics.get("arrival_time", now)
        num_tokens = sum(len(o.token_ids) for o in out.outputs)
        last_time, seen, staged = self._seen.get(out.request_id, (arrival, 0, frozenset()))
        new = num_tokens - seen
        cls = self.request_class(out.request_id)
        if cls is not None and new > 0:
            self.class_tokens.labels(cls.label, cls.priority, "generation").inc(new)
        if seen == 0 and new > 0:
            self.ttft.observe(now - arrival)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            if cls is not None:
                self.class_ttft.labels(cls.label, cls.priority).observe(now - arrival)
                self.class_tokens.labels(cls.label, cls.priority, "prompt").inc(len(out.prompt_token_ids))
        elif new > 0:
            self.itl.observe(now - last_time)
        fresh = {s for s in STAGES if f"{s}_seconds" in out.metrics} - staged  # stages arrive from two engines
        for stage in fresh:
            self.stage.labels(stage).observe(out.metrics[f"{stage}_seconds"])
        if new > 0 or fresh:
            self.generation_tokens.inc(new)
            self._seen[out.request_id] = (now if new > 0 else last_time, num_tokens, staged | fresh)
        if out.finished:
            self._seen.pop(out.request_id, None)
            self.e2e.observe(now - arrival)
            first = out.metrics.get("first_token_time")
            if first is not None and num_tokens > len(out.outputs):
                self.tpot.observe((now - first) / (num_tokens - len(out.outputs)))
            for o in out.outputs:
                self.success.labels(o.finish_reason or "unknown").inc()

    def observe_migration(self, cause: str, lost_engine: str, num_tokens: int) -> None:
        self.migrations.labels(cause).inc()
        self.migrated_tokens.inc(num_tokens)

    def observe_prediction(self, remote: bool, predicted: float, measured: float) -> None:
        where = "remote" if remote else "local"
        self.predicted_ttft.labels(where).observe(predicted)
        self.prediction_error.labels(where).observe(measured - predicted)

    def observe_placement(self, request_id: str, prefill_engine: str | None, decode_engine: str) -> None:
        self.placements.labels(prefill_engine or "local", decode_engine).inc()

    def observe_stats(self, engine: str, instance_id: str, stats: EngineStats) -> None:
        self._engines[engine] = stats
        self._set_gauges()
        self.kv_usage.labels(engine).set(stats.kv_cache_usage)
        self._set_router_gauges(engine, stats)
        key = (engine, instance_id)
        last = self._previous.get(key)
        if last is None:  # a new process under this name: forget its predecessor's totals
            self._previous = {k: v for k, v in self._previous.items() if k[0] != engine}
        self.prefix_queries.inc(stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0))
        self.prefix_hits.inc(stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0))
        self.kv_transfer_bytes.inc(stats.kv_transfer_bytes - (last.kv_transfer_bytes if last else 0))
        self._observe_store(engine, stats, last)
        self._observe_grammars(stats, last)
        swaps = stats.num_swap_preemptions - (last.num_swap_preemptions if last else 0)
        self.preemptions.labels("swap").inc(swaps)
        self.preemptions.labels("recompute").inc(stats.num_preemptions - (last.num_preemptions if last else 0) - swaps)
        self.swap_usage.labels(engine).set(stats.swap_usage)
        self.spec_drafts.inc(stats.spec_num_draft_tokens - (last.spec_num_draft_tokens if last else 0))
        self.spec_accepted.inc(stats.spec_num_accepted_tokens - (last.spec_num_accepted_tokens if last else 0))
        before = last.spec_accepted_by_position if last else []
        for position, count in enumerate(stats.spec_accepted_by_position):
            self.spec_accepted_by_position.labels(str(position)).inc(
                count - (before[position] if position < len(before) else 0))
        for seconds in stats.kv_transfer_seconds:
            self.kv_transfer.observe(seconds)
        self._previous[key] = stats
        self._log_line(engine, stats)

    def _observe_store(self, engine: str, stats: EngineStats, last: EngineStats | None) -> None:
        def since(name: str) -> int:
            return getattr(stats, name) - (getattr(last, name) if last else 0)

        for prefix, tier in self.tiers.items():
            tier.hits.inc(since(f"{prefix}_hits"))
            tier.misses.inc(since(f"{prefix}_misses"))
            tier.bytes.labels("read").inc(since(f"{prefix}_bytes_read"))
            tier.bytes.labels("write").inc(since(f"{prefix}_bytes_written"))
            tier.dropped.inc(since(f"{prefix}_dropped_writes"))
            before = getattr(last, f"{prefix}_errors") if last else {}
            for kind, count in getattr(stats, f"{prefix}_errors").items():
                tier.errors.labels(kind).inc(count - before.get(kind, 0))
            tier.breaker.labels(engine).set(1.0 if getattr(stats, f"{prefix}_breaker_open") else 0.0)
        self.disk_stored.labels(engine).set(stats.kv_disk_bytes_stored)
        self.disk_evicted.inc(since("kv_disk_evicted"))
        self.disk_torn.inc(since("kv_disk_torn"))

    def _observe_grammars(self, stats: EngineStats, last: EngineStats | None) -> None:
        def since(name: str):
            return getattr(stats, name) - (getattr(last, name) if last else 0)

        self.grammars.labels("compiled").inc(since("grammars_compiled"))
        self.grammars.labels("failed").inc(since("grammars_failed"))
        self.grammar_compile.inc(since("grammar_compile_seconds"))
        self.mask_steps.inc(since("grammar_mask_steps"))
        self.mask_seconds.inc(since("grammar_mask_seconds"))

    def observe_structured_requests(self, accepted: int, refused: int) -> None:
        """The frontend's totals so far (called at each scrape)."""
        self._advance(self.structured_requests, {("accepted",): accepted, ("refused",): refused})

    def observe_memory(self, engine: str, report: dict) -> None:
        for kind, value in memory_kinds(report).items():
            self.memory.labels(engine, kind).set(value)

    def engine_down(self, engine: str) -> None:
        """An engine died: what it reported is gone with it."""
        self._engines.pop(engine, None)
        self._set_gauges()
        self.kv_usage.labels(engine).set(0.0)
        self._set_router_gauges(engine, None)
        self._log_marks.pop(engine, None)

    def _set_gauges(self) -> None:
        engines = self._engines.values()
        self.running.set(sum(s.num_running for s in engines))
        self.waiting.set(sum(s.num_waiting for s in engines))
        self.leased.set(sum(s.num_kv_leased for s in engines))
        self.swapped.set(sum(s.num_swapped for s in engines))

    def _log_line(self, engine: str, stats: EngineStats) -> None:
        now = time.monotonic()
        last_time, last_tokens, last_spec = self._log_marks.setdefault(
            engine, (now, stats.num_generated_tokens, (stats.spec_num_steps, stats.spec_num_accepted_tokens)))
        if now - last_time >= self.log_interval and now > last_time:
            rate = (stats.num_generated_tokens - last_tokens) / (now - last_time)
            spec = ""
            steps = stats.spec_num_steps - last_spec[0]
            if steps:  # a verification yields the accepted guesses and one token of the target's own
                spec = f", mean accepted length {1 + (stats.spec_num_accepted_tokens - last_spec[1]) / steps:.2f}"
            logger.info("%s: running %d, waiting %d, KV usage %.1f%%, generation %.1f tokens/s, "
                        "prefix cache hit rate %.1f%%%s", engine, stats.num_running, stats.num_waiting,
                        100 * stats.kv_cache_usage, rate,
                        100 * stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1), spec)
            self._log_marks[engine] = (now, stats.num_generated_tokens,
                                       (stats.spec_num_steps, stats.spec_num_accepted_tokens))


def memory_kinds(report: dict) -> dict[str, int]:
    """An engine's memory report as flat byte counts: weights_<kind>, kv_pool_reserved,
    kv_pool_resident, swap, prefill_scratch, runtime, loading, rss (those it measured)."""
    kinds = {f"weights_{kind.replace(' ', '_')}": size for kind, size in report.get("weights_bytes", {}).items()}
    pool = report.get("kv_pool", {})
    flat = {"kv_pool_reserved": pool.get("bytes"), "kv_pool_resident": pool.get("resident_bytes"),
            "swap": report.get("swap", {}).get("bytes"), "prefill_scratch": report.get("prefill_scratch_bytes"),
            "runtime": report.get("runtime_bytes"), "loading": report.get("loading_bytes"),
            "rss": report.get("rss_bytes")}
    kinds.update({kind: value for kind, value in flat.items() if value is not None})
    return kinds


class _TierMetrics:
    """One KV tier's counters: ``duoserve:<prefix>_hits`` and the rest."""

    def __init__(self, r: CollectorRegistry, prefix: str, what: str) -> None:
        name = f"duoserve:{prefix}"
        self.hits = Counter(f"{name}_hits", f"Blocks found in {what}", registry=r)
        self.misses = Counter(f"{name}_misses", f"Blocks looked up in {what} and not found (or not loadable)",
                              registry=r)
        self.errors = Counter(f"{name}_errors", f"Errors of {what}", ["kind"], registry=r)
        self.bytes = Counter(f"{name}_bytes", f"Bytes read from and written to {what}", ["direction"], registry=r)
        self.dropped = Counter(f"{name}_dropped_writes", f"Blocks not written to {what} (write queue full, or "
                               "the tier failing)", registry=r)
        self.breaker = Gauge(f"{name}_breaker_open", f"1 while the circuit breaker of {what} is open", ["engine"],
                             registry=r)
