"""Roles as one enum (config.Role), and what each puts into an engine built in one place
(engine/role_parts.py): no other module compares a role with a string."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from duoserve.config import EngineConfig, Role
from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.kv_sources import TransferSource
from duoserve.core.roles import PrefillOnly, RolePolicy
from duoserve.engine.role_parts import PARTS, role_parts
from duoserve.errors import ConfigError

PACKAGE = Path(__file__).parents[2] / "duoserve"


def test_a_role_is_a_member_wherever_it_comes_from():
    assert EngineConfig(role="decode").role is Role.DECODE
    config = EngineConfig(role=Role.PREFILL)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig).role is Role.PREFILL
    assert f"{Role.PREFILL} engine" == "prefill engine" and {"prefill": 1}[Role.PREFILL] == 1
    with pytest.raises(ConfigError) as err:
        EngineConfig(role="router")
    assert str(err.value) == "role='router' is not allowed: one of colocated, prefill, decode"


def test_each_role_has_its_parts():
    assert set(PARTS) == set(Role)
    assert role_parts("prefill") is role_parts(Role.PREFILL)
    kv = KVCacheManager(8, 16)
    colocated, prefill, decode = (role_parts(r) for r in (Role.COLOCATED, Role.PREFILL, Role.DECODE))
    assert type(colocated.policy(EngineConfig(), kv)) is RolePolicy and colocated.kv_sources() == []
    assert isinstance(prefill.policy(EngineConfig(role="prefill"), kv), PrefillOnly)
    assert [type(s) for s in decode.kv_sources()] == [TransferSource]
    assert (colocated.decodes, prefill.decodes, decode.decodes) == (True, False, True)
    assert (colocated.takes_turns, prefill.takes_turns, decode.takes_turns) == (False, True, True)
    assert colocated.turns(EngineConfig()) is None


def test_no_module_compares_a_role_with_a_string():
    compared = re.compile(r"""role\s*(==|!=|in|not in)\s*\(?["'](prefill|decode|colocated)""")
    found = [f"{p.relative_to(PACKAGE)}:{n}" for p in PACKAGE.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if compared.search(line)]
    assert found == []
