"""Engines placed, found and restarted by a Ray cluster (``duoserve serve --cluster ray``).

Each engine is a detached, named Ray actor (``duoserve.engine.ray_actor``) in the
deployment's namespace (``--ray-namespace``): ``duoserve-decode-0``, ``duoserve-prefill-0``
(``duoserve-engine-0`` colocated). A frontend gets each one by name, creating it when it
does not exist yet (atomically: two frontends starting together get the same actor), on a
node that advertises the role's resource: ``duoserve_prefill`` or ``duoserve_decode`` (a
colocated engine takes a ``duoserve_decode``), plus a GPU when the role's device is CUDA.
``duoserve ray-node --role`` starts such a node.

What Ray does: placement, discovery (the actor tells its addresses, host and config),
health of nodes, and restarts (``max_restarts=-1``: an engine whose node died comes back on
another node with the resource, at a new address). What it does not: KV and requests keep
duoserve's own paths (ZeroMQ, shared memory between engines of one host, TCP otherwise),
with the same fingerprints, leases and failure rules as engines launched on one host.

The engines outlive their frontends: a frontend that stops (or dies) leaves them serving
the others, and the next frontend finds them by name. ``duoserve ray-stop`` removes them.
A frontend refuses engines that run another configuration than it asks for (it names the
fields). Without ``--auth-key-file`` the first frontend makes a key and the engines keep
it; later frontends read it from them through Ray, whose callers can run any code on the
cluster anyway (give a key file to make the engines' sockets independent of Ray's security).
"""

from __future__ import annotations

import asyncio
import logging
import os

import msgspec

from duoserve.config import ClusterConfig, DisaggConfig, EngineConfig, Role
from duoserve.errors import ConfigError
from duoserve.frontend.engine_client import EngineClient, EngineDeadError, EngineStartError
from duoserve.transport.auth import AuthKey, load_key

logger = logging.getLogger(__name__)

RESOURCES = {Role.PREFILL: "duoserve_prefill", Role.DECODE: "duoserve_decode", Role.COLOCATED: "duoserve_decode"}
ACTOR_PREFIX = "duoserve-"
LOCATE_TIMEOUT_S = 30.0    # one ask of an actor for its address (placing it starts a worker process)
TESTED_RAY = "2.60.0"


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("cluster", "ray", "an installed Ray: pip install 'duoserve[ray]'") from None
    return ray


def connect(cluster: ClusterConfig, disagg: DisaggConfig | None = None) -> None:
    """Join the cluster at ``--ray-address``, or start a Ray instance on this host whose one
    node has the resources of every engine asked for."""
    ray = _ray()
    if ray.is_initialized():
        return
    kwargs = dict(namespace=cluster.ray_namespace, log_to_driver=False, configure_logging=False)
    if cluster.ray_address is None:
        num_prefill = disagg.num_prefill_engines if disagg else 0
        num_decode = disagg.num_decode_engines if disagg else 1
        resources = {RESOURCES[Role.PREFILL]: num_prefill, RESOURCES[Role.DECODE]: num_decode}
        ray.init(resources={k: v for k, v in resources.items() if v}, include_dashboard=False, **kwargs)
    else:
        ray.init(address=cluster.ray_address, **kwargs)
    logger.info("joined Ray cluster (namespace %s): %s", cluster.ray_namespace,
                ", ".join(f"{k} {v:g}" for k, v in sorted(ray.cluster_resources().items())
                          if k in ("CPU", "GPU") or k.startswith("duoserve_")))


def _differences(ours: EngineConfig, theirs: dict) -> list[str]:
    mine = msgspec.msgpack.decode(msgspec.msgpack.encode(ours))   # as theirs came: a tuple is a list

    def walk(a, b, path: str) -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [d for k in sorted(set(a) | set(b)) for d in walk(a.get(k), b.get(k), f"{path}{k}.")]
        return [] if a == b else [f"{path[:-1]}: {b!r} there, {a!r} here"]

    return walk(mine, theirs, "")


