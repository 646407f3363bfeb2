"""Error responses in the caller's API's shape: OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` on its routes, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on
``/v1/messages`` (the shape its SDK reads), chosen by the request's path."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}
# Anthropic's error types by status (its API reference, "Errors")
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code or str(status)}}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"),
                                       "message": message}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error in the shape of the API that ``path`` belongs to (OpenAI's unless Anthropic's)."""
    if path.startswith(ANTHROPIC_PATH):
        where = f" ({param})" if param and param not in message else ""
        return JSONResponse(anthropic_error_body(status, message + where), status_code=status, headers=headers)
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)
