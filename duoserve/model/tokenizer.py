"""Tokenizers: from a Hugging Face ``tokenizer.json`` or rebuilt from GGUF metadata.

A GGUF file stores its vocabulary as lists (tokens, token types, and merges for a
byte-level BPE; scores for a SentencePiece one, whose merges are implied by the
vocabulary). We rebuild the same ``tokenizers.Tokenizer`` that transformers builds
from it, so ids match token for token, special tokens such as ``<|im_start|>``
included.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from duoserve.errors import ModelLoadError
from duoserve.heap import release_free_memory
from duoserve.model.paths import cache_dir

# llama.cpp token types
_CONTROL = 3
_USER_DEFINED = 4

# Split patterns of GGUF pre-tokenizer names whose merges were learned on another split
# than GPT-2's; any other name keeps the GPT-2 byte-level split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """Encode, decode and render chat templates for one model.

    Made from its parsed ``backend``, or from the kept tokenizer.json ``source_file`` with its
    ``facts`` (what an engine needs at start: ``tokenizer_facts``), parsed on first use: an
    engine that never tokenizes (the API process does) never parses it (Gemma 3's: 1.2 s of a
    start and some 110 MB)."""

    def __init__(self, backend: HFTokenizer | None, *, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 chat_template: str | None, add_bos_token: bool = False, source_file: Path | None = None,
                 facts: dict[str, Any] | None = None, rebuild: Callable[[], HFTokenizer] | None = None) -> None:
        if backend is None and (source_file is None or facts is None):
            raise ValueError("a tokenizer without its backend needs the file and the facts of one")
        self._backend = backend
        self._rebuild = rebuild      # where the kept file cannot be parsed (damaged since)
        self._parse_lock = threading.Lock()
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        # the kept tokenizer.json the backend was (or will be) parsed from: its exact to_str()
        self.source_file = source_file
        facts = facts or tokenizer_facts(backend, digest=False)   # the digest when asked (0.8 s for Gemma's)
        self.vocab_size: int = facts["vocab_size"]
        self.special_token_ids = frozenset(facts["special_token_ids"])
        self._vocabulary_digest: str | None = facts.get("vocabulary_digest")

    @property
    def backend(self) -> HFTokenizer:
        if self._backend is None:
            with self._parse_lock:
                if self._backend is None:
                    try:
                        self._backend = parsed(HFTokenizer.from_file(str(self.source_file)))
                    except Exception:  # noqa: BLE001 - a damaged kept file is rebuilt where it can be
                        if self._rebuild is None:
                            raise
                        self._backend = self._rebuild()
        return self._backend

    def vocabulary_digest(self) -> str:
        """sha256 of the canonical vocabulary (fingerprints, a draft model's check)."""
        if self._vocabulary_digest is None:
            self._vocabulary_digest = _vocabulary_digest(self.backend)
        return self._vocabulary_digest

    def token_to_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **variables: Any) -> str:
        """The template's text; ``tools`` (OpenAI's definitions) and ``variables`` (a request's
        ``chat_template_kwargs``) reach it as variables of those names."""
        if not self.chat_template:
            raise ModelLoadError("this model has no chat template; send a plain prompt instead")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(
            **variables, messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.token_to_text(self.bos_token_id) or "",
            eos_token=self.token_to_text(self.eos_token_ids[0] if self.eos_token_ids else None) or "",
        )

def _vocabulary_digest(backend: HFTokenizer) -> str:
    """sha256 of the vocabulary's canonical bytes: (token, id) pairs in id order, as JSON."""
    vocab = backend.get_vocab(with_added_tokens=True)
    return hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]),
                                     ensure_ascii=False).encode()).hexdigest()


def tokenizer_facts(backend: HFTokenizer, digest: bool = True) -> dict[str, Any]:
    """What a Tokenizer knows of its backend without asking it again (kept beside a kept
    tokenizer.json, so a later start needs no parse); without ``digest``, all but the
    vocabulary's digest (computed on first use then)."""
    added = backend.get_added_tokens_decoder()
    facts = {"vocab_size": backend.get_vocab_size(with_added_tokens=True),
             "special_token_ids": sorted(i for i, tok in added.items() if tok.special),
             "end_of_turn_id": backend.token_to_id(_END_OF_TURN)}
    return {**facts, "vocabulary_digest": _vocabulary_digest(backend)} if digest else facts


# Gemma's end of a chat turn: llama.cpp ends generation on it by its text (the file's eos is <eos>)
_END_OF_TURN = "<end_of_turn>"


