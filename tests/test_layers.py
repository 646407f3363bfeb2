"""The layering rule of docs/architecture.md, read from the code: every import of a duoserve
module (function-local ones included) points to a lower layer or stays inside its own package."""

from __future__ import annotations

import ast
from pathlib import Path

# bottom first; a package may import only from the layers below its own
LAYERS = [("heap", "gguf_types", "envs"), ("errors", "kernels", "flags"), ("config", "sampling_params", "transport"), ("platform", "core", "engine_args"),
          ("model", "messages", "outputs"), ("kv", "metrics", "tracing", "bench", "structured"), ("worker",), ("engine",), ("frontend",),
          ("entrypoints",), ("__init__",), ("cli",), ("__main__",)]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
PACKAGE = Path(__file__).parents[1] / "duoserve"


def unit_of(module: str) -> str:
    """duoserve.kv.store -> kv; duoserve -> __init__ (the package's own names)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__version__" else "__init__"


def imported_modules(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("duoserve"):
            found += [node.module] if node.module != "duoserve" else [f"duoserve.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("duoserve")]
    return found


def test_every_import_points_down_and_every_unit_has_a_layer():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        me = "__init__" if parts == ("__init__",) else parts[0]
        assert me in RANK, f"{path}: {me} has no layer in LAYERS (add it, and to docs/architecture.md)"
        for module in imported_modules(ast.parse(path.read_text())):
            other = unit_of(module)
            assert other in RANK, f"{path} imports {module}, which has no layer"
            if other != me and RANK[other] >= RANK[me]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}: {me} imports {module}")
    assert upward == []


def test_the_model_imports_no_kernel_and_the_kernels_no_model():
    for package, forbidden in (("model", "duoserve.kernels"), ("kernels", "duoserve.model")):
        for path in (PACKAGE / package).rglob("*.py"):
            bad = [m for m in imported_modules(ast.parse(path.read_text())) if m.startswith(forbidden)]
            assert bad == [], f"{path} imports {bad}"


def test_no_function_is_longer_than_sixty_lines():
    """A function past a screen is several steps under one name: split it where they part."""
    long = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
            for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert long == []
