"""Placement for disaggregated serving: which engine prefills a request.

``--prefill-device cpu|cuda`` sends every prompt to the prefill engine; ``auto`` (the
seed documents' mode) sends a prompt of at most ``--max-prefill-len`` tokens to the
prefill engine and prefills a longer one on the decode engine itself, chunked. With
no prefill engine alive, every prompt is prefilled on the decode engine.

The frontend does not see the engines' prefix caches, so "uncached part" is judged
by the whole prompt's length.
"""

from __future__ import annotations

import logging

from duoserve.core.request import Request
from duoserve.frontend.engine_client import EngineDeadError, EngineProcessClient

logger = logging.getLogger(__name__)


class Router:
    def __init__(self, prefill_device: str = "cpu", max_prefill_len: int = 512) -> None:
        self.prefill_device = prefill_device
        self.max_prefill_len = max_prefill_len

    def prefill_remotely(self, num_prompt_tokens: int) -> bool:
        return self.prefill_device != "auto" or num_prompt_tokens <= self.max_prefill_len


class DisaggregatedEngines:
    """The ``EngineHandle`` of a prefill engine plus a decode engine, for ``Frontend``."""

    def __init__(self, prefill: EngineProcessClient, decode: EngineProcessClient, router: Router) -> None:
        self.prefill = prefill
        self.decode = decode
        self.router = router
        self.placements: dict[str, str] = {}
        self._warned_fallback = False

    @property
    def tokenizer(self):
        return self.decode.tokenizer

    @property
    def max_model_len(self) -> int:
        return min(self.prefill.max_model_len, self.decode.max_model_len)

    @property
    def vocab_size(self) -> int:
        return self.decode.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.decode.eos_token_ids

    def add_request(self, request: Request) -> None:
        remote = self.router.prefill_remotely(request.num_prompt_tokens)
        if remote and not self.prefill.is_up():
            if not self._warned_fallback:
                logger.warning("no prefill engine is up: prefilling on the decode engine")
                self._warned_fallback = True
            remote = False
        target = self.prefill if remote else self.decode
        self.placements[request.request_id] = target.name
        target.add_request(request)

    def _both(self, method: str, request_id: str) -> None:
        for client in (self.prefill, self.decode):
            if client.is_up():
                try:
                    getattr(client, method)(request_id)
                except EngineDeadError:  # it went down meanwhile: nothing of the request is left there
                    pass

    def abort(self, request_id: str) -> None:
        self._both("abort", request_id)

    def finish_stopped(self, request_id: str) -> None:
        self._both("finish_stopped", request_id)

    def release(self, request_id: str) -> None:
        self.placements.pop(request_id, None)
        self._both("release", request_id)


def check_same_model(prefill: EngineProcessClient, decode: EngineProcessClient) -> None:
    """Refuse engines that would exchange KV of different models, naming what differs."""
    a, b = prefill.ready.fingerprint, decode.ready.fingerprint
    differ = [key for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
    if differ:
        detail = "; ".join(f"{key}: {prefill.name}={a.get(key)!r}, {decode.name}={b.get(key)!r}" for key in differ)
        raise EngineDeadError(f"prefill and decode engines serve different models ({detail})")
