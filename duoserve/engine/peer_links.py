"""What an engine process does with its KV peers: nothing (colocated), connect to the decode
engines its frontend names (prefill), take the transfers prefill engines send (decode). Chosen
once at start by role (``role_parts``); ``EngineServer`` (``process.py``) asks the one it was
given and never reads the role itself."""

from __future__ import annotations

import logging

from duoserve.config import Role

logger = logging.getLogger(__name__)


class NoPeers:
    """A colocated engine: no KV crosses processes."""

    role = Role.COLOCATED
    fingerprint_values: dict = {}   # what the engine's ready message states (its peers check it)

    def receive(self, identity: bytes, message, frames) -> bool:
        """A transfer or a peer's hello reached an engine that takes none: dropped. True when a
        transfer came in (the engine then steps even with nothing else to do)."""
        logger.error("a %s engine got %s: dropped", self.role, type(message).__name__)
        return False

    def on_hello(self, hello) -> None:
        """A frontend said hello (``hello.name``, ``hello.peers``); raises when its peers cannot be reached."""


class _Peers(NoPeers):
    def __init__(self, core) -> None:
        from duoserve.kv.zmq_connector import sweep_orphaned_segments
        from duoserve.model.fingerprint import fingerprint

        sweep_orphaned_segments()
        self.fingerprint_values = core.fingerprint_values
        self.digest = fingerprint(self.fingerprint_values)


class PrefillPeers(_Peers):
    """Sends each prefilled request's KV to the decode engine it names."""

    role = Role.PREFILL

    def __init__(self, core, key) -> None:
        from duoserve.kv.zmq_connector import PrefillConnector

        super().__init__(core)
        self.connector = PrefillConnector(self.digest, self.fingerprint_values, key)
        core.attach_connector(self.connector)

    def on_hello(self, hello) -> None:
        self.connector.connect(hello.name, hello.peers)


class DecodePeers(_Peers):
    """Receives transfers on the engine's own socket."""

    role = Role.DECODE

    def __init__(self, core, sock, instance_id: str, name: str | None = None) -> None:
        from duoserve.kv.zmq_connector import DecodeConnector

        super().__init__(core)
        self.connector = DecodeConnector(sock, self.digest, self.fingerprint_values, instance_id)
        if name:   # a prefill engine's hello may come before any frontend's: refusals name this engine
            self.connector.name = name
        core.attach_connector(self.connector)

    def receive(self, identity: bytes, message, frames) -> bool:
        self.connector.receive(identity, message, frames)
        return True

    def on_hello(self, hello) -> None:
        self.connector.name = hello.name
