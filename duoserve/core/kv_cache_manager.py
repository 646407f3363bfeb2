"""Which KV blocks each request holds: allocation, prefix-cache lookup, forks and frees.

Pure Python bookkeeping over a ``BlockPool``; the tensors live in the model runner.
"""

from __future__ import annotations

import hashlib

from duoserve.core.block_pool import Block, BlockPool, hash_block
from duoserve.core.request import Request


def salt_root(salt: str | None) -> bytes | None:
    """The parent of a salted sequence's first block hash: its blocks hash apart from everyone else's."""
    return None if salt is None else hashlib.sha256(b"duoserve-cache-salt:" + salt.encode()).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_queries = 0   # prompt tokens looked up in the prefix cache
        self.num_hits = 0      # of which found
        # with a KV store: blocks published since the last drain, to be written there once computed
        self.record_published = False
        self.published: list[tuple[int, bytes, list[int]]] = []  # (block id, hash, token ids)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Digest every full block among the first ``num_tokens`` tokens not digested yet."""
        hashes = request.block_hashes
        size = self.block_size
        while (len(hashes) + 1) * size <= num_tokens:
            start = len(hashes) * size
            parent = hashes[-1] if hashes else salt_root(request.params.cache_salt)
            hashes.append(hash_block(parent, request.token_ids(start, start + size)))

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached blocks that starts the request's tokens.

        At least the last token is always left to compute: its logits are needed.
        """
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks * self.block_size)
        found = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        self.num_queries += request.num_tokens
        self.num_hits += len(found) * self.block_size
        return found

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_prefix: list[Block] | None = None) -> list[Block] | None:
        """Make room for ``num_new_tokens`` more tokens; None (and no change) when blocks are short.

        ``cached_prefix`` (a waiting request's prefix-cache hits) is taken first; the
        request's ``num_computed_tokens`` must not include it yet.
        """
        cached_prefix = cached_prefix or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(blocks) - len(cached_prefix)
        num_needed = max(num_needed, 0)
        # A free cached block we are about to reuse cannot also serve as a new block.
        num_reusable_free = sum(1 for b in cached_prefix if b.ref_count == 0)
        if num_needed > self.pool.num_free_blocks - num_reusable_free:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(cached_prefix)
        blocks.extend(cached_prefix)
        new_blocks = self.pool.allocate(num_needed)
        blocks.extend(new_blocks)
        self._publish(request, min(num_computed + num_new_tokens, request.num_tokens))  # not over guesses
        return new_blocks

    def _publish(self, request: Request, num_tokens: int) -> None:
        """Cache the full blocks among the first ``num_tokens`` (their KV is computed this step)."""
        if not self.enable_caching:
            return
        self._extend_hashes(request, num_tokens)
        blocks = self.req_blocks[request.request_id]
        for i, (block, block_hash) in enumerate(zip(blocks[: num_tokens // self.block_size], request.block_hashes)):
            if self.pool.cache(block, block_hash) and self.record_published:
                self.published.append((block.block_id, block_hash, request.token_ids(i * self.block_size,
                                                                                    (i + 1) * self.block_size)))

    def drain_published(self) -> list[tuple[int, bytes, list[int]]]:
        published, self.published = self.published, []
        return published

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Give ``child`` the parent's computed prompt blocks: full ones shared, the partial tail copied.

        Returns the (source, destination) block-id copies to make before the next forward
        (none when the prompt fills whole blocks), or None when no block is free for the
        tail (the child then recomputes its prompt).
        """
        num_prompt = parent.num_prompt_tokens
        parent_blocks = self.req_blocks[parent.request_id]
        num_full = num_prompt // self.block_size
        shared = parent_blocks[:num_full]
        has_tail = num_prompt % self.block_size != 0
        if has_tail and self.pool.num_free_blocks < 1:
            return None
        self.pool.touch(shared)
        blocks = list(shared)
        copies = []
        if has_tail:
            tail = self.pool.allocate(1)[0]
            copies.append((parent_blocks[num_full].block_id, tail.block_id))
            blocks.append(tail)
        self.req_blocks[child.request_id] = blocks
        child.block_hashes = list(parent.block_hashes[:num_full])
        return copies

    def free(self, request: Request) -> None:
        """Release every block the request holds, last block first."""
        blocks = self.req_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.release(reversed(blocks))
