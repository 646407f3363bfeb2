"""Sampling: seeds, penalties, truncation, logprobs, n, stop conditions — on the real default model."""

from __future__ import annotations

import math

import pytest
import torch

from duoserve import SamplingParams
from duoserve.worker.sampler import SamplingRow, draw_seed, sample
from tests.helpers import assert_pool_whole

PROMPT = "Write a short story about a robot who learns to paint."
OTHERS = ["Hi", "List five fruits:", "The meaning of life is", "1, 2, 3, 4,"]


def test_seeded_sampling_same_in_any_batch(smol_llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = smol_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    mixed = [SamplingParams(temperature=1.0, max_tokens=12)] * 2 + [params] + [SamplingParams(temperature=0)] * 2
    batched = smol_llm.generate(OTHERS[:2] + [PROMPT] + OTHERS[2:], mixed, use_tqdm=False)[2].outputs[0].token_ids
    assert alone == batched
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24, ignore_eos=True)
    assert smol_llm.generate([PROMPT], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert_pool_whole(smol_llm)


def test_draw_seed_depends_on_all_three_parts():
    seeds = {draw_seed(s, p, i) for s in (0, 1) for p in (0, 1) for i in (0, 1)}
    assert len(seeds) == 8 and all(0 <= x < 2**63 for x in seeds)
    assert draw_seed(5, 3, 1) == draw_seed(5, 3, 1)


def _row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), 0, 0, [1, 2], [3, 3, 4], (0,))


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    for kw, allowed in [(dict(top_k=2), {0, 1}), (dict(top_p=0.6), {0, 1}), (dict(top_p=0.5), {0}),
                        (dict(min_p=0.35), {0, 1})]:
        seen = {sample(logits, [_row(temperature=1.0, seed=s, **kw)])[0][0] for s in range(300)}
        assert seen == allowed, kw


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    counts = torch.zeros(3)
    for s in range(3000):
        counts[sample(torch.log(probs)[None], [_row(temperature=1.0, seed=s)])[0][0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_penalties():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 1.9]])
    row = SamplingRow(SamplingParams(temperature=0, frequency_penalty=0.5), 0, 0, [], [0, 0], ())
    assert sample(logits, [row])[0] == [4]  # 2.0 - 2 * 0.5 < 1.9
    row = SamplingRow(SamplingParams(temperature=0, presence_penalty=0.2), 0, 0, [], [0, 0], ())
    assert sample(logits, [row])[0] == [4]
    row = SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.2), 0, 0, [0], [], ())
    assert sample(logits, [row])[0] == [4]  # 2.0 / 1.2 < 1.9
    assert logits[0, 0] == 2.0, "penalties must not modify the caller's logits"


