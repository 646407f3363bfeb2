"""Figures of one or more bench runs (matplotlib, written to a PNG): TTFT CDF, ITL distribution,
output tokens per second over the run, and duoserve's TTFT stage breakdown; and the runs'
tables side by side."""

from __future__ import annotations

STAGES = ("queue", "prefill", "transfer", "admit")


def draw(results: dict[str, dict], path: str) -> None:
    """``results``: label -> result document (with its ``samples``)."""
    try:
        import matplotlib
    except ImportError:
        from duoserve.errors import ConfigError

        raise ConfigError("plot", path, "a PNG path with matplotlib installed (pip install 'duoserve[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ttft_ax, itl_ax, rate_ax, stage_ax = axes.flat
    for label, result in results.items():
        samples = result.get("samples") or {}
        ttft = np.sort(np.asarray(samples.get("ttft_ms", [])))
        if ttft.size:
            ttft_ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=label)
        itl = np.asarray(samples.get("itl_ms", []))
        if itl.size:
            itl_ax.hist(itl, bins=60, range=(0, float(np.percentile(itl, 99.5)) or 1), histtype="step", label=label)
        times = np.asarray(samples.get("token_times_s", []))
        if times.size:  # 1-second bins, finer for a short run (at least 20 bins)
            width = min(1.0, max(float(times.max()) / 20, 0.05))
            edges = np.arange(0, times.max() + width, width)
            counts, _ = np.histogram(times, bins=edges)
            rate_ax.plot(edges[:-1], counts / width, drawstyle="steps-post", label=label)
    ttft_ax.set(title="TTFT (CDF)", xlabel="ms", ylabel="fraction of requests")
    itl_ax.set(title="inter-token latency", xlabel="ms", ylabel="gaps")
    rate_ax.set(title="output tokens per second", xlabel="s into the run", ylabel="tokens/s")
    labels = list(results)
    bottom = np.zeros(len(labels))
    for stage in STAGES:
        values = np.asarray([(r.get("server") or {}).get(f"ttft_{stage}_mean_ms", 0.0) for r in results.values()])
        if values.any():
            stage_ax.bar(labels, values, bottom=bottom, label=stage)
            bottom += values
    stage_ax.set(title="mean TTFT by stage (duoserve)", ylabel="ms")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def side_by_side(results: dict[str, dict]) -> str:
    """The headline figures of several runs, a column each."""
    rows = [("completed", lambda r: f"{r['completed']}/{r['num_requests']}"),
            ("output tok/s", lambda r: f"{r['output_throughput']:.1f}"),
            ("request/s", lambda r: f"{r['request_throughput']:.2f}"),
            ("goodput req/s", lambda r: "-" if r["goodput"] is None else f"{r['goodput']:.2f}")]
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("p50", "p99"):
            rows.append((f"{name} {stat} ms", lambda r, n=name, s=stat: "-" if r[f"{n}_ms"][s] is None
                         else f"{r[f'{n}_ms'][s]:.1f}"))
    width = max(14, *(len(label) + 2 for label in results))
    lines = [f"{'':<16}" + "".join(f"{label:>{width}}" for label in results)]
    for title, cell in rows:
        lines.append(f"{title:<16}" + "".join(f"{cell(r):>{width}}" for r in results.values()))
    return "\n".join(lines)