class RayEngineClient(EngineClient):
    """An engine held by a Ray actor: found (or created) by name, asked for its address at
    every (re)connect, since Ray may have restarted it elsewhere."""

    def __init__(self, name: str, role: str, config: EngineConfig, cluster: ClusterConfig,
                 key: AuthKey | None, frontend_id: str, kv_transport: str = "shm") -> None:
        super().__init__(name, address="", key=key, frontend_id=frontend_id)
        self.role = role
        self.engine_config = config
        self.cluster = cluster
        self.kv_transport = kv_transport
        self.actor = None
        self.info: dict | None = None
        self.located = asyncio.Event()
        self.decode_peers: list[RayEngineClient] = []   # a prefill engine's decode engines

    @property
    def managed(self) -> bool:
        return True

    @property
    def actor_name(self) -> str:
        return ACTOR_PREFIX + self.name

    def _actor(self):
        ray = _ray()
        from duoserve.engine.ray_actor import EngineActor

        config = self.engine_config
        options = dict(name=self.actor_name, namespace=self.cluster.ray_namespace, lifetime="detached",
                       get_if_exists=True, max_restarts=-1, max_concurrency=4, num_cpus=config.num_threads or 1,
                       num_gpus=1 if config.model.device.startswith("cuda") else 0, resources={RESOURCES[self.role]: 1})
        return ray.remote(EngineActor).options(**options).remote(
            self.name, msgspec.msgpack.encode(config), None if self.key is None else self.key.secret,
            logging.getLogger().getEffectiveLevel() or logging.INFO)

    async def locate(self, timeout: float = LOCATE_TIMEOUT_S) -> dict:
        """Where the engine listens now; its failure to start, or another config, refused."""
        ray = _ray()
        if self.actor is None:
            self.actor = self._actor()
        try:
            info = await asyncio.wait_for(self.actor.info.remote(), timeout)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            reason = "no answer" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
            raise EngineDeadError(f"{self.name} (Ray actor {self.actor_name}) is not placed or not up yet "
                                  f"({reason} within {timeout:g} s; does a node have the {RESOURCES[self.role]} "
                                  "resource?)") from None
        if info["failure"] is not None:
            reason, config_error = info["failure"]
            self._remove()
            raise EngineStartError(f"{self.name} on Ray node {info['node_id'][:12]} failed to start: {reason}",
                                   config_error=config_error)
        differences = _differences(self.engine_config, msgspec.msgpack.decode(info["config"]))
        if differences:
            raise EngineStartError(
                f"{self.name} (Ray actor {self.actor_name} in namespace {self.cluster.ray_namespace}) runs another "
                f"configuration: {'; '.join(differences[:5])}. Stop it (duoserve ray-stop --ray-namespace "
                f"{self.cluster.ray_namespace}) or use another --ray-namespace", config_error=True)
        if self.key is None:
            secret = await self.actor.auth_secret_key.remote()
            self.key = None if secret is None else AuthKey.from_secret(secret, "auth_key")
        self.info, self.address = info, info["address"]
        self.located.set()
        return info

    def _remove(self) -> None:
        """An engine that cannot start goes: the next frontend (with the mistake mended) makes a fresh one."""
        _ray().kill(self.actor, no_restart=True)
        self.actor = None

    async def connect(self, timeout: float = 300.0) -> None:
        """Ask Ray where the engine is now, then connect as to any engine."""
        await self.locate()
        if self.decode_peers:   # a prefill engine hands KV to where its decode engines are now
            await asyncio.wait_for(asyncio.gather(*(d.located.wait() for d in self.decode_peers)), timeout)
            self.peers = self.current_peers()
        try:
            await super().connect(timeout)
        except EngineStartError as exc:   # its hello was answered with why it cannot start
            if exc.config_error and self.ready is None and self.actor is not None and \
                    (await self.actor.info.remote())["failure"] is not None:
                self._remove()
            raise

    def current_peers(self) -> dict[str, str]:
        return {d.name: d.kv_address_for(self) for d in self.decode_peers if d.info is not None}

    def kv_address_for(self, prefill: EngineClient) -> str:
        """Shared memory to a prefill engine on the same host (unless --kv-transport tcp), else TCP."""
        same_host = isinstance(prefill, RayEngineClient) and prefill.info is not None and \
            prefill.info["host"] == self.info["host"]
        return self.info["ipc_address"] if same_host and self.kv_transport == "shm" else self.info["address"]


def plan_ray_engines(config: EngineConfig, disagg: DisaggConfig | None, cluster: ClusterConfig,
                     frontend_id: str) -> tuple[list[EngineClient], list[EngineClient]]:
    """(decode engines, prefill engines) as clients of Ray actors, not yet located."""
    connect(cluster, disagg)
    key = load_key(cluster.auth_key_file)
    if disagg is None:
        return [RayEngineClient("engine-0", Role.COLOCATED, config, cluster, key, frontend_id)], []
    if disagg.prefill_addrs or disagg.decode_addrs:
        raise ConfigError("cluster", "ray", "engines found through Ray, not --prefill-addrs/--decode-addrs")
    prefill_config, decode_config = disagg.engine_configs(config)
    decode = [RayEngineClient(f"decode-{i}", Role.DECODE, decode_config, cluster, key, frontend_id, disagg.kv_transport)
              for i in range(disagg.num_decode_engines)]
    prefill = [RayEngineClient(f"prefill-{i}", Role.PREFILL, prefill_config, cluster, key, frontend_id,
                               disagg.kv_transport) for i in range(disagg.num_prefill_engines)]
    for client in prefill:
        client.decode_peers = decode
    return decode, prefill


def stop_engines(cluster: ClusterConfig) -> list[str]:
    """Kill every engine actor of the namespace (``duoserve ray-stop``); their names."""
    ray = _ray()
    connect(cluster)
    stopped = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == cluster.ray_namespace and entry["name"].startswith(ACTOR_PREFIX):
            ray.kill(ray.get_actor(entry["name"], namespace=cluster.ray_namespace), no_restart=True)
            stopped.append(entry["name"])
    return stopped


def node_resources(role: str, engines: int = 1) -> dict[str, int]:
    """The custom resources of a node that hosts ``engines`` engines of ``role`` (prefill, decode, both)."""
    roles = (Role.PREFILL, Role.DECODE) if role == "both" else (Role(role),)
    return {RESOURCES[r]: engines for r in roles}


def ray_start_command(role: str, engines: int, address: str | None, extra: list[str]) -> list[str]:
    """``duoserve ray-node``: the ``ray start`` line for a host of that role."""
    import json
    import shutil
    import sys

    ray_bin = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    head = ["--head", "--include-dashboard=false"] if address is None else [f"--address={address}"]
    return [ray_bin, "start", *head, f"--resources={json.dumps(node_resources(role, engines))}", *extra]
