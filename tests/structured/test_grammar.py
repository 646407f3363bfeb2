"""Grammars from specs, checked against the default model's vocabulary: what cannot be enforced
exactly is refused naming the request field and the part, never loosened."""

from __future__ import annotations

import pytest

from duoserve.errors import ConfigError, InvalidInputError
from duoserve.sampling_params import SamplingParams, StructuredOutputsParams as Structured
from duoserve.structured.cache import GrammarCache
from duoserve.structured.grammar import GrammarCompiler, GrammarError


@pytest.fixture(scope="module")
def compiler():
    from duoserve.model.paths import default_model_path
    from duoserve.model.gguf_file import read_gguf
    from duoserve.model.tokenizer import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(read_gguf(default_model_path()).meta, (2,))
    return GrammarCompiler(tokenizer, 49152, (2,))


@pytest.mark.parametrize("schema, part", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "if"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
])
def test_a_schema_keyword_that_cannot_be_enforced_is_named(compiler, schema, part):
    spec = Structured(json=schema, param="response_format.json_schema.schema")
    with pytest.raises(InvalidInputError) as info:
        compiler.check(spec)
    assert info.value.param == "response_format.json_schema.schema" and part in str(info.value)
    with pytest.raises(GrammarError, match=part):
        compiler.compile(spec)


def test_regex_digits_are_ascii_and_choices_are_literal(compiler):
    digits = compiler.compile(Structured(regex=r"\d+"))
    tokenizer = compiler.tokenizer
    assert digits.validate_tokens(tokenizer.encode("123")) == len(tokenizer.encode("123"))
    assert digits.deep_copy().validate_tokens(tokenizer.encode("\u0663")) == 0   # Arabic-Indic three
    quoted = compiler.compile(Structured(choice=['say "hi"', "a|b", "(x)"]))
    for text in ('say "hi"', "a|b", "(x)"):
        matcher = quoted.deep_copy()
        assert matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_stopped(), text
    assert quoted.deep_copy().validate_tokens(tokenizer.encode("a")) == 1
    assert quoted.deep_copy().validate_tokens(tokenizer.encode("b")) == 0


def test_gbnf_and_lark_grammars(compiler):
    tokenizer = compiler.tokenizer
    for grammar in ('root ::= "ab" [0-9]', 'start: "ab" /[0-9]/'):
        matcher = compiler.compile(Structured(grammar=grammar))
        assert matcher.consume_tokens(tokenizer.encode("ab7")) and matcher.is_stopped(), grammar
    with pytest.raises(InvalidInputError, match="undefined"):
        compiler.check(Structured(grammar="start: undefined"))


def test_spec_shapes_are_checked_on_construction():
    with pytest.raises(ConfigError, match="exactly one of"):
        Structured()
    with pytest.raises(ConfigError, match="exactly one of"):
        Structured(regex="a", json_object=True)
    with pytest.raises(ConfigError) as info:
        Structured(choice=["a", ""], param="structured_outputs")
    assert info.value.field == "structured_outputs.choice"
    a, b = Structured(json={"b": 1, "a": 2}), Structured(json='{"b":1,"a":2}')
    assert a.key == b.key, "a schema and its text are one grammar (key order kept: it is the output's)"
    assert SamplingParams(logit_bias={"7": 1}).logit_bias == {7: 1.0}


def test_a_grammar_compiles_once_and_a_bad_one_fails_its_requests(compiler):
    from duoserve.core.request import Request

    cache = GrammarCache(compiler)
    try:
        good = [Request(f"g{i}", [1], SamplingParams(structured_outputs=Structured(regex="[a-z]+")), (2,))
                for i in range(3)]
        bad = Request("b", [1], SamplingParams(structured_outputs=Structured(grammar="start: nowhere")), (2,))
        for request in [*good, bad]:
            while not cache.ready(request):
                cache.wait(1.0)
        assert cache.num_compiled == 1 and cache.num_failed == 1
        matchers = [cache.matcher(r) for r in good]
        assert len({id(m) for m in matchers}) == 3, "each sample has its own matcher"
        with pytest.raises(GrammarError, match="nowhere"):
            cache.matcher(bad)
    finally:
        cache.close()
