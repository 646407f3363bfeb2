"""Engines on a Ray cluster (``--cluster ray``): one real cluster for the module
(``ray.cluster_utils.Cluster``: a head and a prefill node and a decode node on this host, 1 CPU
each). The engines land on the nodes their resources ask for and answer like one colocated
engine; KV crosses between them over TCP when told to (shared memory otherwise, same host);
several frontends share them; a frontend finds them again; a decode node removed mid-stream
fails only its requests, within seconds, and the engine comes back on another node."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from duoserve import SamplingParams
from duoserve.config import ClusterConfig, DisaggConfig
from duoserve.frontend.async_engine import AsyncEngine, EngineUnavailableError
from duoserve.frontend.ray_cluster import stop_engines
from tests.disagg_helpers import GREEDY, assert_same, generate_all, prompts
from tests.e2e.test_disagg_topology import engine_config

# one thread per engine: the reference's matmul order
DISAGG = DisaggConfig(prefill_threads=1, decode_threads=1, kv_lease_timeout=3.0)


@pytest.fixture(scope="module")
def cluster():
    """(cluster, {"prefill": node, "decode": node}); the dict follows node replacements."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = {"prefill": c.add_node(num_cpus=1, resources={"duoserve_prefill": 1}),
             "decode": c.add_node(num_cpus=1, resources={"duoserve_decode": 1})}
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def namespace(cluster, request):
    """A namespace of its own for each test; its engines are removed after it (they hold the
    nodes' duoserve resources)."""
    name = request.node.name.replace("_", "-")[:40]
    yield ClusterConfig(kind="ray", ray_address=cluster[0].address, ray_namespace=name)
    stop_engines(ClusterConfig(kind="ray", ray_address=cluster[0].address, ray_namespace=name))


async def _up(engine: AsyncEngine, within: float) -> float:
    start = time.monotonic()
    while not engine.ready:
        assert time.monotonic() - start < within, engine.not_ready_reason()
        await asyncio.sleep(0.1)
    return time.monotonic() - start


async def _settled_stats(engine: AsyncEngine, within: float = 15.0) -> dict:
    """Stats once every engine holds no request and no KV (fails after ``within``)."""
    start = time.monotonic()
    while True:
        await asyncio.sleep(0.3)
        stats = dict(engine.stats)
        if len(stats) == len(engine.clients) and all(
                s.num_running == s.num_waiting == s.num_kv_leased == 0 and s.kv_cache_usage == 0
                for s in stats.values()):
            return stats
        assert time.monotonic() - start < within, stats


def test_engines_land_on_their_nodes_and_hand_kv_over_tcp(cluster, namespace, tiny_dir, disagg_reference):
    _, nodes = cluster
    config = engine_config(tiny_dir(kind="llama"))

    async def main():
        tcp = AsyncEngine(config, disagg=dataclasses.replace(DISAGG, kv_transport="tcp"), cluster=namespace)
        await tcp.start()
        try:
            outs = await generate_all(tcp, prompts(), GREEDY)
            stats = await _settled_stats(tcp)
            (decode,), (prefill,) = tcp.decode_clients, tcp.prefill_clients
            placed = {"decode": decode.info["node_id"], "prefill": prefill.info["node_id"]}
            tcp_peers = dict(prefill.peers)
            decode_address = decode.address
        finally:
            await tcp.shutdown()
        # the same engines through a frontend that lets same-host engines use shared memory
        shm = AsyncEngine(config, disagg=DISAGG, cluster=namespace)
        await shm.start()
        try:
            shm_outs = await generate_all(shm, prompts()[:3], GREEDY)
            shm_peers = dict(shm.prefill_clients[0].peers)
            same_engine = shm.decode_clients[0].info["pid"] == decode.info["pid"]
        finally:
            await shm.shutdown()
        return outs, stats, placed, tcp_peers, decode_address, shm_outs, shm_peers, same_engine

    outs, stats, placed, tcp_peers, decode_address, shm_outs, shm_peers, same_engine = asyncio.run(main())
    assert placed == {"decode": nodes["decode"].node_id, "prefill": nodes["prefill"].node_id}
    assert tcp_peers == {"decode-0": decode_address} and decode_address.startswith("tcp://")
    assert_same(outs, disagg_reference[0])
    assert stats["prefill-0"].kv_transfer_bytes > 0, "every prompt's KV crossed from the prefill node"
    assert same_engine and shm_peers["decode-0"].startswith("ipc://")
    assert_same(shm_outs, disagg_reference[0][:3])


