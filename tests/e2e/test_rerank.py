"""Rerankers through the engine (``SamplingParams.pooling`` "score", ``LLM.score``): a cross-encoder's
scores equal sentence-transformers' ``CrossEncoder.predict`` (BERT with its token types, XLM-RoBERTa
with its offset positions), a yes/no reranker's equal transformers' softmax over the "no" and "yes"
logits, batched or alone; the pool is whole afterwards (the autouse check)."""

from __future__ import annotations

import pytest
import torch

from duoserve import LLM, SamplingParams
from duoserve.errors import ConfigError, InvalidInputError, ModelLoadError
from duoserve.model.reranker import pair_token_ids
from tests.helpers import make_tiny_cross_encoder, make_tiny_yes_no_reranker

QUERIES = ["what is the sea", "where are animals near peru", "the moon"]
DOCUMENTS = ["the sea is a tide pulled by the moon", "the quick brown fox jumps over the lazy dog",
             "a llama and a camel in peru", "china", "tides rise and fall twice a day"]
# Qwen3-Reranker's model card: the prompt its scores are computed on (the reference's own copy)
CARD_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
               'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
YES_NO = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
          "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def cross_encoder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"ce-{request.param}")
    make_tiny_cross_encoder(path, request.param)
    return path, LLM(model=str(path), dtype="float32")


@pytest.fixture(scope="module")
def yes_no(tmp_path_factory):
    path = tmp_path_factory.mktemp("yes-no")
    make_tiny_yes_no_reranker(path)
    return path, LLM(model=str(path), dtype="float32", quantization="none", hf_overrides=YES_NO)


def test_cross_encoder_scores_equal_sentence_transformers_batched_and_alone(cross_encoder):
    from sentence_transformers import CrossEncoder

    path, llm = cross_encoder
    reference = CrossEncoder(str(path), device="cpu")
    pairs = [(q, d) for q in QUERIES for d in DOCUMENTS]
    for query, document in pairs:   # the pair template is the tokenizer's own
        assert pair_token_ids(llm.get_tokenizer(), "cross-encoder", query, document) == \
            reference.tokenizer(query, document)["input_ids"]
    want = reference.predict(pairs).tolist()
    assert max(want) - min(want) > 0.05   # the scores spread: an order to get right
    got = llm.score([q for q, _ in pairs], [d for _, d in pairs])   # one batch of 15 sequences
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    assert sorted(range(len(got)), key=got.__getitem__) == sorted(range(len(want)), key=want.__getitem__)
    assert llm.score(QUERIES[0], DOCUMENTS) == pytest.approx(want[:len(DOCUMENTS)], abs=1e-5)   # one to many
    for i in (0, 7):
        assert llm.score(*pairs[i])[0] == pytest.approx(want[i], abs=1e-5)   # alone


@pytest.mark.parametrize("cross_encoder", ["bert"], indirect=True)   # XLM-RoBERTa has one token type
def test_bert_reads_the_document_as_token_type_1(cross_encoder):
    """Without the types the same ids give other scores: the types are read back from the [SEP]."""
    path, llm = cross_encoder
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids = pair_token_ids(llm.get_tokenizer(), "cross-encoder", QUERIES[0], DOCUMENTS[0])
    with torch.no_grad():
        untyped = torch.sigmoid(hf(torch.tensor([ids]), token_type_ids=torch.zeros(1, len(ids), dtype=torch.long))
                                .logits)[0, 0].item()
    got = llm.score(QUERIES[0], DOCUMENTS[0])[0]
    assert abs(got - untyped) > 1e-3


def test_a_cross_encoder_only_scores(cross_encoder):
    _, llm = cross_encoder
    with pytest.raises(InvalidInputError, match="cross-encoder"):
        llm.generate("the sea", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidInputError, match="cross-encoder"):
        llm.embed("the sea")


