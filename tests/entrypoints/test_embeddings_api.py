"""/v1/embeddings through the official openai SDK against real servers: the session's colocated one
and a disaggregated one (each input placed on its prefill engine)."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from tests.conftest import API_KEY
from tests.server_helpers import Server, metric, wait_metric

MODEL = "smollm2-135m"
TEXTS = ["The quick brown fox jumps over the lazy dog", "Hello",
         "Tides rise and fall twice a day, pulled by the moon and, less, by the sun."]


def vectors(client, inputs, **kw) -> np.ndarray:
    out = client.embeddings.create(model=MODEL, input=inputs, **kw)
    assert [d.index for d in out.data] == list(range(len(out.data)))
    return np.array([d.embedding for d in out.data], dtype=np.float32)


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory):
    srv = Server("--mode", "disaggregated", "--prefill-device", "cpu", "--dtype", "float32", "--quantization",
                 "none", "--kv-cache-memory", "0.5", api_key=API_KEY, log=tmp_path_factory.mktemp("embd") / "log")
    yield srv
    srv.stop()


def test_stable_normalised_and_batched_equal_to_single(client, smol_llm):
    batch = vectors(client, TEXTS)
    assert batch.shape == (3, 576)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    # a request's inputs are admitted together; which of them share a step depends on when each
    # reaches the engine, and a step's shape moves the last float bits
    assert np.abs(vectors(client, TEXTS) - batch).max() < 1e-5
    for i, text in enumerate(TEXTS):
        assert np.abs(vectors(client, text)[0] - batch[i]).max() < 1e-4
    # the offline engine's vectors, and token ids for text
    assert np.abs(np.array(smol_llm.embed(TEXTS)) - batch).max() < 1e-4
    ids = smol_llm.get_tokenizer().encode(TEXTS[0])
    assert np.abs(vectors(client, ids)[0] - batch[0]).max() < 1e-4
    assert np.abs(vectors(client, [ids, ids[:3]])[0] - batch[0]).max() < 1e-4


def test_usage_counts_the_prompts(client, smol_llm):
    out = client.embeddings.create(model=MODEL, input=TEXTS)
    num_tokens = sum(len(smol_llm.get_tokenizer().encode(t)) for t in TEXTS)
    assert out.usage.prompt_tokens == out.usage.total_tokens == num_tokens
    assert out.model == MODEL and out.object == "list"


def test_base64_decodes_to_the_floats(client):
    floats = vectors(client, TEXTS[2])[0]
    raw = client.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format="base64").data[0].embedding
    assert np.array_equal(np.frombuffer(base64.b64decode(raw), dtype="<f4"), floats)


def test_a_prefix_cache_hit_does_not_change_the_vector(client):
    long = " ".join(["the sea and the sky"] * 60)
    first, again = vectors(client, long), vectors(client, long)   # the second finds the prompt's blocks
    assert np.abs(first - again).max() < 1e-4


@pytest.mark.parametrize("kw, param", [
    (dict(input="hi", dimensions=64), "dimensions"),
    (dict(input=[]), "input"),
    (dict(input=[10 ** 9]), "input"),
])
def test_bad_requests_are_refused_by_name(client, kw, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, **kw)
    assert caught.value.body["param"] == param, caught.value.body


def test_disaggregated_gives_the_colocated_vectors(client, disaggregated):
    remote = openai.OpenAI(base_url=f"{disaggregated.url}/v1", api_key=API_KEY, max_retries=0, timeout=600)
    series = ("duoserve:request_placements_total", {"prefill_engine": "prefill-0", "decode_engine": "decode-0"})
    placed = metric(disaggregated.url, *series, headers=disaggregated.headers)
    assert np.abs(vectors(remote, TEXTS) - vectors(client, TEXTS)).max() < 1e-4
    assert metric(disaggregated.url, *series, headers=disaggregated.headers) == placed + len(TEXTS)
    # finished on the prefill engine: no KV handed to the decode engine
    assert metric(disaggregated.url, "duoserve:kv_transfer_bytes_total", headers=disaggregated.headers) == 0
    # and its generation still works after the embeddings (nothing left held), its KV handed over
    assert remote.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0).choices[0].text
    wait_metric(disaggregated.url, "duoserve:kv_transfer_bytes_total", lambda v: v > 0, headers=disaggregated.headers)


def test_the_model_files_pooling_is_the_servers_default(tiny_dir, tmp_path):
    """A checkpoint whose sentence-transformers config says mean: the server pools by the mean
    unless --pooling says otherwise (the model's answer reaches the API process in EngineReady)."""
    import json
    import shutil

    from duoserve import LLM

    directory = tmp_path / "st"
    shutil.copytree(tiny_dir(), directory)
    (directory / "modules.json").write_text(json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling",
                                                         "type": "sentence_transformers.models.Pooling"}]))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    offline = LLM(str(directory), dtype="float32", kv_cache_memory=0.01)
    mean, last = np.array(offline.embed(ids, pooling="mean")), np.array(offline.embed(ids, pooling="last"))
    for flags, want in (((), mean), (("--pooling", "last"), last)):
        srv = Server("--model", str(directory), "--dtype", "float32", "--kv-cache-memory", "0.01", *flags,
                     log=tmp_path / "log")
        try:
            remote = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=600)
            got = np.array([d.embedding for d in remote.embeddings.create(model=str(directory), input=ids).data])
        finally:
            srv.stop()
        assert np.abs(got - want).max() < 1e-4