def test_frontends_share_the_engines_and_a_new_one_finds_them(namespace, tiny_dir, disagg_reference):
    config = engine_config(tiny_dir(kind="llama"))
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def aborted_early(engine: AsyncEngine, request_id: str) -> int:
        count = 0
        async for out in engine.generate([1, 2, 3], long, request_id):
            count = len(out.outputs[0].token_ids)
            if count >= 3:
                break   # the consumer goes away: the request is aborted in the engines
        return count

    async def full(engine: AsyncEngine, request_id: str) -> list[int]:
        final = None
        async for out in engine.generate([1, 2, 3], long, request_id):
            final = out
        return final.outputs[0].token_ids

    async def main():
        a = AsyncEngine(config, disagg=DISAGG, cluster=namespace)
        b = AsyncEngine(config, disagg=DISAGG, cluster=namespace)
        await asyncio.gather(a.start(), b.start())
        instances = {e.frontend_id: [c.ready.instance_id for c in e.clients] for e in (a, b)}
        # both frontends at once, with the same request ids ("r0", ...) and the same id "x":
        # a's "x" is aborted early, b's runs to its end
        outs_a, outs_b, _, tokens_b = await asyncio.gather(
            generate_all(a, prompts(), GREEDY), generate_all(b, prompts(), GREEDY),
            aborted_early(a, "x"), full(b, "x"))
        await a.shutdown()
        c = AsyncEngine(config, disagg=DISAGG, cluster=namespace)
        await c.start()
        found = [client.ready.instance_id for client in c.clients]
        outs_c = await generate_all(c, prompts()[:2], GREEDY)
        stats = await _settled_stats(c)
        await asyncio.gather(b.shutdown(), c.shutdown())
        return instances, outs_a, outs_b, tokens_b, found, outs_c, stats

    instances, outs_a, outs_b, tokens_b, found, outs_c, stats = asyncio.run(main())
    first, second = instances.values()
    assert first == second == found, "every frontend reaches the same engines (same instances)"
    assert_same(outs_a, disagg_reference[0])
    assert_same(outs_b, disagg_reference[0])
    assert len(tokens_b) == 400, "the other frontend's abort of the same request id left this one alone"
    assert_same(outs_c, disagg_reference[0][:2])
    assert stats["decode-0"].kv_cache_usage == 0


