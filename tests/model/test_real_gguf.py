"""The real GGUF files of the model-families issue against transformers loading the same file.

The files are large and come split over PyPI packages (``python benchmarks/fetch_models.py`` joins
them into ~/models, or $DUOSERVE_MODELS_DIR); these tests run where they are (session 19's CI run
found them there), and are skipped, saying so, where they are not. Transformers' answers (token ids
of TEXTS, greedy tokens after PROMPTS) are computed once per machine, file and version
(``tests/reference_cache.py``): loading a file into transformers takes about a minute."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from duoserve import LLM, SamplingParams
from tests.reference_cache import cached_reference, file_identity

MODELS_DIR = Path(os.environ.get("DUOSERVE_MODELS_DIR", Path.home() / "models"))
FILES = {"gemma3": "gemma-3-270m-q4_k_m.gguf", "qwen2.5-coder": "qwen2.5-coder-0.5b-instruct.gguf"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,  there   was"]
TEXTS = PROMPTS + ["<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
                   "naïve café, 東京 🙂 \t tabs\n\n\nand\r\nreturns", "    indented = [x**2 for x in range(10)]"]


def real_file(name: str) -> Path:
    path = MODELS_DIR / FILES[name]
    if not path.exists():
        # 750 MB over eight PyPI packages: the suite does not fetch them (the tiny Gemma/Qwen GGUF
        # tests in test_gguf*.py run everywhere); these run where the files are
        pytest.skip(f"{path} is not here (python benchmarks/fetch_models.py fetches it)")
    return path


GREEDY_TOKENS = 24


def transformers_answers(path: Path) -> dict:
    """What transformers, loading the GGUF file itself (float32, dequantized), gives: each text's
    token ids, and each prompt's ids with the 24 greedy tokens after them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    greedy = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt).input_ids])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS,
                                 do_sample=False, pad_token_id=0)
        greedy[prompt] = [ids[0].tolist(), out[0, ids.shape[1]:].tolist()]
    return {"ids": {text: tokenizer(text).input_ids for text in TEXTS}, "greedy": greedy}


@pytest.fixture(scope="module", params=list(FILES))
def reference(request):
    """(file, transformers' answers for it)."""
    path = real_file(request.param)
    key = [file_identity(path), TEXTS, PROMPTS, GREEDY_TOKENS]
    return path, cached_reference(f"real-gguf-{request.param}", key, lambda: transformers_answers(path))


def test_tokenizer_ids_equal_transformers(reference):
    path, answers = reference
    llm = LLM(str(path), dtype="float32", max_model_len=1024, kv_cache_memory=0.05)
    ours = llm.get_tokenizer()
    for text in TEXTS:
        assert ours.encode(text) == answers["ids"][text], text


@pytest.mark.parametrize("mode", ["dense", "blocks-exact"])
def test_greedy_tokens_equal_transformers(reference, mode):
    """float32, 24 tokens each: dense (dequantized at load), and computed from the blocks with float32
    products (gguf_mode exact) -- the same numbers as transformers' dequantized model, so the same tokens."""
    path, answers = reference
    kwargs = {"dense": dict(quantization="none"), "blocks-exact": dict(gguf_mode="exact")}[mode]
    llm = LLM(str(path), dtype="float32", max_model_len=1024, kv_cache_memory=0.05, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        prompt_ids, want = answers["greedy"][prompt]
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == want, (mode, prompt)


# gguf_mode fast (the default) rounds activations to 8 bits for integer dot products, as llama.cpp
# does: its logits move by a few hundredths of a nat, so where transformers' top two tokens are that
# close greedy may take the other one and the two texts part from there. The test reads our
# log-probabilities along transformers' own greedy text instead: at every position transformers'
# token must be ours too, or lose to ours by less than a near tie; a wrong kernel moves logits by
# whole nats and fails here.
NEAR_TIE_NATS = 0.25


def test_fast_mode_follows_transformers_greedy_text(reference):
    path, answers = reference
    llm = LLM(str(path), dtype="float32", max_model_len=1024, kv_cache_memory=0.05, gguf_mode="fast")
    agree = total = 0
    for prompt in PROMPTS:
        prompt_ids, want = answers["greedy"][prompt]
        out = llm.generate([prompt_ids + want], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        for position, token in enumerate(want, start=len(prompt_ids)):
            ours = out.prompt_logprobs[position]
            assert ours.token_id == token
            best = ours.top[0][1]
            assert best - ours.logprob < NEAR_TIE_NATS, (prompt, position - len(prompt_ids), ours)
            agree += ours.rank == 1
            total += 1
    assert agree >= total - 3, f"transformers' greedy token was our top token at {agree} of {total} positions"