def tokenizer_from_gguf(meta: dict[str, Any], arch_eos: tuple[int, ...], file: Path | None = None) -> Tokenizer:
    """Rebuild the tokenizer a GGUF file describes (``tokenizer.ggml.*`` metadata). With the
    ``file`` it comes from, the rebuilt tokenizer and its facts are kept in the cache
    (``gguf_tokenizer_cache``), and a later start takes them from there, parsing the tokenizer
    only once it is used: Gemma's merges take seconds to rebuild in Python, a second to parse."""
    cached = gguf_tokenizer_cache(file) if file is not None else None
    facts, backend, source = _read_facts(cached), None, cached
    if facts is None:
        backend = _gguf_backend(meta)
        facts = tokenizer_facts(backend)
        if not _write_kept(cached, backend, facts):
            source = None
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    end_of_turn = facts["end_of_turn_id"] if gemma else None
    eos_ids = tuple(dict.fromkeys([*([eos] if eos is not None else []), *arch_eos,
                                   *([end_of_turn] if end_of_turn is not None else [])]))
    return Tokenizer(
        backend,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        source_file=source,
        facts=facts,
        rebuild=None if file is None else lambda: _rebuild_kept(file),
    )


def _rebuild_kept(file: Path) -> HFTokenizer:
    """The tokenizer of GGUF ``file`` rebuilt from its metadata and kept again (its kept copy was
    damaged after the start that trusted it)."""
    from duoserve.model.gguf_file import read_gguf

    backend = _gguf_backend(read_gguf(file).meta)
    _write_kept(gguf_tokenizer_cache(file), backend, tokenizer_facts(backend))
    return backend


def gguf_tokenizer_cache(file: Path) -> Path:
    """Where the tokenizer rebuilt from ``file`` is kept: named by the file (path, size, time of
    change) and by this module's code, so a changed file or a changed rebuild is never read."""
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode()
                         + Path(__file__).read_bytes()).hexdigest()[:24]
    return cache_dir("tokenizers") / f"{key}.json"


def _facts_file(path: Path) -> Path:
    return path.with_suffix(".facts.json")


def _read_facts(path: Path | None) -> dict[str, Any] | None:
    """The facts kept beside a kept tokenizer (None where either file is missing or unreadable:
    the tokenizer is rebuilt)."""
    if path is None or not path.exists():
        return None
    try:
        facts = json.loads(_facts_file(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    wanted = ("vocab_size", "special_token_ids", "vocabulary_digest", "end_of_turn_id", "json_bytes")
    if not isinstance(facts, dict) or not all(k in facts for k in wanted):
        return None
    return facts if path.stat().st_size == facts["json_bytes"] else None   # a tokenizer cut short or replaced


def parsed(backend: HFTokenizer) -> HFTokenizer:
    """A tokenizer just parsed, the heap its parse freed handed back: half a million merges
    (Gemma 3's) leave some 260 MB of freed pages that would stay resident (``duoserve.heap``)."""
    release_free_memory()
    return backend


def backend_from_json(text: str) -> HFTokenizer:
    """The tokenizer of a tokenizer.json text (the engine sends its own to the API process)."""
    return parsed(HFTokenizer.from_str(text))


def _write_kept(path: Path | None, backend: HFTokenizer, facts: dict[str, Any]) -> bool:
    """The tokenizer, then its facts, each atomically (a concurrent start reads a whole file or
    none, and facts only beside their tokenizer); a cache that cannot be written costs the next
    start its rebuild, nothing else. Whether both were written."""
    if path is None:
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = backend.to_str()
        facts = {**facts, "json_bytes": len(text.encode())}
        for target, text in ((path, text), (_facts_file(path), json.dumps(facts))):
            with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".part", delete=False,
                                             encoding="utf-8") as f:
                f.write(text)
            os.replace(f.name, target)
    except OSError:
        return False
    return True


def _gguf_backend(meta: dict[str, Any]) -> HFTokenizer:
    """The tokenizers backend of a GGUF file's tokenizer, its special and user tokens added."""
    kind = meta.get("tokenizer.ggml.model")
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    if kind == "llama" and gemma:
        backend = _sentencepiece_bpe(meta)
    elif kind == "gpt2":
        backend = _byte_level_bpe(meta)
    elif kind == "t5":
        backend = _unigram(meta)
    else:
        raise ModelLoadError(
            f"tokenizer.ggml.model={kind!r} is not supported here: duoserve rebuilds byte-level BPE ('gpt2') "
            "tokenizers, Gemma's SentencePiece ('llama') one and SentencePiece Unigram ('t5'), from GGUF files; "
            "use the Hugging Face "
            "directory of this model instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    letters = set(byte_alphabet().values()) if kind == "gpt2" else None
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; adding it
    # would grow the vocabulary past the model's, so it is left out (as transformers does).
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind_ in zip(tokens, token_types) if kind_ == _CONTROL and (letters is None or set(t) <= letters)]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind_ in zip(tokens, token_types) if kind_ == _USER_DEFINED and (letters or t in vocab)]
    backend.add_tokens(user)
    return backend


