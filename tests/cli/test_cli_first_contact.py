"""What a new user meets first: config mistakes are one clear line and exit 2, before any load
where they can be found without the model; `python -m duoserve`; --help that says the defaults."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from tests.server_helpers import free_port


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # the time-out only keeps a hung command from blocking CI; every case refuses before loading
    # a model (or loads the small default one), however slowly a shared machine runs it
    return subprocess.run([sys.executable, "-m", "duoserve", *args], capture_output=True, text=True, timeout=600)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("duoserve: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


def test_serve_refuses_a_missing_model_and_a_bad_port_before_loading():
    assert_one_line_error(run_cli("serve", "--model", "/nonexistent"),
                          "model='/nonexistent' is not allowed", "Models are not downloaded")
    assert_one_line_error(run_cli("serve", "--port", "99999"),
                          "port=99999 is not allowed: a TCP port from 1 to 65535")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(run_cli("serve", "--port", str(port)),
                              f"port={port} is not allowed: a free port: 127.0.0.1:{port} cannot be bound")


def test_serve_engine_config_errors_are_one_line():
    """Found by the engine while it starts: still one line, and no suggestion to stretch the context."""
    line = assert_one_line_error(run_cli("serve", "--port", str(free_port()), "--max-model-len", "999999"),
                                 "max_model_len=999999 is not allowed: at most the model's "
                                 "max_position_embeddings (8192)")
    assert "hf-overrides" not in line
    if not torch.cuda.is_available():
        assert_one_line_error(run_cli("serve", "--port", str(free_port()), "--device", "cuda"),
                              "device='cuda' is not allowed: cpu or auto: no CUDA device is visible")


def test_generate_config_error_is_the_same_line():
    assert_one_line_error(run_cli("generate", "--prompt", "x", "--model", "/nonexistent"),
                          "model='/nonexistent' is not allowed")


def test_python_m_duoserve_and_help():
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("duoserve ")
    help_text = run_cli("serve", "--help").stdout
    assert "log level of the HTTP server's own messages (default: info)" in " ".join(help_text.split())
    assert "(default: 1 on CPU" in " ".join(help_text.split()), "the KV default the README quotes"


@pytest.mark.parametrize("cpus,engines,expected", [
    ([0, 1], (1, 1), ([(1,)], [(0,)])),
    ([0, 1, 2, 3], (1, 1), ([(2, 3)], [(0, 1)])),
    (list(range(8)), (1, 3), ([(4, 5, 6, 7)], [(0,), (1,), (2, 3)])),
    ([0, 1, 2], (2, 2), ([(0, 1, 2)] * 2, [(0, 1, 2)] * 2)),
])
def test_default_core_split(cpus, engines, expected):
    from duoserve.frontend.launcher import split_cores

    assert split_cores(cpus, *engines) == expected


def test_disaggregated_defaults_take_turns_on_every_core(monkeypatch, tmp_path):
    import os

    from duoserve.config import DisaggConfig, EngineConfig
    from duoserve.frontend import launcher

    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(launcher.tempfile, "gettempdir", lambda: str(tmp_path))
    decode, prefill = launcher.plan_engines(EngineConfig(), DisaggConfig())
    assert (prefill[0].config.cpus, prefill[0].config.num_threads) == ((0, 1), 2)
    assert (decode[0].config.cpus, decode[0].config.num_threads) == ((0, 1), 2)
    turns = [c.config.turns for c in (*prefill, *decode)]
    assert [t.slot for t in turns] == [0, 1] and turns[0].path == turns[1].path and turns[0].quantum == 0.4
    assert os.path.getsize(turns[0].path) == (2 * 3 + 1) * 8, "one slot of three words per engine, and the bell"
    launcher.remove_turns_file([*prefill, *decode])
    assert not os.path.exists(turns[0].path)
    decode, prefill = launcher.plan_engines(EngineConfig(), DisaggConfig(num_prefill_engines=2, num_decode_engines=2))
    assert [(c.config.cpus, c.config.num_threads, c.config.turns.slot) for c in (*prefill, *decode)] == \
        [((0,), 1, 0), ((1,), 1, 1), ((0,), 1, 2), ((1,), 1, 3)], "a role's engines split the cores"
    launcher.remove_turns_file([*prefill, *decode])


def test_disaggregated_split_pins_each_role_to_its_cores(monkeypatch):
    from duoserve.config import DisaggConfig, EngineConfig
    from duoserve.frontend import launcher

    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1})
    decode, prefill = launcher.plan_engines(EngineConfig(), DisaggConfig(core_sharing="split"))
    assert (prefill[0].config.cpus, prefill[0].config.num_threads) == ((1,), 1)
    assert (decode[0].config.cpus, decode[0].config.num_threads) == ((0,), 1)
    assert prefill[0].config.turns is None and decode[0].config.turns is None
    decode, prefill = launcher.plan_engines(EngineConfig(), DisaggConfig(decode_threads=2))
    assert prefill[0].config.cpus is None and decode[0].config.num_threads == 2, "a flag given: no default split"
    assert decode[0].config.turns is None, "threads given: no turns either"
    decode, prefill = launcher.plan_engines(EngineConfig(), DisaggConfig(core_sharing="split", num_prefill_engines=2,
                                                                         num_decode_engines=2))
    assert [c.config.num_threads for c in (*prefill, *decode)] == [1, 1, 1, 1], "more engines than cores"


def test_the_first_weight_fingerprint_is_logged_then_cached(tiny_dir, tmp_path, monkeypatch, caplog):
    import logging

    from duoserve.model.fingerprint import weights_digest

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tiny_dir(kind="llama")
    with caplog.at_level(logging.INFO, logger="duoserve.model.fingerprint"):
        first = weights_digest(path)
        assert "computing the weight fingerprint of" in caplog.text
        caplog.clear()
        assert weights_digest(path) == first
        assert "computing" not in caplog.text, "a cached digest is not computed again"
