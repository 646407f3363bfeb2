"""Tokenizers rebuilt from GGUF metadata equal transformers' rebuild of the same file, id for id:
Gemma's SentencePiece BPE (no merges in the file; byte fallback; runs of spaces)."""

from __future__ import annotations

import pytest
from gguf import TokenType

from duoserve.config import ModelConfig
from duoserve.worker.backends import load_model
from tests.model.test_gguf import write_gguf

SPACE = "\u2581"
# a Gemma-shaped vocabulary of 256: specials, turn markers, newlines (user-defined), byte tokens,
# runs of spaces stored as real spaces, then pieces whose order (not score) is the merge order
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PIECES = [SPACE + "t", "he", SPACE + "the", "in", SPACE + "a", "an", "er", SPACE + "c", "at", SPACE + "cat",
          "on", SPACE + "s", "at" + "e", SPACE + "on", SPACE + "in", "en", SPACE + "he", "re", SPACE + "w",
          SPACE + "an", "is", SPACE + "is", SPACE + "sat", "ing", SPACE + SPACE, SPACE + "th", "ll", "ed"]


def gemma_vocabulary() -> tuple[list[str], list[int], list[float]]:
    tokens = list(SPECIALS) + ["\n", "\n\n"] + [f"<0x{b:02X}>" for b in range(256)][:64] + ["  ", "   "]
    types = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.USER_DEFINED] * 2 + [TokenType.BYTE] * 64 + \
        [TokenType.NORMAL] * 2
    letters = [SPACE, *"abcdefghijklmnopqrstuvwxyz", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *".,!?'-"]
    for piece in letters + PIECES:
        if piece not in tokens:
            tokens.append(piece)
            types.append(TokenType.NORMAL)
    while len(tokens) < 256:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(TokenType.UNUSED)
    scores = [0.0 if i % 3 else -float(i) for i in range(len(tokens))]  # scores that do not follow the order
    return tokens, [int(t) for t in types], scores


def add_gemma_tokenizer(writer) -> None:
    tokens, types, scores = gemma_vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)


TEXTS = ["the cat sat on the mat", " the  cat   sat", "The Cat!\nis in\n\nthe hat", "<start_of_turn>user\nhi"
         "<end_of_turn>\n", "caterer's inning, sated", "zq xj \u00e9\u4e2d", "", "    "]


@pytest.fixture(scope="module")
def gemma_gguf(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma-tok") / "tiny-gemma.gguf"
    write_gguf(tiny_dir(kind="gemma3", query_pre_attn_scalar=16), path, "F32", tokenizer=add_gemma_tokenizer)
    return path


def test_gemma_sentencepiece_ids_equal_transformers(gemma_gguf):
    from transformers import AutoTokenizer

    ours = load_model(ModelConfig(model=str(gemma_gguf), dtype="float32")).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    assert ours.bos_token_id == 2 and ours.add_bos_token
    assert ours.eos_token_ids == (1, 6), "Gemma's <end_of_turn> ends a turn beside <eos>"
    for text in TEXTS:
        want = theirs(text).input_ids
        got = ours.encode(text)
        assert got == want, text
        assert ours.decode(got, skip_special_tokens=False) == theirs.decode(want), text
    merged = ours.encode(" the cat", add_special_tokens=False)
    assert [ours.token_to_text(i) for i in merged] == [SPACE + "the", SPACE + "cat"], "pieces merge whole"
    assert ours.encode("\u4e2d", add_special_tokens=False) == [3], "no byte token for it: <unk>"
