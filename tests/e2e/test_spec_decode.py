"""Speculative decoding: guesses never change the output, the rejection sampler keeps the
target's distribution, blocks and the prefix cache stay exact, a bad draft is refused."""

from __future__ import annotations

import random
import time

import pytest
import torch

from duoserve import LLM, SamplingParams
from duoserve.config import SpeculativeConfig
from duoserve.core.block_pool import hash_block
from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.request import Request, RequestStatus
from duoserve.core.kv_sources import PrefixCacheSource
from duoserve.core.scheduler import Scheduler, SchedulerSetup
from duoserve.core.speculation import SpeculationPolicy, propose_ngram
from duoserve.errors import ConfigError
from duoserve.worker.spec_verify import rejection_sample
from tests.helpers import assert_pool_whole
from tests.e2e.test_engine_equivalence import prompts_with_shared_prefixes

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
ALWAYS = 64  # disable_batch_size: speculate whatever the batch


def engine_prompts() -> list[list[int]]:
    """The engine tests' prompts, and two that repeat themselves (n-gram lookups find them)."""
    rng = random.Random(4)
    phrase = [rng.randrange(256) for _ in range(12)]
    return prompts_with_shared_prefixes() + [phrase * 4, [7, 8, 9] * 10]


def generate(path, prompts, params, **kwargs):
    llm = LLM(str(path), dtype="float32", **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_pool_whole(llm)
    return llm, [o.outputs for o in outs]


def tokens(outputs) -> list[list[int]]:
    return [[c.token_ids for c in out] for out in outputs]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Speculation off, each prompt scheduled with the rest (its tokens do not depend on the batch)."""
    path = tiny_dir(kind="llama")
    _, greedy = generate(path, engine_prompts(), GREEDY)
    _, seeded = generate(path, engine_prompts(), SEEDED)
    return path, greedy, seeded


# ---- the proposer and the policy -------------------------------------------------------

def test_ngram_takes_the_longest_suffix_at_its_latest_earlier_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 0, 2, 3]
    # suffix [0, 2, 3] (n = 3) is nowhere earlier; [2, 3] is, last at index 5 -> what followed: 7, 5, 0
    assert propose_ngram(tokens, 2, 3, 3) == [7, 5, 0]
    assert propose_ngram(tokens, 2, 3, 10) == [7, 5, 0, 2, 3]  # up to the end of the tokens
    assert propose_ngram([1, 2, 3, 4], 1, 3, 4) == []           # 4 never came before
    assert propose_ngram([5, 5, 5], 2, 2, 2) == [5]             # an occurrence may overlap the suffix
    assert propose_ngram([4], 1, 2, 3) == []


def test_ngram_skips_matches_that_straddle_two_tokens():
    # as int32 words, 256 = 00 01 00 00 and 1 = 01 00 00 00: the bytes of [1] occur inside 256's
    assert propose_ngram([256, 0, 9, 1], 1, 1, 2) == []
    assert propose_ngram([1, 6, 256, 0, 9, 1], 1, 1, 2) == [6, 256]


def scheduler_with(method="ngram", k=4, disable=2, num_blocks=64):
    policy = SpeculationPolicy(SpeculativeConfig(method=method, num_speculative_tokens=k, disable_batch_size=disable))
    kv = KVCacheManager(num_blocks, 4)
    return Scheduler(SchedulerSetup(kv=kv, max_num_batched_tokens=64, max_num_seqs=8,
                                    sources=[PrefixCacheSource(kv)], speculation=policy))


def decoding(scheduler, request_id, prompt, output, max_tokens=50):
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), (), 512)
    scheduler.add_request(request)
    scheduler.schedule()
    request.num_computed_tokens = len(prompt)
    request.output_token_ids = list(output)
    request.status = RequestStatus.RUNNING
    return request


def test_guesses_only_in_small_batches_and_within_max_tokens():
    scheduler = scheduler_with(disable=2)
    decoding(scheduler, "a", [1, 2, 3, 4, 1, 2], [3])
    decoding(scheduler, "b", [5, 6, 5], [6], max_tokens=3)
    plan = {s.request.request_id: s for s in scheduler.schedule().scheduled}
    assert plan["a"].spec_token_ids == [4, 1, 2, 3] and plan["a"].num_new_tokens == 5
    assert plan["b"].spec_token_ids == [5]        # 1 output, max 3: one guess and the target's token
    assert plan["b"].num_new_tokens == 2
    decoding(scheduler, "c", [9, 9, 9], [9])      # three running > 2: nobody guesses
    plan = scheduler.schedule()
    assert [s.num_spec_tokens for s in plan.scheduled] == [0, 0, 0]


def test_short_of_blocks_a_request_guesses_less_before_anyone_is_preempted():
    scheduler = scheduler_with(num_blocks=3)       # 12 slots of 4 tokens
    request = decoding(scheduler, "a", [1, 2, 3, 4, 5, 6, 7, 1, 2], [3])  # 10 tokens in 3 blocks
    plan = scheduler.schedule()
    (item,) = plan.scheduled
    assert item.spec_token_ids == [4, 5] and item.num_new_tokens == 3  # of [4, 5, 6, 7]: 2 fill the blocks
    request.num_computed_tokens = 12
    request.output_token_ids += [4, 5, 6]                               # 13 tokens: 12 fill the blocks
    plan = scheduler.schedule()
    assert plan.scheduled == [] and plan.preempted_ids == ["a"]         # not even its own token fits


# ---- verification ----------------------------------------------------------------------

def test_rejection_sampler_output_follows_the_target_distribution():
    """x ~ q, then accept with min(1, p/q) or draw from the residual: the output is ~ p."""
    p = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.15, 0.05])
    q = torch.tensor([0.30, 0.10, 0.10, 0.10, 0.20, 0.20])
    g = torch.Generator().manual_seed(0)
    draws = 40_000
    counts = torch.zeros(6)
    accepted_total = 0
    guesses = torch.multinomial(q, draws, replacement=True, generator=g)
    u = torch.rand(draws, 2, generator=g, dtype=torch.float64)
    for i in range(draws):
        accepted, token = rejection_sample(p[None], q[None], guesses[i:i + 1], u[i, :1], u[i, 1:])
        accepted_total += accepted
        counts[guesses[i] if accepted else token] += 1
    tv = 0.5 * (counts / draws - p).abs().sum().item()
    assert tv < 0.01, f"total variation {tv:.4f} from the target over {draws} draws"
    expected = torch.minimum(p, q).sum().item()     # the acceptance rate of rejection sampling
    assert abs(accepted_total / draws - expected) < 0.01


def test_rejection_sampler_stops_at_the_first_rejection():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    u = torch.full((3,), 0.5, dtype=torch.float64)
    accepted, token = rejection_sample(p, q, torch.tensor([1, 0, 1]), u, u)
    assert (accepted, token) == (1, 1)   # the second guess has p = 0: rejected, the residual gives 1
    assert rejection_sample(p, p, torch.tensor([1, 1, 1]), u, u) == (3, None)


# ---- the engine: output identical to speculation off -----------------------------------

@pytest.mark.parametrize("spec", [
    dict(method="ngram", ngram_min=1),
    dict(method="draft"),                                  # the target's own weights: all accepted
], ids=["ngram", "self-draft"])
def test_greedy_and_seeded_output_equal_speculation_off(reference, spec):
    path, greedy, seeded = reference
    llm, got = generate(path, engine_prompts(), GREEDY, speculative_config={**spec, "disable_batch_size": ALWAYS})
    assert tokens(got) == tokens(greedy)
    for out, ref in zip(got, greedy):   # the log-probabilities are the target's
        for a, b in zip(out[0].logprobs, ref[0].logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    stats = llm.engine.speculation
    assert stats.num_accepted_tokens > 0 and stats.num_steps > 0
    if spec["method"] == "ngram":  # point guesses: seeded sampling draws what it draws without speculation
        _, got = generate(path, engine_prompts(), SEEDED, speculative_config={**spec, "disable_batch_size": ALWAYS})
        assert tokens(got) == tokens(seeded)


def test_a_draft_that_guesses_badly_changes_nothing(reference, tiny_dir):
    path, greedy, _ = reference
    draft = tiny_dir(kind="llama", seed=3, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    llm, got = generate(path, engine_prompts(), GREEDY,
                        speculative_config=dict(method="draft", model=str(draft), disable_batch_size=ALWAYS))
    assert tokens(got) == tokens(greedy)
    assert llm.engine.speculation.num_draft_tokens > llm.engine.speculation.num_accepted_tokens


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_equal_under_chunked_prefill_prefix_hits_and_preemption(reference, method):
    path, greedy, _ = reference
    spec = dict(method=method, ngram_min=1, disable_batch_size=ALWAYS)
    per_token = 512 * (2 if method == "draft" else 1)  # a draft's KV sits in the same blocks
    # 40 blocks of 4 tokens: one full-length sequence fits, the batch does not
    llm, got = generate(path, engine_prompts(), GREEDY, speculative_config=spec, max_num_batched_tokens=24,
                        kv_cache_memory=40 * 4 * per_token / 2**30, max_model_len=128, block_size=4)
    assert llm.engine.num_blocks == 40
    assert tokens(got) == tokens(greedy)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_hits > 0
    assert llm.engine.speculation.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_n_2_samples_speculate_on_their_own(reference, method):
    path, _, _ = reference
    params = SamplingParams(n=2, temperature=0.3, seed=3, max_tokens=20, ignore_eos=True)
    prompts = engine_prompts()[-2:]
    _, want = generate(path, prompts, params)
    spec = dict(method=method, ngram_min=1, disable_batch_size=ALWAYS)
    if method == "draft":  # drawn guesses: rejection sampling, the same distribution but other draws
        params = SamplingParams(n=2, temperature=0.0, max_tokens=20, ignore_eos=True)
        _, want = generate(path, prompts, params)
    llm, got = generate(path, prompts, params, speculative_config=spec)
    assert tokens(got) == tokens(want)
    assert llm.engine.speculation.num_accepted_tokens > 0


def test_sampling_with_a_draft_model_runs_rejection_sampling(reference, tiny_dir):
    """Drawn guesses with the target's own weights as the draft: q == p, every guess accepted."""
    path, _, _ = reference
    spec = dict(method="draft", disable_batch_size=ALWAYS)
    llm, got = generate(path, engine_prompts()[:3], SEEDED, speculative_config=spec)
    stats = llm.engine.speculation
    assert all(len(c.token_ids) == 24 for out in got for c in out)
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens  # float noise aside, q == p


def test_stop_token_and_eos_inside_an_accepted_run_end_there(reference):
    path, greedy, _ = reference
    prompt_index = len(engine_prompts()) - 1        # [7, 8, 9] * 10: long accepted runs
    ref = greedy[prompt_index][0].token_ids
    stop_at = 9
    stop_id = ref[stop_at]
    first = ref.index(stop_id)
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id])
    spec = dict(method="ngram", ngram_min=1, disable_batch_size=ALWAYS)
    _, (out,) = generate(path, [engine_prompts()[prompt_index]], params, speculative_config=spec)
    assert out[0].token_ids == ref[:first + 1] and out[0].finish_reason == "stop"
    assert out[0].stop_reason == stop_id
    # the same id as the model's eos
    _, (out,) = generate(path, [engine_prompts()[prompt_index]], SamplingParams(temperature=0.0, max_tokens=24),
                         speculative_config=spec, hf_overrides={"eos_token_id": stop_id})
    assert out[0].token_ids == ref[:first + 1] and out[0].finish_reason == "stop"


