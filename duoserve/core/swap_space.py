"""Which swap blocks are free: the host-memory pool that holds the KV of swapped-out requests.

A swapped request's blocks are copied out of the KV cache into swap blocks, and back into
fresh KV blocks when it is scheduled again (RUNNING -> SWAPPED -> RUNNING). Swap blocks are
plain storage: no hashes, no sharing. A swap block released by a swap-in becomes free only at
the next step, after its copy has run. No torch here: the tensors live in the model runner.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SwapCost:
    """Swap or recompute: a preempted request's KV copied out and back in, against its tokens
    computed again. The engine keeps both rates current from what it measures."""
    block_bytes: int
    copy_bytes_per_s: float = 4e9        # one direction, KV cache <-> swap space
    prefill_tokens_per_s: float = 2000.0

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        copy_s = 2 * num_blocks * self.block_bytes / self.copy_bytes_per_s
        return copy_s < num_tokens / self.prefill_tokens_per_s


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, 2 ...
        self.released: list[int] = []   # free after this step's copies

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - (len(self.free) + len(self.released)) / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self.free):
            return None
        taken = self.free[len(self.free) - count:][::-1]
        del self.free[len(self.free) - count:]
        return taken

    def release(self, block_ids: list[int]) -> None:
        """Give blocks back; they are handed out again from the next step on."""
        self.released += block_ids

    def end_step(self) -> None:
        self.free += reversed(self.released)
        self.released = []

    @property
    def is_whole(self) -> bool:
        return len(self.free) + len(self.released) == self.num_blocks
