"""The packaged SmolLM2-135M-Instruct GGUF against transformers loading the same file."""

from __future__ import annotations

import torch

from tests.helpers import forward_one

TEXTS = [
    "Hello, world!",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "  leading spaces, trailing tabs\t\t and\nnew\nlines\r\n",
    "Numbers 1234567 and 3.14159; unicode: héllo wörld, 日本語, emoji 🙂🚀",
    "<|endoftext|>code: def f(x):\n    return x ** 2  # square",
    "",
    "<|im_start|><|im_end|><|im_start|>assistant",
]

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
]


def test_token_ids_match_transformers(default_model, hf_default_model):
    hf_tokenizer, _ = hf_default_model
    for text in TEXTS:
        assert default_model.tokenizer.encode(text) == hf_tokenizer(text)["input_ids"], text
    ids = default_model.tokenizer.encode(TEXTS[1])
    assert ids[0] == 1 and ids.count(1) == 2, "<|im_start|> must stay one special token (id 1)"


def test_decode_round_trips(default_model):
    tokenizer = default_model.tokenizer
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_logits_match_transformers(default_model, hf_default_model):
    hf_tokenizer, hf = hf_default_model
    for prompt in PROMPTS:
        ids = default_model.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
            got = forward_one(default_model.model, ids)
        assert (got - ref).abs().max().item() < 1e-3, prompt


def test_default_model_metadata(default_model):
    arch = default_model.arch
    assert (arch.architecture, arch.num_layers, arch.num_heads, arch.num_kv_heads) == ("LlamaForCausalLM", 30, 9, 3)
    assert arch.tie_word_embeddings and arch.vocab_size == 49152
    assert default_model.tokenizer.eos_token_ids[0] == 2
    chat = default_model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert chat.startswith("<|im_start|>system\n")


def test_bf16_close_to_transformers_bf16(default_model, hf_default_model):
    """bfloat16 (the CPU default where bf16 is native): transformers' own bf16 run differs from its
    fp32 run by up to ~1.3 in a logit here, so ours must stay within 1.5 of transformers' bf16,
    and greedy text must match on at least 3 of the 4 prompts (8 tokens; measured at 16: 3 of 4, the
    fourth diverges at token 7 between two near-equal candidates)."""
    from transformers import AutoModelForCausalLM

    from duoserve import LLM, SamplingParams
    from duoserve.model.loader import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16).eval()
    llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory=0.5)
    assert llm.engine.runner.model.dtype == torch.bfloat16
    tokenizer = default_model.tokenizer
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
            got = forward_one(llm.engine.runner.model, ids).float()
        assert (got - ref).abs().max().item() < 1.5, prompt
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    same = 0
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer.encode(prompt)
        hf.generation_config.eos_token_id = None
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(ids):]
        same += out.outputs[0].token_ids == want.tolist()
    assert same >= 3, f"greedy text equal on {same} of {len(PROMPTS)} prompts"
