"""The connectors' interface declared (kv/connector.py): every connector has what its end's
Protocol names, and the engines are written against the Protocols."""

from __future__ import annotations

import inspect

import pytest

from duoserve.kv.connector import InProcessConnector, KVConnector, KVReceiver, KVSender, PeerSockets
from duoserve.kv.zmq_connector import DecodeConnector, PrefillConnector


def members(protocol) -> set[str]:
    names = {n for n, _ in inspect.getmembers(protocol, callable) if not n.startswith("_")}
    return names | set(getattr(protocol, "__annotations__", {}))


@pytest.mark.parametrize("cls, protocols", [
    (InProcessConnector, (KVSender, KVReceiver)),
    (PrefillConnector, (KVSender, PeerSockets)),
    (DecodeConnector, (KVReceiver, PeerSockets)),
])
def test_each_connector_has_its_ends_members(cls, protocols):
    source = inspect.getsource(cls)
    for protocol in protocols:
        for name in members(protocol):
            assert name in vars(cls) or f"self.{name}" in source, f"{cls.__name__} lacks {protocol.__name__}.{name}"


def test_the_in_process_connector_is_both_ends_at_run_time():
    connector = InProcessConnector()
    assert isinstance(connector, KVConnector) and isinstance(connector, KVSender)
    assert not isinstance(object(), KVReceiver)
    assert members(KVSender) == {"send", "poll_acks", "sweep", "last_transfer"}
    assert members(KVReceiver) == {"poll_transfers", "acknowledge"}
