"""Typed errors shared by every layer.

An expected shortage returns ``None`` (never an exception); caller misuse raises
one of these; a broken invariant is an ``assert``.
"""

from __future__ import annotations

from typing import Any


class DuoserveError(Exception):
    """Base class of every error duoserve raises on purpose."""


class ConfigError(DuoserveError, ValueError):
    """A configuration value is not allowed.

    The message always names the field, the value given and what is allowed, so
    a user can fix it without reading the code.
    """

    def __init__(self, field: str, value: Any, allowed: str, hint: str = "") -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        shown = repr(value)
        if len(shown) > 200:   # a hostile request's megabyte value is not echoed back
            shown = f"{shown[:120]}... ({len(shown)} characters)"
        message = f"{field}={shown} is not allowed: {allowed}"
        if hint:
            message += f". {hint}"
        super().__init__(message)


class ModelLoadError(DuoserveError):
    """A checkpoint could not be turned into a model (missing or mis-shaped tensor, bad file)."""


class KVStoreUnavailable(DuoserveError):
    """``--kv-store-required`` and the store did not answer at start."""


class InvalidRequestError(DuoserveError):
    """A request was asked to do something its state does not allow."""


class InvalidInputError(DuoserveError, ValueError):
    """A request's input cannot be served (empty or too long prompt, bad token id, bad parameter).

    ``param`` names the offending request field; the API turns this into a 400.
    """

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)
