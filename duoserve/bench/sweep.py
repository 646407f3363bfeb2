"""``duoserve bench sweep``: the same workload at several request rates (or concurrencies), and
the highest one that still meets the goodput SLO: at least ``--slo-fraction`` of the requests
within every ``--goodput`` bound."""

from __future__ import annotations

import asyncio

from duoserve.bench import report
from duoserve.bench.client import run


def sweep(base_url: str, endpoint: str, model: str, requests, points: list[float], by: str, goodput: dict,
          slo_fraction: float, ignore_eos: bool, api_key: str | None, seed: int) -> tuple[list[dict], float | None]:
    """One result per point (``by`` = ``rate`` or ``concurrency``); the best point meeting the SLO."""
    results, best = [], None
    for point in points:
        rate = point if by == "rate" else float("inf")
        concurrency = int(point) if by == "concurrency" else None
        records, seconds = asyncio.run(run(base_url, endpoint, model, requests, rate, max_concurrency=concurrency,
                                           ignore_eos=ignore_eos, api_key=api_key, seed=seed))
        result = report.summarize(records, seconds, {by: point}, goodput)
        met = (result["goodput_requests"] or 0) / max(len(records), 1)
        result["slo_met_fraction"] = met
        results.append(result)
        if met >= slo_fraction:
            best = point if best is None else max(best, point)
    return results, best


def table(results: list[dict], by: str, best: float | None) -> str:
    lines = [f"{by:>12}{'req/s':>10}{'tok/s':>10}{'goodput':>10}{'in SLO':>9}{'ttft p99':>10}{'tpot p99':>10}"]
    for r in results:
        point = r["config"][by]
        lines.append(f"{point:>12g}{r['request_throughput']:>10.2f}{r['output_throughput']:>10.1f}"
                     f"{r['goodput'] or 0:>10.2f}{r['slo_met_fraction']:>9.0%}"
                     f"{r['ttft_ms']['p99'] or 0:>10.1f}{r['tpot_ms']['p99'] or 0:>10.1f}")
    lines.append(f"highest {by} meeting the SLO: {best if best is not None else 'none'}")
    return "\n".join(lines)


def plot(results: list[dict], by: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [r["config"][by] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(points, [r["request_throughput"] for r in results], marker="o", label="completed req/s")
    left.plot(points, [r["goodput"] or 0 for r in results], marker="o", label="goodput req/s")
    left.set(xlabel=by, ylabel="requests/s", title="throughput and goodput")
    left.legend()
    right.plot(points, [r["ttft_ms"]["p99"] or 0 for r in results], marker="o", label="TTFT p99")
    right.plot(points, [r["tpot_ms"]["p99"] or 0 for r in results], marker="o", label="TPOT p99")
    right.set(xlabel=by, ylabel="ms", title="tail latency")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
