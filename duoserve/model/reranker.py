"""Yes/no rerankers: a causal LM asked whether a document answers a query, scored by its next
token's logits for "no" and "yes" (Qwen3-Reranker's way). Configured as vLLM configures it, by
``hf_overrides``: ``{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":
["no", "yes"], "is_original_qwen3_reranker": true}``. The model stays the causal LM it is (it can
still generate); a score is the softmax over the listed tokens' logits, the last one's share
(P(yes) = sigmoid(yes - no), what vLLM's converted classifier computes)."""

from __future__ import annotations

import re
from typing import Any

from duoserve.errors import ConfigError

RERANKER_KEYS = ("classifier_from_token", "is_original_qwen3_reranker", "method")
# the kinds of reranker (LoadedModel.reranker); the ones that only score, and generate nothing
CROSS_ENCODER, YES_NO, YES_NO_SCORES_ONLY = "cross-encoder", "yes-no", "yes-no-scores-only"
SCORES_ONLY = frozenset({CROSS_ENCODER, YES_NO_SCORES_ONLY})


def scores_only_reason(reranker: str | None) -> str | None:
    """Why a model of this kind refuses to generate or embed (None: it does not)."""
    if reranker == CROSS_ENCODER:
        return ("this model is a cross-encoder: it scores (query, document) pairs at /v1/rerank and /score, and "
                "neither generates text nor embeds")
    if reranker == YES_NO_SCORES_ONLY:
        return ("this model is a reranker whose file lost its output head (llama.cpp's converter keeps only the "
                "yes/no rows of an untied one): it scores pairs at /v1/rerank and /score, and generates nothing")
    return None


def split_reranker(overrides: dict[str, Any] | None) -> tuple[dict[str, Any] | None, tuple[str, ...] | None]:
    """``hf_overrides`` less vLLM's reranker keys, and the classifier's tokens (None: not a reranker).
    The "...ForSequenceClassification" architecture they name is read as its causal LM."""
    if not overrides or "classifier_from_token" not in overrides:
        return overrides, None
    tokens = overrides["classifier_from_token"]
    if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) and t for t in tokens)):
        raise ConfigError("hf_overrides.classifier_from_token", tokens,
                          'two tokens, the negative answer first: ["no", "yes"]')
    rest = {key: value for key, value in overrides.items() if key not in RERANKER_KEYS}
    names = rest.get("architectures")
    if isinstance(names, list):
        rest["architectures"] = [n.replace("ForSequenceClassification", "ForCausalLM") for n in names]
    return rest, tuple(tokens)


def classifier_token_ids(tokenizer, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """Each token's id: the vocabulary's entry of that text, else the text's single token."""
    ids = []
    for token in tokens:
        token_id = tokenizer.backend.token_to_id(token)
        if token_id is None:
            encoded = tokenizer.backend.encode(token, add_special_tokens=False).ids
            if len(encoded) != 1:
                raise ConfigError("hf_overrides.classifier_from_token", token,
                                  f"one token of the model's vocabulary (it is {len(encoded)} tokens)")
            token_id = encoded[0]
        ids.append(token_id)
    return tuple(ids)


# Qwen3-Reranker's prompt (its model card's; what llama.cpp's converter stores as a GGUF file's
# "rerank" template): a yes/no question about one pair, answered by the next token. The
# placeholders are replaced as text in one pass, so braces in a query or document are only text.
YES_NO_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")

GGUF_RANK_POOLING = 4   # llama.cpp's LLAMA_POOLING_TYPE_RANK
GGUF_RERANK_TEMPLATE = "tokenizer.chat_template.rerank"


def gguf_yes_no_labels(meta: dict[str, Any]) -> list[str] | None:
    """A GGUF file's yes/no reranker labels (the rows of its ``cls.output`` tensor), where llama.cpp's
    converter made it one: rank pooling with the labels "yes" and "no"; None otherwise."""
    arch = meta.get("general.architecture")
    labels = meta.get(f"{arch}.classifier.output_labels")
    if meta.get(f"{arch}.pooling_type") != GGUF_RANK_POOLING or not labels:
        return None
    return list(labels) if sorted(labels) == ["no", "yes"] else None


class PairError(ValueError):
    """A (query, document) pair this model cannot score as it is (the message says why)."""


def render_pair(template: str, query: str, document: str) -> str:
    """Both placeholders replaced in one pass: a query holding "{document}" keeps it as text."""
    return re.sub(r"\{(query|document)\}", lambda m: query if m.group(1) == "query" else document, template)


def pair_token_ids(tokenizer, reranker: str, query: str, document: str, template: str | None = None) -> list[int]:
    """The prompt that scores one (query, document) pair: a cross-encoder's own pair template
    (``[CLS] q [SEP] d [SEP]``, ``<s> q </s></s> d </s>``), or the yes/no question (the model
    file's template where it has one). A BERT pair whose query holds its separator is refused:
    the engine reads the document's token type back from the first separator."""
    if reranker == CROSS_ENCODER:
        encoding = tokenizer.backend.encode(query, document, add_special_tokens=True)
        ids, types = encoding.ids, encoding.type_ids
        if any(types):
            first = types.index(1)
            if first == 0 or ids[first - 1] in ids[:first - 1]:
                raise PairError("the query holds the model's separator token: its pair could not be told apart")
        return ids
    return tokenizer.encode(render_pair(template or YES_NO_TEMPLATE, query, document))
