"""Input processing: a prompt and its SamplingParams in, a ``Request`` for the engines and a
``RequestState`` for the output processor out.

It tokenizes text prompts, checks token ids against the vocabulary and the prompt against
the context length, refuses a grammar (structured outputs) that cannot be enforced exactly,
and gives each sample its incremental detokenizer. It knows the model
only by value (tokenizer, vocabulary size, eos ids) and is told the context length at each
call (an engine group lowers it when a smaller engine joins); it calls no engine.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from duoserve.core.request import Request
from duoserve.errors import InvalidInputError
from duoserve.frontend.detokenizer import IncrementalDetokenizer
from duoserve.frontend.output_processor import RequestState
from duoserve.model.reranker import scores_only_reason
from duoserve.model.tokenizer import Tokenizer
from duoserve.outputs import CompletionOutput
from duoserve.sampling_params import SamplingParams
from duoserve.structured.grammar import GrammarCompiler

_CHECKED_GRAMMARS = 256   # specs known to be enforceable, not checked again


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: tuple[int, ...],
                 reranker: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.reranker = reranker   # what kind of reranker the model is (LoadedModel.reranker), or None
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_ids) if tokenizer is not None else None
        self._checked: OrderedDict[tuple, None] = OrderedDict()
        self.num_constrained = 0          # requests with a grammar: accepted, refused (the metrics)
        self.num_rejected_grammars = 0

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the text, if it was text; the token ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidInputError("prompt", "this model has no tokenizer: send token ids instead of text")
            ids = self.tokenizer.encode(prompt)
            if not ids:   # "" (OpenAI's API allows it): the model starts a new document
                start = self.tokenizer.bos_token_id
                if start is None and not self.eos_token_ids:   # an encoder: nothing starts a document
                    raise InvalidInputError("prompt", "the prompt is empty: give at least one token")
                ids = [start if start is not None else self.eos_token_ids[0]]
            return prompt, ids
        ids = list(prompt)
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidInputError("prompt", f"token id {bad[0]!r} is out of range: ids are integers in [0, {vocab})")
        return None, ids

    @staticmethod
    def check_length(prompt_ids: list[int], params: SamplingParams, max_model_len: int, strict: bool) -> None:
        """Refuse an empty prompt, or one with no room for a token; ``strict`` also counts max_tokens."""
        if not prompt_ids:
            raise InvalidInputError("prompt", "the prompt is empty: give at least one token")
        num = len(prompt_ids)
        room = max_model_len if params.pooling is not None else max_model_len - 1   # a pooled prompt generates nothing
        if num > room:
            raise InvalidInputError(
                "prompt", f"the prompt has {num} tokens, but the context length (max_model_len) is "
                          f"{max_model_len}: at most {room} prompt tokens fit")
        if strict and params.max_tokens is not None and num + params.max_tokens > max_model_len:
            raise InvalidInputError(
                "max_tokens", f"this model's context length is {max_model_len} tokens, but the request "
                              f"asks for {num + params.max_tokens} ({num} in the prompt + {params.max_tokens} "
                              "max_tokens); lower max_tokens or shorten the prompt")

    def check_task(self, params: SamplingParams) -> None:
        """A cross-encoder (or a reranker without its head) only scores; a score needs a reranker."""
        reason = scores_only_reason(self.reranker)
        if reason is not None and params.pooling != "score":
            raise InvalidInputError("model", reason)
        if params.pooling == "score" and self.reranker is None:
            raise InvalidInputError("model", "this model is no reranker: serve a cross-encoder, or a causal LM "
                                    "with hf_overrides' classifier_from_token (a yes/no reranker)")

    def validate(self, prompt: str | list[int], params: SamplingParams, max_model_len: int,
                 strict_length: bool) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt: (its text or None, its token ids)."""
        self.check_task(params)
        text, prompt_ids = self.tokenize_prompt(prompt)
        self.check_length(prompt_ids, params, max_model_len, strict_length)
        self.check_tokens(params)
        if params.structured_outputs is not None:
            self.check_grammar(params)
        return text, prompt_ids

    def check_tokens(self, params: SamplingParams) -> None:
        """The token ids of logit_bias and allowed_token_ids are the model's."""
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidInputError(name, f"token id {bad[0]} is out of range: ids are integers in "
                                              f"[0, {self.vocab_size})")

    def check_grammar(self, params: SamplingParams) -> None:
        spec = params.structured_outputs
        if self.grammars is None:
            raise InvalidInputError(spec.param, "this model has no tokenizer: its outputs cannot follow a grammar")
        if spec.key in self._checked:
            self._checked.move_to_end(spec.key)
            self.num_constrained += 1
            return
        try:
            self.grammars.check(spec)
        except InvalidInputError:
            self.num_rejected_grammars += 1
            raise
        self.num_constrained += 1
        self._checked[spec.key] = None
        while len(self._checked) > _CHECKED_GRAMMARS:
            self._checked.popitem(last=False)

    def bad_words_tokens(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's rule: each word as it starts a text and, when that is another token sequence of
        the same length, after a space."""
        if self.tokenizer is None:
            raise InvalidInputError("bad_words", "this model has no tokenizer: bad words cannot be found")
        sequences: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            sequences.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        return tuple(sequences)

    def build(self, request_id: str, text: str | None, prompt_ids: list[int], params: SamplingParams,
              max_model_len: int) -> tuple[Request, RequestState]:
        """The engines' ``Request`` and the output processor's ``RequestState`` of a validated prompt."""
        if params.bad_words and not params.bad_words_token_ids:
            params = dataclasses.replace(params, bad_words_token_ids=self.bad_words_tokens(params.bad_words))
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens,
                                   params.include_stop_str_in_output) if self.tokenizer else None
            for _ in range(params.n)]
        state = RequestState(request_id, text, prompt_ids, params,
                             [CompletionOutput(i) for i in range(params.n)], detokenizers,
                             [None] if params.prompt_logprobs is not None else None)
        for output in state.outputs:
            output.logprobs = [] if params.logprobs is not None else None
        max_total = max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, len(prompt_ids) + params.max_tokens)
        return Request(request_id, prompt_ids, params, self.eos_token_ids, max_total), state
