"""Shared-memory KV segments never outlive the handoff: the receiver unlinks what it
takes, the sender what its lease gave up on, an engine at start what dead processes left."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from multiprocessing import shared_memory

import torch
import zmq

from duoserve import messages as msg
from duoserve.kv import zmq_connector
from duoserve.kv.connector import KVTransfer
from duoserve.kv.zmq_connector import SEGMENT_PREFIX, PrefillConnector, sweep_orphaned_segments
from duoserve.sampling_params import SamplingParams


def _segments() -> set[str]:
    return {n for n in os.listdir(zmq_connector.SHM_DIR) if n.startswith(SEGMENT_PREFIX)}


def _make(name: str) -> None:
    segment = shared_memory.SharedMemory(name=name, create=True, size=64)
    zmq_connector._untrack(segment)
    segment.close()


def test_segments_of_dead_processes_are_unlinked_at_start():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    orphan, ours = f"{SEGMENT_PREFIX}{dead_pid}-0a0a0a", f"{SEGMENT_PREFIX}{os.getpid()}-0b0b0b"
    _make(orphan)
    _make(ours)
    try:
        assert sweep_orphaned_segments() == [orphan]
        assert orphan not in _segments() and ours in _segments(), "a live creator's segment stays"
    finally:
        zmq_connector._unlink_segment(ours)
        zmq_connector._unlink_segment(orphan)


def _transfer(request_id: str) -> KVTransfer:
    kv = [torch.zeros(3, 1, 4)]
    meta = msg.TransferMeta(request_id, [1, 2, 3], SamplingParams(), [0], 8, 0.0, first_token=5)
    return KVTransfer(meta, kv, kv, peer="decode-0")


def test_the_sender_unlinks_what_no_decode_engine_took():
    ctx = zmq.Context.instance()
    path = os.path.join(tempfile.gettempdir(), f"duoserve-test-{os.getpid()}-segments")
    receiver = ctx.socket(zmq.ROUTER)
    receiver.bind(f"ipc://{path}")
    connector = PrefillConnector(b"\0" * 32, {})
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"ipc://{path}")
    connector.peers, connector.addresses = {"decode-0": dealer}, {"decode-0": f"ipc://{path}"}
    try:
        before = _segments()
        connector.send(_transfer("acked"))
        connector.send(_transfer("never-acked"))
        sent = {rid: name for rid, (name, _) in connector.segments.items()}
        assert set(sent) == {"acked", "never-acked"} and _segments() - before == set(sent.values())
        # the receiver takes one (reads, unlinks, acknowledges)
        identity = receiver.recv_multipart()[0]
        zmq_connector._unlink_segment(sent["acked"])
        receiver.send_multipart([identity, msg.encode(msg.TransferAck("acked"))])
        assert dealer.poll(2000)
        assert connector.poll_acks() == ["acked"]
        assert connector.sweep(max_age=60) == 0, "within its lease a segment stays"
        assert connector.sweep(max_age=0) == 1
        assert _segments() == before and connector.segments == {}
        connector.send(_transfer("at-close"))
        connector.close()
        assert _segments() == before, "a stopping engine unlinks what it still holds"
    finally:
        receiver.close(linger=0)
        os.unlink(path)


def test_socket_files_of_dead_frontends_are_removed(tmp_path):
    import socket as pysocket

    from duoserve.frontend.launcher import sweep_orphaned_sockets

    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                  capture_output=True, text=True).stdout)
    paths = {name: tmp_path / name for name in (f"duoserve-{dead_pid}-ab-engine-0", f"duoserve-{os.getpid()}-cd-engine-0")}
    for path in paths.values():
        pysocket.socket(pysocket.AF_UNIX).bind(str(path))
    (tmp_path / f"duoserve-{dead_pid}-not-a-socket").write_text("")
    (tmp_path / f"duoserve-{dead_pid}-ef-turns").write_bytes(bytes(48))          # its core turns file
    (tmp_path / f"duoserve-{os.getpid()}-gh-turns").write_bytes(bytes(48))
    assert sorted(sweep_orphaned_sockets(str(tmp_path))) == [f"duoserve-{dead_pid}-ab-engine-0",
                                                             f"duoserve-{dead_pid}-ef-turns"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"duoserve-{os.getpid()}-cd-engine-0",
                                                                 f"duoserve-{os.getpid()}-gh-turns",
                                                                 f"duoserve-{dead_pid}-not-a-socket"])
