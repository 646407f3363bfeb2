"""Every process duoserve starts ends with it, and a stop signal is obeyed at every stage.

Each test records the process tree of what it stops (walked again until that process is
gone, so a process started meanwhile counts too) and checks that none of it runs 10 s
later, and that no shared-memory KV segment is left. Engines are held in their start-up
by fault injection (``DUOSERVE_FAULT_START_SLEEP``, as a first start building kernels
would hold them) or by a cold compile. Seconds here are hang guards, except the 10 s the
issue allows and the moments a signal is sent at.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.chaos.harness import kv_segments
from tests.server_helpers import Server, alive, descendants, engine_children

GONE_WITHIN_S = 10.0
BAD_LOG_LINES = ("Traceback", "KeyboardInterrupt", "relaunch")


def _wait_for(predicate, guard: float, what: str) -> float:
    """Seconds until ``predicate()`` holds; ``guard`` only turns a hang into a failure."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < guard, f"{what}: not after {guard:g}s"
        time.sleep(0.02)
    return time.monotonic() - start


def _walk(pid: int, names: dict[int, str]) -> dict[int, str]:
    """``names`` with every process below ``pid`` now, each by its latest name (``comm``)."""
    for child in descendants(pid):
        try:
            names[child] = Path(f"/proc/{child}/comm").read_text().strip()
        except OSError:   # gone meanwhile
            names.setdefault(child, "")
    return names


def _tree_until_exit(proc: subprocess.Popen, names: dict[int, str], guard: float = 60.0) -> set[int]:
    """``names`` with every process below ``proc`` seen until it exits (walked every 20 ms);
    returns those of them still running the moment it had exited."""
    deadline = time.monotonic() + guard
    while proc.poll() is None:
        _walk(proc.pid, names)
        assert time.monotonic() < deadline, "the process did not exit"
        time.sleep(0.02)
    return {p for p in names if alive(p)}


def _engines(names: dict[int, str]) -> list[int]:
    return [p for p, name in names.items() if name.startswith("duoserve-")]


def _assert_gone(tree: set[int] | dict[int, str], segments_before: set[str]) -> float:
    """Seconds until no process of ``tree`` runs (at most 10); then no new KV segment."""
    start = time.monotonic()
    while any(alive(p) for p in tree):
        left = {p: tree.get(p, "") if isinstance(tree, dict) else "" for p in tree if alive(p)}
        assert time.monotonic() - start < GONE_WITHIN_S, f"processes outlived their launcher by 10 s: {left}"
        time.sleep(0.02)
    assert kv_segments() <= segments_before, f"a shared-memory segment was left: {kv_segments() - segments_before}"
    return time.monotonic() - start


# ---- the server's SIGTERM while its engines start ---------------------------------------------

def _send(srv: Server, to: str, sig: int = signal.SIGTERM) -> None:
    """To the server alone, or to its whole process group, as systemd and `timeout` do: the
    engines and the fork server get it too (the fork server dies of SIGTERM)."""
    if to == "group":
        os.killpg(srv.proc.pid, sig)
    else:
        srv.proc.send_signal(sig)


def _stop_while_starting(srv: Server, to: str, log: Path, segments_before: set[str],
                         sig: int = signal.SIGTERM) -> dict[int, str]:
    """``sig`` now: the engines are gone when the server has exited (by SIGTERM, or 0 after
    SIGINT), the rest within 10 s; no segment, no traceback. Returns the tree, by name."""
    try:
        names = _walk(srv.proc.pid, {})
        _send(srv, to, sig)
        running_at_exit = _tree_until_exit(srv.proc, names)
    finally:
        srv.stop(signal.SIGKILL)
    assert not [p for p in _engines(names) if p in running_at_exit], "an engine outlived the server's exit"
    assert srv.proc.returncode == (-signal.SIGTERM if sig == signal.SIGTERM else 0)
    seconds = _assert_gone(names, segments_before)
    text = log.read_text()
    assert not [bad for bad in BAD_LOG_LINES if bad in text], text[-3000:]
    if _engines(names):   # the engines had started: the server stopped them, they did not just notice its exit
        assert "while the engines start: stopping them" in text
    print(f"{sorted(names.values())} gone {seconds:.2f}s after the server's exit")
    return names


