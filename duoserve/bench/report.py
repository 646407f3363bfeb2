"""What a run measured: latency percentiles, throughput, goodput and errors, as a table a person
reads and a JSON document a script reads (schema ``duoserve-bench/1``, ``RESULT_SCHEMA``;
docs/bench.md).

Per request: TTFT = first content chunk - send; ITL = the gaps between its content chunks;
TPOT = (last chunk - first chunk) / (output tokens - 1); E2E = answer complete - send. Output
tokens are the server's ``usage`` count when it sends one. Goodput counts the requests that
met every ``--goodput`` bound, per second of the run.
"""

from __future__ import annotations

import numpy as np

from duoserve.bench.client import RequestRecord

SCHEMA = "duoserve-bench/1"
PERCENTILES = (50, 90, 99)

_STATS = {"type": "object", "required": ["mean", "p50", "p90", "p99"],
          "properties": {k: {"type": ["number", "null"]} for k in ("mean", "p50", "p90", "p99")}}
RESULT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["schema", "config", "duration_s", "num_requests", "completed", "failed", "errors",
                 "request_throughput", "output_throughput", "total_token_throughput", "goodput",
                 "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "server"],
    "properties": {
        "schema": {"const": SCHEMA},
        "config": {"type": "object"},
        "duration_s": {"type": "number"},
        "num_requests": {"type": "integer"}, "completed": {"type": "integer"}, "failed": {"type": "integer"},
        "errors": {"type": "object", "additionalProperties": {"type": "integer"}},
        "total_input_tokens": {"type": "integer"}, "total_output_tokens": {"type": "integer"},
        "request_throughput": {"type": "number"}, "output_throughput": {"type": "number"},
        "total_token_throughput": {"type": "number"},
        "goodput": {"type": ["number", "null"]},
        "goodput_requests": {"type": ["integer", "null"]},
        "ttft_ms": _STATS, "tpot_ms": _STATS, "itl_ms": _STATS, "e2el_ms": _STATS,
        "server": {"type": ["object", "null"]},
        "samples": {"type": "object", "properties": {
            "ttft_ms": {"type": "array", "items": {"type": "number"}},
            "itl_ms": {"type": "array", "items": {"type": "number"}},
            "token_times_s": {"type": "array", "items": {"type": "number"}}}},
    },
}


def stats(values: list[float]) -> dict:
    """Mean and percentiles in milliseconds (None without values)."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values) * 1000
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    from duoserve.errors import ConfigError

    bounds = {}
    for item in items or ():
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value.replace(".", "", 1).isdigit():
            raise ConfigError("goodput", item, "ttft:MS, tpot:MS or e2el:MS")
        bounds[name] = float(value) / 1000
    return bounds


def summarize(records: list[RequestRecord], duration: float, config: dict, goodput: dict[str, float],
              server: dict | None = None) -> dict:
    ok = [r for r in records if r.ok]
    first_send = min((r.start for r in records), default=0.0)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            kind = r.error or "empty"
            errors[kind] = errors.get(kind, 0) + 1
    ttft = [r.chunk_times[0] - r.start for r in ok]
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2el = [r.end - r.start for r in ok]
    good = None   # requests that met every bound
    if goodput:
        def meets(r: RequestRecord) -> bool:
            values = {"ttft": r.chunk_times[0] - r.start, "e2el": r.end - r.start,
                      "tpot": (r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0}
            return all(values[name] <= bound for name, bound in goodput.items())
        good = sum(1 for r in ok if meets(r))
    inputs, outputs = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    return {
        "schema": SCHEMA, "config": config, "duration_s": duration, "num_requests": len(records),
        "completed": len(ok), "failed": len(records) - len(ok), "errors": errors,
        "total_input_tokens": inputs, "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration, "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
        "goodput": None if good is None else good / duration, "goodput_requests": good,
        "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(itl), "e2el_ms": stats(e2el),
        "server": server,
        # the raw figures the plots draw: per request TTFT, every gap, every content chunk's time
        "samples": {"ttft_ms": [1000 * t for t in ttft], "itl_ms": [1000 * t for t in itl],
                    "token_times_s": sorted(t - first_send for r in ok for t in r.chunk_times)},
    }


def table(result: dict) -> str:
    """The result as aligned text."""
    lines = [f"{'requests':<28}{result['completed']} completed, {result['failed']} failed "
             f"{result['errors'] or ''} in {result['duration_s']:.1f} s",
             f"{'request throughput':<28}{result['request_throughput']:.2f} req/s",
             f"{'output token throughput':<28}{result['output_throughput']:.1f} tok/s",
             f"{'total token throughput':<28}{result['total_token_throughput']:.1f} tok/s"]
    if result["goodput"] is not None:
        lines.append(f"{'goodput':<28}{result['goodput']:.2f} req/s")
    lines.append(f"{'(ms)':<28}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = result[f"{name}_ms"]
        cells = "".join(f"{s[k]:>10.1f}" if s[k] is not None else f"{'-':>10}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name.upper():<28}{cells}")
    server = result.get("server")
    if server:
        lines.append("duoserve, over the run:")
        for key, value in server.items():
            shown = f"{value:.3f}" if isinstance(value, float) else str(value)
            lines.append(f"  {key:<26}{shown}")
    return "\n".join(lines)
