"""Which KV blocks each request holds: allocation, prefix-cache lookup, forks and frees.

Pure Python bookkeeping over a ``BlockPool``; the tensors live in the model runner.

Sliding windows (``sliding_window``, set only when every layer is windowed: see
``window_to_free``): a token at position p sees keys p - window + 1 ... p, so once the next
token to compute is p, every block wholly before p - window + 1 is never read again and goes
back to the pool. Its place in the request's table stays (None), so positions still map to
table slots; the runner is handed the request's first live block there, which the window
masks (it is only read, never written: writes land at new positions)::

    positions  0..3   4..7   8..11  12..15  16        window 8, blocks of 4, next token p = 16
    table      None   None   b7     b2      b9        sees 9..16: blocks 0 and 1 freed
    block_ids  b7     b7     b7     b2      b9        what the runner reads
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from duoserve.config import Role
from duoserve.core.block_pool import Block, BlockPool, hash_block
from duoserve.core.request import Request


def chain_root(salt: str | None, lora_digest: str | None = None) -> bytes | None:
    """The parent of a sequence's first block hash where its KV is not everyone's: a cache salt's, or
    a LoRA adapter's (its content digest), whose blocks hash apart from every other's."""
    if lora_digest is not None:
        return hashlib.sha256(b"duoserve-lora:" + lora_digest.encode() + b"\0" + (salt or "").encode()).digest()
    return None if salt is None else hashlib.sha256(b"duoserve-cache-salt:" + salt.encode()).digest()


NO_WINDOW = "off: no layer has a sliding window shorter than the context"


def window_to_free(layer_windows: Sequence[int | None], role: Role, has_draft: bool) -> tuple[int | None, str]:
    """The window past which a request's blocks go back to the pool (None: never), and why, in
    words for the memory report. Every layer reads the same block table, so a block can go only
    when every layer's window has passed it."""
    windows = set(layer_windows)
    if windows == {None}:
        return None, NO_WINDOW
    if None in windows:
        num_full = sum(1 for w in layer_windows if w is None)
        return None, (f"off: {num_full} of {len(layer_windows)} layers attend over the whole context and every layer "
                      "shares one block table, so no block falls outside every layer's view (the local layers' "
                      "blocks would need tables of their own)")
    if Role(role) is Role.PREFILL:
        return None, "off on a prefill engine: it hands the whole prompt's KV over; the decode engine frees it"
    if has_draft:
        return None, ("off with a draft model: its KV shares the blocks and catches up from behind (from the first "
                      "token after a preemption)")
    window = max(w for w in windows if w is not None)
    return window, f"on: blocks wholly before a sequence's last {window} tokens go back to the pool as it decodes"


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window   # every layer's window (window_to_free), or None: keep all
        self.pool = BlockPool(num_blocks, enable_caching)
        # a request's table: None where the window freed a block (always a prefix of the table)
        self.req_blocks: dict[str, list[Block | None]] = {}
        self.num_window_freed = 0   # blocks given back by the window
        self.num_queries = 0   # prompt tokens looked up in the prefix cache
        self.num_hits = 0      # of which found
        # with a KV store: blocks published since the last drain, to be written there once computed
        self.record_published = False
        self.published: list[tuple[int, bytes, list[int]]] = []  # (block id, hash, token ids)
        # with KV events (kv/events.py): ("stored", hashes, parent hash, token ids) and ("removed",
        # hashes) in the order they happened, since the last drain
        self.events: list[tuple] | None = None

    def record_events(self) -> None:
        """From now on, keep the prefix cache's stores and evictions for ``drain_events``."""
        self.events = []
        self.pool.events = self.events

    def drain_events(self) -> list[tuple]:
        """What the prefix cache stored and evicted since the last drain, in order, evictions in a
        row merged into one."""
        if not self.events:
            return []
        drained: list[tuple] = []
        for event in self.events:
            if event[0] == "removed" and drained and drained[-1][0] == "removed":
                drained[-1][1].extend(event[1])
            else:
                drained.append(event)
        self.events.clear()   # in place: the pool appends to this same list
        return drained

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table for the runner; a slot the window freed reads as its first live block."""
        blocks = self.req_blocks.get(request_id, ())
        live = next((b.block_id for b in blocks if b is not None), None)
        return [live if b is None else b.block_id for b in blocks]

    def has_window_freed(self, request: Request) -> bool:
        blocks = self.req_blocks.get(request.request_id)
        return bool(blocks) and blocks[0] is None

    def free_outside_window(self, request: Request) -> list[int]:
        """Give back the request's blocks wholly before the window of its next token (at
        ``num_computed_tokens``); their ids, last first. The last block is always kept."""
        blocks = self.req_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return []
        first_seen = request.num_computed_tokens - self.sliding_window + 1
        num_outside = min(max(first_seen, 0) // self.block_size, len(blocks) - 1)
        freed = [block for block in reversed(blocks[:num_outside]) if block is not None]
        blocks[:num_outside] = [None] * num_outside
        self.pool.release(freed)   # last first, as free() does: the prefix others share is evicted last
        self.num_window_freed += len(freed)
        return [block.block_id for block in freed]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Digest every full block among the first ``num_tokens`` tokens not digested yet."""
        hashes = request.block_hashes
        size = self.block_size
        while (len(hashes) + 1) * size <= num_tokens:
            start = len(hashes) * size
            parent = hashes[-1] if hashes else chain_root(request.params.cache_salt, request.params.lora_digest)
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
        stored: list[int] = []   # indexes of the blocks this call cached
        for i, (block, block_hash) in enumerate(zip(blocks[: num_tokens // self.block_size], request.block_hashes)):
            if block is not None and self.pool.cache(block, block_hash):
                stored.append(i)
                if self.record_published:
                    self.published.append((block.block_id, block_hash, request.token_ids(
                        i * self.block_size, (i + 1) * self.block_size)))
        if stored and self.events is not None:
            self._record_stored(request, stored)

    def _record_stored(self, request: Request, stored: list[int]) -> None:
        """One ("stored", ...) event per run of consecutive blocks cached."""
        size, hashes = self.block_size, request.block_hashes
        run = [stored[0]]
        for i in stored[1:] + [None]:
            if i is not None and i == run[-1] + 1:
                run.append(i)
                continue
            first, last = run[0], run[-1]
            self.events.append(("stored", [hashes[j] for j in run], hashes[first - 1] if first else None,
                                request.token_ids(first * size, (last + 1) * size)))
            if i is not None:
                run = [i]

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
        self.pool.touch(block for block in shared if block is not None)   # the window's frees stay freed
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
            self.pool.release(block for block in reversed(blocks) if block is not None)