START_CASES = [(mode, "1s", "server", signal.SIGTERM) for mode in ("colocated", "disaggregated")] + \
    [(mode, "engines", "server", signal.SIGTERM) for mode in ("colocated", "disaggregated")] + \
    [("disaggregated", "engines", "group", signal.SIGTERM), ("colocated", "engines", "server", signal.SIGINT)]


@pytest.mark.parametrize("mode,at,to,sig", START_CASES,
                         ids=["at-1s-colocated", "at-1s-disaggregated", "engines-held-colocated",
                              "engines-held-disaggregated", "engines-held-to-the-group-disaggregated",
                              "engines-held-SIGINT-colocated"])
def test_sigterm_while_the_engines_start_stops_them_before_the_server_exits(tmp_path, monkeypatch, mode, at, to,
                                                                             sig):
    """SIGTERM 1 s into `duoserve serve`'s start (on a busy machine the server may still be
    importing: then it had started nothing), or once all its engines run, held before they load."""
    monkeypatch.setenv("DUOSERVE_FAULT_START_SLEEP", "600")
    segments_before = kv_segments()
    log = tmp_path / "log"
    started = time.monotonic()
    srv = Server("--mode", mode, "--kv-cache-memory", "0.2", log=log, wait_healthy=False, wait_port=False,
                 new_session=to == "group")
    if at == "1s":
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    else:
        engines = 2 if mode == "disaggregated" else 1
        _wait_for(lambda: len(_engines(_walk(srv.proc.pid, {}))) == engines, 120, "the engines started")
    _stop_while_starting(srv, to, log, segments_before, sig)


COMPILERS = ("g++", "cc1plus", "gcc", "cc1")