def test_min_tokens_and_stop_token_ids(smol_llm):
    eos = smol_llm.engine.eos_token_ids[0]
    out = smol_llm.generate(["Say only yes.<|im_end|>"], SamplingParams(temperature=0, max_tokens=40),
                            use_tqdm=False)[0].outputs[0]
    natural_len = len(out.token_ids)
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    longer = smol_llm.generate(["Say only yes.<|im_end|>"],
                               SamplingParams(temperature=0, max_tokens=40, min_tokens=natural_len + 3),
                               use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= natural_len + 3
    assert eos not in longer.token_ids[:natural_len + 2]
    first = out.token_ids[0]
    stopped = smol_llm.generate(["Say only yes.<|im_end|>"],
                                SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[first]),
                                use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason == first
    assert_pool_whole(smol_llm)


def test_stop_string_across_token_boundary(smol_llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = smol_llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    tokenizer = smol_llm.get_tokenizer()
    # a stop string made of the end of one token and the start of the next
    pieces = [tokenizer.decode([t]) for t in full.token_ids]
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    assert stop in full.text
    out = smol_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    assert out.token_ids == full.token_ids[:k + 2]
    kept = smol_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                      include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == full.text[:full.text.index(stop) + len(stop)]
    assert_pool_whole(smol_llm)


def test_logprobs_match_the_model(smol_llm, default_model):
    out = smol_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    from tests.helpers import forward_one

    ids = smol_llm.get_tokenizer().encode(PROMPT) + out.token_ids
    ref = torch.log_softmax(forward_one(default_model.model, ids)[-5:-1], dim=-1)  # predicts the 4 outputs
    for i, entry in enumerate(out.logprobs):
        assert entry.token_id == out.token_ids[i] and entry.rank == 1
        assert abs(entry.logprob - ref[i, entry.token_id].item()) < 1e-4
        assert [t for t, _ in entry.top] == ref[i].topk(5).indices.tolist()
        assert entry.top[0] == (entry.token_id, pytest.approx(entry.logprob))
    assert math.isclose(out.cumulative_logprob, sum(e.logprob for e in out.logprobs))


def test_truncation_at_temperature_one_leaves_the_callers_logits():
    """At temperature 1 the logits are not divided (no copy): top-k must then write into a copy,
    since the caller reads the raw logits again for logprobs."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.1], [0.1, 0.2, 3.0, 0.3]])
    before = logits.clone()
    rows = [_row(temperature=1.0, top_k=1, seed=1, logprobs=1), _row(temperature=1.0, top_k=2, seed=2)]
    tokens, logprobs = sample(logits, rows)
    assert tokens[0] == 0 and tokens[1] in (2, 3)
    assert torch.equal(logits, before), "truncation must not modify the caller's logits"
    assert logprobs[0].logprob == pytest.approx(torch.log_softmax(before[0], -1)[0].item())


def test_sampled_token_logprob_and_rank_beyond_top():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    row = SamplingRow(SamplingParams(temperature=0, logprobs=1, min_tokens=1), 0, 0, [], [], (0,))
    tokens, logprobs = sample(logits, [row])  # token 0 is forbidden by min_tokens: 1 is chosen
    assert tokens == [1]
    entry = logprobs[0]
    assert entry.rank == 2 and entry.top == [(0, pytest.approx(entry.top[0][1]))]
    assert entry.logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())


def test_n_samples_share_prompt_blocks(smol_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    out = smol_llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    token_lists = [o.token_ids for o in out.outputs]
    assert all(len(t) == 16 for t in token_lists) and len({tuple(t) for t in token_lists}) == 3
    again = smol_llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == token_lists
    assert_pool_whole(smol_llm)


def test_inverse_cdf_draws_follow_the_distribution():
    """20,000 draws from a toy distribution: total variation under 0.01 (its standard error is
    ~0.004 here), and a token of zero probability is never drawn, even at u = 0 or just under 1."""
    from duoserve.worker.sampler import draw_from

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0]])
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = draw_from(probs.expand(20000, -1), uniforms)
    counts = torch.bincount(tokens, minlength=6).double() / 20000
    assert counts[[0, 2, 5]].sum() == 0
    assert 0.5 * (counts - probs[0].double()).abs().sum() < 0.01
    edges = draw_from(probs.expand(2, -1), torch.tensor([0.0, 1.0 - 1e-12], dtype=torch.float64))
    assert edges.tolist() == [1, 4]


@pytest.mark.parametrize("vocab, live, seed, num_draws", [(3000, 0.5, 1, 200000), (2048, 0.3, 3, 100000)])
def test_inverse_cdf_across_blocks_of_the_vocabulary(vocab, live, seed, num_draws):
    """A vocabulary of 3,000 (three draw blocks, the last one short) or of exactly two blocks (no
    padding), the mass spread over all of them: the same total-variation bound, zero-probability
    tokens never drawn."""
    from duoserve.worker.sampler import draw_from

    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(vocab, generator=g) * (torch.rand(vocab, generator=g) > 1 - live)
    probs = probs / probs.sum()
    uniforms = torch.rand(num_draws, generator=g, dtype=torch.float64)
    tokens = draw_from(probs.expand(len(uniforms), -1), uniforms)
    counts = torch.bincount(tokens, minlength=vocab).double() / len(uniforms)
    assert counts[probs == 0].sum() == 0
    assert 0.5 * (counts - probs.double()).abs().sum() < 0.05  # noise ~0.035 at 1,500 live tokens
    assert draw_from(probs[None], torch.tensor([1.0 - 1e-15], dtype=torch.float64)).item() == int(probs.nonzero()[-1])


def test_logit_bias_and_allowed_token_ids():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    row = SamplingRow(SamplingParams(temperature=0, logit_bias={"3": 2.5}), 0, 0, [], [], ())
    assert sample(logits, [row])[0] == [3]          # 0.0 + 2.5 > 2.0
    row = SamplingRow(SamplingParams(temperature=0, logit_bias={0: -100, 7: 100}), 0, 0, [], [], ())
    assert sample(logits, [row])[0] == [1]          # a token past the vocabulary changes nothing
    seen = {sample(logits, [_row(temperature=1.0, seed=s, allowed_token_ids=[2, 4])])[0][0] for s in range(200)}
    assert seen == {2, 4}
    assert logits[0, 0] == 2.0, "biases must not modify the caller's logits"


def test_min_tokens_yields_to_a_row_with_nothing_else_left():
    """A complete grammar allows only eos: min_tokens must not leave the row empty."""
    logits = torch.tensor([[float("-inf"), float("-inf"), 1.0, float("-inf")]])
    row = SamplingRow(SamplingParams(temperature=0, min_tokens=4), 0, 0, [], [], (2,))
    assert sample(logits, [row])[0] == [2]
    logits = torch.tensor([[float("-inf"), 0.5, 1.0, float("-inf")]])
    assert sample(logits, [row])[0] == [1]          # otherwise eos waits for min_tokens


def test_a_bad_words_last_token_is_banned_only_after_the_rest_of_it():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    params = SamplingParams(temperature=0, bad_words_token_ids=[(1,), (3, 2)])
    assert sample(logits, [SamplingRow(params, 0, 0, [], [], ())])[0] == [2]        # 1 alone is banned
    assert sample(logits, [SamplingRow(params, 2, 0, [], [0, 3], ())])[0] == [3]    # after 3: 2 banned too
