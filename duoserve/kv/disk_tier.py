"""The KV tier on disk (``--kv-disk-path``): block records (``duoserve.kv.store_record``) as files,
so a prompt's KV outlives the server that computed it.

A record lives at ``DIR/<2 hex>/<62 hex>.kvb``, named by its key (which already covers the
model, tokenizer, KV layout and every token before the block). It is written whole under a
temporary ``.part`` name of its own and renamed into place: a process killed mid-write leaves
only the ``.part`` file, which no read looks at and a later start removes once it is older than
any write in progress could be (counted as torn). A record that is there but damaged (a flipped
byte, a file cut short by the machine going down) fails its checksum when read: it is a miss,
deleted, counted. Past ``max_bytes`` the least recently used files go first (a read refreshes a
file's time); a full disk lowers the limit to what is stored. Several engines and servers may
share a directory (every engine of a deployment does): a name is only ever renamed into place
whole, and what one wrote the others read; each keeps its own account of the files, so the
directory holds up to ``max_bytes`` for each of them.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from collections import OrderedDict
from contextlib import suppress
from pathlib import Path

from duoserve.kv.store_record import KEY_PREFIX

SUFFIX = ".kvb"
TORN_AFTER_S = 600   # a .part file this old is no write in progress: a start removes it


class DiskTier:
    stats_prefix = "kv_disk"
    required_by = "it is required"

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.dir = Path(directory).expanduser()
        self.what = f"the KV disk tier {self.dir}"
        self.max_bytes = max_bytes
        self.lock = threading.Lock()   # the engine thread reads, the writer thread writes
        self.sizes: OrderedDict[Path, int] = OrderedDict()   # our files, least recently used first
        self.total = self.evicted = self.torn = 0
        self._scan()

    def _scan(self) -> None:
        """What earlier runs left: torn writes removed, whole files indexed by their last use."""
        if not self.dir.is_dir():
            return
        found, now = [], time.time()
        for path in self.dir.glob("*/*"):
            if path.name.endswith(".part"):
                with suppress(FileNotFoundError):
                    if now - path.stat().st_mtime > TORN_AFTER_S:
                        path.unlink()
                        self.torn += 1
            elif path.suffix == SUFFIX:
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue
                found.append((stat.st_mtime_ns, path, stat.st_size))
        for _, path, size in sorted(found):
            self.sizes[path] = size
            self.total += size

    def _path(self, key: bytes) -> Path:
        name = key[len(KEY_PREFIX):].decode()
        return self.dir / name[:2] / (name[2:] + SUFFIX)

    def ping(self) -> None:
        """Raises OSError where the directory cannot be made or written."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise PermissionError(f"{self.dir} is not writable")

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [self._path(key).is_file() for key in keys]

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            try:
                value = path.read_bytes()
            except FileNotFoundError:   # evicted (here or by a server sharing the directory)
                values.append(None)
                with self.lock:
                    self.total -= self.sizes.pop(path, 0)
                continue
            values.append(value)
            with suppress(OSError):   # used now: evicted last (best effort: another's file may refuse it)
                os.utime(path)
            with self.lock:
                if path in self.sizes:
                    self.sizes.move_to_end(path)
        return values

    def put(self, records: list[tuple[bytes, bytes]]) -> None:
        for key, record in records:
            path = self._path(key)
            if path.exists():   # nobody rewrites what is there
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_name(f"{path.name}.{uuid.uuid4().hex}.part")   # no other writer's name
            try:
                with open(part, "wb") as f:
                    f.write(record)
                with self.lock:
                    os.replace(part, path)
                    self.total += len(record) - self.sizes.pop(path, 0)
                    self.sizes[path] = len(record)
                    victims = self._over_limit()
            except OSError as exc:
                part.unlink(missing_ok=True)
                if exc.errno == errno.ENOSPC:   # the disk is full before the limit: the limit is what fits
                    with self.lock:
                        self.max_bytes = max(1, min(self.max_bytes, self.total))
                raise
            for victim in victims:   # outside the lock: the engine thread's reads go on meanwhile
                victim.unlink(missing_ok=True)

    def _over_limit(self) -> list[Path]:
        """The least recently used files past ``max_bytes``, out of the account (to be removed)."""
        victims = []
        while self.total > self.max_bytes and self.sizes:
            path, size = self.sizes.popitem(last=False)
            self.total -= size
            self.evicted += 1
            victims.append(path)
        return victims

    def delete(self, key: bytes) -> None:
        path = self._path(key)
        with self.lock:
            path.unlink(missing_ok=True)
            self.total -= self.sizes.pop(path, 0)

    def error_kind(self, error: Exception) -> str:
        return "io" if isinstance(error, OSError) else "other"

    def stats(self) -> dict:
        with self.lock:
            return {"kv_disk_files": len(self.sizes), "kv_disk_bytes_stored": self.total,
                    "kv_disk_evicted": self.evicted, "kv_disk_torn": self.torn}

    def close(self) -> None:
        pass
