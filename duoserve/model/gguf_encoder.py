"""Cross-encoders from GGUF files, as llama.cpp's converter writes them (arch ``bert``, rank pooling):
XLM-RoBERTa rerankers (bge-reranker) with their classifier head's dense layer (``cls``) and output
(``cls.output``), their position table already cut to start at the first real position, and a
SentencePiece Unigram vocabulary (``tokenizer.ggml.model`` "t5").

A BERT sequence classifier converted so has lost its pooler (the converter keeps BERT for
embeddings and drops ``pooler.dense``): its file holds ``cls.output`` without ``cls`` (or, from
older converters, its classifier as a one-row ``cls``), and its scores would not be the model's,
so it is refused by name. The score is the sigmoid of the logit (the file does not carry
sentence-transformers' activation)."""

from __future__ import annotations

import numpy as np
import torch

from duoserve.errors import ModelLoadError
from duoserve.model.dequant import dequantize
from duoserve.model.encoder import EncoderArch, EncoderClassifier, build_encoder, check_num_labels
from duoserve.model.gguf_file import GGUFFile

GGUF_ENCODER_ARCH = "bert"
_LAYER = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
          "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
          "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
_TOP = {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
        "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm"}


def gguf_encoder_arch(reader: GGUFFile) -> EncoderArch:
    meta, names = reader.meta, {t.name for t in reader.tensors}
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    one_row_cls = "cls.weight" in names and (len(shapes["cls.weight"]) == 1 or shapes["cls.weight"][1] == 1)
    if "cls.output.weight" not in names and not one_row_cls:
        raise ModelLoadError("this GGUF BERT file has no classifier (cls.output): an embedding model, not a reranker")
    if "cls.weight" not in names or "cls.output.weight" not in names:   # older converters: the classifier as cls
        raise ModelLoadError(
            "this GGUF file is a BERT sequence classifier without its pooler (llama.cpp's converter drops "
            "pooler.dense): its scores would not be the model's. Serve its Hugging Face folder instead")
    if meta.get("tokenizer.ggml.model") != "t5":
        raise ModelLoadError(f"tokenizer.ggml.model={meta.get('tokenizer.ggml.model')!r}: duoserve serves GGUF "
                             "cross-encoders of XLM-RoBERTa's SentencePiece vocabulary ('t5')")
    rows = shapes["cls.output.weight"]   # innermost first: [hidden] squeezed, or [hidden, labels]
    check_num_labels(rows[1] if len(rows) > 1 else 1)
    key = f"{GGUF_ENCODER_ARCH}."
    return EncoderArch(
        architecture="XLMRobertaForSequenceClassification", vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=int(meta[key + "embedding_length"]), intermediate_size=int(meta[key + "feed_forward_length"]),
        num_layers=int(meta[key + "block_count"]), num_heads=int(meta[key + "attention.head_count"]),
        max_position_embeddings=int(meta[key + "context_length"]),
        type_vocab_size=int(meta.get("tokenizer.ggml.token_type_count", 1)),
        layer_norm_eps=float(meta.get(key + "attention.layer_norm_epsilon", 1e-5)), hidden_act="gelu",
        num_labels=1, position_offset=0)   # the converter cut the table to start at the first real position


def load_gguf_encoder(reader: GGUFFile, arch: EncoderArch, dtype: torch.dtype, device: str) -> EncoderClassifier:
    tensors = {t.name: t for t in reader.tensors}

    def source(hf_name: str) -> torch.Tensor | None:
        tensor = tensors.get(_gguf_name(hf_name))
        if tensor is None:
            return None
        shape = tuple(int(d) for d in reversed(tensor.shape))
        return dequantize(np.asarray(tensor.data), tensor.tensor_type.name, shape, tensor.name)

    return build_encoder(arch, source, dtype, device)


def _gguf_name(hf_name: str) -> str:
    """transformers' XLM-RoBERTa name -> the converter's."""
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("classifier."):
        return {"classifier.dense": "cls", "classifier.out_proj": "cls.output"}[stem] + f".{kind}"
    stem = stem.removeprefix("roberta.")
    if stem.startswith("encoder.layer."):
        layer, rest = stem[len("encoder.layer."):].split(".", 1)
        return f"blk.{layer}.{_LAYER[rest]}.{kind}"
    return f"{_TOP[stem]}.{kind}"
