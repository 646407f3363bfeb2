"""The model runner: owns the model and its KV tensors, runs one batch per step.

``execute`` turns a ``SchedulerOutput`` into tensors (token ids, positions, slot
mapping, block tables) once per step, runs one forward over every scheduled token,
computes logits only where they are needed (the last token of a sequence, or prompt
tokens whose log-probabilities were asked for) and samples. A speculating request's guesses
(filled in here by the draft model, if there is one) are computed with its last token and
checked against the target's logits (``duoserve.worker.spec_verify``). A request with a
grammar (structured outputs) draws from its token mask, computed on a second thread while the
forward runs (``duoserve.worker.grammar_masks``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from duoserve import envs
from duoserve.core.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from duoserve.kv.reblock import insert_kv
from duoserve.kv.staging import to_device
from duoserve.model.attention import AttentionMetadata
from duoserve.model.loader import LoadedModel
from duoserve.structured.grammar import GrammarError
from duoserve.worker.backends import use_cpu_kernels
from duoserve.worker.fused_decode import EagerDecodeStep
from duoserve.worker.grammar_masks import GrammarMasks, StepMasks
from duoserve.worker.kv_cache import allocate_kv_cache
from duoserve.worker.lora import LoRAManager
from duoserve.worker.sampler import SamplingRow, logprobs_of, sample_tensor, top_logprobs
from duoserve.worker.spec_verify import verify

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: str, seed: int = 0, compile_model: bool = False) -> None:
        self.model = loaded.model
        if self.model.device.type == "cpu":
            use_cpu_kernels(self.model, kv_dtype)
        self.arch = loaded.arch
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv_caches = allocate_kv_cache(self.arch, num_blocks, block_size, kv_dtype, device)
        self.generator = torch.Generator().manual_seed(seed)
        self.forward = self.model
        self.compiled = False   # the step runs as one compiled graph (no Python between its layers)
        if compile_model:
            self._compile(block_size)
        elif self.model.device.type == "cpu":
            self.forward = EagerDecodeStep(self.model, self.kv_caches)
        self.drafter = None  # speculative decoding's draft model (a DraftRunner), when there is one
        self.grammar_masks: GrammarMasks | None = None   # structured outputs (the builder sets it)
        self._mask_thread: ThreadPoolExecutor | None = None
        self.swap_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the swap space (allocate_swap)
        self.swap_seconds = 0.0   # time spent copying to and from it, and bytes copied (cumulative)
        self.swap_bytes = 0
        # a yes/no reranker's (model/reranker.py): its tokens' logits, or a GGUF file's rows for them
        self.classifier_token_ids = list(loaded.classifier_token_ids)
        self.classifier_head = loaded.classifier_head
        self.lora: LoRAManager | None = None   # LoRA adapters (the builder sets it up where asked)

    def allocate_swap(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        """Host-memory blocks of the KV cache's layout for swapped-out requests (pinned for a GPU)."""
        self.swap_caches = allocate_kv_cache(self.arch, num_blocks, block_size, kv_dtype, "cpu")
        self.block_bytes = sum(2 * k[0].numel() * k.element_size() for k, _ in self.kv_caches)  # K and V, all layers
        if self.device.type == "cuda":
            self.swap_caches = [(k.pin_memory(), v.pin_memory()) for k, v in self.swap_caches]

    def swap_blocks(self, pairs: list[tuple[int, int]], out: bool) -> None:
        """Copy blocks KV cache -> swap space (``out``), or swap space -> KV cache: (source, destination)."""
        start = time.perf_counter()
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        sources, targets = (self.kv_caches, self.swap_caches) if out else (self.swap_caches, self.kv_caches)
        for (src_k, src_v), (dst_k, dst_v) in zip(sources, targets):
            for a, b in ((src_k, dst_k), (src_v, dst_v)):
                b.index_copy_(0, dst.to(b.device), a.index_select(0, src.to(a.device)).to(b.device))
        self.swap_seconds += time.perf_counter() - start
        self.swap_bytes += self.block_bytes * len(pairs)

    def _compile(self, block_size: int) -> None:
        """Compile the model step; on any failure (no C++ compiler, say) say why once and stay eager."""
        from duoserve.worker.compiled import CompiledModel

        logger.info("compiling the model step (minutes the first time; a later start reads the compile cache)")
        try:
            compiled = CompiledModel(self.model, self.kv_caches)
            seconds = compiled.warm_up(block_size)
        except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager model, which works
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            logger.warning("cannot compile the model step, running it eagerly (as without --compile): %s", reason)
            return
        self.forward, self.compiled = compiled, True
        logger.info("compiled the model step in %.1fs (graphs: %d; cache in %s)", seconds, compiled.num_compiles,
                    envs.TORCHINDUCTOR_CACHE_DIR)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if plan.block_copies:  # a forked sample's tail block, before that sample may be swapped out
            self.copy_blocks(plan.block_copies)
        if plan.swap_out:  # before the forward: the blocks may be handed to other requests in it
            self.swap_blocks(plan.swap_out, out=True)
        if plan.swap_in:
            self.swap_blocks(plan.swap_in, out=False)
        if plan.block_loads:
            self.load_blocks(plan.block_loads)
        for _, block_ids, transfer in plan.kv_inserts:
            staged = to_device([*transfer.keys, *transfer.values], self.kv_caches[0][0].device)
            layers = len(transfer.keys)
            insert_kv(self.kv_caches, block_ids, staged[:layers], staged[layers:])
        draft_probs = self.drafter.propose(plan.scheduled) if self.drafter is not None else {}
        # one-token sequences first (a request whose guesses the draft dropped is one now)
        items = sorted(plan.scheduled, key=lambda s: s.num_new_tokens != 1)
        token_ids: list[int] = []
        positions: list[int] = []
        adapter_rows: dict[str, list[int]] = {}   # a LoRA adapter's rows of the step
        for item in items:
            if item.request.params.lora_name is not None:
                adapter_rows.setdefault(item.request.params.lora_name, []).extend(
                    range(len(positions), len(positions) + item.num_new_tokens))
            token_ids.extend(item.request.token_ids(item.start, item.start + item.num_known_tokens))
            token_ids.extend(item.spec_token_ids)
            positions.extend(range(item.start, item.start + item.num_new_tokens))
        meta = AttentionMetadata.build(
            [i.num_new_tokens for i in items], [i.start + i.num_new_tokens for i in items],
            [i.block_ids for i in items], self.block_size, self.device)
        rows, row_hidden, owners = self._sampling_rows(items)
        masks = self._start_masks(owners)   # computed on another thread while the forward runs
        # adapter rows: the C++ decode step adds them (meta.lora), the eager model's hooks likewise;
        # a compiled graph calls no hook, so such a step runs the eager model
        forward = self.forward
        if self.lora is not None and self.lora.begin_step(adapter_rows, len(positions), self.device):
            meta.lora = self.lora.step_rows()
            if self.compiled or meta.lora is None:
                forward = self.model
        try:
            hidden = forward(torch.tensor(token_ids, device=self.device),
                             torch.tensor(positions, device=self.device), self.kv_caches, meta)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        output = RunnerOutput(sampled={})
        if rows:
            self._sample(rows, row_hidden, owners, hidden, output, draft_probs,
                         masks.result() if masks is not None else None)
        self._prompt_logprobs(items, hidden, output)
        self._pool(items, hidden, output)
        return output

    @staticmethod
    def _sampling_rows(items: list[ScheduledRequest]) -> tuple[list[SamplingRow], list[int], list]:
        """Rows to sample: the last token of a sequence (n rows for an n > 1 prompt's first token),
        and for a speculating request its last known token and each guess; the hidden state each
        reads, and each sampling item with its first row."""
        rows: list[SamplingRow] = []
        row_hidden: list[int] = []
        owners: list[tuple[ScheduledRequest, int]] = []  # (item, its first row)
        offset = 0
        for item in items:
            offset += item.num_new_tokens
            if not item.sample:
                continue
            request = item.request
            params = request.params
            stop_ids = tuple(params.stop_token_ids) + (() if params.ignore_eos else request.eos_token_ids)
            guesses = item.spec_token_ids
            owners.append((item, len(rows)))
            for k in range(item.num_samples + len(guesses)):
                index = request.sample_index if item.num_samples == 1 else k
                outputs = request.output_token_ids + guesses[:k] if guesses else request.output_token_ids
                rows.append(SamplingRow(params, request.num_output_tokens + (k if guesses else 0), index,
                                        request.prompt_token_ids, outputs, stop_ids))
                row_hidden.append(offset - 1 - (len(guesses) - k if guesses else 0))
        return rows, row_hidden, owners

    def _start_masks(self, owners: list) -> Future | None:
        """Structured outputs: the step's token masks, started on the mask thread (llguidance
        drops the GIL), or None when no request of the step has a grammar."""
        if self.grammar_masks is None or not any(item.request.params.structured_outputs for item, _ in owners):
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="masks")
        return self._mask_thread.submit(self.grammar_masks.fill, owners)

    def _sample(self, rows: list[SamplingRow], row_hidden: list[int], owners: list, hidden: torch.Tensor,
                output: RunnerOutput, draft_probs: dict[str, torch.Tensor], masks: StepMasks | None) -> None:
        logits = self.model.compute_logits(hidden[row_hidden])  # [rows, vocab] float32
        allowed = masks.apply(logits) if masks is not None else logits  # what may be drawn
        drawn, _, _ = sample_tensor(allowed, rows, self.generator)
        tokens, all_logprobs = drawn.tolist(), logprobs_of(logits, rows, drawn)
        for (item, start), (_, end) in zip(owners, [*owners[1:], (None, len(rows))]):
            request_id = item.request.request_id
            if masks is not None and request_id in masks.failed:
                output.failed[request_id] = masks.failed[request_id]
                continue
            if item.spec_token_ids:
                kept, logprobs = verify(allowed[start:end], rows[start:end], tokens[start:end], item.spec_token_ids,
                                        draft_probs.get(request_id), self.generator, raw=logits[start:end])
            else:
                kept, logprobs = tokens[start:end], all_logprobs[start:end]
            output.sampled[request_id] = kept
            if logprobs[0] is not None:
                output.logprobs[request_id] = logprobs
            if masks is not None and item.request.params.structured_outputs is not None:
                try:
                    output.grammar_ended[request_id] = self.grammar_masks.accept(item, kept)
                except GrammarError as exc:
                    output.failed[request_id] = str(exc)

    def _prompt_logprobs(self, items: list[ScheduledRequest], hidden: torch.Tensor, output: RunnerOutput) -> None:
        """Log-probabilities of each prompt token given the ones before it (the first has none)."""
        offset = 0
        for item in items:
            first, offset = offset, offset + item.num_new_tokens
            if not item.prompt_logprobs:
                continue
            request = item.request
            # position p predicts token p + 1: score the prompt tokens this chunk predicts
            end = min(item.start + item.num_new_tokens, request.num_prompt_tokens - 1)
            if end <= item.start:
                output.prompt_logprobs[request.request_id] = []
                continue
            count = end - item.start
            logits = self.model.compute_logits(hidden[first:first + count])  # [count, vocab]
            targets = torch.tensor(request.prompt_token_ids[item.start + 1:end + 1], device=logits.device)
            lp = torch.log_softmax(logits, dim=-1)
            entries: list[TokenLogprobs] = top_logprobs(lp, targets, [request.params.prompt_logprobs] * count)
            output.prompt_logprobs[request.request_id] = entries

    def _pool(self, items: list[ScheduledRequest], hidden: torch.Tensor, output: RunnerOutput) -> None:
        """Embeddings: each pooling request's final hidden states, summed over its prompt's chunks
        (a chunk from position 0 starts the sum again: the prompt is being computed anew), and
        given out when its last chunk is done. A score: the last token's logits of the yes/no
        reranker's tokens, softmaxed, the last one's share."""
        offset = 0
        for item in items:
            first, offset = offset, offset + item.num_new_tokens
            request = item.request
            pooling = request.params.pooling
            if pooling is None or item.start >= request.num_prompt_tokens:
                continue
            rows = hidden[first:offset].float()   # [num_new_tokens, hidden]
            if pooling == "mean":
                total = rows.sum(dim=0) if item.start == 0 else request.pool_sum + rows.sum(dim=0)
                request.pool_sum = total
            if item.start + item.num_new_tokens == request.num_prompt_tokens:
                if pooling == "score":
                    if self.classifier_head is not None:
                        logits = self.classifier_head @ hidden[offset - 1].float()
                    elif self.classifier_token_ids:
                        logits = self.model.compute_logits(hidden[offset - 1:offset])[0, self.classifier_token_ids]
                    else:
                        output.failed[request.request_id] = "this model is no reranker: it gives no score"
                        continue
                    output.pooled[request.request_id] = [torch.softmax(logits.float(), dim=0)[-1].item()]
                    continue
                vector = request.pool_sum / request.num_prompt_tokens if pooling == "mean" else rows[-1]
                output.pooled[request.request_id] = vector.tolist()
                request.pool_sum = None

    @torch.inference_mode()
    def scratch_forward(self, num_tokens: int) -> None:
        """One prefill chunk of ``num_tokens`` into the first blocks (nobody's yet), for measuring
        its temporary memory at start."""
        blocks = list(range(-(-num_tokens // self.block_size)))
        meta = AttentionMetadata.build([num_tokens], [num_tokens], [blocks], self.block_size, self.device)
        hidden = self.forward(torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                              torch.arange(num_tokens, device=self.device), self.kv_caches, meta)
        self.model.compute_logits(hidden[-1:])

    def load_blocks(self, loads: list[tuple[int, object]]) -> None:
        """Write blocks found in the shared KV store: (block id, (K, V) per layer [block_size, ...])."""
        block_ids = [block_id for block_id, _ in loads]
        keys = [torch.cat([kv[0][layer] for _, kv in loads]) for layer in range(len(self.kv_caches))]
        values = [torch.cat([kv[1][layer] for _, kv in loads]) for layer in range(len(self.kv_caches))]
        insert_kv(self.kv_caches, block_ids, keys, values)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
