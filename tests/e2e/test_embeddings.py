"""Embeddings through the engine (``SamplingParams.pooling``): the pooled final hidden states equal
transformers' ``last_hidden_state`` pooled the same way, whatever the batch, the chunking or the
prefix cache; the pool is whole afterwards (the autouse check)."""

from __future__ import annotations

import math

import pytest
import torch

from duoserve import SamplingParams
from duoserve.errors import ConfigError

TEXTS = ["The quick brown fox jumps over the lazy dog", "Hello",
         "Tides rise and fall twice a day, pulled by the moon and, less, by the sun."]


def reference(hf_default_model, ids: list[int], pooling: str) -> list[float]:
    _, hf = hf_default_model
    with torch.no_grad():
        states = hf.model(torch.tensor([ids])).last_hidden_state[0]   # [tokens, hidden]
    vector = states[-1] if pooling == "last" else states.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0).tolist()


def close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_states_equal_transformers_batched_and_alone(smol_llm, hf_default_model, pooling):
    tokenizer = smol_llm.get_tokenizer()
    batched = smol_llm.embed(TEXTS, pooling=pooling)
    for text, vector in zip(TEXTS, batched):
        assert close(vector, reference(hf_default_model, tokenizer.encode(text), pooling))
        assert close(smol_llm.embed(text, pooling=pooling)[0], vector)
        assert math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_chunked_prompt_and_a_prefix_cache_hit_give_the_same_vector(smol_llm, hf_default_model, pooling):
    """A prompt over the step's token budget is computed in chunks (a mean sums over them); the
    same prompt again finds its blocks cached: "last" takes the hit, "mean" computes every
    position anyway."""
    ids = smol_llm.get_tokenizer().encode(" ".join(["the sea and the sky"] * 140))   # past 512 tokens
    assert len(ids) > 600
    params = SamplingParams(max_tokens=0, pooling=pooling)
    first, again = (smol_llm.generate([ids], params, use_tqdm=False)[0] for _ in range(2))
    assert first.outputs[0].token_ids == [] and first.outputs[0].finish_reason == "length"
    assert close(first.embedding, reference(hf_default_model, ids, pooling))
    assert close(again.embedding, first.embedding)
    assert (again.num_cached_tokens > 0) == (pooling == "last")


def test_pooling_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="pooling"):
        SamplingParams(max_tokens=4, pooling="last")
    with pytest.raises(ConfigError, match="pooling"):
        SamplingParams(max_tokens=0, pooling="cls")


def test_the_model_files_pooling_is_read(tmp_path, tiny_dir):
    """GGUF's pooling_type and sentence-transformers' Pooling config; a file that says nothing: None."""
    import json
    import shutil

    import gguf

    from duoserve import LLM
    from duoserve.model.pooling import declared_pooling

    for value, expected in ((1, "mean"), (3, "last"), (2, None)):
        path = tmp_path / f"pool{value}.gguf"
        writer = gguf.GGUFWriter(str(path), "qwen3")
        writer.add_uint32("qwen3.pooling_type", value)
        writer.add_tensor("t", torch.zeros(4).numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert declared_pooling(path) == expected
    directory = tmp_path / "st"
    shutil.copytree(tiny_dir(), directory)
    assert declared_pooling(directory) is None
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert declared_pooling(directory) == "mean"
    llm = LLM(str(directory), dtype="float32", kv_cache_memory=0.01)
    ids = [[5, 6, 7, 8], [9, 10]]
    assert llm.embed(ids) == llm.embed(ids, pooling="mean") != llm.embed(ids, pooling="last")