def test_yes_no_reranker_equals_transformers_yes_no_logits(yes_no):
    import transformers

    path, llm = yes_no
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    want = []
    for document in DOCUMENTS:
        text = f"{CARD_PREFIX}<Instruct>: {CARD_INSTRUCTION}\n<Query>: {QUERIES[1]}\n<Document>: {document}{CARD_SUFFIX}"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == pair_token_ids(llm.get_tokenizer(), "yes-no", QUERIES[1], document)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        want.append(torch.softmax(logits[[no, yes]], dim=0)[1].item())
    assert max(want) - min(want) > 1e-3
    got = llm.score(QUERIES[1], DOCUMENTS)
    assert got == pytest.approx(want, abs=1e-5)
    assert sorted(range(5), key=got.__getitem__) == sorted(range(5), key=want.__getitem__)
    # again: the query's prefix comes from the cache, the score does not change
    prompt = pair_token_ids(llm.get_tokenizer(), "yes-no", QUERIES[1], DOCUMENTS[2])
    again = llm.generate([prompt], SamplingParams(max_tokens=0, pooling="score"), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.pooled[0] == pytest.approx(want[2], abs=1e-5)
    assert len(llm.generate("the sea", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
               .outputs[0].token_ids) == 3   # still a causal LM that generates


def test_what_is_no_reranker_is_refused_by_name(smol_llm, tmp_path):
    with pytest.raises(ConfigError, match="reranker"):
        smol_llm.score("the sea", "a tide")
    with pytest.raises(InvalidInputError, match="no reranker"):
        smol_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=0, pooling="score"), use_tqdm=False)
    make_tiny_cross_encoder(tmp_path, "bert")
    import json

    config = json.loads((tmp_path / "config.json").read_text())
    config.update(num_labels=3, id2label={str(i): f"L{i}" for i in range(3)})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_labels"):
        LLM(model=str(tmp_path), dtype="float32")


def test_classifier_tokens_are_checked(yes_no):
    path, _ = yes_no
    with pytest.raises(ConfigError, match="classifier_from_token"):
        LLM(model=str(path), dtype="float32", quantization="none",
            hf_overrides={**YES_NO, "classifier_from_token": ["yes"]})
    with pytest.raises(ConfigError, match="classifier_from_token"):
        LLM(model=str(path), dtype="float32", quantization="none",
            hf_overrides={**YES_NO, "classifier_from_token": ["no", "a yes"]})


def test_a_gguf_rank_model_scores_as_its_checkpoint(yes_no, tmp_path):
    """llama.cpp's converter writes a Qwen3 reranker as rank pooling, labels ["yes", "no"], a
    cls.output tensor of those two rows of the head, and the prompt as a "rerank" template: such a
    file needs no flag, and scores as the checkpoint does with vLLM's overrides."""
    import gguf
    from safetensors.torch import load_file

    from tests.model.test_gguf import write_gguf

    path, llm = yes_no
    backend = llm.get_tokenizer().backend
    no, yes = backend.token_to_id("no"), backend.token_to_id("yes")
    weights = load_file(str(path / "model.safetensors"))
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])   # the converter's source rows

    def add_reranker(writer) -> None:   # as llama.cpp's converter writes Qwen3-Reranker
        vocab = backend.get_vocab()
        tokens = sorted(vocab, key=vocab.get)
        specials = {"<|im_start|>", "<|im_end|>", "<think>", "</think>"}
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.USER_DEFINED
                                if t in ("yes", "no") else gguf.TokenType.NORMAL for t in tokens])
        writer.add_token_merges([])
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_classifier_output_labels(["yes", "no"])
        writer.add_chat_template([{"name": "rerank", "template": CARD_PREFIX + f"<Instruct>: {CARD_INSTRUCTION}\n"
                                   "<Query>: {query}\n<Document>: {document}" + CARD_SUFFIX}])
        writer.add_tensor("cls.output.weight", torch.stack([head[yes], head[no]]).numpy())

    out = tmp_path / "reranker.gguf"
    write_gguf(path, out, "F32", tokenizer=add_reranker)
    ranked = LLM(model=str(out), dtype="float32", quantization="none")
    want = llm.score(QUERIES[0], DOCUMENTS)
    assert ranked.score(QUERIES[0], DOCUMENTS) == pytest.approx(want, abs=1e-5)
    from duoserve.model.reranker import render_pair

    assert render_pair("<{query}|{document}>", "a {document} b", "c {query} d") == "<a {document} b|c {query} d>"
    assert ranked.score("{query} {document}", DOCUMENTS[0]) == pytest.approx(   # braces stay text
        llm.score("{query} {document}", DOCUMENTS[0]), abs=1e-5)