def test_a_decode_node_removed_mid_stream_its_requests_wait_and_go_on_on_its_successor(cluster, namespace, tiny_dir,
                                                                                      disagg_reference):
    c, nodes = cluster
    config = engine_config(tiny_dir(kind="llama"))
    long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)

    async def stream(engine: AsyncEngine, request_id: str, started: asyncio.Event) -> tuple[str, float]:
        try:
            async for out in engine.generate([7, 8, 9], long, request_id):
                if out.outputs[0].token_ids:
                    started.set()
        except EngineUnavailableError as exc:
            return str(exc), time.monotonic()
        return "finished", time.monotonic()

    async def main():
        engine = AsyncEngine(config, disagg=DISAGG, cluster=namespace)
        await engine.start()
        try:
            old = dict(engine.decode_clients[0].info)
            events = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.create_task(stream(engine, f"s{i}", e)) for i, e in enumerate(events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            removed_at = time.monotonic()
            c.remove_node(nodes["decode"])
            for _ in range(200):   # noticed: no decode engine is up
                if not engine.accepting:
                    break
                await asyncio.sleep(0.05)
            noticed = time.monotonic() - removed_at
            nodes["decode"] = c.add_node(num_cpus=1, resources={"duoserve_decode": 1})
            results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
            back_after = await _up(engine, within=120)
            after = await generate_all(engine, prompts()[:3], GREEDY)
            first_success = time.monotonic() - removed_at
            new = dict(engine.decode_clients[0].info)
            stats = await _settled_stats(engine)
            return old, new, results, noticed, back_after, after, first_success, stats
        finally:
            await engine.shutdown()

    old, new, results, noticed, back_after, after, first_success, stats = asyncio.run(main())
    assert noticed < 5.0, f"the lost node noticed {noticed:.1f} s after it was removed"
    for message, _ in results:
        assert message == "finished", "a request waits for the relaunched engine and goes on there"
    assert new["node_id"] == nodes["decode"].node_id != old["node_id"] and new["address"] != old["address"]
    assert_same(after, disagg_reference[0][:3])
    assert stats["prefill-0"].num_kv_leased == 0 and stats["prefill-0"].kv_cache_usage == 0, \
        "no block of the dead engine's requests left on the prefill side"
    print(f"node removed -> noticed in {noticed:.2f} s; first new success after {first_success:.1f} s")


def test_another_configuration_or_a_failed_start_is_refused_by_name(namespace, tiny_dir, tmp_path):
    from duoserve.frontend.engine_client import EngineStartError

    config = engine_config(tiny_dir(kind="llama"))

    async def main():
        running = AsyncEngine(config, cluster=namespace)
        await running.start()
        try:
            other = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"))
            with pytest.raises(EngineStartError) as mismatch:
                await AsyncEngine(other, cluster=namespace).start()
            serves = await generate_all(running, prompts()[:1], GREEDY)
        finally:
            await running.shutdown()
        stop_engines(namespace)
        missing = dataclasses.replace(config, model=dataclasses.replace(config.model, model=str(tmp_path / "none")))
        with pytest.raises(EngineStartError) as failed:
            await AsyncEngine(missing, cluster=namespace).start()
        return mismatch.value, serves, failed.value

    mismatch, serves, failed = asyncio.run(main())
    assert mismatch.config_error and "model.dtype: 'float32' there, 'bfloat16' here" in str(mismatch)
    assert "duoserve ray-stop --ray-namespace" in str(mismatch)
    assert len(serves[0].token_ids) == 16, "the refused frontend left the engines serving"
    assert failed.config_error and f"model='{tmp_path / 'none'}' is not allowed" in str(failed)
    with pytest.raises(ValueError):   # removed, so that a corrected start makes a fresh one
        ray.get_actor("duoserve-engine-0", namespace=namespace.ray_namespace)


def test_two_api_servers_share_the_engines_until_ray_stop(cluster, namespace, tiny_dir, tmp_path):
    """Two `duoserve serve --cluster ray` behind a load balancer: both serve from the same
    engines, one stopping leaves the other serving, and `duoserve ray-stop` removes the engines."""
    import httpx

    from duoserve.cli import main as cli_main
    from tests.server_helpers import Server

    args = ("--cluster", "ray", "--ray-address", namespace.ray_address, "--ray-namespace", namespace.ray_namespace,
            "--mode", "disaggregated", "--model", str(tiny_dir(kind="llama")), "--dtype", "float32",
            "--kv-cache-memory", "0.01", "--prefill-threads", "1", "--decode-threads", "1")
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    first = Server(*args, log=tmp_path / "first.log")
    second = Server(*args, log=tmp_path / "second.log")
    try:
        answers = [httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json() for srv in (first, second)]
        first.stop()
        still = httpx.post(f"{second.url}/v1/completions", json=body, timeout=60).json()
        assert cli_main(["ray-stop", "--ray-address", namespace.ray_address,
                         "--ray-namespace", namespace.ray_namespace]) == 0
        deadline = time.monotonic() + 15
        while httpx.get(f"{second.url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "the frontend noticed its engines were removed"
            time.sleep(0.2)
    finally:
        first.stop()
        second.stop()
    assert all("choices" in a for a in (*answers, still)), (answers, still)
    chosen = [a["choices"][0]["logprobs"]["token_logprobs"] for a in (*answers, still)]
    assert len(chosen[0]) == 16 and chosen[0] == chosen[1] == chosen[2]
    tokens = answers[0]["choices"][0]["logprobs"]["tokens"]   # the tiny model has no tokenizer: ids
    assert all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens)
    assert all(a["usage"]["completion_tokens"] == 16 for a in (*answers, still))


def test_cluster_settings_and_node_commands():
    from duoserve.errors import ConfigError
    from duoserve.frontend.ray_cluster import node_resources, ray_start_command

    with pytest.raises(ConfigError, match="cluster.*one of local, ray"):
        ClusterConfig(kind="k8s")
    with pytest.raises(ConfigError, match="ray_address.*only with --cluster ray"):
        ClusterConfig(ray_address="auto")
    with pytest.raises(ConfigError, match="ray_namespace"):
        ClusterConfig(kind="ray", ray_namespace="a b")
    assert node_resources("both", 2) == {"duoserve_prefill": 2, "duoserve_decode": 2}
    command = ray_start_command("decode", 1, "10.0.0.1:6379", ["--num-cpus", "8"])
    assert command[1:] == ["start", "--address=10.0.0.1:6379", '--resources={"duoserve_decode": 1}',
                           "--num-cpus", "8"]
    assert ray_start_command("prefill", 1, None, [])[2:4] == ["--head", "--include-dashboard=false"]
