"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from duoserve import envs
from duoserve.engine.builder import build_engine
from duoserve.engine.core import EngineCore
from duoserve.engine_args import EngineArgs
from duoserve.errors import ConfigError
from duoserve.frontend.frontend import Frontend
from duoserve.model.reranker import pair_token_ids
from duoserve.outputs import RequestOutput
from duoserve.sampling_params import EMBEDDING_POOLINGS, LoRARequest, SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


def show_logs_by_default() -> None:
    """Offline use with logging left unconfigured (a script, a notebook): duoserve's INFO lines on
    stderr, as a server prints them, so that a first start that builds kernels and compiles says
    what it is doing. Configuring logging first, or DUOSERVE_CONFIGURE_LOGGING=0, leaves them out."""
    ours = logging.getLogger("duoserve")
    if not envs.DUOSERVE_CONFIGURE_LOGGING or logging.getLogger().handlers or ours.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s duoserve: %(message)s", "%H:%M:%S"))
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)


class LLM:
    """An engine in this process, for batch generation from Python."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """``engine_args``: any field of ``duoserve.engine_args.EngineArgs``, the engine flags'
        names (``dtype``, ``max_model_len``, ``kv_cache_memory``, ..., and ``speculative_config``
        as one dict); an unknown keyword is a TypeError naming it."""
        show_logs_by_default()
        unknown = sorted(set(engine_args) - set(EngineArgs.names()))
        if unknown:
            raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}: its keywords are the fields "
                            f"of duoserve.engine_args.EngineArgs ({', '.join(EngineArgs.names())})")
        self._attach(build_engine(EngineArgs(model=model, **engine_args).create_engine_config()))

    @classmethod
    def from_engine(cls, engine: EngineCore) -> "LLM":
        """Wrap an engine built elsewhere (e.g. over an already loaded model)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: EngineCore) -> None:
        self.engine = engine
        self.frontend = Frontend(engine)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None) -> list[list[float]]:
        """One L2-normalised vector per prompt: its final hidden states pooled, the ``last`` token's
        or the ``mean`` of all (vLLM's ``LLM.embed``; what /v1/embeddings returns). ``None``: what
        the model file says, else last."""
        pooling = pooling or self.engine.loaded.pooling or "last"
        if pooling not in EMBEDDING_POOLINGS:
            raise ConfigError("pooling", pooling, f"one of {', '.join(EMBEDDING_POOLINGS)} (a score is LLM.score's)")
        outputs = self.generate(prompts, SamplingParams(max_tokens=0, pooling=pooling), use_tqdm=False)
        return [out.embedding for out in outputs]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[float]:
        """A reranker's relevance of each pair (vLLM's ``LLM.score``, what /score returns): one
        text_1 against each text_2, or pairwise."""
        reranker = self.engine.loaded.reranker
        if reranker is None:
            raise ConfigError("model", str(self.engine.loaded.path), "a reranker: a cross-encoder, or a causal LM "
                              "with hf_overrides' classifier_from_token")
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds) or not seconds:
            raise ValueError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1 or as many "
                             "of each (and at least one text_2)")
        template = self.engine.loaded.score_template
        prompts = [pair_token_ids(self.engine.tokenizer, reranker, a, b, template) for a, b in zip(firsts, seconds)]
        outputs = self.generate(prompts, SamplingParams(max_tokens=0, pooling="score"), use_tqdm=False)
        for index, out in enumerate(outputs):
            if out.pooled is None:   # ended without its score (the engine's error)
                raise RuntimeError(f"pair {index} got no score: {out.outputs[0].error if out.outputs else 'none'}")
        return [out.pooled[0] for out in outputs]

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Complete every prompt (strings or token-id lists); outputs come back in input order.
        ``priority``: one per prompt, lower first (vLLM's; needs ``scheduling_policy="priority"``).
        ``lora_request``: the adapter computing every prompt, or one per prompt (None: the base
        model); each is loaded on first use (needs ``enable_lora=True`` or ``lora_modules``)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams: "
                             "give one, or one per prompt")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities: give one per prompt")
            params_list = [dataclasses.replace(sp, priority=p) for sp, p in zip(params_list, priority)]
        if lora_request is not None:
            loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests: give one per prompt")
            params_list = [sp if lora is None else dataclasses.replace(sp, lora_name=self._adapter(lora))
                           for sp, lora in zip(params_list, loras)]
        for sp in params_list:
            self.engine.config.scheduler.check_priority(sp.priority)
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params_list):
                ids.append(self.frontend.add_request(prompt, sp))
        except Exception:  # one bad prompt: nothing of this call stays in the engine
            for request_id in ids:
                self.frontend.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _adapter(self, lora: LoRARequest) -> str:
        """The adapter's name, loaded first where it is not (or was loaded from elsewhere)."""
        manager = self.engine.runner.lora
        if manager is None:
            raise ConfigError("lora_request", lora.lora_name, "None for an LLM made without enable_lora=True or "
                              "lora_modules")
        loaded = manager.adapters.get(lora.lora_name)
        if loaded is None or (lora.lora_path and loaded.path != lora.lora_path):
            if not lora.lora_path:
                raise ConfigError("lora_request", lora.lora_name, "a LoRARequest with lora_path: the adapter is "
                                  "not loaded")
            manager.load(lora.lora_name, lora.lora_path, in_use=self.engine.adapter_in_use)
        return lora.lora_name

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(c, add_generation_prompt),
                                    add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm)
        try:
            while self.frontend.has_unfinished():
                for out in self.frontend.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request_id in request_ids:
                self.frontend.abort(request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in request_ids]
