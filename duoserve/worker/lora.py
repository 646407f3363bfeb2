"""LoRA adapters computed in the step that computes the base model: rows of different adapters
and of the base together.

Each projection an adapter may target (every layer's ``qkv``, ``o_proj``, ``gate_up`` and
``down``) gets a forward hook. The base layer computes every row once, whatever its kernel
(packed float, GGUF blocks, int8); the hook then adds each adapter's low-rank update to its own
rows only: the step's rows are grouped by adapter (``LoRAStep``) and per group one matmul by the
adapter's stacked A and one by each slice's B, added into the slice's output rows. A step with no
adapter row costs one Python call per hooked layer; the C++ decode step and a compiled graph,
which call no hook, are not used for a step with adapter rows (the runner runs those eagerly).

Adapters are loaded by name (``LoRAManager.load``) up to ``--max-loras``; one more unloads the
least recently used that no request in the engine uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from duoserve.config import LoRAConfig
from duoserve.model.arch import ModelArch
from duoserve.model.lora import LoRAAdapter, LoRALayer, LoRALoadError, adapter_targets, load_adapter

logger = logging.getLogger(__name__)


@dataclass
class LoRAStep:
    """A step's rows by adapter: (the adapter's layers, the rows' indices)."""
    groups: list[tuple[dict[str, LoRALayer], torch.Tensor]]


class _LoRAHook:
    """The forward hook of one projection: adds each group's update to its rows."""

    def __init__(self, manager: "LoRAManager", layer: str) -> None:
        self.manager, self.layer = manager, layer

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        step = self.manager.step
        if step is None or torch.compiler.is_compiling():
            return None
        x = args[0]
        for modules, rows in step.groups:
            update = modules.get(self.layer)
            if update is None:
                continue
            xa = x.index_select(0, rows) @ update.a.T   # [n, sum of ranks]: every slice's A at once
            for s in update.slices:
                delta = (xa[:, s.ranks[0]:s.ranks[1]] @ s.b.T) * s.scale
                output[:, s.offset:s.offset + s.rows].index_add_(0, rows, delta)
        return output


class LoRAManager:
    def __init__(self, model: nn.Module, arch: ModelArch, config: LoRAConfig, dtype: torch.dtype,
                 gguf_arch: str | None = None) -> None:
        self.arch, self.config, self.dtype, self.gguf_arch = arch, config, dtype, gguf_arch
        self.adapters: dict[str, LoRAAdapter] = {}
        self.last_used: dict[str, float] = {}
        self.step: LoRAStep | None = None
        modules = dict(model.named_modules())
        for layer in sorted({target[0] for target in adapter_targets(arch).values()}):
            modules[layer].register_forward_hook(_LoRAHook(self, layer))

    # ---- adapters ---------------------------------------------------------------------------

    def load(self, name: str, path: str, in_use: Callable[[str], bool] = lambda name: False) -> LoRAAdapter:
        """Load an adapter under ``name`` (again: replaced), first unloading the least recently
        used that no request uses when ``--max-loras`` are loaded. ``LoRALoadError`` says why not."""
        adapter = load_adapter(name, path, self.arch, self.config.max_lora_rank, self.dtype, self.gguf_arch)
        if name not in self.adapters and len(self.adapters) >= self.config.max_loras:
            idle = [n for n in self.adapters if not in_use(n)]
            if not idle:
                raise LoRALoadError(f"--max-loras ({self.config.max_loras}) adapters are loaded and every one "
                                    "has requests: unload one, or wait for them")
            victim = min(idle, key=lambda n: self.last_used[n])
            logger.info("unloading LoRA adapter %s (least recently used) for %s", victim, name)
            self.unload(victim)
        self.adapters[name] = adapter
        self.last_used[name] = time.monotonic()
        logger.info("LoRA adapter %s loaded from %s: rank %d, %d layers, %.1f MiB", name, path, adapter.rank,
                    len(adapter.modules), adapter.nbytes() / 2**20)
        return adapter

    def unload(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.last_used.pop(name, None)

    def digest(self, name: str) -> str | None:
        adapter = self.adapters.get(name)
        return None if adapter is None else adapter.digest

    # ---- steps --------------------------------------------------------------------------------

    def begin_step(self, rows_by_adapter: dict[str, list[int]], device: torch.device) -> bool:
        """Group the step's rows by adapter; False (nothing to add) for a step of base rows only."""
        if not rows_by_adapter:
            return False
        now = time.monotonic()
        groups = []
        for name, rows in rows_by_adapter.items():
            self.last_used[name] = now
            groups.append((self.adapters[name].modules, torch.tensor(rows, dtype=torch.long, device=device)))
        self.step = LoRAStep(groups)
        return True

    def end_step(self) -> None:
        self.step = None


def adapter_problem(manager: LoRAManager | None, name: str | None, digest: str | None = None) -> str | None:
    """Why this engine cannot compute a request of adapter ``name`` (None: it can). ``digest``: the
    adapter another engine computed its KV with (a handoff), which must be the same adapter."""
    if name is None:
        return None
    if manager is None:
        return f"LoRA adapter {name!r} asked of an engine serving no adapters (start it with --enable-lora)"
    ours = manager.digest(name)
    if ours is None:
        return f"LoRA adapter {name!r} is not loaded (loaded: {', '.join(manager.adapters) or 'none'})"
    if digest is not None and digest != ours:
        return (f"LoRA adapter {name!r} is not the same adapter here as on the engine that computed the "
                "request's KV (their files differ): load the same files on every engine")
    return None
