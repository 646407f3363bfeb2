r"""From ``StructuredOutputsParams`` to an llguidance grammar, checked against the model's vocabulary.

llguidance computes a token mask from the tokenizer's own vocabulary (its Rust core reads the
``tokenizers`` JSON), refuses by name the JSON-schema keywords it does not implement instead
of ignoring them (``not``, ``if``, ``uniqueItems``...), and needs no torch.
JSON is generated compact with one space after ``,`` and ``:`` (OpenAI's ``json.dumps`` look):
a small model given free whitespace can fill ``max_tokens`` with newlines. In a regular
expression ``\d`` and ``\w`` are ASCII (``[0-9]``, ``[0-9a-zA-Z_]``), as in a JSON schema's
``pattern``; Unicode's meaning would let ``\d{3}`` be three mathematical-digit symbols.
"""

from __future__ import annotations

import threading

import llguidance

from duoserve.errors import InvalidInputError
from duoserve.model.tokenizer import Tokenizer
from duoserve.sampling_params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'
_MAX_ERROR = 400   # characters of llguidance's message kept in an error (it can quote a whole grammar)


class GrammarError(ValueError):
    """A grammar that cannot be compiled or enforced exactly; the message says which part."""


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``spec`` (not yet checked: ``GrammarCompiler.check`` does)."""
    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = spec.json if kind == "json" else ANY_JSON_OBJECT
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":   # \d and \w in ASCII, as in JSON Schema's patterns and JavaScript
            return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(spec.regex, 'dw')}/")
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)   # Lark, or GBNF translated to Lark
    except ValueError as exc:
        raise GrammarError(_short(f"not a valid {_NAMES[kind]}: {exc}")) from None


_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
          "choice": "choice", "grammar": "grammar (Lark or GBNF)"}


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MAX_ERROR else message[:_MAX_ERROR] + "..."


class GrammarCompiler:
    """Grammars over one model's vocabulary. The llguidance tokenizer is built on first use
    (about half a second for a 49k vocabulary) and shared by every grammar."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size        # the model's logits: at least the tokenizer's tokens
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                eos = list(self.eos_token_ids)
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=eos[0] if len(eos) == 1 else eos)
            return self._ll_tokenizer

    def check(self, spec: StructuredOutputsParams) -> None:
        """Refuse (400, naming the request field) a spec that cannot be enforced exactly."""
        try:
            grammar = grammar_text(spec)
        except GrammarError as exc:
            raise InvalidInputError(spec.param, str(exc)) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise InvalidInputError(spec.param, _short(f"cannot enforce this {_NAMES[spec.kind]}: {error}"))

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the grammar's start (a template: each sample takes a ``deep_copy``)."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(_short(f"cannot enforce this {_NAMES[spec.kind]}: {matcher.get_error()}"))
        return matcher
