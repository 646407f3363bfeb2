"""How a model writes tool calls, found from its chat template, and the grammars that keep a call whole.

``tool_format`` reads the template: Hermes' ``<tool_call>`` tags (Qwen2/2.5/3, Hermes, SmolLM3),
Mistral's ``[TOOL_CALLS]``, Llama 3.x's bare JSON (``<|python_tag|>``). A template that never
mentions ``tools`` would drop them silently, so such a model (SmolLM2, Gemma) gets llama.cpp's
**generic format**: ``render_generic`` writes the tools into the system prompt, and under ``auto``
the whole answer is JSON (``generic_schema``): ``{"tool_calls": [{"name": ..., "arguments": ...}]}``
or ``{"response": "..."}``, the model choosing which; an earlier call is shown as that JSON, the
tools' results as a user turn of lines ``Result of get_weather: ...`` (of the renderings tried, the
one after which the default model answers instead of calling again: README, Tool calls).

Small models often write the call as bare or fenced JSON instead of their template's tags. Under
``tool_choice: "auto"`` the output is free until it starts a call in any of those forms (the
*triggers*: ``<tool_call>``, a ```json fence opening ``{"name": "``, or anywhere a call's JSON
naming one of the tools, ``{"name": "get_weather"``, alone or opening a list); from there on
``auto_call_grammar`` holds it to the tools' names and argument schemas, and then to more calls or
the end: llama.cpp's lazy grammars, written as one llguidance grammar whose free-text lexeme cannot
contain a trigger.
"""

from __future__ import annotations

import functools
import json

HERMES, LLAMA3_JSON, MISTRAL, GENERIC = "hermes", "llama3_json", "mistral", "generic"
TOOL_CALL_PARSERS = (HERMES, LLAMA3_JSON, MISTRAL)   # serve --tool-call-parser's choices

_WS = r"[ \t\r\n]*"
NAME_OPENING = r"\{" + _WS + r'"name"' + _WS + ":" + _WS + '"'   # a call's JSON up to its name's quote
LIST_OPENING = r"(?:\[" + _WS + ")?"                              # calls may come as a JSON list
FENCE_OPENING = "```(?:json)?" + _WS + LIST_OPENING                 # a fenced call's fence


def trigger(names: list[str], tags: bool = True) -> str:
    """Where a call starts: ``<tool_call>``, a ```json fence opening a call's JSON, or anywhere a
    call's JSON naming one of the tools (``{"name": "get_weather"``); another JSON object stays text.
    Tool names are ``[a-zA-Z0-9_-]`` (the API checks), so they need no escaping here."""
    named = LIST_OPENING + NAME_OPENING + "(?:" + "|".join(names) + ')"'
    return ("<tool_call>|" if tags else "") + FENCE_OPENING + NAME_OPENING + "|" + named


@functools.lru_cache(maxsize=8)   # asked per chat request; a server has one template
def tool_format(template: str | None) -> str:
    """How the model writes tool calls, from its chat template: ``generic`` when it shows no tools."""
    text = template or ""
    if "tools" not in text:
        return GENERIC
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "<|python_tag|>" in text or ("ipython" in text and '"parameters"' in text):
        return LLAMA3_JSON
    return HERMES   # <tool_call> tags, or a markup of the template's own: read as Hermes' and JSON


GENERIC_TOOLS = "You can call the following tools to satisfy the user's requests:\n{tools}"
GENERIC_AUTO = ('\n\nAnswer in JSON: either {"tool_calls": [...]} to call tools (each call '
                '{"name": ..., "arguments": {...}}), or {"response": "..."} to reply to the user.')


def render_generic(messages: list[dict], tools: list[dict], auto: bool) -> list[dict]:
    """A conversation for a template that knows no tools (llama.cpp's generic format): the tools
    join the system prompt (one is added when there is none), with the JSON answer ``auto`` asks
    for; an assistant's calls become that JSON, and the results that follow one user turn of
    ``Result of <tool>: <content>`` lines (templates that know only user and assistant roles render it)."""
    out: list[dict] = []
    names: dict[str, str] = {}   # call id -> the tool it called
    if tools:
        described = GENERIC_TOOLS.format(tools=json.dumps([t["function"] for t in tools], indent=2,
                                                          ensure_ascii=False)) + (GENERIC_AUTO if auto else "")
        if messages and messages[0]["role"] in ("system", "developer"):
            first, messages = messages[0], messages[1:]
            out.append({"role": "system", "content": f"{first.get('content') or ''}\n\n{described}".lstrip()})
        else:
            out.append({"role": "system", "content": described})
    for message in messages:
        role = message["role"]
        if message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message["tool_calls"]]
            names.update((c.get("id"), c["function"]["name"]) for c in message["tool_calls"])
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        elif role in ("tool", "function"):
            name = names.get(message.get("tool_call_id")) or message.get("name") or "the tool"
            line = f"Result of {name}: {message.get('content') or ''}"
            if out and out[-1].get("results"):
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line, "results": True})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_call_id", "name")})
    return [{k: v for k, v in m.items() if k != "results"} for m in out]


