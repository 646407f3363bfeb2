"""Which engine probably holds a prompt's first blocks in its prefix cache (``--routing prefix``).

The frontend keeps, for each engine, the block hashes of the prompts it placed there, newest last,
and forgets the oldest beyond that engine's pool (``num_blocks``): an engine evicts its least
recently used free blocks first, so the map forgets roughly as the engine does. It is
approximate by design (SGLang's router keeps such a tree of what it routed, not what the engines
hold): an engine's own evictions, a relaunch (``forget``) or another frontend's requests move
the truth under it, and a wrong guess costs a prefill the engine would have done anyway.

A block's hash chains its tokens to every block before it (as the engines' prefix caches key
their blocks), so a match is always a prompt's first blocks.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixMap:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def hashes(self, tokens: list[int]) -> list[int]:
        """The chained hashes of ``tokens``' full blocks."""
        chain, parent = [], 0
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(tokens[start:start + self.block_size])))
            chain.append(parent)
        return chain

    def matched(self, engine: str, hashes: list[int]) -> int:
        """How many of ``hashes``' first blocks ``engine`` probably holds."""
        held = self._blocks.get(engine)
        if not held:
            return 0
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    def record(self, engine: str, hashes: list[int], capacity: int) -> None:
        """``engine`` computed (or found) these blocks just now; it holds at most ``capacity``."""
        held = self._blocks.setdefault(engine, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > max(capacity, 0):
            held.popitem(last=False)

    def forget(self, engine: str) -> None:
        """``engine`` restarted: its cache is empty."""
        self._blocks.pop(engine, None)