def test_guessed_tokens_never_enter_the_prefix_cache(reference):
    path, greedy, _ = reference
    prompts = engine_prompts()
    llm, got = generate(path, prompts, GREEDY, block_size=4,
                        speculative_config=dict(method="draft", disable_batch_size=ALWAYS))
    chains = set()
    for prompt, out in zip(prompts, got):
        final = prompt + out[0].token_ids
        parent = None
        for start in range(0, len(final) - 3, 4):
            parent = hash_block(parent, final[start:start + 4])
            chains.add(parent)
    cached = set(llm.engine.kv.pool.cached)
    assert cached and cached <= chains, f"{len(cached - chains)} cached blocks hold tokens that were never output"
    # and their KV is the accepted tokens': a prompt made of a whole output hits them and goes on alike
    again = prompts[-1] + got[-1][0].token_ids
    (cont,) = llm.generate([again], GREEDY, use_tqdm=False)
    fresh = LLM(str(path), dtype="float32", enable_prefix_caching=False).generate([again], GREEDY, use_tqdm=False)
    assert cont.outputs[0].token_ids == fresh[0].outputs[0].token_ids
    assert cont.num_cached_tokens > 0


# ---- a draft that does not fit -----------------------------------------------------------

@pytest.mark.parametrize("overrides, names", [
    (dict(vocab_size=300), ["vocab_size", "256", "300"]),
    (dict(max_position_embeddings=128), ["context", "512", "128"]),
    (dict(bos_token_id=5), ["special token ids", "'bos': 1", "'bos': 5"]),
])
def test_an_incompatible_draft_is_a_config_error(tiny_dir, overrides, names):
    target = tiny_dir(kind="llama")
    draft = tiny_dir(kind="llama", **overrides)
    with pytest.raises(ConfigError) as err:
        LLM(str(target), dtype="float32", speculative_config=dict(method="draft", model=str(draft)))
    message = str(err.value)
    assert "speculative_model" in message and str(draft) in message
    for name in names:
        assert name in message


