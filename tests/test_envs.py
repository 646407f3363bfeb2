"""Every environment variable declared once (duoserve/envs.py) and read only through it: the
sources name no other, no other module reads os.environ for one, the C sources read none, and a
wrong value is an error naming the variable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from duoserve import envs

PACKAGE = Path(__file__).parents[1] / "duoserve"


def test_every_variable_the_sources_name_is_declared():
    named = set()
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.glob("kernels/csrc/*.[ch]*")]:
        named |= {m for m in re.findall(r"\bDUOSERVE_[A-Z0-9_]+\b", path.read_text()) if not m.endswith("_H")}
    assert named - set(envs.VARIABLES) == set()
    assert {"DUOSERVE_C_KERNELS", "DUOSERVE_TILED_PREFILL", "DUOSERVE_API_KEY"} <= named


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read a variable: os.environ.get(...), os.getenv(...), os.environ[...] loaded."""
    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ"
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if (node.func.attr == "get" and is_environ(node.func.value)) or node.func.attr == "getenv":
                lines.append(node.lineno)
        if isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
    return lines


def test_no_module_but_envs_reads_the_environment_and_no_c_source_does():
    reads = {str(path.relative_to(PACKAGE)): lines for path in PACKAGE.rglob("*.py")
             if path.name != "envs.py" and (lines := _environment_reads(ast.parse(path.read_text())))}
    assert reads == {}
    assert [p.name for p in PACKAGE.glob("kernels/csrc/*") if "getenv" in p.read_text()] == []


def test_a_variable_reads_as_its_type_its_default_when_unset(monkeypatch):
    monkeypatch.delenv("DUOSERVE_SILENCE_TIMEOUT", raising=False)
    monkeypatch.setenv("DUOSERVE_C_KERNELS", "0")
    monkeypatch.setenv("DUOSERVE_MAX_MESSAGE_BYTES", "1024")
    assert envs.DUOSERVE_SILENCE_TIMEOUT == 30.0
    assert envs.DUOSERVE_C_KERNELS is False
    assert envs.DUOSERVE_MAX_MESSAGE_BYTES == 1024
    monkeypatch.setenv("DUOSERVE_C_KERNELS", "")   # empty: as unset
    assert envs.DUOSERVE_C_KERNELS is True
    with pytest.raises(AttributeError):
        envs.DUOSERVE_NOT_A_VARIABLE


@pytest.mark.parametrize("name, value, expected", [
    ("DUOSERVE_SILENCE_TIMEOUT", "soon", "environment variable DUOSERVE_SILENCE_TIMEOUT='soon': expected a float"),
    ("DUOSERVE_DECODE_STEP", "maybe", "environment variable DUOSERVE_DECODE_STEP='maybe': expected 1 or 0 "
                                      "(true/false, yes/no, on/off)"),
])
def test_a_wrong_value_names_the_variable_and_what_it_takes(monkeypatch, name, value, expected):
    monkeypatch.setenv(name, value)
    with pytest.raises(envs.EnvError) as err:
        getattr(envs, name)
    assert str(err.value) == expected


def test_every_variable_says_what_it_means():
    for var in envs.VARIABLES.values():
        assert len(var.meaning) > 20, var.name
        assert var.default is None or isinstance(var.default, (bool, int, float, str)), var.name
