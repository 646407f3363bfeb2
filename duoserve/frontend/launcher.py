"""Which engines a frontend drives, and where each listens.

Colocated: one engine this frontend launches. Disaggregated: the decode and prefill
engines at ``--decode-addrs`` / ``--prefill-addrs`` (started elsewhere with ``duoserve
decode|prefill --listen``), or else ``--num-decode-engines`` / ``--num-prefill-engines``
launched here. Launched engines listen on ``ipc://`` paths (KV then moves through
shared memory), or on TCP ports of ``engine_host`` with ``--kv-transport tcp`` or when
any engine is remote (a remote engine cannot reach an ``ipc://`` path).
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid

from duoserve.config import DisaggConfig, EngineConfig
from duoserve.frontend.engine_client import EngineClient


def _ipc_address(name: str) -> str:
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'duoserve-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}')}"


def _tcp_address(host: str) -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def plan_engines(config: EngineConfig, disagg: DisaggConfig | None) -> tuple[list[EngineClient], list[EngineClient]]:
    """(decode engines, prefill engines) as clients, not yet started."""
    if disagg is None:
        return [EngineClient("engine-0", _ipc_address("engine-0"), config)], []
    prefill_config, decode_config = disagg.engine_configs(config)
    tcp = disagg.kv_transport == "tcp" or bool(disagg.prefill_addrs or disagg.decode_addrs)

    def address(name: str) -> str:
        return _tcp_address(disagg.engine_host) if tcp else _ipc_address(name)

    if disagg.decode_addrs:
        decode = [EngineClient(f"decode-{i}", a) for i, a in enumerate(disagg.decode_addrs)]
    else:
        decode = [EngineClient(f"decode-{i}", address(f"decode-{i}"), decode_config)
                  for i in range(disagg.num_decode_engines)]
    peers = {c.name: c.address for c in decode}
    if disagg.prefill_addrs:
        prefill = [EngineClient(f"prefill-{i}", a, peers=peers) for i, a in enumerate(disagg.prefill_addrs)]
    else:
        prefill = [EngineClient(f"prefill-{i}", address(f"prefill-{i}"), prefill_config, peers=peers)
                   for i in range(disagg.num_prefill_engines)]
    return decode, prefill
