"""The chaos suite's load and its checks: mixed requests against a real server, some of
them hung up on at random, every answer checked against an undisturbed reference, and the
server checked whole afterwards (gauges idle, no segment or process left, memory flat).

Scale: ``DUOSERVE_CHAOS_FULL=1`` runs the full scenarios (1,000 requests, 2 + 2 engines,
a minute of overload); without it, the short CI subset.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

FULL = os.environ.get("DUOSERVE_CHAOS_FULL") == "1"
NEAR_TIE = 0.02   # a greedy answer may leave its reference only where the reference's top two were this close

WORDS = ("river stone lantern quiet orbit maple signal copper window harbor violet engine meadow "
         "thunder paper candle mirror garden silver rocket").split()


@dataclass(frozen=True)
class Spec:
    """One distinct request of the mix; the soak sends each many times."""
    key: int
    endpoint: str            # completions or chat
    prompt: str
    max_tokens: int
    n: int = 1
    stop: tuple[str, ...] = ()
    echo_logprobs: bool = False   # completions: the prompt's log-probabilities too (echo + logprobs)

    @property
    def seeded(self) -> bool:
        return self.n > 1

    def body(self, model: str, stream: bool) -> dict:
        body: dict = {"model": model, "max_tokens": self.max_tokens, "n": self.n, "stream": stream}
        body.update({"temperature": 0.8, "seed": 1000 + self.key} if self.seeded else {"temperature": 0})
        if self.stop:
            body["stop"] = list(self.stop)
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
            body.update(logprobs=True, top_logprobs=2)
        else:
            body.update(prompt=self.prompt, logprobs=2, echo=self.echo_logprobs and not stream)
        return body


def make_specs(count: int, seed: int = 5) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for key in range(count):
        long = key % 4 == 3
        words = [rng.choice(WORDS) for _ in range(rng.randint(150, 300) if long else rng.randint(3, 20))]
        specs.append(Spec(key=key, endpoint="chat" if key % 3 == 1 else "completions", prompt=" ".join(words),
                          max_tokens=rng.randint(6, 20), n=(1, 1, 2, 4)[key % 4] if key % 5 == 2 else 1,
                          stop=(".", " the") if key % 5 == 4 else (), echo_logprobs=key % 6 == 0))
    return specs


@dataclass
class Answer:
    """Per choice: its text, its tokens and the gap between its top two log-probabilities at each."""
    texts: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, list[str]] = field(default_factory=dict)
    gaps: dict[int, list[float]] = field(default_factory=dict)
    prompt_logprobs: list | None = None

    def add(self, index: int, text: str, tokens: list[str], tops: list[dict | None]) -> None:
        self.texts[index] = self.texts.get(index, "") + (text or "")
        self.tokens.setdefault(index, []).extend(tokens)
        self.gaps.setdefault(index, []).extend(_gap(t) for t in tops)


def _gap(top: dict | None) -> float:
    values = sorted((top or {}).values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def _parse_choice(endpoint: str, choice: dict, answer: Answer, stream: bool, prompt_tokens: int = 0) -> None:
    if endpoint == "chat":
        text = (choice["delta"] if stream else choice["message"]).get("content") or ""
        content = (choice.get("logprobs") or {}).get("content") or []
        answer.add(choice["index"], text, [c["token"] for c in content],
                   [{t["token"] + f"#{i}": t["logprob"] for i, t in enumerate(c["top_logprobs"])} for c in content])
        return
    lp = choice.get("logprobs") or {"tokens": [], "top_logprobs": [], "token_logprobs": []}
    tokens, tops, text = lp["tokens"], lp["top_logprobs"], choice["text"]
    if prompt_tokens:   # echo: the prompt's entries come first
        answer.prompt_logprobs = lp["token_logprobs"][:prompt_tokens]
        text = text[len("".join(tokens[:prompt_tokens])):]
        tokens, tops = tokens[prompt_tokens:], tops[prompt_tokens:]
    answer.add(choice["index"], text, tokens, tops)


@dataclass
class Outcome:
    spec: Spec
    stream: bool
    status: int | None = None        # None: this client hung up
    answer: Answer | None = None
    error: str | None = None
    seconds: float = 0.0
    hung_up: bool = False


async def send(client: httpx.AsyncClient, url: str, model: str, spec: Spec, stream: bool,
               hang_up_after: float | None = None) -> Outcome:
    """One request; with ``hang_up_after`` the client goes away after that many seconds."""
    outcome = Outcome(spec, stream)
    path = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
    start = time.monotonic()
    try:
        coro = _exchange(client, url + path, model, spec, stream, outcome)
        if hang_up_after is None:
            await coro
        else:
            await asyncio.wait_for(coro, hang_up_after)
    except asyncio.TimeoutError:
        outcome.hung_up, outcome.status = True, None
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.seconds = time.monotonic() - start
    return outcome


async def _exchange(client: httpx.AsyncClient, url: str, model: str, spec: Spec, stream: bool,
                    outcome: Outcome) -> None:
    body = spec.body(model, stream)
    if not stream:
        r = await client.post(url, json=body, timeout=600)
        outcome.status = r.status_code
        data = r.json()
        if r.status_code != 200:
            outcome.error = data["error"]["message"]
            return
        outcome.answer = Answer()
        prompt_tokens = data["usage"]["prompt_tokens"] if body.get("echo") else 0
        for choice in data["choices"]:
            _parse_choice(spec.endpoint, choice, outcome.answer, False, prompt_tokens)
        return
    async with client.stream("POST", url, json=body, timeout=600) as r:
        outcome.status = r.status_code
        if r.status_code != 200:
            outcome.error = json.loads(await r.aread())["error"]["message"]
            return
        outcome.answer = Answer()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                code = str(chunk["error"].get("code") or 500)   # the error event's code: "503"
                outcome.status = int(code) if code.isdigit() else 500
                outcome.error = chunk["error"]["message"]
                return
            for choice in chunk["choices"]:
                _parse_choice(spec.endpoint, choice, outcome.answer, True)


def compare(got: Answer, want: Answer, spec: Spec, stream: bool) -> str | None:
    """None when ``got`` is the reference's answer; else what differs."""
    if sorted(got.texts) != sorted(want.texts):
        return f"choices {sorted(got.texts)} instead of {sorted(want.texts)}"
    for index, text in want.texts.items():
        if got.texts[index] == text:
            continue
        mine, theirs = got.tokens[index], want.tokens[index]
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        if spec.seeded or first >= len(theirs) or want.gaps[index][first] >= NEAR_TIE:
            return f"choice {index}: {got.texts[index]!r} instead of {text!r} (first difference at token {first})"
    if spec.echo_logprobs and not stream and (got.prompt_logprobs is None or len(got.prompt_logprobs) != len(want.prompt_logprobs)):
        return "prompt log-probabilities missing or of the wrong length"
    return None


