"""Placement: which engines prefill and decode a request.

``--prefill-device cpu|cuda`` (cpu, the default) sends every prompt to a prefill engine; ``auto``
prefills each prompt where its predicted time to first token is lowest, on a prefill engine or
on its decode engine itself (``duoserve.frontend.placement``: from the rates the engines
measure, the backlogs counted here; before any rate is measured, the seed documents' rule: a
prompt of at most ``--max-prefill-len`` tokens on a prefill engine, a longer one on its decode
engine, chunked). With no prefill engine up, every prompt is prefilled on its decode engine.

Among engines of one role (``--routing prefix``, the default) the prompt goes to the engine
with the fewest prompt tokens to compute before its first token: its backlog (the prompt tokens
placed there without a first token yet, less what was expected cached there) plus the part of
this prompt it probably does not hold in its prefix cache (``prefix_map``: what this frontend
placed where, and what the engine reports). So a cached system prompt wins until its engine's
queue costs more than computing the prompt elsewhere. An engine with ``IMBALANCE`` or more
requests beyond the least loaded one (queue depth, counted here exactly: a decode engine's
unfinished requests, a prefill engine's requests not yet prefilled) is passed over, since a
decode engine's backlog does not count its decodes; between equals the less loaded, then the
one holding fewer of the request's tenant's requests (a heavy tenant spread over the engines,
each engine's fair share sees its part), then the first in its list (``decode-0`` before
``decode-1``). ``--routing kv-events`` is prefix routing on what each engine says it caches in
its KV events (``kv_event_feed``), exact as of its last step, instead of this frontend's
placements and the engines' reports. With ``--routing least-loaded`` the least loaded takes it. An engine that is down, or draining (its stats say so: it got SIGTERM and
finishes what it holds before it stops), is passed over. The decode engine is chosen first,
then the prefill engine, then where the prompt is prefilled (``auto``: each side's backlog and
uncached part).

Migration (``migrate``): a request whose engine went down is placed again. One no sample of
which has a token yet starts over, placed like a new request; otherwise each unfinished
sample is added to a decode engine with the tokens it had sent as outputs (the engine
computes them again like the prompt, or finds their blocks in its prefix cache or the KV
store), so the stream goes on from its next token. The request takes a new id on the
engines (``rid#1``, ``rid#2``...; the frontend's id stays) so that nothing an engine still
sends for an earlier placement can be mistaken for the new one's: ``note_outputs`` renames
the new one's outputs and drops the others.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from duoserve.core.request import Request
from duoserve.frontend import placement
from duoserve.frontend.engine_client import EngineClient, EngineDeadError
from duoserve.frontend.prefix_map import PrefixMap

logger = logging.getLogger(__name__)

# queued requests beyond the least loaded engine's at which an engine takes no more: a hot prefix
# must not pile every decode on one engine while another idles
IMBALANCE = 4


class Router:
    def __init__(self, prefill_device: str = "cpu", max_prefill_len: int = 512, routing: str = "prefix",
                 step_budget: int = 512, max_stall: float = 0.2, turn_wait: float = 0.0,
                 prefill_step_budget: int | None = None) -> None:
        self.prefill_device = prefill_device
        self.max_prefill_len = max_prefill_len
        self.routing = routing
        self.step_budget = step_budget   # a decode engine's prompt tokens in one step
        self.prefill_step_budget = prefill_step_budget or step_budget   # a prefill engine's
        self.max_stall = max_stall       # the longest a prompt may hold up a decode engine's decodes
        self.turn_wait = turn_wait       # the longest a decode step waits for its turn on shared cores

    def where(self, num_tokens: int, decode: Option, prefill: Option | None) -> placement.Choice:
        """Prefill on ``prefill`` (remote) or on ``decode`` itself, with the predicted TTFT."""
        if self.prefill_device != "auto":
            return placement.Choice(prefill is not None, None)
        return placement.choose(num_tokens, decode.client.rates, decode.backlog,
                                prefill.client.rates if prefill else None, prefill.backlog if prefill else 0,
                                self.step_budget, self.max_stall, self.max_prefill_len, self.turn_wait,
                                decode.cached, prefill.cached if prefill else 0, decode.load + 1,
                                self.prefill_step_budget)


@dataclass(frozen=True)
class Option:
    """An engine a request may go to, as the router sees it then."""
    client: EngineClient
    backlog: int = 0    # prompt tokens placed there still to compute
    cached: int = 0     # of this prompt's tokens, those it probably holds in its prefix cache
    load: int = 0       # its requests (a decode engine's: those it decodes)


@dataclass
class Placement:
    decode: str
    prefill: str | None = None
    samples: int = 1          # n: each sample is handed over on its own
    prefilled: bool = False   # the prefill engine has reported (its first token)
    handed_over: set[int] = field(default_factory=set)   # samples the decode engine has reported
    request: Request | None = None     # as the frontend first added it: a migration starts from it
    engine_id: str = ""                # the request's id on its engines (a new one at each migration)
    resumed: list[int] = field(default_factory=list)     # migrated samples added one by one
    lost_on: list[str] = field(default_factory=list)     # the engines it was on when they went down
    migrated_at: float | None = None   # until its first token after the migration (time to resume)
    predicted: float | None = None     # its predicted time to first token (placement.py), until it comes
    placed_at: float = 0.0
    uncached: int = 0                  # the prompt tokens expected computed where it is prefilled

    def engine_ids(self) -> list[str]:
        """Its ids on the engines: the request's, or each resumed sample's."""
        return [sample_id(self.engine_id, i) for i in self.resumed] if self.resumed else [self.engine_id]

    @property
    def decoding(self) -> bool:
        """Every sample lives on the decode engine now (a prefill engine that dies loses none)."""
        return len(self.handed_over) >= self.samples


def sample_id(engine_id: str, index: int) -> str:
    """An engine's id for sample ``index`` of a request (``rid``, ``rid/1``, ...)."""
    return engine_id if index == 0 else f"{engine_id}/{index}"


