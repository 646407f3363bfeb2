"""Engines talk only to their own: the deployment key (ZeroMQ CURVE), several frontends on
one engine kept apart, and the size limit on every message."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys

import pytest
import zmq

from duoserve import SamplingParams
from duoserve import messages as msg
from duoserve.cli import main as cli_main
from duoserve.core.request import Request
from duoserve.errors import ConfigError
from duoserve.frontend.engine_client import EngineClient, EngineStartError
from duoserve.frontend.supervisor import start_engine, stop_engine
from duoserve.kv.zmq_connector import PeerRefusedError, PrefillConnector
from duoserve.transport import auth
from duoserve.transport.auth import AuthKey, Gatekeeper, check_listen, is_loopback, load_key, secure_client
from tests.server_helpers import free_port


@pytest.fixture
def router():
    """A keyed ROUTER on loopback: yields (address, socket, key)."""
    ctx = zmq.Context.instance()
    key = AuthKey.generate()
    gate = Gatekeeper(ctx, key)
    sock = gate.guard(ctx.socket(zmq.ROUTER))
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}", sock, key
    sock.close(linger=0)
    gate.close()


def _delivered(address: str, key: AuthKey | None, sock: zmq.Socket, payload: bytes = b"hello") -> bool:
    client = secure_client(zmq.Context.instance().socket(zmq.DEALER), key)
    client.connect(address)
    client.send(payload)
    try:
        if not sock.poll(1500):
            return False
        return sock.recv_multipart()[1] == payload
    finally:
        client.close(linger=0)


def test_only_holders_of_the_key_get_through(router):
    address, sock, key = router
    public_only = AuthKey(AuthKey.generate().secret, AuthKey.generate().public)
    outsider = AuthKey.generate()
    # an outsider that knows the engine's public key (it is not secret) but not the secret
    knows_public = AuthKey(outsider.secret, outsider.public)
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.curve_serverkey, client.curve_publickey, client.curve_secretkey = key.public, knows_public.public, knows_public.secret
    client.connect(address)
    client.send(b"let me in")
    assert not sock.poll(1000), "the ZAP handler admits only the deployment key"
    client.close(linger=0)
    assert not _delivered(address, None, sock), "no key: refused"
    assert not _delivered(address, outsider, sock), "another key: refused"
    assert not _delivered(address, public_only, sock)
    assert _delivered(address, key, sock), "the deployment key gets through"


def test_an_over_limit_frame_is_dropped_and_the_socket_keeps_serving(monkeypatch):
    monkeypatch.setattr(auth, "MAX_MESSAGE_BYTES", 4096)
    ctx = zmq.Context.instance()
    gate = Gatekeeper(ctx, None)
    sock = gate.guard(ctx.socket(zmq.ROUTER))
    address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        assert not _delivered(address, None, sock, b"x" * 5000)
        assert _delivered(address, None, sock, b"y" * 4000)
    finally:
        sock.close(linger=0)


def test_a_prefill_engine_with_another_key_is_refused_at_once(router):
    address, sock, key = router
    connector = PrefillConnector(b"\0" * 32, {}, AuthKey.generate())
    try:
        with pytest.raises(PeerRefusedError, match="refused this side's auth key in the handshake"):
            connector.connect("prefill-0", {"decode-0": address}, timeout=30)
    finally:
        connector.close()


def test_key_files_and_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    monkeypatch.delenv(auth.ENV_KEY_FILE, raising=False)
    path = tmp_path / "deploy.key"
    assert cli_main(["keygen", str(path)]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = load_key(str(path))
    assert len(key.secret) == 40 and key.public == zmq.curve_public(key.secret)
    assert key.secret.decode() not in repr(key)
    assert cli_main(["keygen", str(path)]) == 2, "an existing key is never overwritten"
    assert "a new file that can be created" in capsys.readouterr().err
    assert load_key(None) is None
    monkeypatch.setenv(auth.ENV_KEY_FILE, str(path))
    assert load_key(None) == key
    monkeypatch.delenv(auth.ENV_KEY_FILE)
    monkeypatch.setenv(auth.ENV_KEY, key.secret.decode())
    assert load_key(None) == key
    monkeypatch.setenv(auth.ENV_KEY, "short")
    with pytest.raises(ConfigError, match="DUOSERVE_AUTH_KEY.*a CURVE secret key: 40 Z85 characters"):
        load_key(None)
    with pytest.raises(ConfigError, match="auth_key_file.*a readable key file"):
        load_key(str(tmp_path / "missing"))


def test_listening_beyond_loopback_needs_a_key(tmp_path, capsys):
    assert is_loopback("tcp://127.0.0.1:7100") and is_loopback("tcp://[::1]:7100") and is_loopback("ipc:///tmp/x")
    assert is_loopback("tcp://localhost:7100")
    assert not is_loopback("tcp://0.0.0.0:7100") and not is_loopback("tcp://10.1.2.3:7100")
    assert not is_loopback("tcp://node-7:7100")
    check_listen("tcp://127.0.0.1:7100", None, insecure=False)
    check_listen("tcp://0.0.0.0:7100", AuthKey.generate(), insecure=False)
    check_listen("tcp://0.0.0.0:7100", None, insecure=True)
    with pytest.raises(ConfigError, match=r"auth_key_file.*beyond loopback \(tcp://0.0.0.0:7100\)"):
        check_listen("tcp://0.0.0.0:7100", None, insecure=False)
    # the standalone engine refuses before it loads anything
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUOSERVE_AUTH")}
    done = subprocess.run([sys.executable, "-m", "duoserve.cli", "decode", "--listen",
                           f"tcp://0.0.0.0:{free_port()}", "--model", str(tmp_path / "nowhere")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert "auth_key_file" in done.stderr and "duoserve keygen FILE" in done.stderr


def _start_engine(path, port: int, key_file) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "duoserve.cli", "decode", "--listen", f"tcp://127.0.0.1:{port}", "--model", str(path),
         "--dtype", "float32", "--kv-cache-memory", "0.01", "--num-threads", "1", "--auth-key-file", str(key_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _run(client: EngineClient, request_id: str, prompt: list[int], abort_after: int | None = None,
               max_tokens: int = 12) -> tuple[list[int], str]:
    """One greedy request on ``client``: its tokens and finish reason (aborted after
    ``abort_after`` tokens when given)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    client.add_request(Request(request_id, prompt, params, client.eos_token_ids, len(prompt) + max_tokens))
    tokens: list[int] = []
    while True:
        batch = await client.recv()
        for out in batch.outputs:
            assert out.request_id == request_id, "an engine sends a frontend only its own requests"
            tokens += out.new_token_ids[max(0, len(tokens) - out.position):]
            if out.finish_reason is not None:
                client.release(request_id)
                return tokens, out.finish_reason
        if abort_after is not None and len(tokens) >= abort_after:
            client.abort(request_id)
            abort_after = None


