"""Structured outputs on the default configuration (the packaged GGUF file, its blocks computed
in fast mode): every output parses and validates against its JSON schema (each keyword family
llguidance implements), matches its regex, is one of its choices or a sentence of its grammar,
greedy and seeded, and ends where the grammar does. A constrained request keeps every equality
of an unconstrained one: batched, chunked, prefix-cached, preempted, swapped, n = 2, n-gram
speculation and a prefill engine handing over to a decode engine give the tokens it gives alone.
Through the server and the openai SDK: tests/entrypoints/test_default_server_equality.py."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from duoserve import LLM, SamplingParams
from duoserve.core.request import Request
from duoserve.sampling_params import StructuredOutputsParams as Structured
from duoserve.worker.kv_cache import bytes_per_token
from tests.helpers import assert_pool_whole

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "address"], "additionalProperties": False}
SCHEMAS = {
    "nested objects, pattern, integer range": PERSON,
    "$ref and $defs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
    "anyOf": {"type": "object", "properties": {"id": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 999}, {"type": "string", "pattern": "^[a-z]{1,6}$"}]}},
        "required": ["id"], "additionalProperties": False},
    "enum and const": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                        "kind": {"const": "paint"}, "gloss": {"type": "boolean"}},
                       "required": ["color", "kind", "gloss"], "additionalProperties": False},
    "array with bounds": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                          "minItems": 2, "maxItems": 4},
    "numbers": {"type": "object", "properties": {
        "count": {"type": "integer", "exclusiveMinimum": 10, "maximum": 20},
        "step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}},
        "required": ["count", "step", "ratio"], "additionalProperties": False},
    "strings and formats": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}\\d$"}, "day": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 8}, "maxItems": 3}},
        "required": ["code", "day", "tags"], "additionalProperties": False},
}
QUESTION = "Describe a person who lives in Paris as a JSON object."


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory=0.1, max_model_len=1024)


def chat(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_validates_against_its_schema(llm, name):
    schema = SCHEMAS[name]
    prompt = chat(llm, f"Answer with JSON only. {QUESTION}")
    greedy = SamplingParams(temperature=0, max_tokens=200, structured_outputs=Structured(json=schema))
    seeded = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=200, structured_outputs=Structured(json=schema))
    (g,), (s,) = llm.generate([prompt], greedy, use_tqdm=False), llm.generate([prompt], seeded, use_tqdm=False)
    for sample in [*g.outputs, *s.outputs]:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), schema)
    assert g.outputs[0].token_ids[-1] not in llm.engine.eos_token_ids, "the grammar ends the output, not eos"
    assert len({sample.text for sample in s.outputs}) > 1, "seeded samples should differ"
    again = llm.generate([prompt], seeded, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in s.outputs], "a seed fixes the samples"


def test_json_object_regex_choice_and_grammar(llm):
    prompts = [chat(llm, 'Reply with a JSON object with one key, "ok", set to true.'),
               chat(llm, "Give a JSON object with a name and an age.")]
    cases = [
        (Structured(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (Structured(regex=r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (Structured(choice=["yes", "no", "it depends"]), lambda t: t in ("yes", "no", "it depends")),
        (Structured(grammar='start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/'),
         lambda t: re.fullmatch(r"The answer is [1-9][0-9]?\.", t)),
        (Structured(grammar='root ::= ("cat" | "dog") " " [0-9]'), lambda t: re.fullmatch(r"(cat|dog) [0-9]", t)),
    ]
    for spec, ok in cases:
        for params in (SamplingParams(temperature=0, max_tokens=120, structured_outputs=spec),
                       SamplingParams(temperature=1.0, seed=3, max_tokens=120, structured_outputs=spec)):
            for out in llm.generate(prompts, params, use_tqdm=False):
                text = out.outputs[0].text
                assert ok(text), (spec.kind, text)
                assert out.outputs[0].finish_reason == "stop", (spec.kind, text)


def test_a_choice_ends_at_its_last_token(llm):
    out = llm.generate([chat(llm, "Is the sky blue?")], SamplingParams(
        temperature=0, max_tokens=50, structured_outputs=Structured(choice=["Absolutely not", "yes"])), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert text in ("Absolutely not", "yes")
    ids = out.outputs[0].token_ids
    assert llm.get_tokenizer().decode(ids[:-1]) != text and ids[-1] not in llm.engine.eos_token_ids, \
        "the output ends at the token that completes the grammar"


def test_logit_bias_and_allowed_token_ids(llm):
    tokenizer = llm.get_tokenizer()
    prompt = chat(llm, "Say something.")
    hello = tokenizer.encode(" Hello")[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                logit_bias={hello: 100}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [hello] * 4
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logit_bias={free[0]: -100}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert banned[0] != free[0]
    allowed = tokenizer.encode(" one two three")
    for params in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)):
        assert set(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids) <= set(allowed)


# ---- a constrained request keeps the engine's equalities ------------------------------------

EQUALITY_SPECS = [Structured(json=PERSON), Structured(regex=r"[A-Z][a-z]+( [a-z]+){3,6}\."),
                  Structured(json=SCHEMAS["$ref and $defs"]), Structured(json_object=True),
                  Structured(choice=["Paris", "London", "a city I do not know"])]


def constrained(spec: Structured, max_tokens: int = 40, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec, **extra)


@pytest.fixture(scope="module")
def equality_prompts(llm) -> list[str]:
    return [chat(llm, f"Answer with JSON only. {QUESTION}"), chat(llm, "Write one short sentence about rain."),
            chat(llm, "Give two points as JSON."), chat(llm, "Describe a cat in JSON."),
            chat(llm, "Which city is the capital of France?")]


def run_each(llm: LLM, prompts: list[str], **extra) -> list[list[int]]:
    """Each prompt under its own grammar, all in one batch."""
    outs = llm.generate(prompts, [constrained(spec, **extra) for spec in EQUALITY_SPECS], use_tqdm=False)
    assert_pool_whole(llm)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(llm, equality_prompts) -> list[list[int]]:
    fresh = LLM(kv_cache_memory=0.1, max_model_len=1024, enable_prefix_caching=False)
    return [fresh.generate([p], constrained(spec), use_tqdm=False)[0].outputs[0].token_ids
            for p, spec in zip(equality_prompts, EQUALITY_SPECS)]


def test_batched_chunked_and_prefix_cached_equal_alone(alone, equality_prompts):
    llm = LLM(kv_cache_memory=0.1, max_model_len=1024, max_num_batched_tokens=24)
    assert run_each(llm, equality_prompts) == alone
    assert run_each(llm, equality_prompts) == alone     # the prompts' blocks from the cache now
    assert llm.engine.kv.num_hits > 0


def test_preempted_swapped_and_n_2_equal_alone(llm, alone, equality_prompts):
    per_token = bytes_per_token(llm.engine.arch, llm.engine.loaded.dtype)   # 12 blocks: the batch does not fit
    small = dict(kv_cache_memory=12 * 16 * per_token / 2**30, max_model_len=192, max_num_batched_tokens=64)
    recompute = LLM(**small)
    assert run_each(recompute, equality_prompts) == alone
    assert recompute.engine.scheduler.num_preemptions > 0
    swapping = LLM(**small, swap_space=64 * 16 * per_token / 2**30)
    assert run_each(swapping, equality_prompts) == alone
    assert swapping.engine.scheduler.num_swap_preemptions > 0
    assert swapping.engine.scheduler.swap.space.is_whole
    outs = swapping.generate(equality_prompts, [constrained(s, n=2) for s in EQUALITY_SPECS], use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[a, a] for a in alone]


def test_ngram_speculation_equals_alone(alone, equality_prompts):
    llm = LLM(kv_cache_memory=0.1, max_model_len=1024,
              speculative_config=dict(method="ngram", ngram_min=1, disable_batch_size=64))
    assert run_each(llm, equality_prompts) == alone
    assert llm.engine.speculation.num_accepted_tokens > 0   # verification steps checked guesses


def test_disaggregated_equals_alone(llm, alone, equality_prompts):
    """The prefill engine draws the first token under the grammar; the decode engine's matcher
    starts from it."""
    from tests.e2e.test_default_config_equality import disaggregated_pair
    from tests.e2e.test_disagg_inprocess import pool_whole

    prefill, decode = disaggregated_pair(str(llm.engine.loaded.dtype).removeprefix("torch."))
    eos = prefill.eos_token_ids
    ids = [prefill.tokenizer.encode(p) for p in equality_prompts]
    for i, (prompt, spec) in enumerate(zip(ids, EQUALITY_SPECS)):
        prefill.add_request(Request(f"r{i}", prompt, constrained(spec), eos, 1024))
    got, finished = {f"r{i}": [] for i in range(len(ids))}, {}
    for _ in range(2000):
        for out in prefill.step() + decode.step():
            got[out.request_id][out.position:] = out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if len(finished) == len(ids) and not prefill.has_unfinished() and not decode.has_unfinished():
            break
    assert [got[f"r{i}"] for i in range(len(ids))] == alone
    assert pool_whole(prefill) and pool_whole(decode)
    for engine in (prefill, decode):
        for i in range(len(ids)):
            engine.release(f"r{i}")



def test_bad_words_are_never_generated(llm):
    prompt = chat(llm, "Tell me about Paris.")
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0].text
    word = next(w.strip(".,") for w in free.split() if len(w.strip(".,")) > 3)
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, bad_words=[word, "Eiffel Tower"]),
                          use_tqdm=False)[0].outputs[0].text
    assert re.search(rf"(^|\s){re.escape(word)}", free), free
    assert not re.search(rf"(^|\s){re.escape(word)}", banned) and "Eiffel Tower" not in banned, (free, banned)
