"""/v1/embeddings: a prompt's final hidden states, pooled and L2-normalised.

Each input is a prompt that generates nothing (``SamplingParams.pooling``, ``max_tokens`` 0): it
is admitted, batched, chunked and placed like any other (on a prefill engine when disaggregated),
and its vector comes back with its finish. ``last`` pooling reads the last token's state (a
prefix-cache hit still computes that token); ``mean`` averages every position's, so it takes no
hit. The vector is never kept: only its prompt's KV blocks stay cached, as any prompt's do.
The pooling is ``--pooling``'s, else what the model file says (``model/pooling.py``), else last.
"""

from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import Request

from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.protocol import EmbeddingRequest
from duoserve.entrypoints.serving import OpenAIServing
from duoserve.entrypoints.streams import Streams, checked_params, run_until_disconnect
from duoserve.sampling_params import SamplingParams


def encoded(values: np.ndarray, encoding_format: str) -> list[float] | str:
    """float: a list; base64: the little-endian float32 bytes (what OpenAI's SDK decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode()
    return values.tolist()


class EmbeddingServing:
    def __init__(self, base: OpenAIServing, pooling: str | None) -> None:
        self.base = base
        self.pooling = pooling   # --pooling; None: the model file's, else last

    @property
    def chosen_pooling(self) -> str:
        return self.pooling or self.base.engine.declared_pooling or "last"

    async def embeddings(self, body: EmbeddingRequest, raw: Request) -> dict:
        self.base.check_model(body.model)
        if body.dimensions is not None:
            raise APIError(400, "'dimensions' is not supported: this model's vectors cannot be shortened "
                           "(leave it out for the full size)", param="dimensions")
        inputs = body.inputs()
        if not inputs:
            raise APIError(400, "input must not be empty", param="input")
        params = checked_params(lambda: SamplingParams(max_tokens=0, pooling=self.chosen_pooling,
                                                       tenant=body.user or ""))
        streams = Streams(self.base.engine, inputs, params, f"embd-{uuid.uuid4().hex}", prompt_param="input")
        finals = await run_until_disconnect(raw, streams.start_and_collect())
        data, num_tokens = [], 0
        for index, out in enumerate(finals):
            vector = out.embedding   # normalised once
            if vector is None:   # ended without its vector (an engine's error)
                error = out.outputs[0].error if out.outputs else None
                raise APIError(503, f"input {index} got no embedding: {error or 'the engine gave none'}")
            num_tokens += len(out.prompt_token_ids)
            data.append({"object": "embedding", "index": index,
                         "embedding": encoded(np.asarray(vector, dtype=np.float32), body.encoding_format)})
        return {"object": "list", "data": data, "model": self.base.model_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