def test_a_keyed_engine_refuses_strangers_and_keeps_its_frontends_apart(tiny_dir, tmp_path):
    path = tiny_dir(kind="llama")
    key_file = tmp_path / "deploy.key"
    key = AuthKey.generate()
    key.save(str(key_file))
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    engine = _start_engine(path, port, key_file)

    async def refused(client: EngineClient) -> EngineStartError:
        with pytest.raises(EngineStartError) as info:
            await start_engine(client, timeout=120)
        await stop_engine(client)
        return info.value

    async def main():
        wrong = await refused(EngineClient("decode-0", address, key=AuthKey.generate(), frontend_id="mallory"))
        none = await refused(EngineClient("decode-0", address, frontend_id="mallory"))
        alice = EngineClient("decode-0", address, key=key, frontend_id="alice")
        bob = EngineClient("decode-0", address, key=key, frontend_id="bob")
        await start_engine(alice, timeout=120)
        await start_engine(bob, timeout=30)
        alone, _ = await _run(bob, "solo", [5, 6, 7])
        # the same request id from both at once: alice aborts hers, bob's runs to the end
        (aborted, a_reason), (together, b_reason) = await asyncio.gather(
            _run(alice, "same", [5, 6, 7], abort_after=2, max_tokens=200), _run(bob, "same", [5, 6, 7]))
        # alice vanishes without a Shutdown, a request running: the engine drops it, bob serves on
        alice.add_request(Request("left", [5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True),
                                  alice.eos_token_ids, 2003))
        await asyncio.sleep(0.3)
        alice._close_sockets()
        idle = None
        for _ in range(100):   # the engine's stats probe notices within a second or two
            batch = await bob.recv()
            if batch.stats is not None and batch.stats.num_running == 0 and batch.stats.num_waiting == 0:
                idle = batch.stats
                break
        after, _ = await _run(bob, "after", [5, 6, 7])
        await stop_engine(bob)
        return wrong, none, alone, (aborted, a_reason), (together, b_reason), idle, after

    try:
        wrong, none, alone, (aborted, a_reason), (together, b_reason), idle, after = asyncio.run(main())
        alive = engine.poll() is None
    finally:
        engine.send_signal(signal.SIGTERM)
        code = engine.wait(timeout=20)
    assert wrong.config_error and "refused this side's auth key in the handshake" in str(wrong)
    assert none.config_error and "refused a connection without an auth key" in str(none)
    assert a_reason == "abort" and 2 <= len(aborted) < 200
    assert b_reason == "length" and together == alone == after and len(alone) == 12
    assert idle is not None and idle.kv_cache_usage == 0.0, "the vanished frontend's request was dropped"
    assert alive and code == 0, "refusals and departures never harm the engine"