def test_a_scaled_rope_draft_serves_the_targets_context(tiny_dir):
    """A dynamic-NTK draft (16 positions trained, factor 4) covers a 64-token context as its target
    does (the target's rule, not max_position_embeddings alone), with rope tables that long: the
    target's tokens past position 16, and the draft (the target's own file) guessing them."""
    path = tiny_dir(kind="llama", rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
                    max_position_embeddings=16)
    prompt, params = [[5, 17, 200, 3, 99, 42, 42, 7, 128, 255, 0, 64, 31, 8, 150, 77, 23, 11, 90, 4]], \
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    _, (want,) = generate(path, prompt, params, max_model_len=64)
    llm, (got,) = generate(path, prompt, params, max_model_len=64,
                           speculative_config=dict(method="draft", model=str(path), disable_batch_size=ALWAYS))
    assert got[0].token_ids == want[0].token_ids and len(want[0].token_ids) == 40
    spec = llm.engine.speculation
    assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens > 0


def test_a_draft_larger_than_the_target_is_only_a_warning(tiny_dir, caplog):
    target = tiny_dir(kind="llama")
    draft = tiny_dir(kind="llama", num_hidden_layers=4)
    with caplog.at_level("WARNING", logger="duoserve.worker.draft"):
        llm = LLM(str(target), dtype="float32", speculative_config=dict(method="draft", model=str(draft)))
    assert "is larger than the target" in caplog.text
    assert llm.engine.draft is not None


