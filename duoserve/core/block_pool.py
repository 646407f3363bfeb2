"""The pool of KV cache blocks: reference counts, an LRU free queue and the prefix cache.

A block is free when no request holds it (``ref_count == 0``). Free blocks wait in
a queue; new blocks are taken from its head, and freed blocks join its tail::

    head (evicted first) -> b7 -> b3 -> b9 -> tail (freed last)

A free block may still carry a hash: its KV is valid and a later request with the
same prefix can take it back out of the queue (a prefix-cache hit). Only when a
free block is handed out as a new block is its hash dropped (eviction), so cached
blocks are evicted in least-recently-freed order, and only when free blocks run out.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

NONE_HASH = b"\x00" * 32


def hash_block(parent: bytes | None, token_ids: Iterable[int], extra: bytes = b"") -> bytes:
    """sha256 over the parent digest, the tokens as little-endian int32 and an extra key."""
    tokens = list(token_ids)
    digest = hashlib.sha256()
    digest.update(parent or NONE_HASH)
    digest.update(struct.pack(f"<{len(tokens)}i", *tokens))
    digest.update(extra)
    return digest.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.prev: Block | None = None  # free-queue links; None when not queued
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) append, pop from head and removal from the middle."""

    def __init__(self, blocks: list[Block]) -> None:
        self._head = Block(-1)  # sentinels
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None and block.prev is None, f"{block} is already queued"
        last.next, block.prev, block.next, self._tail.prev = block, last, self._tail, block
        self.num_blocks += 1

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, f"{block} is not queued"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_blocks -= 1

    def pop_head(self) -> Block:
        block = self._head.next
        assert block is not None and block is not self._tail, "the free queue is empty"
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        """Head to tail, for tests and debugging."""
        ids, block = [], self._head.next
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0, "a block pool needs at least one block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.num_evictions = 0
        self.version = 0   # changes whenever a hash joins or leaves ``cached`` (engines report the set)
        # KV events (kv/events.py): ("removed", [hash]) appended at each eviction, when a list is given
        self.events: list[tuple] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they can be evicted)."""
        return self.free_queue.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take ``num_blocks`` from the head of the free queue, evicting their cached KV."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks with only {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            block = self.free_queue.pop_head()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.append(("removed", [block.block_hash]))
                block.block_hash = None
                self.num_evictions += 1
                self.version += 1
            block.ref_count = 1
            taken.append(block)
        return taken

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the cache (or shared with a sibling)."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block; a block nobody holds joins the free queue's tail.

        Callers pass a request's blocks last-first, so a sequence's tail is evicted
        before its prefix (the prefix is the part other requests share).
        """
        for block in blocks:
            assert block.ref_count > 0, f"{block} released more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def cache(self, block: Block, block_hash: bytes) -> bool:
        """Publish a full, computed block under its hash (first writer wins); True if it is new."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # the same content computed twice at once: keep the published one
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.version += 1
        return True