# to the server: the disaggregated case (two engines compiling); to the group: the colocated one
@pytest.mark.parametrize("mode,to", [("disaggregated", "server"), ("colocated", "group")])
def test_sigterm_while_an_engine_compiles_stops_it_before_the_server_exits(tmp_path, monkeypatch, mode, to):
    """The same while the engines compile their model step (a cold compile cache: minutes of
    work on 2 cores, so the signal lands inside it): to the server 1 s into the compile; to the
    group once Inductor runs the C++ compiler, which must end too."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    segments_before = kv_segments()
    log = tmp_path / "log"
    srv = Server("--mode", mode, "--compile", "--kv-cache-memory", "0.2", "--max-model-len", "1024", log=log,
                 wait_healthy=False, wait_port=False, new_session=to == "group")
    _wait_for(lambda: "compiling the model step" in log.read_text(), 120, "the engine compiling")
    if to == "group":
        _wait_for(lambda: any(n in COMPILERS for n in _walk(srv.proc.pid, {}).values()), 300, "a C++ compiler")
    else:
        time.sleep(1.0)   # into the compile, past its first call
    names = _stop_while_starting(srv, to, log, segments_before)
    assert "compiled the model step" not in log.read_text(), "the signal came after the compile"
    assert len(_engines(names)) == (2 if mode == "disaggregated" else 1)
    assert to == "server" or any(n in COMPILERS for n in names.values())


# ---- SIGKILL: nobody cleans up, the pidfd watch does ------------------------------------------

@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_server_killed_while_its_engines_start_leaves_no_process(tmp_path, monkeypatch, mode):
    """SIGKILL to `duoserve serve` while its engines are still starting (held there by fault
    injection, as a first start building kernels would be): every process it started (the fork
    server, the engines, the resource tracker), walked from the tree recorded then, is gone
    within 10 s, and so is every shared-memory segment it made."""
    monkeypatch.setenv("DUOSERVE_FAULT_START_SLEEP", "600")
    segments_before = kv_segments()
    srv = Server("--mode", mode, "--kv-cache-memory", "0.2", log=tmp_path / "log", wait_healthy=False,
                 wait_port=False)
    try:
        want = 2 if mode == "disaggregated" else 1
        _wait_for(lambda: len(engine_children(srv.proc.pid)) == want, 120, "the engines started")
        tree = set(descendants(srv.proc.pid))
        assert len(tree) >= want + 1, tree   # the engines and the fork server at least
        srv.proc.kill()
        srv.proc.wait(30)
    finally:
        srv.stop(signal.SIGKILL)
    _assert_gone(tree, segments_before)


def _stream(url: str, body: dict, lines: list, timeout: float = 300) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    except httpx.HTTPError as exc:   # the server was killed under it
        lines.append(f"error: {exc}")


# a colocated engine on one thread: on a machine whose other cores are busy, an engine's threads
# meeting at a barrier per op wait for each other's time slices (0.4 tokens/s seen here), and
# these tests are about signals, not speed
ONE_THREAD = ("--kv-cache-memory", "0.2", "--max-model-len", "4096", "--num-threads", "1")


def _streaming(url: str, prompt: str, max_tokens: int) -> tuple[list[str], threading.Thread]:
    """A stream of exactly ``max_tokens`` tokens, returned once its first tokens came back (in
    flight, however loaded the machine): its lines so far, and the thread reading the rest."""
    lines: list[str] = []
    thread = threading.Thread(target=_stream, args=(url, {"prompt": prompt, "max_tokens": max_tokens,
                                                          "ignore_eos": True}, lines), daemon=True)
    thread.start()
    _wait_for(lambda: len(lines) >= 3, 120, "the stream's first tokens")
    return lines, thread


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_sigkill_while_serving_leaves_no_process(tmp_path, mode):
    """SIGKILL to `duoserve serve` while a stream runs through its engines."""
    segments_before = kv_segments()
    srv = Server("--mode", mode, "--kv-cache-memory", "0.2", "--max-model-len", "4096", log=tmp_path / "log")
    try:
        _streaming(srv.url, "Once upon a time", 3000)
        tree = set(descendants(srv.proc.pid))
        assert len(engine_children(srv.proc.pid)) == (2 if mode == "disaggregated" else 1)
        srv.proc.kill()
        srv.proc.wait(30)
    finally:
        srv.stop(signal.SIGKILL)
    print(f"{mode}: {len(tree)} processes gone {_assert_gone(tree, segments_before):.2f}s after SIGKILL")


def test_sigkill_to_a_standalone_engines_launcher_leaves_no_process(tmp_path):
    """Standalone engines (`duoserve prefill|decode --listen`) are started by their user, and
    start processes of their own (multiprocessing's resource tracker, for the KV segments):
    SIGKILL to each engine while a stream runs through them leaves none of those, and no segment."""
    segments_before = kv_segments()
    addresses = {role: f"ipc://{tempfile.gettempdir()}/duoserve-test-{uuid.uuid4().hex[:8]}-{role}"
                 for role in ("prefill", "decode")}
    log = open(tmp_path / "engines.log", "w")
    engines = {role: subprocess.Popen([sys.executable, "-m", "duoserve.cli", role, "--listen", address,
                                       "--kv-cache-memory", "0.2", "--max-model-len", "2048", "--num-threads", "1"],
                                      stdout=log, stderr=subprocess.STDOUT)
               for role, address in addresses.items()}
    srv = None
    try:
        srv = Server("--mode", "disaggregated", "--prefill-addrs", addresses["prefill"],
                     "--decode-addrs", addresses["decode"], log=tmp_path / "server.log")
        for i in range(3):   # KV handed over in shared memory
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": f"Count to {i}", "max_tokens": 4}, timeout=120)
            assert r.status_code == 200
        lines, _ = _streaming(srv.url, "Go", 1500)
        trees = {role: _walk(proc.pid, {}) for role, proc in engines.items()}
        assert all(trees.values()), f"each engine started a process of its own: {trees}"
        for proc in engines.values():
            proc.kill()
            proc.wait(30)
        seconds = _assert_gone({**trees["prefill"], **trees["decode"]}, segments_before)
    finally:
        for proc in engines.values():
            proc.kill()
        if srv is not None:
            srv.stop(signal.SIGKILL)
        for address in addresses.values():
            Path(address.removeprefix("ipc://")).unlink(missing_ok=True)
    print(f"standalone engines' processes {trees} gone in {seconds:.2f}s")


def test_sigterm_to_the_process_group_while_serving_drains_every_process(tmp_path):
    """systemd's stop (SIGTERM to every process of the service, the fork server included, which
    dies of it): the stream in flight still finishes whole, every process exits, none is
    relaunched, nothing is left."""
    segments_before = kv_segments()
    log = tmp_path / "log"
    srv = Server("--mode", "disaggregated", "--kv-cache-memory", "0.2", "--max-model-len", "4096",
                 "--shutdown-timeout", "120", log=log, new_session=True)
    try:
        lines, thread = _streaming(srv.url, "Once upon a time", 40)
        names = _walk(srv.proc.pid, {})
        _send(srv, "group")
        thread.join(150)
        _tree_until_exit(srv.proc, names, guard=150)
    finally:
        srv.stop(signal.SIGKILL)
    assert lines[-1] == "data: [DONE]" and len(lines) == 40 + 1, lines[-3:]
    assert srv.proc.returncode == -signal.SIGTERM
    _assert_gone(names, segments_before)
    text = log.read_text()
    assert not [bad for bad in BAD_LOG_LINES if bad in text], text[-3000:]
    assert "the drain deadline passed" not in text and "ending 1 requests still running" not in text


def test_a_second_sigterm_to_the_server_ends_its_drain_at_once(tmp_path):
    """A drain of minutes (a long stream, --shutdown-timeout 300): the second SIGTERM ends it,
    as a second Ctrl-C does; the engines are stopped before the server exits (uvicorn skips the
    app's shutdown when forced) and nothing is left."""
    segments_before = kv_segments()
    log = tmp_path / "log"
    srv = Server(*ONE_THREAD, "--shutdown-timeout", "300", log=log)
    try:
        _streaming(srv.url, "Go", 3000)   # in flight: the drain would last minutes
        names = _walk(srv.proc.pid, {})
        srv.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: "draining: 1 requests in flight" in log.read_text(), 60, "the server draining")
        srv.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        running_at_exit = _tree_until_exit(srv.proc, names, guard=60)   # a hang guard, far inside the 300 s drain
        exited_after = time.monotonic() - start
    finally:
        srv.stop(signal.SIGKILL)
    assert srv.proc.returncode == -signal.SIGTERM
    assert _engines(names) and not set(_engines(names)) & running_at_exit, "the engine outlived the server's exit"
    _assert_gone(names, segments_before)
    print(f"the server exited {exited_after:.2f}s after its second SIGTERM")


