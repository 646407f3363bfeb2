"""Who may talk to an engine: ZeroMQ CURVE with one key per deployment.

Every member of a deployment (frontends, prefill and decode engines) holds the same
CURVE secret key, and so the same public key. An engine's socket is a CURVE server
with that key pair, and its ZAP handler admits only clients that prove they hold it
too; a frontend or a prefill engine connects as a CURVE client with it. Whoever lacks
the secret cannot finish the handshake: nothing it sends reaches the engine, and the
traffic (requests, outputs, KV over TCP) is encrypted.

Where the key comes from:

- ``--auth-key-file FILE`` (a file made by ``duoserve keygen FILE``: the Z85 secret, 40
  characters), or ``$DUOSERVE_AUTH_KEY_FILE``, or the secret itself in ``$DUOSERVE_AUTH_KEY``;
- engines a frontend launches get a fresh key of their own when none is given (it never
  leaves the frontend's process tree).

An engine that listens beyond loopback refuses to start without a key unless it is told
``--insecure-no-auth``. ``ipc://`` sockets are made readable by their owner only.
Torch-free: the API process uses it.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

import zmq

from duoserve import envs
from duoserve.errors import ConfigError

ENV_KEY = "DUOSERVE_AUTH_KEY"
ENV_KEY_FILE = "DUOSERVE_AUTH_KEY_FILE"
KEY_CHARS = 40                      # a CURVE key in Z85
# the largest ZeroMQ frame any duoserve socket accepts: a layer's K or V for a long prompt
# travels as one frame over TCP (a 32k-token prompt of an 8-KV-head, 128-dim model in bf16
# is 64 MiB a frame); anything larger is dropped by ZeroMQ before it is read
MAX_MESSAGE_BYTES = envs.DUOSERVE_MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class AuthKey:
    secret: bytes   # Z85
    public: bytes   # Z85, derived from the secret

    def __repr__(self) -> str:   # never print the secret
        return f"AuthKey(public={self.public.decode()})"

    @classmethod
    def generate(cls) -> "AuthKey":
        public, secret = zmq.curve_keypair()
        return cls(secret, public)

    @classmethod
    def from_secret(cls, text: str | bytes, source: str) -> "AuthKey":
        secret = (text.encode() if isinstance(text, str) else text).strip()
        try:
            if len(secret) != KEY_CHARS:
                raise ValueError
            public = zmq.curve_public(secret)
        except (ValueError, zmq.ZMQError):
            raise ConfigError(source, f"<{len(secret)} characters>",
                              f"a CURVE secret key: {KEY_CHARS} Z85 characters, as `duoserve keygen FILE` "
                              "writes") from None
        return cls(secret, public)

    def save(self, path: str) -> None:
        """Write the secret, readable by its owner only (refuses to overwrite a file)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.secret + b"\n")


def load_key(path: str | None = None) -> AuthKey | None:
    """The key in ``path``, else in ``$DUOSERVE_AUTH_KEY_FILE`` or ``$DUOSERVE_AUTH_KEY``; None if none is set."""
    path = path or envs.DUOSERVE_AUTH_KEY_FILE
    if path:
        try:
            with open(path, "rb") as f:
                return AuthKey.from_secret(f.read(), "auth_key_file")
        except OSError as exc:
            raise ConfigError("auth_key_file", path, f"a readable key file ({exc.strerror})") from None
    if envs.DUOSERVE_AUTH_KEY:
        return AuthKey.from_secret(envs.DUOSERVE_AUTH_KEY, ENV_KEY)
    return None


def is_loopback(address: str) -> bool:
    """An ``ipc://`` path, or a ``tcp://`` address on a loopback interface."""
    scheme, _, rest = address.partition("://")
    if scheme == "ipc":
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:   # a host name or an interface: reachable from elsewhere
        return False


def check_listen(address: str, key: AuthKey | None, insecure: bool) -> None:
    """Refuse an engine that would accept anyone on a network interface."""
    if key is None and not insecure and not is_loopback(address):
        raise ConfigError("auth_key_file", None,
                          f"a key when the engine listens beyond loopback ({address}): make one with "
                          "`duoserve keygen FILE` and pass --auth-key-file FILE here and to the frontend "
                          f"(or set ${ENV_KEY_FILE}); --insecure-no-auth accepts anyone who reaches the port")


# what a connecting socket's monitor reports when the other side will not admit it
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def handshake_refused(address: str, key: AuthKey | None) -> str:
    held = "this side's auth key" if key is not None else "a connection without an auth key"
    return (f"{address} refused {held} in the handshake: both sides need the same key "
            f"(--auth-key-file, ${ENV_KEY_FILE}), or neither")


def limit_messages(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    return sock


def secure_client(sock: zmq.Socket, key: AuthKey | None) -> zmq.Socket:
    """Before ``connect``: prove the deployment key to the engine (no-op without a key)."""
    if key is not None:
        sock.curve_serverkey = key.public
        sock.curve_publickey = key.public
        sock.curve_secretkey = key.secret
    return sock


class Gatekeeper:
    """An engine's side: its socket a CURVE server, and a ZAP handler admitting the key's holders."""

    def __init__(self, ctx: zmq.Context, key: AuthKey | None) -> None:
        self.key = key
        self._auth = None
        if key is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:   # the ZAP handler asks, per connection
        return client_key == self.key.public

    def guard(self, sock: zmq.Socket) -> zmq.Socket:
        """Before ``bind``."""
        if self.key is not None:
            sock.curve_server = True
            sock.curve_secretkey = self.key.secret
            sock.curve_publickey = self.key.public
        return limit_messages(sock)

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def restrict_ipc(address: str) -> None:
    """After ``bind``: an ``ipc://`` socket file readable and writable by its owner only."""
    if address.startswith("ipc://"):
        os.chmod(address[len("ipc://"):], 0o600)
