"""Find a model (path, alias or the packaged default) and load it with its tokenizer, as plain torch
modules; the runner's edge (``duoserve.worker.backends``) adds the kernels' weight backends."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from duoserve.config import ModelConfig
from duoserve.errors import ConfigError, ModelLoadError
from duoserve.model.arch import ModelArch, apply_overrides
from duoserve.model.encoder import EncoderArch, build_encoder, encoder_arch_from_hf, is_encoder_config
from duoserve.model.gguf_encoder import GGUF_ENCODER_ARCH
from duoserve.model.llama import LlamaModel
from duoserve.model.paths import default_model_path, resolve_model_path  # noqa: F401 (re-exported)
from duoserve.model.pooling import declared_pooling
from duoserve.model.reranker import (CROSS_ENCODER, GGUF_RERANK_TEMPLATE, YES_NO, YES_NO_SCORES_ONLY,
                                     classifier_token_ids, gguf_yes_no_labels, split_reranker)
from duoserve.model.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from duoserve.model.weights import BlockModules, build_model
from duoserve.platform import RunTime

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaModel
    arch: ModelArch
    tokenizer: Tokenizer | None
    path: Path
    dtype: torch.dtype
    quantization: str = "none"  # none, gguf-fast, gguf-exact or int8: part of the fingerprint
    pooling: str | None = None  # how the file says its embeddings are pooled (duoserve.model.pooling)
    # a reranker: "cross-encoder" (model/encoder.py) or "yes-no" (model/reranker.py), with the
    # latter's classifier tokens (negative first); None: not a reranker
    reranker: str | None = None
    classifier_token_ids: tuple[int, ...] = ()
    classifier_head: torch.Tensor | None = None   # or its rows [no, yes] ([2, hidden]; a GGUF rank model's)
    score_template: str | None = None             # the file's yes/no prompt ({query}, {document})
    gguf_arch: str | None = None                  # a GGUF file's general.architecture (its adapters' too)


def check_max_model_len(arch: ModelArch | EncoderArch, max_model_len: int | None) -> int:
    """The context length to serve: ``max_model_len`` if the model allows it, else its own maximum
    (max_position_embeddings; a YaRN or dynamic-NTK rope allows up to the original context times
    its factor when asked; an encoder's position table less its offset)."""
    if isinstance(arch, EncoderArch):
        limit = arch.max_context
    else:
        limit = arch.rope.max_context(arch.max_position_embeddings)
    if max_model_len is None:
        max_model_len = limit if isinstance(arch, EncoderArch) else arch.max_position_embeddings
    elif max_model_len > limit:
        what = ("max_position_embeddings less its padding offset" if isinstance(arch, EncoderArch) and limit !=
                arch.max_position_embeddings else "max_position_embeddings", "trained") if (
            limit == arch.max_position_embeddings or isinstance(arch, EncoderArch)) else (
            f"{arch.rope.rope_type} rope's original context times its factor", "scaled")
        raise ConfigError(
            "max_model_len", max_model_len,
            f"at most the model's {what[0]} ({limit}), the context it was {what[1]} for",
            "Lower --max-model-len, or leave it unset to serve the model's whole context",
        )
    return max_model_len


def read_chat_template(given: str) -> str:
    """--chat-template: a file's text, else the text given; refused by name when Jinja cannot parse it."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = given
    if "{" not in given:   # no Jinja in it: the name of a file
        path = Path(given).expanduser()
        if not path.is_file():
            raise ConfigError("chat_template", given, "a Jinja template, or the path of a file holding one "
                              "(there is no such file)")
        template = path.read_text()
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as exc:
        raise ConfigError("chat_template", given if len(given) < 80 else given[:77] + "...",
                          f"a Jinja template, or a file holding one ({exc})") from exc
    return template


def load_checkpoint(config: ModelConfig, runtime: RunTime, blocks: BlockModules | None = None,
                    quantization: str = "none") -> LoadedModel:
    """The model of ``config`` in plain torch modules on ``runtime``'s device and dtype, a GGUF
    file's weights dequantized; with ``blocks`` (the caller's modules for ``--quantization gguf``)
    the weights they compute from stay in blocks. ``quantization`` labels the result (the
    fingerprint covers it)."""
    path = resolve_model_path(config.model)
    dtype, device = runtime.torch_dtype, runtime.device
    encoder_label = "int8" if quantization == "int8" else "none"   # an encoder's weights: int8 or dequantized
    if not path.is_file() and is_encoder_dir(path):
        return load_encoder(config, path, dtype, device, encoder_label)
    overrides, classifier_tokens = split_reranker(config.hf_overrides)
    classifier_head, score_template = None, None   # a GGUF reranker's [no, yes] rows and prompt
    reranker, gguf_arch = None, None
    if path.is_file():
        from duoserve.model.gguf_loader import GGUFSource, open_gguf, read_header

        reader = read_header(path)
        if reader.meta.get("general.architecture") == GGUF_ENCODER_ARCH:
            return load_gguf_cross_encoder(config, reader, path, dtype, device, encoder_label)
        reader, meta, arch = open_gguf(path, overrides, reader)
        tokenizer = tokenizer_from_gguf(meta, arch.eos_token_ids, path) if "tokenizer.ggml.tokens" in meta else None
        gguf_arch = str(meta.get("general.architecture"))
        source = GGUFSource(reader, arch, permuted_qk=gguf_arch == "llama", gguf_arch=gguf_arch)
        pooling = declared_pooling(path, meta)
        labels = gguf_yes_no_labels(meta) if classifier_tokens is None else None
        if labels is not None:   # llama.cpp's yes/no reranker: its classifier rows, its prompt
            rows = source.file_tensor("cls.output.weight")
            if rows is None or rows.shape[0] != len(labels):
                raise ModelLoadError(f"{path.name} is a rank model labelled {labels} without a cls.output tensor "
                                     "of one row per label")
            classifier_head = rows[[labels.index("no"), labels.index("yes")]].to(dtype=torch.float32, device=device)
            score_template = meta.get(GGUF_RERANK_TEMPLATE)
            if not _keeps_its_head(source, reader, tokenizer, classifier_head):
                reranker = YES_NO_SCORES_ONLY
    else:
        from duoserve.model.hf_loader import SafetensorsSource, read_hf_arch

        arch = read_hf_arch(path, overrides)
        tokenizer = tokenizer_from_hf_dir(path, arch.bos_token_id, arch.eos_token_ids)
        source = SafetensorsSource(path)
        pooling = declared_pooling(path)
    if tokenizer is None:
        logger.warning("%s has no tokenizer: only token-id prompts will work", path)
    elif config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    if classifier_tokens is not None and tokenizer is None:
        raise ConfigError("hf_overrides.classifier_from_token", list(classifier_tokens),
                          "unset for a model without a tokenizer (its tokens cannot be found)")
    classifier_ids = classifier_token_ids(tokenizer, classifier_tokens) if classifier_tokens else ()
    max_model_len = check_max_model_len(arch, config.max_model_len)
    arch = arch.for_context(max_model_len)
    model = build_model(arch, source, dtype, device, max_positions=max_model_len, blocks=blocks)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, path=path, dtype=dtype, quantization=quantization,
                       pooling=pooling,
                       reranker=reranker or (YES_NO if classifier_ids or classifier_head is not None else None),
                       classifier_token_ids=classifier_ids, classifier_head=classifier_head,
                       score_template=score_template, gguf_arch=gguf_arch)


def is_encoder_dir(path: Path) -> bool:
    """A Hugging Face directory holding a cross-encoder (``duoserve.model.encoder``)."""
    try:
        return is_encoder_config(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def load_encoder(config: ModelConfig, path: Path, dtype: torch.dtype, device: str,
                 quantization: str = "none") -> LoadedModel:
    """A cross-encoder: scores (query, document) pairs; it generates nothing."""
    from duoserve.model.hf_loader import SafetensorsSource

    hf_config = apply_overrides(json.loads((path / "config.json").read_text()), config.hf_overrides)
    tokenizer = tokenizer_from_hf_dir(path, None, ())
    if tokenizer is None:
        raise ConfigError("model", str(path), "a cross-encoder directory with its tokenizer.json (a pair is "
                          "tokenized by the model's own template)")
    arch = encoder_arch_from_hf(hf_config, _separator_id(path, tokenizer))
    check_max_model_len(arch, config.max_model_len)
    model = build_encoder(arch, SafetensorsSource(path), dtype, device)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, path=path, dtype=dtype, reranker=CROSS_ENCODER,
                       quantization=quantization)


def _keeps_its_head(source, reader, tokenizer, classifier_head: torch.Tensor) -> bool:
    """Whether a GGUF rank model still has the head it generates with: an output tensor, or a tied
    one (its classifier rows are then the embedding's rows of "no" and "yes"). llama.cpp's
    converter drops an untied head and keeps only those two rows."""
    if any(t.name == "output.weight" for t in reader.tensors):
        return True
    if tokenizer is None:
        return False
    ids = classifier_token_ids(tokenizer, ("no", "yes"))
    rows = source.file_rows("token_embd.weight", list(ids))
    if rows is None:
        return False
    difference = (rows - classifier_head.cpu()).norm() / classifier_head.norm().clamp_min(1e-12)
    return bool(difference < 0.05)   # the same rows, whatever each tensor's quantization


def _separator_id(path: Path, tokenizer: Tokenizer) -> int | None:
    """The id of the token between a pair's two texts: tokenizer_config.json's sep_token, else [SEP]."""
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    sep = config.get("sep_token")
    text = sep.get("content") if isinstance(sep, dict) else sep
    return tokenizer.backend.token_to_id(text or "[SEP]")


def load_gguf_cross_encoder(config: ModelConfig, reader, path: Path, dtype: torch.dtype, device: str,
                            quantization: str = "none") -> LoadedModel:
    """A cross-encoder from a GGUF file (``duoserve.model.gguf_encoder``), its weights dequantized."""
    from duoserve.model.gguf_encoder import gguf_encoder_arch, load_gguf_encoder

    arch = gguf_encoder_arch(reader)
    tokenizer = tokenizer_from_gguf(reader.meta, (), path)
    check_max_model_len(arch, config.max_model_len)
    model = load_gguf_encoder(reader, arch, dtype, device)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, path=path, dtype=dtype, reranker=CROSS_ENCODER,
                       quantization=quantization)


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the weights by kind: packed blocks (GGUF), int8, embedding (GGUF blocks), dense;
    a module's ``weight_kind`` names its kind (dense without one)."""
    sizes = {"packed blocks": 0, "int8": 0, "embedding": 0, "dense": 0}
    seen: set[int] = set()
    for module in model.modules():
        kind = getattr(module, "weight_kind", "dense")
        plain = (v for v in vars(module).values() if isinstance(v, torch.Tensor))  # e.g. CPULinear's weight
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False), *plain]:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                sizes[kind] += tensor.numel() * tensor.element_size()
    return sizes
