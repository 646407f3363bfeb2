"""Opt-in (root, not in CI): three "hosts" on this machine, each a network namespace with its
own address behind a veth pair on one bridge, each running a Ray node started with
`duoserve ray-node`; the frontend runs in the root namespace. Then the decode host's link is
cut: its requests fail within 5 s naming the engine, Ray declares the node dead and starts
the decode engine on the spare decode host, and requests succeed again.

    sudo DUOSERVE_NETNS=1 python -m pytest -s tests/netns

Engines on these "hosts" share the machine's filesystem, so ``ipc://`` would still reach
across namespaces: the test forces ``--kv-transport tcp``, the only path between real hosts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

if os.environ.get("DUOSERVE_NETNS") != "1":
    # it needs root, adds a bridge and namespaces to the host and stops every Ray process on it:
    # never by default (issue 16 asks for it opt-in, outside CI)
    pytest.skip("opt-in: DUOSERVE_NETNS=1 as root (changes the host's network, stops all Ray processes)",
                allow_module_level=True)

from tests.server_helpers import Server   # noqa: E402

BRIDGE, SUBNET = "duobr0", "10.77.0"
HEAD = f"{SUBNET}.1"
HOSTS = {"prefill": (f"{SUBNET}.2", "prefill"), "decode": (f"{SUBNET}.3", "decode"),
         "spare": (f"{SUBNET}.4", "decode")}
RAY_PORT = 6390


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True)


def _up_network() -> None:
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{HEAD}/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for name, (address, _) in HOSTS.items():
        ns = f"duo-{name}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", f"v-{name}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", f"v-{name}", "master", BRIDGE, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", HEAD)   # the machine's own addresses


def _down_network() -> None:
    for name in HOSTS:
        sh("ip", "netns", "del", f"duo-{name}", check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


def _ray_node(name: str | None) -> list[str]:
    """`duoserve ray-node` for a host (None: the head, plain `ray start`: no engines of its own)."""
    duoserve = [sys.executable, "-m", "duoserve.cli", "ray-node"]
    if name is None:
        return [shutil.which("ray") or "ray", "start", "--head", f"--node-ip-address={HEAD}", f"--port={RAY_PORT}",
                "--num-cpus=1", "--include-dashboard=false"]
    address, role = HOSTS[name]
    return ["ip", "netns", "exec", f"duo-{name}", *duoserve, "--role", role, "--address", f"{HEAD}:{RAY_PORT}",
            "--", f"--node-ip-address={address}", "--num-cpus=1"]


@pytest.fixture(scope="module")
def hosts():
    _down_network()
    _up_network()
    try:
        sh(*_ray_node(None))
        for name in ("prefill", "decode"):
            sh(*_ray_node(name))
        yield
    finally:
        sh(shutil.which("ray") or "ray", "stop", "--force", check=False)
        _down_network()


def test_a_cut_link_fails_the_decode_hosts_requests_and_ray_moves_the_engine(hosts, tmp_path):
    srv = Server("--cluster", "ray", "--ray-address", f"{HEAD}:{RAY_PORT}", "--mode", "disaggregated",
                 "--kv-transport", "tcp", "--dtype", "float32", "--prefill-threads", "1",
                 "--decode-threads", "1", "--max-model-len", "2048", log=tmp_path / "serve.log")
    body = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    try:
        before = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()
        long = dict(body, max_tokens=1500)
        import threading

        result: dict = {}

        def in_flight() -> None:
            start = time.monotonic()
            response = httpx.post(f"{srv.url}/v1/completions", json=long, timeout=120)
            result.update(status=response.status_code, body=response.json(), at=time.monotonic(), start=start)

        thread = threading.Thread(target=in_flight)
        thread.start()
        time.sleep(2)
        cut_at = time.monotonic()
        sh("ip", "link", "set", "v-decode", "down")
        sh(*_ray_node("spare"))
        thread.join(60)
        deadline = time.monotonic() + 180
        after = None
        while time.monotonic() < deadline:
            response = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
            if response.status_code == 200:
                after = response.json()
                break
            time.sleep(1)
        healed_after = time.monotonic() - cut_at
    finally:
        srv.stop()
        sh(sys.executable, "-m", "duoserve.cli", "ray-stop", "--ray-address", f"{HEAD}:{RAY_PORT}", check=False)
    assert result["status"] in (500, 503) and "decode-0" in result["body"]["error"]["message"]
    assert result["at"] - cut_at < 5.0, f"failed {result['at'] - cut_at:.1f} s after the cut"
    assert after is not None, "the decode engine came back on the spare host"
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    print(f"link cut -> in-flight request failed in {result['at'] - cut_at:.2f} s; "
          f"served again after {healed_after:.1f} s")
