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
