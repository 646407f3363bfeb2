"""Incremental detokenization: UTF-8 safe deltas, stop strings held back while streaming."""

from __future__ import annotations

from duoserve.frontend.detokenizer import IncrementalDetokenizer

TEXT = "Café ☕ and 日本語 with emoji 🙂🚀 done."


def test_deltas_never_split_a_character(default_model):
    tokenizer = default_model.tokenizer
    ids = tokenizer.encode(TEXT)
    # byte-level BPE splits some of these characters over several tokens
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tokenizer, [1, 2])
    deltas = []
    for token in ids:
        detok.add_tokens([token])
        deltas.append(detok.take_delta(finished=False))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == tokenizer.decode(ids)


def test_stop_string_held_back_until_resolved(default_model):
    tokenizer = default_model.tokenizer
    ids = tokenizer.encode("The end is near. STOP here")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("near. ST",))
    streamed = ""
    stop = None
    for token in ids:
        stop = detok.add_tokens([token])
        streamed += detok.take_delta(finished=False)
        assert "near" not in streamed or stop is not None
        if stop:
            break
    assert stop == "near. ST"
    assert streamed == "The end is " and detok.text == "The end is "


def test_special_tokens_skipped_or_kept(default_model):
    tokenizer = default_model.tokenizer
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    skip = IncrementalDetokenizer(tokenizer, [])
    skip.add_tokens(ids)
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    keep.add_tokens(ids)
    assert skip.text == "assistant\nHi" and keep.text == "<|im_start|>assistant\nHi<|im_end|>"
