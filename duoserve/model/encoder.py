"""Cross-encoders: a BERT or XLM-RoBERTa encoder with a sequence-classification head (rerankers such
as ms-marco-MiniLM or bge-reranker), scoring a (query, document) pair in one forward.

Unlike the decoders it keeps no KV: every token attends to every other of its sequence, so a
sequence is computed whole, in one step (the engine turns chunking and the prefix cache off for
it). The batch comes flat, as a decoder's does: the token ids of several sequences one after the
other, their positions (0 at each start) and their lengths.

A BERT pair is ``[CLS] query [SEP] document [SEP]``; the document's tokens have token type 1. The
engine carries token ids only, so the type is read back from them: 1 after the first [SEP]
(what the tokenizer's pair template writes). XLM-RoBERTa has one token type, and its positions
start after the padding id (``padding_idx + 1``), as transformers computes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from duoserve.errors import ConfigError, ModelLoadError

# config.json's architecture -> the prefix of its encoder's weights
ENCODER_CLASSIFIERS = {"BertForSequenceClassification": "bert", "XLMRobertaForSequenceClassification": "roberta",
                       "RobertaForSequenceClassification": "roberta"}
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# what a score is made of the logit: sentence-transformers' activation_fn, as it saves it in config.json
SCORE_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}


@dataclass(frozen=True)
class EncoderArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    num_labels: int
    score_activation: str = "sigmoid"  # sigmoid or identity (the raw logit), as sentence-transformers reads it
    position_offset: int = 0          # XLM-RoBERTa: padding_idx + 1
    sep_token_id: int | None = None   # BERT: the document's tokens (type 1) follow the first of these
    eos_token_ids: tuple[int, ...] = ()
    family: str = "encoder"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_context(self) -> int:
        """The longest sequence its position table covers."""
        return self.max_position_embeddings - self.position_offset

    @property
    def pooler(self) -> bool:
        """BERT pools [CLS] through ``pooler.dense``; RoBERTa's head has its own dense layer."""
        return ENCODER_CLASSIFIERS[self.architecture] == "bert"


def is_encoder_config(config: dict[str, Any]) -> bool:
    names = config.get("architectures") or []
    return bool(names) and names[0] in ENCODER_CLASSIFIERS


def encoder_arch_from_hf(config: dict[str, Any], sep_token_id: int | None) -> EncoderArch:
    architecture = config["architectures"][0]
    activation = config.get("hidden_act", "gelu")
    if activation not in _ACTIVATIONS:
        raise ConfigError("hidden_act", activation, f"one of {', '.join(sorted(_ACTIVATIONS))}")
    position_type = config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ConfigError("position_embedding_type", position_type, "absolute (the only kind duoserve computes)")
    roberta = ENCODER_CLASSIFIERS[architecture] == "roberta"
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if hidden % heads:
        raise ConfigError("num_attention_heads", heads, f"a divisor of hidden_size ({hidden})")
    num_labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)
    check_num_labels(num_labels)
    type_vocab_size = int(config.get("type_vocab_size", 2))
    if not roberta and type_vocab_size > 1 and sep_token_id is None:
        raise ConfigError("sep_token", None, "a token of the vocabulary (tokenizer_config.json's sep_token, or "
                          "[SEP]): a BERT pair's document follows it")
    return EncoderArch(
        architecture=architecture, vocab_size=int(config["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]), num_layers=int(config["num_hidden_layers"]),
        num_heads=heads, max_position_embeddings=int(config["max_position_embeddings"]),
        type_vocab_size=type_vocab_size, layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        hidden_act=_ACTIVATIONS[activation], num_labels=num_labels,
        position_offset=int(config.get("pad_token_id", 1)) + 1 if roberta else 0,
        sep_token_id=None if roberta else sep_token_id, score_activation=score_activation(config),
    )


def check_num_labels(num_labels: int) -> None:
    if num_labels != 1:
        raise ConfigError("num_labels", num_labels, "1: a reranker's one relevance logit (a classifier of "
                          f"{num_labels} labels ranks nothing)")


def score_activation(config: dict[str, Any]) -> str:
    """sentence-transformers' activation of the logit (``sentence_transformers.activation_fn``, or
    before its v4 ``sbert_ce_default_activation_function``): a sigmoid unless it says otherwise
    (ms-marco's cross-encoders say Identity: their scores are the raw logits)."""
    path = (config.get("sentence_transformers") or {}).get("activation_fn") or \
        config.get("sbert_ce_default_activation_function")
    if path is None:
        return "sigmoid"
    if path not in SCORE_ACTIVATIONS:
        raise ConfigError("sentence_transformers.activation_fn", path, f"one of {', '.join(SCORE_ACTIVATIONS)}")
    return SCORE_ACTIVATIONS[path]


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "relu":
        return F.relu
    return (lambda x: F.gelu(x, approximate="tanh")) if name == "gelu_tanh" else F.gelu


class EncoderLayer(nn.Module):
    def __init__(self, arch: EncoderArch) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.layer_norm_eps
        self.arch = arch
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps)
        self.up = nn.Linear(hidden, arch.intermediate_size)
        self.down = nn.Linear(arch.intermediate_size, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps)
        self.act = _activation(arch.hidden_act)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        heads, head_dim = self.arch.num_heads, self.arch.head_dim
        q, k, v = self.qkv(x).view(x.shape[0], 3, heads, head_dim).unbind(1)
        outs, start = [], 0
        for length in seq_lens:   # each sequence attends over itself only, both ways
            part = slice(start, start + length)
            qs, ks, vs = (t[part].transpose(0, 1).unsqueeze(0) for t in (q, k, v))   # [1, heads, len, dim]
            outs.append(F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1).reshape(length, -1))
            start += length
        x = self.attn_norm(x + self.attn_out(torch.cat(outs)))   # post-norm, as BERT is
        return self.out_norm(x + self.down(self.act(self.up(x))))


