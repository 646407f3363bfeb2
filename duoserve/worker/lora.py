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

import ctypes
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


PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")   # a layer's, in lora.h's order
MAX_SLICES, MAX_STACKED = 3, 768                     # lora.h's LORA_MAX_SLICES, LORA_MAX_STACKED


class _Slice(ctypes.Structure):   # lora.h's struct lora_slice
    _fields_ = [("bt", ctypes.c_void_p), ("offset", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("r0", ctypes.c_int64), ("r1", ctypes.c_int64), ("scale", ctypes.c_float)]


class _Update(ctypes.Structure):   # lora.h's struct lora_update
    _fields_ = [("a", ctypes.c_void_p), ("stacked", ctypes.c_int64), ("in_", ctypes.c_int64),
                ("num_slices", ctypes.c_int64), ("bf16", ctypes.c_int64), ("slices", _Slice * MAX_SLICES)]


def c_lora_available() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("duoserve::lora_rows", "CPU")


class AdapterTable:
    """An adapter's updates as csrc/lora.c reads them: copies of its matrices (B transposed) in
    the model's dtype, float32 or bfloat16 (the bytes a step reads: four rank-16 adapters of
    SmolLM2-135M are 78 MB in float32), and one ``struct lora_update`` per layer and projection
    (index layer * 4 + projection)."""

    def __init__(self, adapter: LoRAAdapter, num_layers: int, dtype: torch.dtype) -> None:
        self.dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.tensors: list[torch.Tensor] = []   # what the table points into, kept alive with it
        self.updates = (_Update * (num_layers * len(PROJECTIONS)))()
        for name, layer in adapter.modules.items():
            _, index, projection = name.split(".")
            update = self.updates[int(index) * len(PROJECTIONS) + PROJECTIONS.index(projection)]
            a = self._keep(layer.a)
            update.a, update.stacked, update.in_ = a.data_ptr(), a.shape[0], a.shape[1]
            update.num_slices, update.bf16 = len(layer.slices), int(self.dtype == torch.bfloat16)
            for i, piece in enumerate(layer.slices):
                bt = self._keep(piece.b.T)   # transposed: lora.c sums across outputs
                update.slices[i] = _Slice(bt.data_ptr(), piece.offset, piece.rows, piece.ranks[0], piece.ranks[1],
                                          piece.scale)
        self.address = ctypes.addressof(self.updates)

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        kept = tensor.to(self.dtype).contiguous()
        self.tensors.append(kept)
        return kept


@dataclass
class LoRAStep:
    """A step's rows by adapter: (the adapter's layers, the rows' indices) for the torch path;
    each row's adapter index and the adapters' table addresses for csrc/lora.c."""
    groups: list[tuple[dict[str, LoRALayer], torch.Tensor]]
    row_adapter: torch.Tensor | None = None
    tables: torch.Tensor | None = None


class _LoRAHook:
    """The forward hook of one projection: adds each row's adapter update to its output row."""

    def __init__(self, manager: "LoRAManager", layer: str) -> None:
        self.manager, self.layer = manager, layer
        _, index, projection = layer.split(".")
        self.index = int(index) * len(PROJECTIONS) + PROJECTIONS.index(projection)

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        step = self.manager.step
        if step is None or torch.compiler.is_compiling():
            return None
        x = args[0]
        if step.tables is not None:   # the C kernel: the decode step's own arithmetic
            torch.ops.duoserve.lora_rows(output, x.contiguous(), step.row_adapter, step.tables, self.index)
            return output
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
        self.device = torch.device(getattr(model, "device", "cpu"))
        self.adapters: dict[str, LoRAAdapter] = {}
        # every adapter loaded and not unloaded, by path: one unloaded past --max-loras is read again
        self.known: dict[str, str] = {}
        self.tables: dict[str, AdapterTable] = {}   # csrc/lora.c's, where it is built
        self.c_kernel = c_lora_available()
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
        if any(layer.a.shape[0] > MAX_STACKED for layer in adapter.modules.values()):
            raise LoRALoadError(f"adapter {name!r}: its ranks over a fused projection's parts pass {MAX_STACKED}")
        if self.device.type != "cpu":   # the torch path computes it where the model is
            for layer in adapter.modules.values():
                layer.a = layer.a.to(self.device)
                for piece in layer.slices:
                    piece.b = piece.b.to(self.device)
        if name not in self.adapters and len(self.adapters) >= self.config.max_loras:
            idle = [n for n in self.adapters if not in_use(n)]
            if not idle:
                raise LoRALoadError(f"--max-loras ({self.config.max_loras}) adapters are loaded and every one "
                                    "has requests: unload one, or wait for them")
            victim = min(idle, key=lambda n: self.last_used[n])
            logger.info("unloading LoRA adapter %s (least recently used) for %s", victim, name)
            self.unload(victim, forget=False)
        if self.c_kernel and self.device.type == "cpu":
            self.tables[name] = AdapterTable(adapter, self.arch.num_layers, self.dtype)
        self.adapters[name], self.known[name] = adapter, path
        self.last_used[name] = time.monotonic()
        logger.info("LoRA adapter %s loaded from %s: rank %d, %d layers, %.1f MiB", name, path, adapter.rank,
                    len(adapter.modules), adapter.nbytes() / 2**20)
        return adapter

    def unload(self, name: str, forget: bool = True) -> None:
        """Unload an adapter; ``forget=False`` (past --max-loras) keeps its path to read it again."""
        if forget:
            self.known.pop(name, None)
        self.adapters.pop(name, None)
        self.tables.pop(name, None)
        self.last_used.pop(name, None)

    def digest(self, name: str) -> str | None:
        adapter = self.adapters.get(name)
        return None if adapter is None else adapter.digest

    # ---- steps --------------------------------------------------------------------------------

    def begin_step(self, rows_by_adapter: dict[str, list[int]], num_rows: int, device: torch.device) -> bool:
        """Group the step's rows by adapter; False (nothing to add) for a step of base rows only."""
        if not rows_by_adapter:
            return False
        now = time.monotonic()
        for name in rows_by_adapter:
            self.last_used[name] = now
        if self.tables:   # csrc/lora.c: each row's adapter, and the adapters' tables
            row_adapter = torch.full((num_rows,), -1, dtype=torch.long)
            for i, rows in enumerate(rows_by_adapter.values()):
                row_adapter[rows] = i
            self.step = LoRAStep([], row_adapter, torch.tensor([self.tables[name].address for name in rows_by_adapter],
                                                               dtype=torch.long))
        else:             # torch's matmuls: each adapter's rows as an index
            self.step = LoRAStep([(self.adapters[name].modules, torch.tensor(rows, dtype=torch.long, device=device))
                                  for name, rows in rows_by_adapter.items()])
        return True

    def step_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's rows for the C decode step (None: its adapters go through the hooks only)."""
        step = self.step
        return None if step is None or step.tables is None else (step.row_adapter, step.tables)

    def end_step(self) -> None:
        self.step = None


def adapter_problem(manager: LoRAManager | None, name: str | None, digest: str | None = None,
                    in_use: Callable[[str], bool] = lambda name: True) -> str | None:
    """Why this engine cannot compute a request of adapter ``name`` (None: it can), reading again
    one unloaded past --max-loras. ``digest``: the adapter another engine computed its KV with (a
    handoff), which must be the same adapter."""
    if name is None:
        return None
    if manager is None:
        return f"LoRA adapter {name!r} asked of an engine serving no adapters (start it with --enable-lora)"
    if name not in manager.adapters and name in manager.known:
        try:
            manager.load(name, manager.known[name], in_use)
        except LoRALoadError as exc:
            return str(exc)
    ours = manager.digest(name)
    if ours is None:
        return f"LoRA adapter {name!r} is not loaded (loaded: {', '.join(manager.adapters) or 'none'})"
    if digest is not None and digest != ours:
        return (f"LoRA adapter {name!r} is not the same adapter here as on the engine that computed the "
                "request's KV (their files differ): load the same files on every engine")
    return None