def renamed(base: Request, engine_id: str, sample_index: int = 0, outputs: list[int] = ()) -> Request:
    """``base`` under another id on the engines: one sample of it, with the outputs it had sent."""
    request = Request(engine_id, base.prompt_token_ids, base.params, base.eos_token_ids, base.max_total_tokens,
                      sample_index=sample_index, arrival_time=base.arrival_time)
    request.output_token_ids = list(outputs)
    return request


def split_sample(output_id: str) -> tuple[str, str]:
    """(the request's id, the sample's suffix "" or "/k") of an engine's output id."""
    parent, _, index = output_id.rpartition("/")
    return (parent, "/" + index) if parent and index.isdigit() else (output_id, "")


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
        self.aliases: dict[str, str] = {}   # a migrated request's engine id -> the frontend's id
        self.on_place: list = []   # hooks(request_id, prefill engine or None, decode engine): metrics
        self.on_resume: list = []  # hooks(seconds from the migration to the stream's next token)
        self.on_first_token: list = []   # hooks(prefilled remotely, predicted TTFT, measured TTFT)
        self.prefixes = PrefixMap(first.ready.block_size, from_events=self.router.routing == "kv-events")

    def engine_up(self, client: EngineClient) -> None:
        """An engine came up (late, or again): the context is what every engine can hold, and
        its prefix cache starts empty."""
        self.max_model_len = min(self.max_model_len, client.ready.max_model_len)
        self.prefixes.forget(client.name)

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

    def tenant_load(self, tenant: str | None = None) -> dict[tuple[str, str], int]:
        """(engine, tenant) -> requests placed there (decoding, or prefilling on a prefill engine),
        of every tenant or of ``tenant`` alone."""
        counts: dict[tuple[str, str], int] = {}
        for p in self.placements.values():
            t = p.request.params.tenant
            if tenant is not None and t != tenant:
                continue
            for name in (p.decode, p.prefill if p.prefill is not None and not p.prefilled else None):
                if name is not None:
                    counts[name, t] = counts.get((name, t), 0) + 1
        return counts

    @staticmethod
    def _takers(clients: list[EngineClient]) -> list[EngineClient]:
        """The engines that take new work: up and not draining (all that are up, if every one drains)."""
        up = [c for c in clients if c.is_up()]
        return [c for c in up if not getattr(c, "draining", False)] or up

    def _least_loaded(self, clients: list[EngineClient]) -> EngineClient | None:
        up = self._takers(clients)
        if not up:
            return None
        load = self.load
        return min(up, key=lambda c: load[c.name])

    def _best(self, clients: list[EngineClient], hashes: list[int], num_tokens: int,
              mine: dict[str, int] | None = None) -> Option | None:
        """The engine the request goes to among ``clients`` (the module docstring's rule; between
        engines equal by it, the one holding fewest of the request's tenant's requests: ``mine``,
        engine -> their count)."""
        up = self._takers(clients)
        if not up:
            return None
        load = self.load
        mine = mine or {}
        shortest_first = clients is self.prefill   # a prefill engine's order (core.roles.PrefillOnly)
        if self.router.routing == "least-loaded":
            least = min(up, key=lambda c: (load[c.name], mine.get(c.name, 0)))
            backlog = self.backlog(least.name, num_tokens if shortest_first else None)
            return Option(least, backlog, load=load[least.name])
        fewest = min(load[c.name] for c in up)
        options = []
        for client in up:
            if load[client.name] - fewest < IMBALANCE:
                # an engine computes a prompt's last token even when every block is cached
                cached = max(min(self.prefixes.matched(client.name, hashes) * self.prefixes.block_size,
                                 num_tokens - 1), 0)
                ahead = num_tokens - cached if shortest_first else None
                options.append(Option(client, self.backlog(client.name, ahead), cached, load[client.name]))
        return min(options, key=lambda o: (o.backlog + num_tokens - o.cached, o.load, mine.get(o.client.name, 0)))

    def backlog(self, name: str, ahead_of: int | None = None) -> int:
        """Prompt tokens placed on engine ``name`` still to be computed there: the placements'
        without their first token, less what each expected cached there. With ``ahead_of`` (a
        prefill engine, which takes the shortest remaining prompt first): those computed before a
        prompt of that many tokens, the shorter prompts' and of the longer ones' at most a step."""
        shorter = longer = 0
        for p in self.placements.values():
            if p.prefill == name and not p.prefilled or p.prefill is None and p.decode == name and not p.handed_over:
                if ahead_of is None or p.uncached <= ahead_of:
                    shorter += p.uncached
                else:
                    longer += p.uncached
        return shorter + min(longer, self.router.prefill_step_budget)

    def choose(self, request: Request) -> tuple[EngineClient, EngineClient | None, placement.Choice, int]:
        """(decode engine, prefill engine or None, the choice, the prompt tokens it computes) for a
        new request, by the module docstring's rules. Raises EngineDeadError when no decode engine is up."""
        # an adapter's blocks hash under its digest, which the engines know: such a request goes by load
        hashes = (self.prefixes.hashes(request.prompt_token_ids, request.params.cache_salt)
                  if self.router.routing != "least-loaded" and request.params.lora_name is None else [])
        n = request.num_prompt_tokens
        mine = {name: count for (name, _), count in self.tenant_load(request.params.tenant).items()}
        decode = self._best(self.decode, hashes, n, mine)
        if decode is None:
            raise EngineDeadError("no decode engine is up")
        prefill = self._best(self.prefill, hashes, n, mine) if self.prefill else None
        if self.prefill and prefill is None and not self._warned_fallback:
            logger.warning("no prefill engine is up: prefilling on the decode engines")
        self._warned_fallback = bool(self.prefill) and prefill is None
        where = self.router.where(n, decode, prefill)
        if not where.remote:
            prefill = None
        for option in (decode, prefill):   # both hold the prompt's blocks once it is prefilled
            if option is not None and hashes:
                self.prefixes.record(option.client.name, hashes, option.client.ready.num_blocks)
        uncached = n - (prefill or decode).cached
        return decode.client, prefill.client if prefill else None, where, uncached

    def add_request(self, request: Request, original: Request | None = None) -> None:
        decode, prefill, where, uncached = self.choose(request)
        if prefill is not None:
            prefill.add_request(request, kv_peer=decode.name, kv_peer_instance=decode.ready.instance_id)
        else:
            decode.add_request(request)
        self.placements[(original or request).request_id] = Placement(
            decode.name, prefill.name if prefill else None, samples=request.params.n, request=original or request,
            engine_id=request.request_id, predicted=where.predicted, placed_at=time.monotonic(), uncached=uncached)
        self._placed(request.request_id, prefill, decode)

    def _placed(self, request_id: str, prefill: EngineClient | None, decode: EngineClient) -> None:
        logger.debug("request %s: prefill on %s, decode on %s", request_id,
                     prefill.name if prefill else decode.name, decode.name)
        for hook in self.on_place:
            hook(request_id, prefill.name if prefill else None, decode.name)

    def migrate(self, request_id: str, resumed: dict[int, list[int]], lost_on: str) -> str:
        """Place again a request whose engine ``lost_on`` went down; ``resumed``: each unfinished
        sample's tokens so far (empty: none has a token, it starts over). Returns the decode
        engine's name; raises EngineDeadError when no decode engine is up (nothing changes)."""
        old = self.placements[request_id]
        decode = self._least_loaded(self.decode)
        if decode is None:
            raise EngineDeadError("no decode engine is up")
        for client in self._engines_of(request_id):   # a survivor may still hold a part of it
            for engine_id in old.engine_ids():
                self._send(client, "abort", engine_id)
                self._send(client, "release", engine_id)
        self.aliases.pop(old.engine_id, None)
        lost = [*old.lost_on, lost_on]
        engine_id = f"{request_id}#{len(lost)}"
        base = old.request
        self.aliases[engine_id] = request_id
        if not resumed:
            self.add_request(renamed(base, engine_id), original=base)
        else:
            for index, tokens in sorted(resumed.items()):
                decode.add_request(renamed(base, sample_id(engine_id, index), index, tokens))
            self.placements[request_id] = Placement(decode.name, samples=base.params.n, request=base,
                                                    engine_id=engine_id, resumed=sorted(resumed),
                                                    uncached=base.num_prompt_tokens)
            self._placed(engine_id, None, decode)
        placement = self.placements[request_id]
        placement.lost_on, placement.migrated_at = lost, time.monotonic()
        return placement.decode

    def note_outputs(self, client: EngineClient, outputs: list) -> list:
        """Outputs came from ``client``: those of each request's current placement, under the
        frontend's ids (a migrated request's renamed, an earlier placement's dropped); a prefill
        engine is done with those requests."""
        kept = []
        for out in outputs:
            engine_id, suffix = split_sample(out.request_id)
            request_id = self.aliases.get(engine_id, engine_id)
            placement = self.placements.get(request_id)
            if placement is not None:
                if engine_id != placement.engine_id or client.name not in (placement.decode, placement.prefill):
                    continue
                if client.name == placement.decode:
                    placement.handed_over.add(int(suffix[1:]) if suffix else 0)
                elif client.name == placement.prefill:
                    placement.prefilled = True
                if placement.predicted is not None and out.new_token_ids:
                    for hook in self.on_first_token:
                        hook(placement.prefill is not None, placement.predicted, time.monotonic() - placement.placed_at)
                    placement.predicted = None
                if placement.migrated_at is not None and out.new_token_ids:
                    for hook in self.on_resume:
                        hook(time.monotonic() - placement.migrated_at)
                    placement.migrated_at = None
                out.request_id = request_id + suffix
            kept.append(out)
        return kept

    def stranded_by(self, client: EngineClient) -> list[str]:
        """The requests that die with ``client``: all it decodes, and those it prefills with a sample
        not yet handed over, unless it stopped after a drain having reported them prefilled (a
        draining prefill engine exits only once the decode engine acknowledged their KV)."""
        drained = getattr(client, "draining", False)
        return [rid for rid, p in self.placements.items()
                if p.decode == client.name
                or (p.prefill == client.name and not p.decoding and not (drained and p.prefilled))]

    def _engines_of(self, request_id: str) -> list[EngineClient]:
        placement = self.placements.get(request_id)
        if placement is None:
            return [*self.prefill, *self.decode]
        return [self._by_name[n] for n in (placement.prefill, placement.decode) if n is not None]

    @staticmethod
    def _send(client: EngineClient, method: str, engine_id: str) -> None:
        if client.is_up():
            try:
                getattr(client, method)(engine_id)
            except EngineDeadError:  # it went down meanwhile: nothing of the request is left there
                pass

    def _tell(self, method: str, request_id: str) -> None:
        """Tell the request's engines, under their ids: the request's (or one sample's, "rid/k")."""
        parent, suffix = split_sample(request_id)
        placement = self.placements.get(parent)
        if placement is None:
            ids = [request_id]
        elif suffix:
            ids = [sample_id(placement.engine_id, int(suffix[1:]))]
        else:
            ids = placement.engine_ids()
        for client in self._engines_of(parent):
            for engine_id in ids:
                self._send(client, method, engine_id)

    def abort(self, request_id: str) -> None:
        self._tell("abort", request_id)

    def finish_stopped(self, request_id: str) -> None:
        self._tell("finish_stopped", request_id)

    def release(self, request_id: str) -> None:
        self._tell("release", request_id)
        placement = self.placements.pop(request_id, None)
        if placement is not None:
            self.aliases.pop(placement.engine_id, None)
