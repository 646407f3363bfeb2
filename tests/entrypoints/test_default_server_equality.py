"""The first thing a new user tries, on ``duoserve serve`` with no model flags (the packaged GGUF
file computed from its blocks, ``--dtype auto``): the same greedy chat request through the openai
SDK, answered whole and then streamed, gives the same text, though the second finds the prompt's
blocks in the prefix cache and computes only the rest. Colocated and disaggregated."""

from __future__ import annotations

import signal

import pytest
from openai import OpenAI

from tests.server_helpers import Server

SYSTEM = ("You are a careful assistant. Answer in plain English, in full sentences, and say so when you do "
          "not know. Keep every answer short, and never use lists.")


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_greedy_request_answered_whole_then_streamed_gives_one_text(tmp_path, mode):
    srv = Server("--mode", mode, "--kv-cache-memory", "0.2", "--max-model-len", "1024", log=tmp_path / "log")
    try:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=600)
        (model,) = [m.id for m in client.models.list()]
        request = dict(model=model, temperature=0, max_tokens=40,
                       messages=[{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": "Why is the sky blue?"}])
        whole = client.chat.completions.create(**request)
        assert whole.usage.prompt_tokens_details.cached_tokens == 0
        chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content
        usage = chunks[-1].usage
        assert usage.completion_tokens == whole.usage.completion_tokens
        # every full block of the prompt came from the cache; its last token is always computed
        assert usage.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // 16 * 16 > 0
    finally:
        assert srv.stop() in (0, -signal.SIGTERM)