def generic_schema(tools: list[dict], parallel: bool) -> dict:
    """The generic format's answer: ``{"tool_calls": [...]}`` under the tools' schemas (leniently:
    a keyword llguidance cannot enforce is no reason to refuse the request), or ``{"response": ...}``."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    listed = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        listed["maxItems"] = 1
    return {"x-guidance": {"lenient": True},
            "anyOf": [{"type": "object", "properties": {"tool_calls": listed}, "required": ["tool_calls"],
                       "additionalProperties": False},
                      {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                       "additionalProperties": False}]}


def _lark_string(text: str) -> str:
    return json.dumps(text)   # a JSON string is a Lark string literal


CALL_OPENING = '{"name": "'   # how the grammar writes a call's start after a tag or between calls


def auto_call_grammar(tools: list[dict], parallel: bool, arguments_key: str = "arguments",
                      tags: bool = True) -> str:
    """The lazy grammar of ``tool_choice: "auto"``: free text that contains no trigger, or text
    up to a trigger and then calls, each naming a given tool with arguments under its schema
    (leniently: a keyword llguidance cannot enforce is not a reason to refuse the request), in the
    form the first one took (tagged, fenced, or bare JSON, alone or listed); with ``parallel`` more
    calls may follow, then the answer ends."""
    names = [t["function"]["name"] for t in tools]
    rules = []
    for k, tool in enumerate(tools):
        schema = dict(tool["function"].get("parameters") or {"type": "object"})
        schema["x-guidance"] = {"lenient": True, "whitespace_flexible": False,
                                "item_separator": ", ", "key_separator": ": "}
        after = f', "{arguments_key}": '
        rules += [f"call_{k}: {_lark_string(names[k] + chr(34))} after_{k}",
                  f'after_{k}: {_lark_string(after)} args_{k} "}}"',
                  f"args_{k}: %json {json.dumps(schema)}"]
    no_trigger = f"~/(?s:.*)(?:{trigger(names, tags)})(?s:.*)/"
    first_only = f"~/(?s:.*)(?:{trigger(names, tags)})(?s:.+)/"   # the lead ends at its trigger, the first
    more = "((SEP | WS) bare)*" if parallel else ""
    starts = [f"LEAD_FENCE call {more} FENCE_CLOSE WS?",
              *[f"LEAD_NAMED_{k} after_{k} {more} CLOSE? WS?" for k in range(len(tools))]]
    lines = [f"FREE: /(?s:.*)/ & {no_trigger}",
             f"LEAD_FENCE: /(?s:.*){FENCE_OPENING}{NAME_OPENING}/ & {first_only}",
             *[f"LEAD_NAMED_{k}: /(?s:.*){LIST_OPENING}{NAME_OPENING}{name}\"/ & {first_only}"
               for k, name in enumerate(names)],
             'FENCE_CLOSE: /[ \\t\\r\\n]*(\\][ \\t\\r\\n]*)?```/', 'CLOSE: /[ \\t\\r\\n]*\\]/',
             "SEP: /[ \\t\\r\\n]*,[ \\t\\r\\n]*/", "WS: /[ \\t\\r\\n]+/",
             f"bare: {_lark_string(CALL_OPENING)} call",
             "call: " + " | ".join(f"call_{k}" for k in range(len(tools)))]
    if tags:
        starts.append(f"LEAD_TAG tag_body{' (WS tagged)*' if parallel else ''} WS?")
        lines += [f"LEAD_TAG: /(?s:.*)<tool_call>/ & {first_only}", 'tagged: "<tool_call>" tag_body',
                  f'tag_body: "\\n"? {_lark_string(CALL_OPENING)} call "\\n"? "</tool_call>"']
    return "\n".join(["start: FREE | " + " | ".join(starts)] + lines + rules) + "\n"