def _byte_level_bpe(meta: dict[str, Any]) -> HFTokenizer:
    """GPT-2's byte-level BPE from the file's tokens and merges, with its pre-tokenizer's split."""
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= letters else "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab[spelled] = index
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


_SPACE = "\u2581"  # SentencePiece's visible space


def _unigram(meta: dict[str, Any]) -> HFTokenizer:
    """SentencePiece Unigram (XLM-RoBERTa's: llama.cpp's "t5" kind) from the pieces, their scores and
    the normalizer's compiled character map; a pair is ``<s> A </s></s> B </s>``, as XLM-RoBERTa's."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    backend = HFTokenizer(models.Unigram([(t, float(s)) for t, s in zip(tokens, scores)],
                                         unk_id=meta.get("tokenizer.ggml.unknown_token_id"), byte_fallback=False))
    steps = []
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        steps.append(normalizers.Precompiled(bytes(v & 0xFF for v in charsmap)))   # stored as uint8 or int8
    if meta.get("tokenizer.ggml.remove_extra_whitespaces", True):
        steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    backend.normalizer = normalizers.Sequence(steps)
    prepend = "always" if meta.get("tokenizer.ggml.add_space_prefix", True) else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme=prepend)
    backend.decoder = decoders.Metaspace(replacement=_SPACE, prepend_scheme=prepend)
    cls = meta.get("tokenizer.ggml.bos_token_id")   # llama.cpp starts a sequence with BOS: <s>, the CLS
    sep = meta.get("tokenizer.ggml.seperator_token_id", meta.get("tokenizer.ggml.eos_token_id"))
    if cls is not None and sep is not None:
        special = [(tokens[cls], cls), (tokens[sep], sep)]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[cls]} $A {tokens[sep]}", pair=f"{tokens[cls]} $A {tokens[sep]} {tokens[sep]} $B {tokens[sep]}",
            special_tokens=list(dict.fromkeys(special)))
    return backend


def _sentencepiece_bpe(meta: dict[str, Any]) -> HFTokenizer:
    """Gemma's SentencePiece BPE (byte fallback, spaces as U+2581). The file lists no merges: every
    token's splits into two tokens are merges, best first, where a token ranks by its place in the
    file (Gemma's scores do not follow its merge order); a token made of spaces is stored with real
    spaces and looked up as U+2581s."""
    tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in meta["tokenizer.ggml.tokens"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges: list[tuple[int, int, int, str, str]] = []  # (rank, -len left, -len right, left, right)
    for rank, token in enumerate(tokens):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((rank, -len(left), -len(right), left, right) for left, right in splits)
    merges.sort(key=lambda m: m[:3])  # stable: a token's own splits keep their order
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], dropout=None,
                                     unk_token=tokens[unk] if unk is not None else None, fuse_unk=True,
                                     byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def tokenizer_from_hf_dir(path: Path, arch_bos: int | None, arch_eos: tuple[int, ...]) -> Tokenizer | None:
    """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, chat template) or None when absent."""
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.exists():
        return None
    backend = parsed(HFTokenizer.from_file(str(tokenizer_file)))
    config: dict[str, Any] = {}
    if (path / "tokenizer_config.json").exists():
        config = json.loads((path / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    # The post-processor in tokenizer.json adds BOS where the model wants it; ``encode``
    # never runs it and adds BOS itself, so both tokenizer sources behave alike.
    add_bos = bool(config.get("add_bos_token", False))
    if backend.post_processor is not None and arch_bos is not None:
        probe = backend.encode("a", add_special_tokens=True).ids
        add_bos = add_bos or (len(probe) > 0 and probe[0] == arch_bos)
    bos_text = _token_content(config.get("bos_token"))
    bos_id = backend.token_to_id(bos_text) if bos_text else arch_bos
    eos_text = _token_content(config.get("eos_token"))
    eos_from_config = backend.token_to_id(eos_text) if eos_text else None
    eos_ids = tuple(dict.fromkeys([*([eos_from_config] if eos_from_config is not None else []), *arch_eos]))
    return Tokenizer(backend, bos_token_id=bos_id, eos_token_ids=eos_ids,
                     chat_template=template, add_bos_token=add_bos)
