"""Cut OpenAI's OpenAPI description down to what duoserve serves and the schemas those paths use.

    python tests/conformance/extract_openai_subset.py PATH/openai-openapi.json > tests/conformance/openai-subset.json

The source is OpenAI's published description (github.com/openai/openai-openapi, MIT licence,
spec version 2.3.0); the cut keeps its text unchanged.
"""

from __future__ import annotations

import json
import sys

PATHS = {"/models": ["get"], "/completions": ["post"], "/chat/completions": ["post"]}


def refs(node, found: set[tuple[str, str]]) -> None:
    """Every ``#/components/KIND/NAME`` the node refers to, as (KIND, NAME)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/"):
            kind, name = ref[len("#/components/"):].split("/", 1)
            found.add((kind, name))
        for value in node.values():
            refs(value, found)
    elif isinstance(node, list):
        for value in node:
            refs(value, found)


def main(source: str) -> dict:
    spec = json.load(open(source))
    paths = {p: {m: op for m, op in spec["paths"][p].items() if m in methods} for p, methods in PATHS.items()}
    components: dict[str, dict] = {"securitySchemes": spec["components"].get("securitySchemes", {})}
    todo: set[tuple[str, str]] = set()
    refs(paths, todo)
    while todo:
        kind, name = todo.pop()
        if name in components.get(kind, {}):
            continue
        node = spec["components"][kind][name]
        components.setdefault(kind, {})[name] = node
        refs(node, todo)
    return {"openapi": spec["openapi"], "info": {**spec["info"], "description": "A subset: " + ", ".join(PATHS)},
            "servers": [{"url": "/v1"}], "paths": paths,
            "components": {kind: dict(sorted(items.items())) for kind, items in sorted(components.items())},
            "security": spec.get("security", [])}


if __name__ == "__main__":
    json.dump(main(sys.argv[1]), sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
