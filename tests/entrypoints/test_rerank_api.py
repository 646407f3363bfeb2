"""/v1/rerank, /v2/rerank, /rerank and /score against real servers: a tiny BERT cross-encoder's
scores equal sentence-transformers', sorted, cut to top_n; a yes/no reranker served with vLLM's
hf_overrides; bad requests answered 400 naming the field; a generative model refuses to rank and a
cross-encoder to generate."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import API_KEY
from tests.helpers import make_tiny_cross_encoder, make_tiny_yes_no_reranker
from tests.server_helpers import Server

QUERY = "where are animals near peru"
DOCUMENTS = ["the sea is a tide pulled by the moon", "the quick brown fox jumps over the lazy dog",
             "a llama and a camel in peru", "china", "tides rise and fall twice a day"]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ce-bert")
    make_tiny_cross_encoder(path, "bert")
    return path


@pytest.fixture(scope="module")
def ranker(bert_dir, tmp_path_factory):
    srv = Server("--model", str(bert_dir), "--served-model-name", "ce", "--dtype", "float32", api_key=API_KEY,
                 log=tmp_path_factory.mktemp("rerank") / "log")
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=HEADERS, timeout=120)


@pytest.fixture(scope="module")
def want(bert_dir) -> list[float]:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(bert_dir), device="cpu").predict([(QUERY, d) for d in DOCUMENTS]).tolist()


def test_rerank_sorts_by_sentence_transformers_scores(ranker, want, bert_dir):
    reply = post(ranker, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bert_dir)
    assert body["usage"]["total_tokens"] == sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    assert body["model"] == "ce" and body["id"].startswith("rerank-")
    # Cohere's v2 and Jina's paths, documents as objects, top_n, no documents back
    for path in ("/v2/rerank", "/rerank"):
        short = post(ranker, path, {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 2,
                                    "return_documents": False}).json()
        assert [r["index"] for r in short["results"]] == order[:2]
        assert all("document" not in r for r in short["results"])


def test_score_one_to_many_and_pairwise(ranker, want):
    reply = post(ranker, "/score", {"model": "ce", "text_1": QUERY, "text_2": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    assert [d["index"] for d in data] == list(range(len(DOCUMENTS)))
    assert [d["score"] for d in data] == pytest.approx(want, abs=1e-5)
    pairwise = post(ranker, "/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(want[:2], abs=1e-5)
    assert pairwise["object"] == "list" and pairwise["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": ["the sea " * 80]}, "documents"),   # past 128 positions
    ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS}, "text_2"),
    ("/v1/rerank", {"model": "other", "query": QUERY, "documents": DOCUMENTS}, "model"),
])
def test_bad_requests_are_refused_by_field(ranker, path, body, param):
    reply = post(ranker, path, body)
    assert reply.status_code == (404 if param == "model" else 400), reply.text
    assert reply.json()["error"]["param"] == param
    assert post(ranker, "/score", {"text_1": QUERY, "text_2": "china"}).status_code == 200   # still serving


def test_a_cross_encoder_neither_generates_nor_embeds(ranker):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "the sea", "max_tokens": 2}),
                       ("/v1/embeddings", {"input": "the sea"})):
        reply = post(ranker, path, body)
        assert reply.status_code == 400, reply.text
        assert "cross-encoder" in reply.json()["error"]["message"]


def test_a_generative_model_ranks_nothing(server):
    reply = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"
    assert "no reranker" in reply.json()["error"]["message"]


def test_a_yes_no_reranker_served_with_vllms_overrides(tmp_path_factory):
    from duoserve import LLM

    path = tmp_path_factory.mktemp("yes-no")
    make_tiny_yes_no_reranker(path)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                 "is_original_qwen3_reranker": True}
    want = LLM(model=str(path), dtype="float32", quantization="none", hf_overrides=overrides).score(QUERY, DOCUMENTS)
    srv = Server("--model", str(path), "--dtype", "float32", "--hf-overrides", json.dumps(overrides),
                 api_key=API_KEY, log=tmp_path_factory.mktemp("yes-no-log") / "log")
    try:
        body = post(srv, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
        assert [r["index"] for r in body["results"]] == sorted(range(5), key=lambda i: -want[i])[:3]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
            sorted(want, reverse=True)[:3], abs=1e-5)
    finally:
        srv.stop()
