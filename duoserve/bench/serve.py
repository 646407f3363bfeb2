"""``duoserve bench serve``: load any OpenAI-compatible server, report, and for duoserve add what
its ``/metrics`` saw over the run (TTFT stages, prefix-cache and KV-store hit rates,
preemptions, KV usage)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import threading
from pathlib import Path

import httpx

from duoserve.bench import report, workloads
from duoserve.bench.client import auth_headers, run
from duoserve.errors import ConfigError


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--model", default=None, help="the model name to send (default: the first of /v1/models)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                        help="LoRA adapters' names to send instead, a request each in turn (vLLM's flag; the "
                             "server's --lora-modules names)")
    parser.add_argument("--tokenizer", default=None,
                        help="a local HF directory or GGUF file to count tokens with (default: the default model's)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", default="random",
                        help="random, mixed:LEN:SHARE,... (e.g. mixed:64:0.8,1500:0.2), shared-prefix, or "
                             "jsonl:FILE (default: random)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens to generate (default: 128)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths vary by this fraction")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: the shared tokens (default: 512)")
    parser.add_argument("--num-prefixes", type=int, default=1,
                        help="shared-prefix: how many different prefixes, one drawn at random a prompt (default: 1)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send (default: 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly output-len")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests a second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="arrival gaps are gamma-distributed with this shape: 1 Poisson, <1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    parser.add_argument("--goodput", nargs="*", default=None, metavar="NAME:MS",
                        help="bounds a request must meet to count, e.g. ttft:500 tpot:50")
    parser.add_argument("--result-json", default=None, help="write the result here (schema duoserve-bench/1)")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="draw TTFT CDF, ITL distribution, throughput over time and TTFT stages here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def load_tokenizer(path: str | None):
    """A duoserve Tokenizer from an HF directory, a GGUF file, or the default model."""
    from duoserve.model.paths import resolve_model_path
    from duoserve.model.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir

    resolved = resolve_model_path(path)
    if resolved.is_dir():
        tokenizer = tokenizer_from_hf_dir(resolved, None, ())
    else:
        from duoserve.model.gguf_file import read_gguf

        tokenizer = tokenizer_from_gguf(read_gguf(resolved).meta, ())
    if tokenizer is None:
        raise ConfigError("tokenizer", path, "a directory with tokenizer.json, or a GGUF file with a vocabulary")
    return tokenizer


def first_model(base_url: str, api_key: str | None) -> str:
    headers = auth_headers(api_key)
    try:
        models = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10).json()["data"]
        return models[0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ConfigError("model", None, f"a model name: {base_url}/v1/models gave none ({exc})") from None


class DuoserveMetrics:
    """``/metrics`` before and after the run, and the KV usage gauge sampled during it."""

    def __init__(self, base_url: str, headers: dict) -> None:
        self.url, self.headers = base_url.rstrip("/") + "/metrics", headers
        self.usage: list[float] = []
        self.stop = threading.Event()
        self.before = self.scrape()

    def scrape(self) -> dict[tuple[str, tuple], float] | None:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(self.url, headers=self.headers, timeout=5).text
            if "duoserve:" not in text:
                return None
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in text_string_to_metric_families(text) for s in family.samples}
        except (httpx.HTTPError, ValueError):
            return None

    def sample(self) -> None:
        while not self.stop.wait(0.5):
            now = self.scrape()
            if now:
                self.usage.append(max((v for (n, _), v in now.items() if n == "duoserve:kv_cache_usage_ratio"),
                                      default=0.0))

    def report(self) -> dict | None:
        after = self.scrape()
        if self.before is None or after is None:
            return None

        def delta(name: str, **labels) -> float:
            def total(samples):
                return sum(v for (n, ls), v in samples.items()
                           if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))
            return total(after) - total(self.before)

        result = {}
        for stage in ("queue", "prefill", "transfer", "admit"):
            count = delta("duoserve:ttft_stage_seconds_count", stage=stage)
            if count:
                result[f"ttft_{stage}_mean_ms"] = 1000 * delta("duoserve:ttft_stage_seconds_sum", stage=stage) / count
        queries = delta("duoserve:prefix_cache_queries_total")
        result["prefix_cache_hit_rate"] = delta("duoserve:prefix_cache_hits_total") / queries if queries else 0.0
        looked = delta("duoserve:kv_store_hits_total") + delta("duoserve:kv_store_misses_total")
        if looked:
            result["kv_store_hit_rate"] = delta("duoserve:kv_store_hits_total") / looked
        result["preemptions_recompute"] = int(delta("duoserve:num_preemptions_total", kind="recompute"))
        result["preemptions_swap"] = int(delta("duoserve:num_preemptions_total", kind="swap"))
        if self.usage:
            result["kv_usage_mean"] = sum(self.usage) / len(self.usage)
            result["kv_usage_max"] = max(self.usage)
        return result


def run_bench_serve(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    goodput = report.parse_goodput(args.goodput)
    model = args.model or first_model(args.base_url, args.api_key)
    tokenizer = load_tokenizer(args.tokenizer)
    requests = workloads.build(args.dataset, tokenizer, args.num_prompts, args.input_len, args.output_len,
                               args.range_ratio, args.prefix_len, args.seed, args.num_prefixes)
    metrics = DuoserveMetrics(args.base_url, auth_headers(args.api_key))
    sampler = threading.Thread(target=metrics.sample, daemon=True)
    sampler.start()
    progress = None if args.quiet else tqdm(total=len(requests), desc="requests")
    try:
        names = [n.partition("=")[0] for n in args.lora_modules] if args.lora_modules else model
        records, seconds = asyncio.run(run(args.base_url, args.endpoint, names, requests, args.request_rate,
                                           args.burstiness, args.max_concurrency, args.duration, args.ignore_eos,
                                           args.api_key, args.seed, progress=progress))
    finally:
        metrics.stop.set()
        if progress is not None:
            progress.close()
    config = {"base_url": args.base_url, "endpoint": args.endpoint, "model": model, "dataset": args.dataset,
              "lora_modules": names if args.lora_modules else None,
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "range_ratio": args.range_ratio, "request_rate": args.request_rate, "burstiness": args.burstiness,
              "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "seed": args.seed,
              "goodput_ms": {k: v * 1000 for k, v in goodput.items()},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    result = report.summarize(records, seconds, config, goodput, metrics.report())
    print(report.table(result))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2))
    if args.plot:
        from duoserve.bench.plot import draw

        draw({model: result}, args.plot)
    return 0


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    add_args(parser)
    parser.add_argument("--rates", default=None, help="request rates to try, e.g. 0.5,1,2,4")
    parser.add_argument("--concurrencies", default=None, help="or concurrencies to try, e.g. 1,4,16,32")
    parser.add_argument("--slo-fraction", type=float, default=0.9,
                        help="share of requests that must meet every --goodput bound (default: 0.9)")


def run_bench_sweep(args: argparse.Namespace) -> int:
    from duoserve.bench import sweep

    if bool(args.rates) == bool(args.concurrencies):
        raise ConfigError("rates", args.rates, "one of --rates or --concurrencies, a comma-separated list")
    if not args.goodput:
        raise ConfigError("goodput", None, "the SLO to meet, e.g. --goodput ttft:1000 tpot:100")
    by, text = ("rate", args.rates) if args.rates else ("concurrency", args.concurrencies)
    try:
        points = [float(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(by, text, "a comma-separated list of numbers") from None
    model = args.model or first_model(args.base_url, args.api_key)
    requests = workloads.build(args.dataset, load_tokenizer(args.tokenizer), args.num_prompts, args.input_len,
                               args.output_len, args.range_ratio, args.prefix_len, args.seed, args.num_prefixes)
    results, best = sweep.sweep(args.base_url, args.endpoint, model, requests, points, by,
                                report.parse_goodput(args.goodput), args.slo_fraction, args.ignore_eos,
                                args.api_key, args.seed)
    print(sweep.table(results, by, best))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps({"best": best, "by": by, "runs": results}, indent=2))
    if args.plot:
        sweep.plot(results, by, args.plot)
    return 0


def run_bench_prompts(args: argparse.Namespace) -> int:
    from duoserve.bench.prompts import report as prompts_report

    path = Path(args.file)
    if not path.is_file():
        raise ConfigError("file", args.file, "an existing JSONL file")
    print(prompts_report(path, load_tokenizer(args.tokenizer), args.output_len, args.kv_bytes_per_token))
    return 0


def run_bench_compare(args: argparse.Namespace) -> int:
    """Several result documents: their tables side by side, and one figure."""
    from duoserve.bench.plot import draw, side_by_side

    results = {}
    for name in args.results:
        try:
            results[Path(name).stem] = json.loads(Path(name).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError("results", name, f"a result document of duoserve bench serve ({exc})") from None
    print(side_by_side(results))
    if args.plot:
        draw(results, args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duoserve bench serve", description=__doc__)
    add_args(parser)
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
