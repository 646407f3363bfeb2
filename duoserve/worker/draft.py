"""The draft model of speculative decoding: a second, cheaper model in the same engine.

Its KV cache has the target's block layout and is indexed by the same block tables: a
request's draft KV sits in the blocks the scheduler gave the request, in separate tensors,
so the draft needs no allocator of its own and is freed with the request.
``Request.num_draft_computed`` says how many of the request's tokens the draft holds.

Before the target's forward, for every request with guess slots, the draft *catches up*
(computes its tokens from ``num_draft_computed`` to the last known one, in one batched
forward: usually one or two tokens; the whole prompt on the first step after a prefill, a
prefix-cache hit or a KV handoff, since the draft never ran there), draws the first guess,
and then one batched single-token forward per further guess. A step catches up at most
``max_catch_up`` tokens in all (the engine's token budget); a request whose catch-up does
not fit guesses nothing this step and catches up the rest later.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from duoserve.config import ModelConfig, SpeculativeConfig
from duoserve.core.outputs import ScheduledRequest
from duoserve.errors import ConfigError
from duoserve.model.arch import ModelArch
from duoserve.model.attention import AttentionMetadata
from duoserve.model.loader import LoadedModel
from duoserve.worker.backends import load_model, use_cpu_kernels
from duoserve.worker.kv_cache import allocate_kv_cache
from duoserve.worker.sampler import STREAM_DRAFT, SamplingRow, sample_tensor

logger = logging.getLogger(__name__)


def load_draft(spec: SpeculativeConfig, target_config: ModelConfig, target: LoadedModel,
               max_model_len: int) -> LoadedModel:
    """Load the draft model (the target's own file when ``spec.model`` is unset) in the target's
    dtype and device, and refuse one that does not fit the target (``check_compatible``)."""
    config = dataclasses.replace(target_config, model=spec.model or str(target.path), quantization=spec.quantization,
                                 gguf_mode=spec.gguf_mode, max_model_len=None, hf_overrides={},
                                 dtype=str(target.dtype).removeprefix("torch."))
    draft = load_model(config)
    check_compatible(target, draft, max_model_len)
    if max_model_len > draft.arch.max_position_embeddings:   # YaRN/dynamic past its trained context: longer tables
        draft = load_model(dataclasses.replace(config, max_model_len=max_model_len))
    logger.info("speculative decoding with draft model %s (%s), %d tokens a step", draft.path.name,
                draft.quantization, spec.num_speculative_tokens)
    return draft


def _special_ids(loaded: LoadedModel) -> dict:
    source = loaded.tokenizer or loaded.arch
    return {"bos": source.bos_token_id, "eos": tuple(source.eos_token_ids)}


def _tokenizer_digest(loaded: LoadedModel) -> str | None:
    if loaded.tokenizer is None:
        return None
    return loaded.tokenizer.vocabulary_digest()[:16]


def approximate_parameters(arch: ModelArch) -> int:
    """Weights of a decoder of this shape (embedding, attention, MLP), for comparing sizes."""
    attention = arch.hidden_size * arch.head_dim * (2 * arch.num_heads + 2 * arch.num_kv_heads)
    mlp = 3 * arch.hidden_size * arch.intermediate_size
    return arch.vocab_size * arch.hidden_size + arch.num_layers * (attention + mlp)


def check_compatible(target: LoadedModel, draft: LoadedModel, max_model_len: int) -> None:
    """A draft must speak the target's tokens: same vocabulary size, special token ids and
    tokenizer, and a context at least the target's. A ``ConfigError`` names the value and both
    sides; a draft bigger than the target only gets a warning (it will not pay)."""
    checks = [
        ("vocab_size", target.arch.vocab_size, draft.arch.vocab_size),
        ("special token ids", _special_ids(target), _special_ids(draft)),
        ("tokenizer", _tokenizer_digest(target), _tokenizer_digest(draft)),
    ]
    for name, want, got in checks:
        if want != got:
            raise ConfigError("speculative_model", str(draft.path),
                              f"a draft with the target's {name} (target {want!r}, draft {got!r})")
    draft_context = draft.arch.rope.max_context(draft.arch.max_position_embeddings)   # the target's rule
    if draft_context < max_model_len:
        raise ConfigError("speculative_model", str(draft.path),
                          f"a draft whose context covers the target's max_model_len (target {max_model_len}, "
                          f"draft {draft_context})", "Lower --max-model-len")
    target_size, draft_size = approximate_parameters(target.arch), approximate_parameters(draft.arch)
    if draft_size > target_size:
        logger.warning("the draft model (~%.0fM parameters) is larger than the target (~%.0fM): speculation "
                       "will cost more than it saves", draft_size / 1e6, target_size / 1e6)


class DraftRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: str, seed: int = 0, compile_model: bool = False, max_catch_up: int = 512) -> None:
        self.model = loaded.model
        if self.model.device.type == "cpu":
            use_cpu_kernels(self.model, kv_dtype)
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_catch_up = max_catch_up
        self.kv_caches = allocate_kv_cache(loaded.arch, num_blocks, block_size, kv_dtype, device)
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.forward = self.model
        if compile_model:
            from duoserve.worker.compiled import CompiledModel

            try:
                compiled = CompiledModel(self.model, self.kv_caches)
                seconds = compiled.warm_up(block_size)
            except Exception as exc:  # noqa: BLE001 - the eager draft works, only slower
                logger.warning("cannot compile the draft model, running it eagerly: %s", exc)
            else:
                self.forward = compiled
                logger.info("compiled the draft model step in %.1fs", seconds)

    def _run(self, seqs: list[tuple[ScheduledRequest, int, int]], tokens: list[list[int]]) -> torch.Tensor:
        """One draft forward: per sequence (item, first position, end position) and its tokens;
        one-token sequences must come first. Returns the hidden state of each sequence's last token."""
        flat = [t for ts in tokens for t in ts]
        positions = [p for _, start, end in seqs for p in range(start, end)]
        meta = AttentionMetadata.build([end - start for _, start, end in seqs], [end for _, _, end in seqs],
                                       [item.block_ids for item, _, _ in seqs], self.block_size, self.device)
        hidden = self.forward(torch.tensor(flat, device=self.device), torch.tensor(positions, device=self.device),
                              self.kv_caches, meta)
        last = torch.tensor([0] + [end - start for _, start, end in seqs]).cumsum(0)[1:] - 1
        return hidden[last.to(hidden.device)]

    def _draw(self, items: list[ScheduledRequest], hidden: torch.Tensor, step: int,
              probs_out: dict[str, list[torch.Tensor]]) -> None:
        """Draw guess ``step`` of each item from the draft's logits (its distribution kept for
        sampled requests: the verification's q)."""
        rows = []
        for item in items:
            request = item.request
            params = request.params
            stop_ids = tuple(params.stop_token_ids) + (() if params.ignore_eos else request.eos_token_ids)
            rows.append(SamplingRow(params, request.num_output_tokens + step, request.sample_index,
                                    request.prompt_token_ids, request.output_token_ids + item.spec_token_ids,
                                    stop_ids))
        logits = self.model.compute_logits(hidden).float()
        tokens, probs, sampled = sample_tensor(logits, rows, self.generator, STREAM_DRAFT)
        for item, token in zip(items, tokens.tolist()):
            item.spec_token_ids.append(token)
        for row, index in enumerate(sampled):
            probs_out.setdefault(items[index].request.request_id, []).append(probs[row])

    @torch.inference_mode()
    def propose(self, items: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
        """Fill each item's guess slots; returns the draft's distributions [k, vocab] of the
        requests that sample (greedy guesses are point guesses and need none)."""
        spec = [item for item in items if item.num_spec_tokens]
        if not spec:
            return {}
        catch_up = []
        room = self.max_catch_up
        for item in spec:
            request = item.request
            start, end = request.num_draft_computed, request.num_tokens
            if end - start > room:  # a long catch-up: a chunk now, guesses later
                end = start + room
                item.drop_guesses(0)
            if end > start:
                catch_up.append((item, start, end))
                room -= end - start
        catch_up.sort(key=lambda seq: seq[2] - seq[1] != 1)
        hidden = self._run(catch_up, [item.request.token_ids(start, end) for item, start, end in catch_up])
        for item, _, end in catch_up:
            item.request.num_draft_computed = end
        probs: dict[str, list[torch.Tensor]] = {}
        # the slots come empty from the scheduler; num_spec_tokens says how many to fill
        guessing = [(i, item) for i, (item, _, _) in enumerate(catch_up) if item.num_spec_tokens]
        if guessing:
            self._draw([item for _, item in guessing], hidden[[i for i, _ in guessing]], 0, probs)
        step = 1
        active = [item for _, item in guessing if item.num_spec_tokens > 1]
        while active:
            seqs = [(item, item.request.num_tokens + step - 1, item.request.num_tokens + step) for item in active]
            hidden = self._run(seqs, [[item.spec_token_ids[-1]] for item in active])
            for item, _, end in seqs:
                item.request.num_draft_computed = end
            self._draw(active, hidden, step, probs)
            step += 1
            active = [item for item in active if item.num_spec_tokens > step]
        return {request_id: torch.stack(rows) for request_id, rows in probs.items()}