# ---- SIGTERM to a launched engine itself ----------------------------------------------------------

def test_sigterm_to_a_serving_engine_drains_it_then_it_is_relaunched(tmp_path):
    """SIGTERM to the engine (not the server): the stream it runs finishes whole, then the
    engine exits (before --shutdown-timeout, having nothing left), the server relaunches it and
    serves on; stopping the server then leaves nothing."""
    segments_before = kv_segments()
    log = tmp_path / "log"
    srv = Server(*ONE_THREAD, "--shutdown-timeout", "120", log=log)
    try:
        (engine_pid,) = engine_children(srv.proc.pid)
        lines, thread = _streaming(srv.url, "Once upon a time", 30)
        os.kill(engine_pid, signal.SIGTERM)
        thread.join(120)
        assert lines[-1] == "data: [DONE]" and len(lines) == 30 + 1, lines[-3:]
        assert not [ln for ln in lines if "error" in ln]
        exited_after = _wait_for(lambda: not alive(engine_pid), 120, "the engine exiting once drained")
        _wait_for(lambda: httpx.get(f"{srv.url}/health", timeout=10).status_code == 200 and
                  engine_children(srv.proc.pid) not in ([], [engine_pid]), 120, "the engine relaunched")
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x y", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        text = log.read_text()
        assert "SIGTERM: draining" in text and "drained: stopping" in text
        tree = set(descendants(srv.proc.pid))
    finally:
        srv.stop(signal.SIGTERM)
    _assert_gone(tree, segments_before)
    print(f"the engine exited {exited_after:.2f}s after its stream ended")


