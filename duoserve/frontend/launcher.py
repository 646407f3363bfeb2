"""Which engines a frontend drives, and where each listens.

Colocated: the engines this frontend launches (``--num-engines``, one by default; several
split this host's cores between them unless ``--num-threads`` says otherwise). Disaggregated: the decode and prefill
engines at ``--decode-addrs`` / ``--prefill-addrs`` (started elsewhere with ``duoserve
decode|prefill --listen``), or else ``--num-decode-engines`` / ``--num-prefill-engines``
launched here. Launched engines listen on ``ipc://`` paths (KV then moves through
shared memory), or on TCP ports of ``engine_host`` with ``--kv-transport tcp`` or when
any engine is remote (a remote engine cannot reach an ``ipc://`` path).

The launcher also starts the process of every engine launched here (``spawn_engine``) and
kills it (``kill_engine``); when to do either is the supervisor's call
(``duoserve.frontend.supervisor``). With ``--cluster ray`` the engines are Ray actors
instead (``duoserve.frontend.ray_cluster``).

Every engine gets the deployment's auth key (``--auth-key-file``); when none is given and
every engine is launched here, they share a fresh key that never leaves this process tree.

Engines launched on one host share its cores. Unless a ``--prefill-*``/``--decode-*``
threads or CPUs flag says otherwise, every engine of a role uses every core (several of one
role split them) and the roles take turns on them (``--core-sharing turns``,
``duoserve.engine.cpu_turns``: a shared file this launcher creates and removes), or the
cores are split between the roles (``split``, see ``split_cores``). Never two engines spinning
OpenMP threads on the same cores at once: they would stall each other at every barrier.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import tempfile
import time
import uuid

import msgspec

from duoserve.config import ClusterConfig, DisaggConfig, EngineConfig, TurnsConfig
from duoserve.errors import ConfigError
from duoserve.engine.cpu_turns import create_turns_file
from duoserve.engine.process import launched_engine_main
from duoserve.frontend.engine_client import FRONTEND_ID, EngineClient, process_running
from duoserve.frontend.ray_cluster import plan_ray_engines
from duoserve.transport.auth import AuthKey, check_listen, load_key


def _ipc_address(name: str) -> str:
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'duoserve-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}')}"


def sweep_orphaned_sockets(directory: str | None = None) -> list[str]:
    """Remove the ``ipc://`` socket files (and core turn files) of frontends that died without
    shutting down."""
    import stat

    directory = directory or tempfile.gettempdir()
    swept = []
    for name in os.listdir(directory):
        pid = name[len("duoserve-"):].partition("-")[0] if name.startswith("duoserve-") else ""
        path = os.path.join(directory, name)
        try:
            mode = os.lstat(path).st_mode
            ours = stat.S_ISSOCK(mode) or (stat.S_ISREG(mode) and name.endswith("-turns"))
            if not pid.isdigit() or not ours or os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            os.unlink(path)
            swept.append(name)
        except OSError:
            continue
    return swept


def _tcp_address(host: str) -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def share_cores(cpus: list[int], count: int) -> list[tuple[int, ...]]:
    """``cpus`` cut into ``count`` contiguous runs, as even as they divide."""
    return [tuple(cpus[len(cpus) * i // count: len(cpus) * (i + 1) // count]) for i in range(count)]


def split_cores(cpus: list[int], num_prefill: int, num_decode: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Disjoint CPU sets for each launched engine: decode engines share the first half of the
    cores (at least one each), prefill engines the rest, each engine a contiguous run. With
    fewer cores than engines, every engine gets all of them (the caller then gives each one
    thread). 2 cores, one engine per role: prefill on CPU 0, decode on CPU 1."""
    num_engines = num_prefill + num_decode
    if len(cpus) < num_engines or num_prefill == 0 or num_decode == 0:
        every = tuple(cpus)
        return [every] * num_prefill, [every] * num_decode
    num_for_decode = max(num_decode, len(cpus) // 2)
    num_for_decode = min(num_for_decode, len(cpus) - num_prefill)
    return share_cores(cpus[num_for_decode:], num_prefill), share_cores(cpus[:num_for_decode], num_decode)


def _taking_turns(prefill: list[EngineConfig], decode: list[EngineConfig], cpus: list[int],
                  quantum: float) -> tuple[list[EngineConfig], list[EngineConfig]]:
    """Each role's engines split every core among themselves, and the roles take turns on them."""
    path = os.path.join(tempfile.gettempdir(), f"duoserve-{os.getpid()}-{uuid.uuid4().hex[:8]}-turns")
    create_turns_file(path, len(prefill) + len(decode))
    slots = iter(range(len(prefill) + len(decode)))

    def share(configs: list[EngineConfig]) -> list[EngineConfig]:
        oversubscribed = len(cpus) < len(configs)
        return [dataclasses.replace(_pinned(config, cores, oversubscribed),
                                    turns=TurnsConfig(path, next(slots), quantum))
                for config, cores in zip(configs, share_cores(cpus, len(configs)))]

    return share(prefill), share(decode)


def remove_turns_file(clients: list[EngineClient]) -> None:
    """After the launched engines stopped: the file they took turns through, if they had one."""
    for client in clients:
        turns = client.config.turns if client.config is not None else None
        if turns is not None and os.path.exists(turns.path):
            os.unlink(turns.path)


def _pinned(config: EngineConfig, cpus: tuple[int, ...], oversubscribed: bool) -> EngineConfig:
    if oversubscribed:
        return dataclasses.replace(config, num_threads=1)
    return dataclasses.replace(config, num_threads=len(cpus), cpus=cpus)


def deployment_key(disagg: DisaggConfig | None) -> AuthKey | None:
    """The key given (file or environment); else a fresh one when every engine is launched here."""
    key = load_key(disagg.auth_key_file if disagg else None)
    if key is None and not (disagg and (disagg.prefill_addrs or disagg.decode_addrs)):
        key = AuthKey.generate()
    return key


def _events_of(config: EngineConfig, index: int) -> EngineConfig:
    """Engine ``index`` of the deployment publishes its KV events on ports of its own."""
    if config.kv_events is None:
        return config
    return dataclasses.replace(config, kv_events=config.kv_events.for_engine(index))


def plan_engines(config: EngineConfig, disagg: DisaggConfig | None, frontend_id: str = FRONTEND_ID,
                 num_engines: int = 1) -> tuple[list[EngineClient], list[EngineClient]]:
    """(decode engines, prefill engines) as clients, not yet started."""
    key = deployment_key(disagg)
    sweep_orphaned_sockets()
    if disagg is None:
        configs = [config] * num_engines
        if num_engines > 1 and config.num_threads is None and config.cpus is None:
            cpus = sorted(os.sched_getaffinity(0))
            oversubscribed = len(cpus) < num_engines
            shares = share_cores(cpus, num_engines)
            configs = [_pinned(config, () if oversubscribed else c, oversubscribed) for c in shares]
        configs = [_events_of(c, i) for i, c in enumerate(configs)]
        return [EngineClient(f"engine-{i}", _ipc_address(f"engine-{i}"), c, key=key, frontend_id=frontend_id)
                for i, c in enumerate(configs)], []
    prefill_config, decode_config = disagg.engine_configs(config)
    tcp = disagg.kv_transport == "tcp" or bool(disagg.prefill_addrs or disagg.decode_addrs)
    num_prefill = 0 if disagg.prefill_addrs else disagg.num_prefill_engines
    num_decode = 0 if disagg.decode_addrs else disagg.num_decode_engines
    prefill_configs, decode_configs = [prefill_config] * num_prefill, [decode_config] * num_decode
    if disagg.splits_cores_by_default and num_prefill and num_decode and disagg.core_sharing == "turns":
        prefill_configs, decode_configs = _taking_turns(prefill_configs, decode_configs,
                                                        sorted(os.sched_getaffinity(0)), disagg.prefill_turn)
    elif disagg.splits_cores_by_default and num_prefill and num_decode:
        cpus = sorted(os.sched_getaffinity(0))
        oversubscribed = len(cpus) < num_prefill + num_decode
        prefill_cpus, decode_cpus = split_cores(cpus, num_prefill, num_decode)
        prefill_configs = [_pinned(prefill_config, c, oversubscribed) for c in prefill_cpus]
        decode_configs = [_pinned(decode_config, c, oversubscribed) for c in decode_cpus]
    decode_configs = [_events_of(c, i) for i, c in enumerate(decode_configs)]
    prefill_configs = [_events_of(c, len(decode_configs) + i) for i, c in enumerate(prefill_configs)]

    def address(name: str) -> str:
        if not tcp:
            return _ipc_address(name)
        check_listen(f"tcp://{disagg.engine_host}:0", key, disagg.insecure_no_auth)
        return _tcp_address(disagg.engine_host)

    def client(name: str, addr: str, launch: EngineConfig | None = None, **kw) -> EngineClient:
        return EngineClient(name, addr, launch, key=key, frontend_id=frontend_id, **kw)

    if disagg.decode_addrs:
        decode = [client(f"decode-{i}", a) for i, a in enumerate(disagg.decode_addrs)]
    else:
        decode = [client(f"decode-{i}", address(f"decode-{i}"), c) for i, c in enumerate(decode_configs)]
    peers = {c.name: c.address for c in decode}
    if disagg.prefill_addrs:
        prefill = [client(f"prefill-{i}", a, peers=peers) for i, a in enumerate(disagg.prefill_addrs)]
    else:
        prefill = [client(f"prefill-{i}", address(f"prefill-{i}"), c, peers=peers)
                   for i, c in enumerate(prefill_configs)]
    return decode, prefill


def plan_deployment(config: EngineConfig, disagg: DisaggConfig | None, cluster: ClusterConfig | None,
                    frontend_id: str) -> tuple[list[EngineClient], list[EngineClient]]:
    """(decode engines, prefill engines) of a deployment: launched here, or Ray actors."""
    if cluster is not None and cluster.kind == "ray":
        return plan_ray_engines(config, disagg, cluster, frontend_id)
    num_engines = 1 if cluster is None else cluster.num_engines
    if disagg is not None and num_engines != 1:
        raise ConfigError("num_engines", num_engines, "1 with --disagg (use --num-decode-engines)")
    return plan_engines(config, disagg, frontend_id, num_engines)


# What every engine imports (torch, the model and kernel code: seconds of a start) is imported
# once, in a fork server started with the first engine; each engine is a fork of that server:
# a fresh process (none of this process's sockets or threads) that starts with those imports
# done. The server runs no torch op before it forks, so no thread pool is copied half-made.
ENGINE_PRELOAD = ["duoserve.engine.process", "duoserve.engine.builder"]


def engine_process_context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(ENGINE_PRELOAD)
    return context


def start_engine_server() -> None:
    """Start the fork server now: its imports take a second or two, which the caller's own
    imports (the web server's) then overlap instead of preceding. It ends with this process, or
    when the engines are up (``stop_engine_server``)."""
    engine_process_context()
    multiprocessing.forkserver.ensure_running()


def stop_engine_server() -> None:
    """Stop the fork server once the engines it forked are up: it would hold its own copy of
    their imports (torch and the model code: 161 MB of PSS beside Gemma 3 270M's engine) for
    nothing until an engine must be launched again, which starts a new one (a relaunch then
    waits for its imports, a second or two). The engines watch this process, not the fork
    server, and become its children (``adopt_orphans``)."""
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None and hasattr(server, "_stop"):
        server._stop()   # closes the pipe it waits on and waits for it (multiprocessing's own way)


PR_SET_CHILD_SUBREAPER = 36   # prctl's option (linux/prctl.h)


def adopt_orphans() -> None:
    """Make this process the parent of the processes its children leave behind (Linux's child
    subreaper): the engines, once their fork server is stopped, stay in this process's tree,
    and this process reaps them (``process_running``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):   # not Linux: orphans go to init, which reaps them
        pass


def spawn_engine(client: EngineClient) -> None:
    """Start the process of an engine this frontend launches (``client.config``); the client watches it."""
    adopt_orphans()
    process = engine_process_context().Process(
        target=launched_engine_main, name=f"duoserve-{client.name}", daemon=True,
        args=(client.name, dict(os.environ), msgspec.msgpack.encode(client.config), client.address,
              logging.getLogger().getEffectiveLevel() or logging.INFO, os.getpid(),
              None if client.key is None else client.key.secret))
    process.start()
    client.process = process


def engine_running(client: EngineClient) -> bool:
    return client.process is not None and process_running(client.process)


def signal_engine(client: EngineClient, sig: int) -> None:
    if engine_running(client):
        os.kill(client.process.pid, sig)


def kill_engine(client: EngineClient) -> None:
    """Kill a launched engine's process if it still runs, and reap it."""
    if client.process is not None:
        signal_engine(client, signal.SIGKILL)
        client.process.join(timeout=5)   # its fork server reports its end, where it still runs
        deadline = time.monotonic() + 5
        while process_running(client.process) and time.monotonic() < deadline:   # else reaped here
            time.sleep(0.01)


def remove_socket(client: EngineClient) -> None:
    """After a launched engine stopped: its ``ipc://`` socket file, if it left one."""
    path = client.address[len("ipc://"):]
    if client.launched and client.address.startswith("ipc://") and os.path.exists(path):
        os.unlink(path)
