"""Which engine probably holds a prompt's first blocks in its prefix cache (``--routing prefix``).

The frontend keeps, for each engine, the block hashes of the prompts it placed there, newest last,
and forgets the oldest beyond that engine's pool (``num_blocks``): an engine evicts its least
recently used free blocks first, so the map forgets roughly as the engine does. Each engine
also reports what its prefix cache holds (the first 8 bytes of its cached blocks' hashes, in
its stats at most once a second when they changed: ``EngineStats.cached_blocks``), which
replaces that engine's last report here: its own evictions and other frontends' requests then
show within a second. It stays approximate (between reports, and a report omits a pool's
oldest blocks beyond 8,192), and a wrong guess costs a prefill the engine would have done anyway.

Fed by the engines' KV events instead (``--routing kv-events``: ``stored``, ``removed``,
``cleared``), the map holds exactly what each engine said it caches, and placements and reports
change nothing.

A block's hash is the engines' own (``core.block_pool.hash_block``: sha256 chaining its tokens to
every block before it, from the request's cache salt), so a match is always a prompt's first
blocks, and a report and a placement name a block alike.
"""

from __future__ import annotations

from collections import OrderedDict

from duoserve.core.block_pool import hash_block
from duoserve.core.kv_cache_manager import chain_root


def short_hash(block_hash: bytes) -> int:
    """A block hash as engines report it: its first 8 bytes."""
    return int.from_bytes(block_hash[:8], "little")


class PrefixMap:
    def __init__(self, block_size: int, from_events: bool = False) -> None:
        self.block_size = block_size
        self.from_events = from_events
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._reported: dict[str, frozenset[int]] = {}   # engine -> its last report
        self._events: dict[str, set[int]] = {}           # engine -> what its KV events say it caches

    def hashes(self, tokens: list[int], cache_salt: str | None = None) -> list[int]:
        """The chained hashes of ``tokens``' full blocks, as the engines key them."""
        chain, parent = [], chain_root(cache_salt)
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = hash_block(parent, tokens[start:start + self.block_size])
            chain.append(short_hash(parent))
        return chain

    def report(self, engine: str, cached: list[int]) -> None:
        """``engine`` says its prefix cache holds these blocks (short hashes)."""
        if not self.from_events:
            self._reported[engine] = frozenset(cached)

    def stored(self, engine: str, block_hashes: list[bytes]) -> None:
        """A KV event: ``engine`` cached these blocks (full hashes)."""
        self._events.setdefault(engine, set()).update(short_hash(h) for h in block_hashes)

    def removed(self, engine: str, block_hashes: list[bytes]) -> None:
        """A KV event: ``engine`` evicted these blocks."""
        self._events.setdefault(engine, set()).difference_update(short_hash(h) for h in block_hashes)

    def cleared(self, engine: str) -> None:
        """A KV event: ``engine`` holds nothing (it started)."""
        self._events[engine] = set()

    def matched(self, engine: str, hashes: list[int]) -> int:
        """How many of ``hashes``' first blocks ``engine`` probably holds."""
        if self.from_events:
            held, reported = self._events.get(engine, set()), frozenset()
        else:
            held, reported = self._blocks.get(engine, {}), self._reported.get(engine, frozenset())
        count = 0
        for h in hashes:
            if h not in held and h not in reported:
                break
            count += 1
        return count

    def record(self, engine: str, hashes: list[int], capacity: int) -> None:
        """``engine`` computed (or found) these blocks just now; it holds at most ``capacity``."""
        if self.from_events:   # the engine's own events will say so
            return
        held = self._blocks.setdefault(engine, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > max(capacity, 0):
            held.popitem(last=False)

    def forget(self, engine: str) -> None:
        """``engine`` restarted: its cache is empty."""
        self._blocks.pop(engine, None)
        self._reported.pop(engine, None)
        self._events.pop(engine, None)