def test_prompt_logprobs_with_speculation_equal_without(reference):
    path, _, _ = reference
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    prompts = engine_prompts()[-2:]
    want = LLM(str(path), dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(path), dtype="float32", speculative_config=dict(method="ngram", ngram_min=1))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.speculation.num_accepted_tokens > 0
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        assert all(x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
                   for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]))
    assert_pool_whole(llm)


def test_bad_speculative_settings_name_the_field():
    cases = [
        (dict(method="medusa"), "speculative_method"),
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(ngram_min=5, ngram_max=3), "ngram_min"),
        (dict(method="ngram", model="x"), "speculative_model"),
        (dict(disable_batch_size=0), "speculative_disable_batch_size"),
        (dict(k=3), "speculative_config"),
    ]
    for value, field in cases:
        with pytest.raises(ConfigError, match=field):
            SpeculativeConfig.from_value(value)


# ---- the default model: stop strings, the server and its metrics ---------------------------

REPEAT = [{"role": "user", "content": "Repeat this sentence three times: The red fox jumps over the lazy brown dog."}]


@pytest.fixture(scope="module")
def smol_ngram(default_model):
    from duoserve.config import CacheConfig, EngineConfig, ModelConfig
    from duoserve.engine.builder import build_engine

    config = EngineConfig(model=ModelConfig(dtype="float32", quantization="none"), cache=CacheConfig(kv_cache_memory=0.4),
                          speculative=SpeculativeConfig(method="ngram", ngram_min=1))
    return LLM.from_engine(build_engine(config, loaded=default_model))