def test_launched_engines_get_a_key_of_their_own():
    from duoserve.config import DisaggConfig, EngineConfig
    from duoserve.frontend.launcher import plan_engines

    decode, prefill = plan_engines(EngineConfig(), DisaggConfig(kv_transport="tcp"))
    assert decode[0].key is not None and decode[0].key == prefill[0].key
    other, _ = plan_engines(EngineConfig(), None)
    assert other[0].key is not None and other[0].key != decode[0].key
    with pytest.raises(ConfigError, match="auth_key_file.*beyond loopback"):
        plan_engines(EngineConfig(), DisaggConfig(prefill_addrs=("tcp://10.0.0.2:7100",), engine_host="0.0.0.0"))
    remote, _ = plan_engines(EngineConfig(), DisaggConfig(prefill_addrs=("tcp://10.0.0.2:7100",),
                                                           engine_host="0.0.0.0", insecure_no_auth=True))
    assert remote[0].key is None


def test_hello_fields_default_for_older_frontends():
    hello = msg.decode_at_engine(msg.encode(msg.Hello("decode-0")))
    assert hello.frontend_id == "" and hello.connection == 0


def test_a_request_the_engine_cannot_read_fails_at_once(tiny_dir):
    """A message that passed the frontend but not the engine's decoder (here: top_p out of
    range) fails its request with the reason, instead of leaving it waiting forever."""
    import msgspec

    from duoserve.config import CacheConfig, EngineConfig, ModelConfig
    from duoserve.frontend.launcher import _ipc_address

    config = EngineConfig(model=ModelConfig(model=str(tiny_dir(kind="llama")), dtype="float32"),
                          cache=CacheConfig(kv_cache_memory=0.01), num_threads=1)
    client = EngineClient("engine-0", _ipc_address("engine-0"), config, key=AuthKey.generate())

    async def main():
        await start_engine(client, timeout=120)
        try:
            good = msgspec.msgpack.decode(msg.encode(msg.AddRequest("bad-1", [1, 2, 3], SamplingParams(max_tokens=2),
                                                                    [0], 16, 0.0)))
            good["params"]["top_p"] = 5.0
            client._sock.send(msgspec.msgpack.encode(good))
            for _ in range(20):
                for out in (await client.recv()).outputs:
                    if out.request_id == "bad-1":
                        return out
        finally:
            await stop_engine(client)

    out = asyncio.run(main())
    assert out.finish_reason == "error" and "could not read this request" in out.error and "top_p" in out.error
