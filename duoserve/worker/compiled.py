"""The compiled model step: the decoder run through ``torch.compile`` (Inductor's CPU backend).

In eager mode every norm, rotary, residual add and activation of every layer is its own
torch call with its own Python and dispatch overhead, which at one or a few sequences costs
as much as streaming the weights. Compiled, the decoder is one call per step, with no Python
between its kernels. Inductor does not trace into the layer's small ops (norms, rotary,
SiLU-and-multiply: ``duoserve.kernels.glue``): each is one op call, the same as in an eager
step, so compiled and eager steps compute the same bits (its own fused loops would sum in
another order and round elsewhere, and on the GGUF fast path a moved bit moves tokens).

The model code is not touched: at the edge each layer's attention module (the C kernels' or
the torch reference) is wrapped in ``OpAttention``, a routed MLP (``model/moe.py``) in ``EagerModule``
(which experts run depends on the tokens), and the CPU linears are ops while compiling
(``duoserve.kernels.ops``), so the graph is whole and its only inputs are the token ids
and positions. Their length is an unbacked dynamic size: one graph serves every token
count, a single decode token included (a plain dynamic size would specialize 1 into a
second graph: twice the compile time); ``num_compiles`` counts the graphs. Compiled code is cached on disk under
``~/.cache/duoserve/inductor`` (Inductor's FX graph cache), so a later start only traces. The
step's wrapper is generated as C++ (``cpp_wrapper``): its kernels and the custom ops are called
without Python between them (faster decode steps, a longer first compile: BENCHMARKS.md).

Once warmed up with a single graph, a step skips Dynamo altogether: the bytecode Dynamo wrote
for the step (which calls the compiled graph) is kept when it is made and then called as a
plain function. Dynamo would otherwise check its guards, one per model parameter among them,
before every step, a noticeable part of a one-sequence step. Nothing a guard protects can
change between steps (the weights are fixed, the token count is a dynamic size, the caches
and the metadata are not graph inputs); with more than one graph the guards choose between
them, and every call goes through Dynamo as before (as it does with
``DUOSERVE_COMPILED_GUARDS=1``, which the tests use to show that no step would recompile).
"""

from __future__ import annotations

import logging
import os
import time
import types

import torch
from torch import nn

from duoserve import envs
from duoserve.kernels.attention import OpAttention
from duoserve.kernels.ops import EagerModule, StepContext, register_context
from duoserve.model.attention import AttentionMetadata
from duoserve.model.paths import cache_dir
from duoserve.worker.fused_decode import fused_step

logger = logging.getLogger(__name__)


class CompiledModel:
    """``model(input_ids, positions, kv_caches, meta)`` with the decoder compiled; counts compilations."""

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if (envs.TORCHINDUCTOR_CACHE_DIR or default_cache_dir()) == default_cache_dir():
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir("inductor"))  # unless the user chose one
        self.context = StepContext(kv_caches, [layer.attn for layer in model.layers])
        handle = register_context(self.context, owner=self)
        for i, layer in enumerate(model.layers):
            layer.attn = OpAttention(layer.attn, handle, i)
            if getattr(layer, "moe", None) is not None:   # routed MLPs: data-dependent, run eagerly
                layer.moe = EagerModule(layer.moe)
        self.model = model
        self.num_compiles = 0
        placeholders = [None] * len(kv_caches)

        # Inductor's C++ wrapper: the compiled step calls its kernels and ops from C++ rather than
        # from a generated Python function (~450 lines a step); TORCHINDUCTOR_CPP_WRAPPER=0 keeps Python
        self.cpp_wrapper = envs.TORCHINDUCTOR_CPP_WRAPPER

        def backend(graph, example_inputs):
            from torch._inductor.compile_fx import compile_fx

            self.num_compiles += 1
            return compile_fx(graph, example_inputs, config_patches={"cpp_wrapper": self.cpp_wrapper})

        def step(ids, pos):
            return model(ids, pos, placeholders, None)

        # a code object of its own: dynamo keeps compiled entries and its dynamic-shape decisions
        # per code object, and a second compiled model in the process (a draft) must not meet the
        # first one's (its different constants would turn them into symbols and restart the trace)
        step.__code__ = step.__code__.replace(co_name=f"step_{handle}")
        self._forward = torch.compile(step, backend=backend, fullgraph=True)
        self._step = step
        self._direct = None            # the step's compiled bytecode as a function, once warm
        self._bytecodes: list[types.CodeType] = []

        def keep(old: types.CodeType, new: types.CodeType) -> None:
            if old is step.__code__:
                self._bytecodes.append(new)

        self._hook = torch._dynamo.convert_frame.register_bytecode_hook(keep)

        # a step of decodes runs whole in C++ where the model allows it (fused_decode.py)
        self.fused = fused_step(model, kv_caches, self.context, "the compiled graph")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata):
        if self.fused is not None and self.fused.serves(meta, input_ids.shape[0]):
            return self.fused(input_ids, positions, meta)
        return self.graph(input_ids, positions, meta)

    def graph(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step through the compiled graph, whatever its size."""
        self.context.begin(meta)
        try:
            if self._direct is not None:
                return self._direct(input_ids, positions)
            torch._dynamo.decorators.mark_unbacked(input_ids, 0)   # for Dynamo: one graph for every count
            torch._dynamo.decorators.mark_unbacked(positions, 0)
            return self._forward(input_ids, positions)
        finally:
            self.context.end()

    @torch.inference_mode()
    def warm_up(self, block_size: int) -> float:
        """Compile before the first request (and run one token and two through it); returns seconds."""
        start = time.monotonic()
        for num_tokens in (1, 2):
            meta = AttentionMetadata.build([num_tokens], [num_tokens], [[0]], block_size)
            self.graph(torch.zeros(num_tokens, dtype=torch.long), torch.arange(num_tokens), meta)
        self._hook.remove()
        guarded = envs.DUOSERVE_COMPILED_GUARDS
        if self.num_compiles == 1 and len(self._bytecodes) == 1 and not guarded:
            step = self._step   # same globals (Dynamo put the compiled graph there) and closure
            self._direct = types.FunctionType(self._bytecodes[0], step.__globals__, step.__name__,
                                              step.__defaults__, step.__closure__)
        return time.monotonic() - start
