"""What an engine's role puts into it, built in this one place: its scheduling policy
(``core.roles``), its part in handing KV to or from another engine (``engine.handoff``), the KV
source only it asks (transfers, for a decode engine), its link to KV peers (``engine.peer_links``),
its side of the turns on shared cores (``engine.cpu_turns``) and whether it decodes at all.

The builder and the engine process ask ``role_parts(config.role)`` and never compare roles
themselves; a new role is one class here and a ``Role`` member (``duoserve.config``).
"""

from __future__ import annotations

from duoserve.config import EngineConfig, Role
from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.kv_sources import KVSource, TransferSource
from duoserve.core.roles import PrefillOnly, RolePolicy
from duoserve.engine.cpu_turns import CpuTurns
from duoserve.engine.handoff import Handoff, ReceiveKV, SendKV
from duoserve.engine.peer_links import DecodePeers, NoPeers, PrefillPeers


class ColocatedParts:
    """An engine that computes both steps of its requests: no KV crosses to another engine."""

    role = Role.COLOCATED
    decodes = True            # it samples past the first token (speculative decoding applies)
    takes_turns = False       # takes turns on cores shared with the other role's engines

    def policy(self, config: EngineConfig, kv: KVCacheManager) -> RolePolicy:
        return RolePolicy()

    def handoff(self, config: EngineConfig, scheduler, runner) -> Handoff:
        return Handoff()

    def kv_sources(self) -> list[KVSource]:
        """Its own KV sources, asked after the prefix cache, the store and swap."""
        return []

    def peer_link(self, core, sock, key, instance_id: str, name: str | None) -> NoPeers:
        return NoPeers()

    def turns(self, config: EngineConfig, layers=(), compiled: bool = True) -> CpuTurns | None:
        """Its turns on the cores it shares with the other role's engines (none given: none);
        ``layers``: the model's, where an eager step may offer a turn between two of them."""
        if config.turns is None or not self.takes_turns:
            return None
        return CpuTurns(config.turns, self.role)


class PrefillParts(ColocatedParts):
    """Computes prompts (the shortest remaining first) and sends their KV to a decode engine."""

    role = Role.PREFILL
    decodes = False
    takes_turns = True

    def policy(self, config: EngineConfig, kv: KVCacheManager) -> RolePolicy:
        return PrefillOnly(kv, config.kv_lease_timeout)

    def turns(self, config: EngineConfig, layers=(), compiled: bool = True) -> CpuTurns | None:
        """A prefill engine's turns also offer the decode engines a turn between two layers of an
        eager prompt step (a compiled one offers it between steps only)."""
        turns = super().turns(config, layers, compiled)
        if turns is not None and not compiled:
            for layer in layers:
                layer.register_forward_pre_hook(lambda module, args: turns.checkpoint())
        return turns

    def handoff(self, config: EngineConfig, scheduler, runner) -> Handoff:
        return SendKV(scheduler, runner, config.kv_lease_timeout)

    def peer_link(self, core, sock, key, instance_id: str, name: str | None) -> NoPeers:
        return PrefillPeers(core, key)


class DecodeParts(ColocatedParts):
    """Admits requests whose prompt KV a prefill engine sent, and decodes them."""

    role = Role.DECODE
    takes_turns = True

    def handoff(self, config: EngineConfig, scheduler, runner) -> Handoff:
        return ReceiveKV(scheduler, runner)

    def kv_sources(self) -> list[KVSource]:
        return [TransferSource()]

    def peer_link(self, core, sock, key, instance_id: str, name: str | None) -> NoPeers:
        return DecodePeers(core, sock, instance_id, name)


PARTS = {parts.role: parts for parts in (ColocatedParts(), PrefillParts(), DecodeParts())}


def role_parts(role: Role) -> ColocatedParts:
    return PARTS[Role(role)]
