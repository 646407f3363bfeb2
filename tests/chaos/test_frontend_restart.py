"""A frontend killed under load while its standalone engines (keyed, on TCP) run on: the
engines drop its requests, a new frontend started on the same engines serves right answers,
and the engines' pools come back whole. A third frontend then joins the second on the same
engines (two API servers behind a load balancer): both serve at once, every answer right."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

from duoserve.transport.auth import AuthKey
from tests.chaos.harness import check_answers, make_specs, reference, report, soak
from tests.chaos.test_soak import MODEL
from tests.server_helpers import Server, alive, free_port, wait_gauges_idle

ENGINE_ARGS = ("--dtype", "float32", "--quantization", "none", "--max-model-len", "2048", "--kv-cache-memory", "0.25",
               "--num-threads", "1")


def _engine(role: str, port: int, key_file, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "duoserve.cli", role, "--listen", f"tcp://127.0.0.1:{port}",
                             "--auth-key-file", str(key_file), *ENGINE_ARGS], stdout=log, stderr=subprocess.STDOUT)


def test_a_frontend_killed_under_load_is_replaced_on_the_same_engines(tmp_path):
    key_file = tmp_path / "deploy.key"
    AuthKey.generate().save(str(key_file))
    ports = {"prefill": free_port(), "decode": free_port()}
    engine_log = open(tmp_path / "engines.log", "w")
    engines = {role: _engine(role, port, key_file, engine_log) for role, port in ports.items()}
    args = ("--mode", "disaggregated", "--served-model-name", MODEL, "--auth-key-file", str(key_file),
            "--prefill-addrs", f"tcp://127.0.0.1:{ports['prefill']}",
            "--decode-addrs", f"tcp://127.0.0.1:{ports['decode']}", "--max-model-len", "2048")
    specs = make_specs(12)
    first = Server(*args, log=tmp_path / "first.log")
    second = third = None
    try:
        answers = asyncio.run(reference(first.url, MODEL, specs))
        load = threading.Thread(target=lambda: asyncio.run(soak(first.url, MODEL, specs, 400, 16, 0.0)), daemon=True)
        load.start()
        time.sleep(3)
        first.proc.kill()   # no drain, no Shutdown: the engines see the connection drop
        first.proc.wait()
        load.join(timeout=60)   # its remaining requests fail at once: nobody is listening
        killed_at = time.monotonic()
        second = Server(*args, log=tmp_path / "second.log")
        healthy_after = time.monotonic() - killed_at
        outcomes = asyncio.run(soak(second.url, MODEL, specs, 24, 8, 0.0))
        figures = check_answers(outcomes, answers)
        idle = wait_gauges_idle(second.url, within=120)   # the dead frontend's requests were dropped
        third = Server(*args, log=tmp_path / "third.log")

        async def both():
            return await asyncio.gather(soak(second.url, MODEL, specs, 16, 8, 0.2, seed=3),
                                        soak(third.url, MODEL, specs, 16, 8, 0.2, seed=4))

        side_by_side = [check_answers(outcomes, answers) for outcomes in asyncio.run(both())]
        both_idle = [wait_gauges_idle(srv.url, within=120) for srv in (second, third)]
        engines_alive = all(p.poll() is None for p in engines.values())
    finally:
        for srv in (first, second, third):
            if srv is not None:
                srv.stop()
        for proc in engines.values():
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=30) for proc in engines.values()]
    # a hang guard (the seconds are reported): the new frontend connects to the running engines
    assert healthy_after < 120, f"the new frontend served only after {healthy_after:.1f} s"
    assert figures["failed"] == 0 and figures["wrong"] == 0
    assert all(f["failed"] == 0 and f["wrong"] == 0 and f["completed"] > 0 for f in side_by_side), side_by_side
    assert all(t is not None for t in both_idle)
    assert engines_alive and codes == [0, 0], "the engines outlive every frontend and stop cleanly"
    assert not any(alive(p.pid) for p in engines.values())
    report("frontend-restart", {"healthy_after_s": round(healthy_after, 2), "idle_after_s": round(idle, 2),
                                **figures, "side_by_side": side_by_side})