async def reference(url: str, model: str, specs: list[Spec]) -> dict[int, Answer]:
    """Each spec once, alone: the answers the load must reproduce."""
    async with httpx.AsyncClient() as client:
        answers = {}
        for spec in specs:
            outcome = await send(client, url, model, spec, stream=False)
            assert outcome.status == 200, f"reference request {spec} failed: {outcome.error}"
            answers[spec.key] = outcome.answer
        return answers


async def soak(url: str, model: str, specs: list[Spec], count: int, concurrency: int,
               hang_up_fraction: float = 0.2, seed: int = 11) -> list[Outcome]:
    """``count`` requests drawn from ``specs``, ``concurrency`` at a time; a fraction of the
    clients hang up at a random moment of their request."""
    rng = random.Random(seed)
    plan = [(rng.choice(specs), rng.random() < 0.5, rng.uniform(0.02, 0.8) if rng.random() < hang_up_fraction else None)
            for _ in range(count)]
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one(spec, stream, hang_up):
            async with gate:
                return await send(client, url, model, spec, stream, hang_up)

        return await asyncio.gather(*(one(*item) for item in plan))


def check_answers(outcomes: list[Outcome], answers: dict[int, Answer]) -> dict:
    """Every request that was not hung up on completed with its reference answer."""
    wrong, failed = [], []
    for o in outcomes:
        if o.hung_up:
            continue
        if o.status != 200 or o.error:
            failed.append(f"{o.spec} -> {o.status}: {o.error}")
            continue
        difference = compare(o.answer, answers[o.spec.key], o.spec, o.stream)
        if difference:
            wrong.append(f"{o.spec} ({'stream' if o.stream else 'whole'}): {difference}")
    assert not failed, f"{len(failed)} requests failed: {failed[:3]}"
    assert not wrong, f"{len(wrong)} wrong answers: {wrong[:3]}"
    return {"completed": sum(not o.hung_up for o in outcomes), "hung_up": sum(o.hung_up for o in outcomes),
            "wrong": len(wrong), "failed": len(failed)}


# ---- the server, checked whole ------------------------------------------------------------------

def kv_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("duoserve-kv-")}


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and every process below it, in MB."""
    from tests.server_helpers import descendants

    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            continue
    return total / 1024


def report(name: str, figures: dict) -> None:
    """One line per scenario on stdout (``-s``), and into $DUOSERVE_CHAOS_REPORT when set."""
    line = json.dumps({"scenario": name, "full": FULL, **figures})
    print(line)
    path = os.environ.get("DUOSERVE_CHAOS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
