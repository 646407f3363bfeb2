"""Flags declared once, on the dataclass field they set.

A field made with ``flag(...)`` carries its command-line flag: help, how its text parses, its
choices and its group. ``add_flags`` turns a dataclass's flagged fields into ``argparse``
arguments (``max_model_len`` is ``--max-model-len``; the default shown is the field's own), and
``values_from_args`` reads them back from the parsed namespace for the dataclass's constructor, so
that a new flag is one field: ``EngineArgs`` (engine_args.py), ``DisaggConfig`` and
``ClusterConfig`` (config.py) and ``ServerConfig`` (entrypoints/server_config.py) are made so.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import field
from typing import Any, Callable

Convert = Callable[[Any, str], Any]   # (the flag's value, the field's name) -> the field's value


def flag(default: Any = None, help: str = "", *, parse: Callable[[str], Any] | None = None,
         choices: tuple[str, ...] | None = None, group: str | None = None, default_help: str | None = None,
         factory: Callable[[], Any] | None = None, cli: bool = True, name: str | None = None,
         cli_default: Any = dataclasses.MISSING, convert: Convert | None = None, nargs: str | None = None):
    """A dataclass field with what its flag needs:

    ``parse`` turns the flag's text into the value (``bool``: --x/--no-x); ``choices`` the values
    allowed; ``group`` the help's group (default: the class's ``FLAG_GROUP``); ``default_help`` says
    what the default means where the value alone would not; ``cli=False`` keeps a keyword out of
    the command line; ``name`` the flag's name where it is not the field's; ``cli_default`` the
    flag's own default where it differs from the field's (None, to tell a flag given from one left
    out; a callable is called when the parser is made); ``convert`` makes the field's value of
    the flag's (a list in one string, checked and named by the field); ``nargs`` argparse's (words
    after the flag, as a list)."""
    metadata = {"help": help, "parse": parse, "choices": choices, "group": group, "default_help": default_help,
                "cli": cli, "name": name, "cli_default": cli_default, "convert": convert,
                "nargs": nargs}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def flagged_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "cli" in f.metadata and f.metadata["cli"]]


def dest(f: dataclasses.Field) -> str:
    """Where the parsed flags hold field ``f``'s value: its flag's name (``--cluster``: cluster)."""
    return f.metadata.get("name") or f.name


def option(f: dataclasses.Field) -> str:
    """The flag of field ``f``: --max-model-len."""
    return "--" + dest(f).replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls, groups: dict[str, argparse._ArgumentGroup] | None = None,
              actions: dict[str, type[argparse.Action]] | None = None) -> dict[str, argparse._ArgumentGroup]:
    """One flag per flagged field of dataclass ``cls``, in field order, each in its group (made
    where ``groups`` lacks it; ``cls.FLAG_GROUP`` = (title, description) names the class's own);
    ``actions`` gives a field's flag an action of its own (by its name: --model given again)."""
    groups = {} if groups is None else groups
    title, description = getattr(cls, "FLAG_GROUP", ("options", None))
    for f in flagged_fields(cls):
        meta = f.metadata
        group_title = meta["group"] or title
        if group_title not in groups:
            groups[group_title] = parser.add_argument_group(group_title,
                                                            description if group_title == title else None)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        given = default if meta["cli_default"] is dataclasses.MISSING else meta["cli_default"]
        given = given() if callable(given) else given
        shown = meta["default_help"] or ("on" if default is True else "off" if default is False
                                         else f"{default:g}" if isinstance(default, float) else default)
        kwargs: dict[str, Any] = {"default": given, "help": f"{meta['help']} (default: {shown})", "dest": dest(f)}
        if meta["parse"] is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif meta["parse"] is not None:
            kwargs["type"] = meta["parse"]
        if meta["choices"]:
            kwargs["choices"] = list(meta["choices"])
        if meta.get("nargs"):
            kwargs["nargs"] = meta["nargs"]
        if actions and f.name in actions:
            kwargs["action"] = actions[f.name]
        groups[group_title].add_argument(option(f), **kwargs)
    return groups


def values_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of ``cls`` from parsed flags: each flagged field's value (converted), and
    any other field the namespace holds under its name (a flag another group declares, as
    --auth-key-file). A flag left at a ``cli_default`` of None leaves the field's default."""
    values = {}
    for f in dataclasses.fields(cls):
        if not hasattr(args, dest(f)):
            continue
        value, meta = getattr(args, dest(f)), f.metadata
        if meta.get("cli_default", dataclasses.MISSING) is None and value is None:
            continue
        values[f.name] = meta["convert"](value, f.name) if meta.get("convert") else value
    return values
