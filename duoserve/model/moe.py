"""Mixtures of experts: Mixtral, Qwen2-MoE and Qwen3-MoE, the Llama-family decoder with routed MLPs.

In a routed layer each token's MLP is the weighted sum of its top ``experts_per_token`` experts
(each a gate/up/down MLP of its own), chosen by a linear router's softmax; Mixtral and Qwen3-MoE
renormalize the chosen weights to sum to one, Qwen2-MoE does not and adds a shared expert behind a
sigmoid gate. Tokens are grouped by expert, so each expert a step chose runs once over all its
tokens and the others are never read: a decode step reads the active experts' weights, not all of
them. Attention, norms and the rest are ``llama.py``'s.

The routing is data-dependent (which experts run, and over how many tokens), so a compiled step
calls a routed MLP as one opaque op (``worker/compiled.py``). The routing, an expert's weighted
add and the shared expert's add are modules of their own (``TopKRouting``, ``ExpertSum``,
``SharedExpertAdd``), which the runner replaces by ops over the functions the C++ decode step
computes them with (``kernels/glue.py``), so which experts a token takes, and its sums, do not
depend on the path its step took.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from duoserve.model.arch import ModelArch
from duoserve.model.layers import gate_activation
from duoserve.model.llama import DecoderLayer, LlamaModel


class Expert(nn.Module):
    """One gated MLP: down(act(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, hidden: int, intermediate: int, hidden_act: str) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.act = gate_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)))


class TopKRouting(nn.Module):
    """Each token's experts [num_tokens, top_k] (long) and their weights (the logits' dtype) from
    its router logits, as Hugging Face computes them: softmax in float32, top-k, renormalized to
    sum to one where the model says."""

    def __init__(self, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)   # [num_tokens, num_experts]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(logits.dtype)


class ExpertSum(nn.Module):
    """out[rows] += y * weights (one expert's outputs, each row once), in place."""

    def forward(self, out: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> None:
        out.index_add_(0, rows, y * weights.unsqueeze(1))


class SharedExpertAdd(nn.Module):
    """out + sigmoid(gate) * shared: Qwen2-MoE's shared expert behind its one-value gate."""

    def forward(self, out: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return out + torch.sigmoid(gate) * shared


class SparseMoE(nn.Module):
    """A routed MLP: x [num_tokens, hidden] -> [num_tokens, hidden]. ``expert_tokens`` counts the
    tokens each expert has served since load (the experts' load, for the log and metrics)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        h = arch.hidden_size
        self.top_k = arch.experts_per_token
        self.renormalize = arch.norm_topk_prob
        self.router = nn.Linear(h, arch.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(h, arch.moe_intermediate_size, arch.hidden_act)
                                     for _ in range(arch.num_experts))
        self.shared = None
        if arch.shared_expert_intermediate_size:
            self.shared = Expert(h, arch.shared_expert_intermediate_size, arch.hidden_act)
            self.shared_gate = nn.Linear(h, 1, bias=False)
            self.shared_add = SharedExpertAdd()
        self.routing = TopKRouting(self.top_k, self.renormalize)
        self.expert_sum = ExpertSum()
        # explicit device: models are built under a meta device; the C++ decode step counts here too
        self.expert_tokens = torch.zeros(arch.num_experts, dtype=torch.long, device="cpu")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [num_tokens, top_k] (long) and their weights (x's dtype)."""
        return self.routing(self.router(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        flat = chosen.flatten()                                # [num_tokens * top_k]: token t's picks at t*k..
        order = torch.argsort(flat, stable=True)               # the picks grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        pick_weights = weights.flatten()                         # [num_tokens * top_k], in the picks' order
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue   # an expert no token chose is never read
            picks = order[start: start + count]
            start += count
            tokens = picks // self.top_k
            self.expert_sum(out, tokens, self.experts[expert](x[tokens]), pick_weights[picks])
            self.expert_tokens[expert] += count
        if self.shared is not None:
            out = self.shared_add(out, self.shared_gate(x), self.shared(x))
        return out


class MoEDecoderLayer(DecoderLayer):
    """The Llama decoder layer with a routed MLP where ``arch.routed(index)`` (Qwen MoE models can
    keep dense layers: ``mlp_only_layers``, ``decoder_sparse_step``)."""

    def __init__(self, arch: ModelArch, index: int) -> None:
        super().__init__(arch, index)
        self.moe = None
        if arch.routed(index):
            del self.gate_up, self.down
            self.moe = SparseMoE(arch)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return super().mlp(x) if self.moe is None else self.moe(x)


class MoEModel(LlamaModel):
    layer_class = MoEDecoderLayer
