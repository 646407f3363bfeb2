"""An engine as a Ray actor (``duoserve serve --cluster ray``).

Ray places the actor on a node that has its role's resource and starts it there; the actor
runs the same engine loop as ``duoserve prefill|decode --listen`` (``engine_main``) in a
thread of its own process. Nothing of the engine's traffic goes through Ray: the engine
listens on a TCP port of its node's address (for frontends and prefill engines on other
hosts) and on an ``ipc://`` path (prefill engines on its own host hand it KV through shared
memory). Ray gives placement, discovery (``info``: the addresses, the host, the config it
runs) and restarts: the actor exits when its engine stops serving, and Ray starts it again
where the resources allow, at a new address.

The class is plain Python: ``duoserve.frontend.ray_cluster`` wraps it in ``ray.remote``, so
importing this module imports neither Ray nor torch.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import uuid

logger = logging.getLogger(__name__)


def host_id() -> str:
    """One name per machine (and boot): engines with the same one share ``/dev/shm``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _with_threads(config_bytes: bytes) -> bytes:
    """No thread count given: every core this process may use (Ray sets OMP_NUM_THREADS to the
    actor's CPU reservation, 1 by default, which would be torch's default here)."""
    import msgspec

    config = msgspec.msgpack.decode(config_bytes)
    if config.get("num_threads") is None:
        config["num_threads"] = len(os.sched_getaffinity(0))
    return msgspec.msgpack.encode(config)


class EngineActor:
    """One engine on a Ray node, serving from the moment it is created until it is killed."""

    def __init__(self, name: str, config_bytes: bytes, auth_secret: bytes | None,
                 log_level: int = logging.INFO) -> None:
        import ray

        from duoserve.engine.process import engine_main

        node_ip = ray.util.get_node_ip_address()
        self.name = name
        self.config_bytes = config_bytes
        self.auth_secret = auth_secret
        self.address = f"tcp://{node_ip}:{_free_port(node_ip)}"
        path = os.path.join(tempfile.gettempdir(), f"duoserve-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}")
        self.ipc_address = f"ipc://{path}"
        self.node_id = ray.get_runtime_context().get_node_id()
        self.host = host_id()
        self.failure: tuple[str, bool] | None = None   # (reason, is a config error) when it cannot start
        self.thread = threading.Thread(
            target=self._serve, name=f"duoserve-{name}", daemon=True,
            args=(engine_main, _with_threads(config_bytes), [self.address, self.ipc_address], log_level))
        self.thread.start()

    def _serve(self, engine_main, config_bytes: bytes, addresses: list[str], log_level: int) -> None:
        try:
            engine_main(config_bytes, addresses, log_level, auth_secret=self.auth_secret,
                        on_start_failure=self._failed, name=self.name)
        except BaseException:
            logger.exception("%s stopped", self.name)
        if self.failure is None:
            # it served and stopped (a fault): exiting hands the restart to Ray; one that could
            # not start stays, so that every frontend can read why (``info``) until it is removed
            logger.error("%s stopped serving: exiting, Ray restarts it", self.name)
            os._exit(1)

    def _failed(self, reason: str, config_error: bool) -> None:
        self.failure = (reason, config_error)

    def info(self) -> dict:
        """Where the engine listens, where it runs, what it runs."""
        return {"name": self.name, "address": self.address, "ipc_address": self.ipc_address,
                "host": self.host, "node_id": self.node_id, "pid": os.getpid(),
                "config": self.config_bytes, "failure": self.failure}

    def auth_secret_key(self) -> bytes | None:
        """The deployment key it was created with (for frontends started without a key file:
        whoever can call this can already run any code on the cluster)."""
        return self.auth_secret
