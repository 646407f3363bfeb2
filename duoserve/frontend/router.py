"""Placement: which engines prefill and decode a request.

``--prefill-device cpu|cuda`` sends every prompt to a prefill engine; ``auto`` (the
seed documents' mode) sends a prompt of at most ``--max-prefill-len`` tokens to a
prefill engine and prefills a longer one on its decode engine itself, chunked. With
no prefill engine up, every prompt is prefilled on its decode engine.

Among engines of one role the least loaded takes the request (queue depth, counted
here exactly: a decode engine's unfinished requests, a prefill engine's requests not
yet prefilled); between equals the first in its list (``decode-0`` before
``decode-1``), and an engine that is down is passed over. The frontend does not see
the engines' prefix caches, so "uncached part" is judged by the whole prompt's length.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from duoserve.core.request import Request
from duoserve.frontend.engine_client import EngineClient, EngineDeadError

logger = logging.getLogger(__name__)


class Router:
    def __init__(self, prefill_device: str = "cpu", max_prefill_len: int = 512) -> None:
        self.prefill_device = prefill_device
        self.max_prefill_len = max_prefill_len

    def prefill_remotely(self, num_prompt_tokens: int) -> bool:
        return self.prefill_device != "auto" or num_prompt_tokens <= self.max_prefill_len


@dataclass
class Placement:
    decode: str
    prefill: str | None = None
    samples: int = 1          # n: each sample is handed over on its own
    prefilled: bool = False   # the prefill engine has reported (its first token)
    handed_over: set[int] = field(default_factory=set)   # samples the decode engine has reported

    @property
    def decoding(self) -> bool:
        """Every sample lives on the decode engine now (a prefill engine that dies loses none)."""
        return len(self.handed_over) >= self.samples


class EngineGroup:
    """The ``EngineHandle`` of all the engines one frontend drives: the only object that
    sends them requests, aborts and releases, and the one ``AsyncEngine`` talks to.

    ``decode`` holds the engines that decode (colocated ones too); ``prefill`` may be empty.
    It is built once the first decode engine is up; engines that come up later (checked by
    the supervisor to serve the same model) are announced with ``engine_up``.
    """

    def __init__(self, decode: list[EngineClient], prefill: list[EngineClient] | None = None,
                 router: Router | None = None) -> None:
        self.decode = decode
        self.prefill = prefill or []
        self.router = router or Router()
        first = next(c for c in decode if c.ready is not None)
        self.reference = first.ready           # every engine serves the same model
        self.tokenizer = first.tokenizer
        # kept here: while an engine is being relaunched its EngineReady is gone
        self.max_model_len = min(c.ready.max_model_len for c in (*self.decode, *self.prefill) if c.ready is not None)
        self.placements: dict[str, Placement] = {}
        self._by_name = {c.name: c for c in (*self.decode, *self.prefill)}
        self._warned_fallback = False
        self.on_place: list = []   # hooks(request_id, prefill engine or None, decode engine): metrics

    def engine_up(self, client: EngineClient) -> None:
        """An engine came up (late, or again): the context is what every engine can hold."""
        self.max_model_len = min(self.max_model_len, client.ready.max_model_len)

    @property
    def vocab_size(self) -> int:
        return self.reference.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.reference.eos_token_ids)

    @property
    def load(self) -> dict[str, int]:
        """Queue depth per engine, derived from the placements."""
        load = {name: 0 for name in self._by_name}
        for p in self.placements.values():
            load[p.decode] += 1
            if p.prefill is not None and not p.prefilled:
                load[p.prefill] += 1
        return load

    def _least_loaded(self, clients: list[EngineClient]) -> EngineClient | None:
        up = [c for c in clients if c.is_up()]
        if not up:
            return None
        load = self.load
        return min(up, key=lambda c: load[c.name])

    def choose(self, request: Request) -> tuple[EngineClient, EngineClient | None]:
        """(decode engine, prefill engine or None) for a new request; the placement rules are
        the module docstring's. Raises EngineDeadError when no decode engine is up."""
        decode = self._least_loaded(self.decode)
        if decode is None:
            raise EngineDeadError("no decode engine is up")
        prefill = None
        if self.prefill and self.router.prefill_remotely(request.num_prompt_tokens):
            prefill = self._least_loaded(self.prefill)
            if prefill is None and not self._warned_fallback:
                logger.warning("no prefill engine is up: prefilling on the decode engines")
            self._warned_fallback = prefill is None
        return decode, prefill

    def add_request(self, request: Request) -> None:
        decode, prefill = self.choose(request)
        if prefill is not None:
            prefill.add_request(request, kv_peer=decode.name, kv_peer_instance=decode.ready.instance_id)
        else:
            decode.add_request(request)
        self.placements[request.request_id] = Placement(decode.name, prefill.name if prefill else None,
                                                        samples=request.params.n)
        logger.debug("request %s: prefill on %s, decode on %s", request.request_id,
                     prefill.name if prefill else decode.name, decode.name)
        for hook in self.on_place:
            hook(request.request_id, prefill.name if prefill else None, decode.name)

    def note_outputs(self, client: EngineClient, request_ids) -> None:
        """Outputs came from ``client``: a prefill engine is done with those requests."""
        for request_id in request_ids:
            parent, _, index = request_id.partition("/")
            placement = self.placements.get(parent)
            if placement is None:
                continue
            if client.name == placement.decode:
                placement.handed_over.add(int(index) if index.isdigit() else 0)
            elif client.name == placement.prefill:
                placement.prefilled = True

    def stranded_by(self, client: EngineClient) -> list[str]:
        """The requests that die with ``client``: all it decodes, and those it prefills with a sample
        not yet handed over."""
        return [rid for rid, p in self.placements.items()
                if p.decode == client.name or (p.prefill == client.name and not p.decoding)]

    def _engines_of(self, request_id: str) -> list[EngineClient]:
        placement = self.placements.get(request_id)
        if placement is None:
            return [*self.prefill, *self.decode]
        return [self._by_name[n] for n in (placement.prefill, placement.decode) if n is not None]

    def _tell(self, method: str, request_id: str) -> None:
        for client in self._engines_of(request_id):
            if client.is_up():
                try:
                    getattr(client, method)(request_id)
                except EngineDeadError:  # it went down meanwhile: nothing of the request is left there
                    pass

    def abort(self, request_id: str) -> None:
        self._tell("abort", request_id)

    def finish_stopped(self, request_id: str) -> None:
        self._tell("finish_stopped", request_id)

    def release(self, request_id: str) -> None:
        self._tell("release", request_id)
        self.placements.pop(request_id, None)