def write_encoder_gguf(hf_dir, out, with_pooler: bool = True) -> None:
    """A cross-encoder as llama.cpp's converter writes it: arch "bert", the position table cut to
    start after the padding id, the head's dense layer as ``cls`` and its output as ``cls.output``,
    the SentencePiece vocabulary as "t5"; ``with_pooler=False``: a BERT classifier's file, which has
    lost its pooler on the way."""
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]   # [[piece, score], ...]
    offset = config["pad_token_id"] + 1
    writer = gguf.GGUFWriter(str(out), "bert")
    writer.add_context_length(config["max_position_embeddings"] - offset)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([piece for piece, _ in vocab])
    writer.add_token_scores([score for _, score in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if p in ("<s>", "<pad>", "</s>", "<mask>") else
                            gguf.TokenType.UNKNOWN if p == "<unk>" else gguf.TokenType.NORMAL for p, _ in vocab])
    writer.add_add_space_prefix(True)
    writer.add_token_type_count(config["type_vocab_size"])
    writer.add_remove_extra_whitespaces(True)
    for add, value in ((writer.add_bos_token_id, 0), (writer.add_pad_token_id, 1), (writer.add_eos_token_id, 2),
                       (writer.add_unk_token_id, 3), (writer.add_sep_token_id, 2)):
        add(value)
    layer = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
             "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
             "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
    top = {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
           "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm",
           "classifier.dense": "cls", "classifier.out_proj": "cls.output"}
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        stem, kind = name.removeprefix("roberta.").rsplit(".", 1)
        if stem.startswith("encoder.layer."):
            index, rest = stem[len("encoder.layer."):].split(".", 1)
            gguf_name = f"blk.{index}.{layer[rest]}"
        else:
            gguf_name = top[stem]
        if gguf_name == "cls" and not with_pooler:
            continue
        if gguf_name == "position_embd":
            tensor = tensor[offset:]
        writer.add_tensor(f"{gguf_name}.{kind}", tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("cross_encoder", ["xlm-roberta"], indirect=True)
def test_a_gguf_cross_encoder_scores_as_its_checkpoint(cross_encoder, tmp_path):
    from sentence_transformers import CrossEncoder

    path, llm = cross_encoder
    out = tmp_path / "reranker.gguf"
    write_encoder_gguf(path, out)
    ranked = LLM(model=str(out), dtype="float32")
    reference = CrossEncoder(str(path), device="cpu")
    for query in QUERIES:   # the vocabulary rebuilt from the file tokenizes a pair as the checkpoint's
        for document in DOCUMENTS:
            assert pair_token_ids(ranked.get_tokenizer(), "cross-encoder", query, document) == \
                reference.tokenizer(query, document)["input_ids"]
    want = reference.predict([(QUERIES[1], d) for d in DOCUMENTS]).tolist()
    assert ranked.score(QUERIES[1], DOCUMENTS) == pytest.approx(want, abs=1e-5)
    pooler_lost = tmp_path / "no-pooler.gguf"
    write_encoder_gguf(path, pooler_lost, with_pooler=False)
    with pytest.raises(ModelLoadError, match="pooler"):
        LLM(model=str(pooler_lost), dtype="float32")


def test_the_checkpoint_says_what_a_score_is_made_of(tmp_path):
    """ms-marco's cross-encoders tell sentence-transformers to keep the raw logit (Identity)."""
    import json

    from sentence_transformers import CrossEncoder

    make_tiny_cross_encoder(tmp_path, "bert", seed=3)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    want = CrossEncoder(str(tmp_path), device="cpu").predict([(QUERIES[0], d) for d in DOCUMENTS]).tolist()
    assert min(want) < 0 or max(want) > 1   # logits, not probabilities
    assert LLM(model=str(tmp_path), dtype="float32").score(QUERIES[0], DOCUMENTS) == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("cross_encoder", ["bert"], indirect=True)
def test_pairs_that_cannot_be_told_apart_or_fill_the_context(cross_encoder):
    from duoserve.model.reranker import PairError

    _, llm = cross_encoder
    with pytest.raises(PairError, match="separator"):
        pair_token_ids(llm.get_tokenizer(), "cross-encoder", "the sea [SEP] the sky", "a tide")
    assert len(pair_token_ids(llm.get_tokenizer(), "cross-encoder", "the sea", "the sky [SEP] a tide")) > 0
    # a pair of exactly the context's length is scored (it generates nothing); one more is refused
    filling = llm.get_tokenizer().backend.encode("the " * 62, "sea " * 62, add_special_tokens=True).ids
    assert len(filling) == 127 and llm.engine.max_model_len == 128
    full = filling[:-1] + [filling[-2]] + filling[-1:]
    assert len(full) == 128
    assert llm.generate([full], SamplingParams(max_tokens=0, pooling="score"), use_tqdm=False)[0].pooled
    with pytest.raises(InvalidInputError, match="at most 128"):
        llm.generate([full + [5]], SamplingParams(max_tokens=0, pooling="score"), use_tqdm=False)
    with pytest.raises(ConfigError, match="pooling"):
        llm.embed("the sea", pooling="score")
