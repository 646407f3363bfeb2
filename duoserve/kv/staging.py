"""KV between a GPU and host memory, through pinned buffers.

A transfer leaves a GPU prefill engine, or enters a GPU decode engine, through page-locked
host memory: the copies are issued non-blocking (DMA, no bounce through a pageable
buffer) and ordered on the current stream, so the decode side's cache writes that follow
need no synchronization. On CPU both are no-ops.
"""

from __future__ import annotations

import torch


def pinned_like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Empty page-locked views shaped like ``tensors``, carved from one buffer."""
    total = sum(t.numel() for t in tensors)
    buffer = torch.empty(total, dtype=tensors[0].dtype, pin_memory=True)
    views, offset = [], 0
    for t in tensors:
        views.append(buffer[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """GPU tensors -> pinned host copies (one synchronize for all); CPU tensors unchanged."""
    if not tensors or tensors[0].device.type != "cuda":
        return tensors
    views = pinned_like(tensors)
    for view, t in zip(views, tensors):
        view.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return views


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors -> ``device`` via pinned memory, copies queued non-blocking on the current stream."""
    if not tensors or device.type != "cuda":
        return tensors
    views = pinned_like(tensors)
    for view, t in zip(views, tensors):
        view.copy_(t)
    return [view.to(device, non_blocking=True) for view in views]