def test_a_second_sigterm_stops_a_draining_engine_at_once_and_its_stream_moves(tmp_path):
    """Two SIGTERMs to an engine running a long stream, with a --shutdown-timeout of minutes: it
    stops at the second, long before the deadline; the stream goes on on the relaunched engine."""
    log = tmp_path / "log"
    srv = Server(*ONE_THREAD, "--shutdown-timeout", "300", log=log)
    try:
        (engine_pid,) = engine_children(srv.proc.pid)
        lines, thread = _streaming(srv.url, "Tell me a long story", 60)
        os.kill(engine_pid, signal.SIGTERM)
        _wait_for(lambda: "SIGTERM: draining" in log.read_text(), 60, "the engine draining")
        assert alive(engine_pid), "one SIGTERM drains: the engine still runs its stream"
        os.kill(engine_pid, signal.SIGTERM)
        stopped_after = _wait_for(lambda: not alive(engine_pid), 60, "the engine stopping at the second SIGTERM")
        thread.join(300)
    finally:
        srv.stop(signal.SIGTERM)
    assert lines[-1] == "data: [DONE]" and not [ln for ln in lines if "error" in ln], lines[-3:]
    assert len(lines) == 60 + 1, "the stream went on on the relaunched engine, every token once"
    text = log.read_text()
    assert "SIGTERM while draining: stopping at once" in text and "moving the 1 requests it held" in text
    print(f"stopped {stopped_after:.2f}s after the second SIGTERM")


def test_an_engine_draining_past_its_deadline_exits_and_its_stream_moves(tmp_path):
    """SIGTERM to an engine whose stream outlasts --shutdown-timeout (half a second): it serves on
    until the deadline, exits then, and the stream goes on on the relaunched engine, every token
    once."""
    log = tmp_path / "log"
    srv = Server(*ONE_THREAD, "--shutdown-timeout", "0.5", log=log)
    # long enough to outlast the deadline on a fast CPU: 120 tokens took 0.43 s on a Zen 5's core
    num_tokens = 600
    try:
        (engine_pid,) = engine_children(srv.proc.pid)
        lines, thread = _streaming(srv.url, "Tell me a long story", num_tokens)
        os.kill(engine_pid, signal.SIGTERM)
        exited_after = _wait_for(lambda: not alive(engine_pid), 60, "the engine exiting at its deadline")
        thread.join(600)
    finally:
        srv.stop(signal.SIGTERM)
    text = log.read_text()
    assert "the drain deadline passed: stopping with 1 requests unfinished" in text
    assert exited_after >= 0.5 - 0.1, f"it exited {exited_after:.2f}s after SIGTERM, before its deadline"
    assert lines[-1] == "data: [DONE]" and not [ln for ln in lines if "error" in ln], lines[-3:]
    assert len(lines) == num_tokens + 1 and "moving the 1 requests it held" in text


def test_sigterm_to_a_starting_engine_stops_it_at_once(tmp_path, monkeypatch):
    """SIGTERM to an engine held in its start: it stops at once (not after its 600 s hold), the
    server reports the engine gone and exits, and nothing it started remains."""
    monkeypatch.setenv("DUOSERVE_FAULT_START_SLEEP", "600")
    segments_before = kv_segments()
    log = tmp_path / "log"
    srv = Server("--kv-cache-memory", "0.2", log=log, wait_healthy=False, wait_port=False)
    try:
        _wait_for(lambda: len(engine_children(srv.proc.pid)) == 1, 120, "the engine started")
        (engine_pid,) = engine_children(srv.proc.pid)
        tree = set(descendants(srv.proc.pid))
        os.kill(engine_pid, signal.SIGTERM)
        stopped_after = _wait_for(lambda: not alive(engine_pid), 60, "the engine stopping")
        srv.proc.wait(60)
    finally:
        srv.stop(signal.SIGKILL)
    assert srv.proc.returncode == 2   # the start failed: a one-line error naming the engine
    text = log.read_text()
    assert "SIGTERM while starting: stopping at once" in text
    assert "duoserve: error: engine-0 exited (exit code 143) while waiting for EngineReady" in text
    _assert_gone(tree, segments_before)
    print(f"the engine stopped {stopped_after:.2f}s after SIGTERM")