class EncoderClassifier(nn.Module):
    """``forward`` gives each token's final hidden state; ``classify`` one sequence's logits from them."""

    def __init__(self, arch: EncoderArch) -> None:
        super().__init__()
        hidden = arch.hidden_size
        self.arch = arch
        self.embed = nn.Embedding(arch.vocab_size, hidden)
        self.positions = nn.Embedding(arch.max_position_embeddings, hidden)
        self.token_types = nn.Embedding(arch.type_vocab_size, hidden)
        self.embed_norm = nn.LayerNorm(hidden, arch.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(arch) for _ in range(arch.num_layers))
        self.head_dense = nn.Linear(hidden, hidden)   # BERT's pooler, or RoBERTa's head's dense layer
        self.head_out = nn.Linear(hidden, arch.num_labels)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def token_types_of(self, token_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """0 up to each sequence's first [SEP], 1 after it (BERT's pair template); 0 without one."""
        types = torch.zeros_like(token_ids)
        if self.arch.sep_token_id is None or self.arch.type_vocab_size < 2:
            return types
        start = 0
        for length in seq_lens:
            seps = (token_ids[start:start + length] == self.arch.sep_token_id).nonzero()
            if len(seps):
                types[start + int(seps[0]) + 1:start + length] = 1
            start += length
        return types

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        types = self.token_types_of(token_ids, seq_lens)
        x = self.embed(token_ids) + self.token_types(types) + self.positions(positions + self.arch.position_offset)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, seq_lens)
        return x

    def score(self, states: torch.Tensor) -> torch.Tensor:
        """One sequence's relevance from its hidden states: its first token's through the head, the
        one logit through the model's activation (what sentence-transformers' CrossEncoder and vLLM's
        score give: a sigmoid, or the logit itself)."""
        logit = self.head_out(torch.tanh(self.head_dense(states[0]))).float()[0]
        return torch.sigmoid(logit) if self.arch.score_activation == "sigmoid" else logit


def _hf_names(arch: EncoderArch) -> dict[str, str]:
    """Our parameter names -> the checkpoint's (transformers' BERT and RoBERTa layouts)."""
    base = ENCODER_CLASSIFIERS[arch.architecture]
    names = {"embed.weight": f"{base}.embeddings.word_embeddings.weight",
             "positions.weight": f"{base}.embeddings.position_embeddings.weight",
             "token_types.weight": f"{base}.embeddings.token_type_embeddings.weight"}
    for part in ("weight", "bias"):
        names[f"embed_norm.{part}"] = f"{base}.embeddings.LayerNorm.{part}"
        head = ("bert.pooler.dense", "classifier") if arch.pooler else ("classifier.dense", "classifier.out_proj")
        names[f"head_dense.{part}"], names[f"head_out.{part}"] = (f"{h}.{part}" for h in head)
        for i in range(arch.num_layers):
            layer = f"{base}.encoder.layer.{i}"
            names.update({f"layers.{i}.attn_out.{part}": f"{layer}.attention.output.dense.{part}",
                          f"layers.{i}.attn_norm.{part}": f"{layer}.attention.output.LayerNorm.{part}",
                          f"layers.{i}.up.{part}": f"{layer}.intermediate.dense.{part}",
                          f"layers.{i}.down.{part}": f"{layer}.output.dense.{part}",
                          f"layers.{i}.out_norm.{part}": f"{layer}.output.LayerNorm.{part}"})
    return names


def build_encoder(arch: EncoderArch, source: Callable[[str], torch.Tensor | None], dtype: torch.dtype,
                  device: str) -> EncoderClassifier:
    """The classifier with the weights ``source`` names (transformers' names); a missing tensor is
    refused by name."""
    def read(name: str) -> torch.Tensor:
        tensor = source(name)
        if tensor is None:
            raise ModelLoadError(f"the checkpoint has no tensor {name} ({arch.architecture} needs it)")
        return tensor

    with torch.device("meta"):
        model = EncoderClassifier(arch)
    state = {ours: read(theirs) for ours, theirs in _hf_names(arch).items()}
    base = ENCODER_CLASSIFIERS[arch.architecture]
    for i in range(arch.num_layers):   # Q, K and V stored fused, as one matmul
        attention = f"{base}.encoder.layer.{i}.attention.self"
        for part in ("weight", "bias"):
            state[f"layers.{i}.qkv.{part}"] = torch.cat([read(f"{attention}.{p}.{part}") for p in ("query", "key", "value")])
    shapes = {name: p.shape for name, p in model.state_dict().items()}
    for name, tensor in state.items():   # some converters squeeze a one-row matrix into a vector
        if tensor.shape != shapes[name]:
            if tensor.numel() != shapes[name].numel():
                raise ModelLoadError(f"tensor {_hf_names(arch).get(name, name)} has shape {list(tensor.shape)}, "
                                     f"expected {list(shapes[name])}")
            state[name] = tensor.reshape(shapes[name])
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.to(device).eval()
