"""Token masks of structured outputs in a step: llguidance's bits unpacked exactly, each row's
mask from its sample's state (guesses consumed and rolled back), matchers advanced by the
tokens kept. The default model's tokenizer; no model forward."""

from __future__ import annotations

import pytest
import torch

from duoserve.core.outputs import ScheduledRequest
from duoserve.core.request import Request
from duoserve.sampling_params import SamplingParams, StructuredOutputsParams
from duoserve.structured.cache import GrammarCache
from duoserve.structured.grammar import GrammarCompiler
from duoserve.worker.grammar_masks import GrammarMasks, allowed_tokens


def test_bits_unpack_to_the_tokens_they_name():
    vocab = 70
    allowed = torch.rand(3, vocab) < 0.3
    words = torch.zeros(3, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)   # bit 31: the sign
    assert torch.equal(allowed_tokens(bitmask, vocab), allowed)


@pytest.fixture(scope="module")
def tokenizer():
    from duoserve.model.paths import default_model_path
    from duoserve.model.gguf_file import read_gguf
    from duoserve.model.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(read_gguf(default_model_path()).meta, (2,))


@pytest.fixture(scope="module")
def masks(tokenizer) -> GrammarMasks:
    cache = GrammarCache(GrammarCompiler(tokenizer, 49152, (2,)))
    yield GrammarMasks(cache, 49152)
    cache.close()


def constrained(rid: str, spec: StructuredOutputsParams, outputs=(), n: int = 1) -> Request:
    request = Request(rid, [1, 2, 3], SamplingParams(n=n, structured_outputs=spec), (2,))
    request.output_token_ids = list(outputs)
    return request


def allowed_of(step, row: int) -> list[int]:
    return allowed_tokens(step.bitmask[row:row + 1], 49152)[0].nonzero()[:, 0].tolist()


def wait_ready(masks, request):
    while not masks.cache.ready(request):
        masks.cache.wait(1.0)


def test_rows_of_guesses_see_the_guesses_before_them(masks, tokenizer):
    spec = StructuredOutputsParams(choice=["red fox", "blue"])
    red, fox = tokenizer.encode("red"), tokenizer.encode(" fox")
    request = constrained("a", spec)
    wait_ready(masks, request)
    item = ScheduledRequest(request, 3, 1 + len(red) + 1, [0], True, spec_token_ids=[*red, 999], num_spec_tokens=3)
    step = masks.fill([(item, 0)])
    assert step.rows == [0, 1, 2] and not step.failed
    assert red[0] in allowed_of(step, 0) and tokenizer.encode("blue")[0] in allowed_of(step, 0)
    assert fox[0] in allowed_of(step, 1)            # after "red": " fox" goes on
    assert len(allowed_of(step, 2)) == 49152        # after the guess outside the grammar: never drawn from
    # the matcher is back where it was: the rows' state was rolled back
    assert request.grammar.matcher.validate_tokens(red + fox) == len(red + fox)
    assert masks.accept(item, [*red, *fox]) == [False, True]


def test_each_of_n_samples_starts_alike_and_ends_apart(masks, tokenizer):
    spec = StructuredOutputsParams(choice=["no", "yes please"])
    no = tokenizer.encode("no")
    request = constrained("b", spec, n=2)
    wait_ready(masks, request)
    item = ScheduledRequest(request, 0, 3, [0], True, num_samples=2)
    step = masks.fill([(item, 4)])
    assert step.rows == [4, 5] and allowed_of(step, 0) == allowed_of(step, 1)
    assert len(no) == 1
    assert masks.accept(item, [no[0], tokenizer.encode("yes")[0]]) == [True, False]
    assert request.grammar.num_consumed == 1


def test_a_sample_made_later_consumes_the_tokens_it_has(masks, tokenizer):
    """A handed-over request (its first token drawn by the prefill engine) or a new sample."""
    spec = StructuredOutputsParams(regex="[0-9]+ apples")
    request = constrained("c", spec, outputs=tokenizer.encode("12"))
    wait_ready(masks, request)
    step = masks.fill([(ScheduledRequest(request, 5, 1, [0], True), 0)])
    assert request.grammar.num_consumed == len(tokenizer.encode("12"))
    assert tokenizer.encode(" apples")[0] in allowed_of(step, 0)
    assert tokenizer.encode("x")[0] not in allowed_of(step, 0)


def test_a_token_outside_the_grammar_fails_its_request_only(masks, tokenizer):
    spec = StructuredOutputsParams(regex="[0-9]+")
    bad = constrained("d", spec, outputs=tokenizer.encode("ab"))
    good = constrained("e", spec)
    free = Request("f", [1], SamplingParams(), (2,))
    for r in (bad, good):
        wait_ready(masks, r)
    step = masks.fill([(ScheduledRequest(bad, 4, 1, [0], True), 0), (ScheduledRequest(free, 1, 1, [0], True), 1),
                       (ScheduledRequest(good, 3, 1, [0], True), 2)])
    assert list(step.failed) == ["d"] and "outside the grammar" in step.failed["d"]
    assert step.rows == [0, 2]
    logits = torch.zeros(3, 49152)
    masked = step.apply(logits)
    assert torch.isfinite(masked[1]).all() and torch.isfinite(masked[0]).all()   # free row, failed row: untouched
    assert torch.isfinite(masked[2]).sum() < 49152 and logits.eq(0).all()
