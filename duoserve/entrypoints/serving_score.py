"""/v1/rerank, /v2/rerank, /rerank and /score: a reranker's relevance of each (query, document) pair.

Each pair is one prompt that generates nothing (``SamplingParams.pooling`` "score"): a
cross-encoder's pair template, or a yes/no reranker's question (``duoserve.model.reranker``). The
pairs of a request are admitted together and batched like any prompts (a cross-encoder's engine
computes each whole in one step); a yes/no reranker's pairs share the query's prefix in the cache.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.protocol import RerankRequest, ScoreRequest
from duoserve.entrypoints.serving import OpenAIServing
from duoserve.entrypoints.streams import Streams, checked_params, run_until_disconnect
from duoserve.model.reranker import PairError, pair_token_ids
from duoserve.sampling_params import SamplingParams


class ScoreServing:
    def __init__(self, base: OpenAIServing) -> None:
        self.base = base

    async def rerank(self, body: RerankRequest, raw: Request) -> dict:
        self.base.check_model(body.model, generates=False)
        documents = body.texts()
        if not documents:
            raise APIError(400, "documents must not be empty", param="documents")
        if body.top_n is not None and body.top_n < 0:
            raise APIError(400, f"top_n must be 0 (every document) or more, not {body.top_n}", param="top_n")
        scores, num_tokens = await self._scores([(body.query, d) for d in documents], body, raw, "documents")
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:body.top_n or None]
        results = []
        for index in order:
            result = {"index": index, "relevance_score": scores[index]}
            if body.return_documents:
                result["document"] = {"text": documents[index]}
            results.append(result)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.base.model_name, "results": results,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    async def score(self, body: ScoreRequest, raw: Request) -> dict:
        self.base.check_model(body.model, generates=False)
        firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if not firsts or not seconds:
            raise APIError(400, "text_1 and text_2 must not be empty", param="text_1" if not firsts else "text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise APIError(400, f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1 (scored "
                           "against each text_2) or as many of each (scored pairwise)", param="text_2")
        scores, num_tokens = await self._scores(list(zip(firsts, seconds)), body, raw, "text_2")
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.base.model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}

    async def _scores(self, pairs: list[tuple[str, str]], body, raw: Request, param: str) -> tuple[list[float], int]:
        """Each pair's score, in order, and the prompt tokens they took."""
        engine = self.base.engine
        reranker, tokenizer, max_len = engine.reranker, engine.tokenizer, engine.max_model_len
        if tokenizer is None:
            raise APIError(503, f"the engine is unavailable: {engine.not_ready_reason()}")
        if reranker is None:
            raise APIError(400, f"{self.base.model_name} is no reranker: serve a cross-encoder (a BERT or XLM-RoBERTa "
                           "sequence classifier) or a causal LM with hf_overrides' classifier_from_token", param="model")
        template = engine.score_template
        try:
            prompts = [pair_token_ids(tokenizer, reranker, query, document, template) for query, document in pairs]
        except PairError as exc:
            raise APIError(400, str(exc), param="query" if param == "documents" else "text_1") from exc
        for index, ids in enumerate(prompts):
            if len(ids) > max_len:
                raise APIError(400, f"pair {index} is {len(ids)} tokens (the query, {param} {index} and the template), "
                               f"but the model's context length is {max_len}", param=param)
        params = checked_params(lambda: SamplingParams(max_tokens=0, pooling="score", tenant=body.user or "",
                                                       priority=body.priority))
        streams = Streams(engine, prompts, params, f"score-{uuid.uuid4().hex}", prompt_param=param)
        finals = await run_until_disconnect(raw, streams.start_and_collect())
        scores = []
        for index, out in enumerate(finals):
            if out.pooled is None:   # ended without its score (an engine's error)
                error = out.outputs[0].error if out.outputs else None
                raise APIError(503, f"pair {index} got no score: {error or 'the engine gave none'}")
            scores.append(out.pooled[0])
        return scores, sum(len(ids) for ids in prompts)