def test_a_stop_string_inside_an_accepted_run_ends_the_output_there(smol_llm, smol_ngram, monkeypatch):
    from duoserve.frontend.detokenizer import IncrementalDetokenizer

    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (want,) = smol_llm.chat(REPEAT, plain, use_tqdm=False)
    text = want.outputs[0].text
    stop = "jumps"  # in the sentence copied from the prompt: the lookup guesses it and what follows
    assert stop in text, text
    unused: list[int] = []                          # tokens that came with the stop string and were dropped
    original = IncrementalDetokenizer.add_tokens

    def add_tokens(self, token_ids):
        hit = original(self, token_ids)
        if hit is not None:
            unused.append(len(token_ids) - self.num_used)
        return hit

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", add_tokens)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    (plain_stop,) = smol_llm.chat(REPEAT, params, use_tqdm=False)
    before = smol_ngram.engine.speculation.num_accepted_tokens
    (got,) = smol_ngram.chat(REPEAT, params, use_tqdm=False)
    assert got.outputs[0].text == text[:text.index(stop)] == plain_stop.outputs[0].text
    assert got.outputs[0].token_ids == plain_stop.outputs[0].token_ids
    assert got.outputs[0].finish_reason == "stop" and got.outputs[0].stop_reason == stop
    assert smol_ngram.engine.speculation.num_accepted_tokens > before
    assert unused[-1] > 0, "the stop string should fall inside a run of accepted tokens"
    assert_pool_whole(smol_ngram)


def test_server_speculates_and_counts_it(tmp_path):
    import httpx

    from tests.server_helpers import Server, metric

    server = Server("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.4", "--num-threads", "2",
                    "--speculative-method", "ngram", "--ngram-min", "1", log=tmp_path / "server.log")
    try:
        body = {"model": "smollm2-135m", "messages": REPEAT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
        assert reply["usage"]["completion_tokens"] == 40
        deadline = time.monotonic() + 10   # engine stats arrive once a second
        while metric(server.url, "duoserve:spec_decode_num_draft_tokens_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        drafts = metric(server.url, "duoserve:spec_decode_num_draft_tokens_total")
        accepted = metric(server.url, "duoserve:spec_decode_num_accepted_tokens_total")
        first = metric(server.url, "duoserve:spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"})
        assert 0 < accepted <= drafts and 0 < first <= accepted
        assert metric(server.url, "duoserve:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    finally:
        server.stop()


def test_stats_line_reports_the_mean_accepted_length(caplog):
    from duoserve.messages import EngineStats
    from duoserve.metrics import ServerMetrics

    metrics = ServerMetrics(log_interval=0.0)
    base = dict(num_running=1, num_waiting=0, kv_cache_usage=0.1, num_blocks=10, prefix_cache_queries=0,
                prefix_cache_hits=0, num_preemptions=0, num_prompt_tokens=5)
    metrics.observe_stats("engine-0", "i1", EngineStats(num_generated_tokens=0, **base))
    with caplog.at_level("INFO", logger="duoserve.stats"):
        metrics.observe_stats("engine-0", "i1", EngineStats(
            num_generated_tokens=30, spec_num_steps=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=25,
            spec_accepted_by_position=[9, 8, 5, 3], **base))
    assert "mean accepted length 3.50" in caplog.text


def test_the_decode_engine_of_a_handoff_speculates_with_a_draft(tiny_dir):
    """The prefill engine has no draft: the decode engine's draft computes the prompt's draft KV
    itself (its first catch-up), then guesses; the tokens are the colocated engine's."""
    from duoserve.config import CacheConfig, DisaggConfig, EngineConfig, ModelConfig
    from duoserve.engine.builder import build_engine
    from duoserve.kv.connector import InProcessConnector
    from tests.e2e.test_disagg_inprocess import pool_whole, prompts, run

    path = tiny_dir(kind="llama")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float32").generate(prompts(), params, use_tqdm=False)]
    base = EngineConfig(model=ModelConfig(model=str(path), dtype="float32"), cache=CacheConfig(kv_cache_memory=0.01),
                        speculative=SpeculativeConfig(method="draft", disable_batch_size=ALWAYS))
    prefill_config, decode_config = DisaggConfig().engine_configs(base)
    assert prefill_config.speculative is None and decode_config.speculative is not None
    prefill, decode = build_engine(prefill_config), build_engine(decode_config)
    assert prefill.draft is None and decode.draft is not None
    link = InProcessConnector()
    prefill.attach_connector(link)
    decode.attach_connector(link)
    got, finished = run(prefill, decode, prompts(), params)
    assert got == want
    assert decode.speculation.num_accepted_tokens > 0
    assert pool_whole(prefill) and pool_whole(decode)
