"""Soak: mixed requests (short and long prompts, streaming or not, n up to 4, stop strings,
prompt log-probabilities), a fifth of the clients hanging up at random moments, against a
real server, colocated and disaggregated. Afterwards nothing is lost: every completed answer
is its undisturbed reference's, the pools are whole, no process, segment or socket file is
left, memory is flat."""

from __future__ import annotations

import asyncio
import glob
import os
import tempfile

import httpx
import pytest

from tests.chaos.harness import FULL, check_answers, kv_segments, make_specs, reference, report, soak, tree_rss_mb
from tests.server_helpers import Server, alive, engine_children, metric, wait_gauges_idle

MODEL = "chaos"
# dense fp32 weights: an answer does not depend on the batch it was computed in beyond
# rounding (the quantized fast path rounds small batches' activations to 8 bits)
COMMON = ("--served-model-name", MODEL, "--dtype", "float32", "--quantization", "none", "--max-model-len", "2048",
          "--kv-cache-memory", "0.25")
# a safety bound for waits that end once the engine has caught up (gauges back to idle, /health):
# long enough for any machine sharing its cores, short enough that a hang fails the test
IDLE_WITHIN_S = 120
# requests sent while another process spins on every core: each waits on the hogs' share of the
# cores, so the count buys seconds one for one (16 clients: every engine is kept busy either way)
COTENANT_REQUESTS = 16


def server_args(mode: str) -> tuple[str, ...]:
    if mode == "colocated":
        return COMMON
    engines = "2" if FULL else "1"
    return (*COMMON, "--mode", "disaggregated", "--num-prefill-engines", engines, "--num-decode-engines", engines)


_ANSWERS: dict[str, dict] = {}   # mode -> the reference answers of make_specs(24) (the same on every server of a mode)


def answers_of(mode: str, url: str, specs) -> dict:
    if mode not in _ANSWERS:
        _ANSWERS[mode] = asyncio.run(reference(url, MODEL, specs))
    return _ANSWERS[mode]


def ipc_files(pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"duoserve-{pid}-*"))


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_soak_loses_nothing(mode, tmp_path):
    count, concurrency = (1000, 32) if FULL else (64, 16)   # each half: two rounds of the 16 clients
    specs = make_specs(24)
    segments_before = kv_segments()
    srv = Server(*server_args(mode), log=tmp_path / "log")
    try:
        engines = sorted(engine_children(srv.proc.pid))
        answers = answers_of(mode, srv.url, specs)
        first = asyncio.run(soak(srv.url, MODEL, specs, count // 2, concurrency, seed=11))
        wait_gauges_idle(srv.url, within=IDLE_WITHIN_S)
        rss_mid = tree_rss_mb(srv.proc.pid)
        second = asyncio.run(soak(srv.url, MODEL, specs, count - count // 2, concurrency, seed=12))
        idle_after = wait_gauges_idle(srv.url, within=IDLE_WITHIN_S)
        rss_end = tree_rss_mb(srv.proc.pid)
        figures = check_answers(first + second, answers)
        assert sorted(engine_children(srv.proc.pid)) == engines, "no engine died or was relaunched"
        assert kv_segments() <= segments_before, "every KV segment was taken and unlinked"
        assert httpx.get(f"{srv.url}/health", timeout=IDLE_WITHIN_S).json() == {"status": "ok"}
        assert rss_end <= rss_mid * 1.1 + 30, f"memory grew from {rss_mid:.0f} to {rss_end:.0f} MB"
        seconds = [o.seconds for o in first + second if not o.hung_up]
    finally:
        code = srv.stop()
    assert code in (0, -15)
    assert not any(alive(pid) for pid in engines), "no engine outlives the server"
    assert not ipc_files(srv.proc.pid), "no socket file is left behind"
    assert kv_segments() <= segments_before
    report(f"soak-{mode}", {**figures, "requests": count, "concurrency": concurrency,
                            "max_request_s": round(max(seconds), 2), "idle_after_s": round(idle_after, 2),
                            "rss_mid_mb": round(rss_mid), "rss_end_mb": round(rss_end)})


def test_a_cotenant_busy_on_every_core_slows_the_engines_but_kills_nothing(tmp_path):
    """A round of the soak's 16 clients (16 requests; disaggregated: the engines pinned to one core each)
    while another process spins on every core: the engines are slow, not dead. No request fails
    or differs from its reference, no engine is declared down, migrated from or relaunched."""
    import subprocess
    import sys

    specs = make_specs(24)
    log = tmp_path / "log"
    srv = Server(*server_args("disaggregated"), log=log)
    hogs = []
    try:
        engines = sorted(engine_children(srv.proc.pid))
        answers = answers_of("disaggregated", srv.url, specs)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
        outcomes = asyncio.run(soak(srv.url, MODEL, specs, COTENANT_REQUESTS, 16, seed=13))
        for hog in hogs:
            hog.kill()
        figures = check_answers(outcomes, answers)
        wait_gauges_idle(srv.url, within=IDLE_WITHIN_S)
        assert sorted(engine_children(srv.proc.pid)) == engines, "no engine died or was relaunched"
        assert metric(srv.url, "duoserve:request_migrations_total") == 0, "no request moved off an engine"
    finally:
        for hog in hogs:
            hog.kill()
        srv.stop()
    assert " is down (" not in log.read_text(), "an engine whose process lives was declared down"
    report("soak-cotenant", {**figures, "requests": COTENANT_REQUESTS, "concurrency": 16})
