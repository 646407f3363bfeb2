"""The HTTP server: FastAPI app, its guards (API key, body size, queue length) and lifecycle.

``duoserve serve`` starts the engines before the port opens (a launched engine that cannot
start is a one-line error), or, for engines that run elsewhere, opens the port at once and
answers /health 503 until they come. On SIGTERM or Ctrl-C, ``DrainingServer`` stops taking
requests and gives those in flight ``--shutdown-timeout`` seconds; any still running then
end with an error (a stream gets a final error event and ``[DONE]``). Then the engines stop,
so no child process outlives the server. The guards are plain ASGI middleware: FastAPI's
``@app.middleware("http")`` would hide client disconnects from the routes.
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from duoserve.config import ClusterConfig, DisaggConfig, EngineConfig
from duoserve.entrypoints.errors import APIError, error_response
from duoserve.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                           GenerateRequest, TokenizeRequest)
from duoserve.entrypoints.serving import OpenAIServing
from duoserve.entrypoints.serving_chat import ChatServing
from duoserve.frontend.async_engine import AsyncEngine
from duoserve.metrics import ServerMetrics

logger = logging.getLogger("duoserve.api")


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_queue_len: int | None = None         # requests in flight beyond which new ones get 429
    max_request_bytes: int = 1 << 20
    shutdown_timeout: float = 30.0
    tool_call_parser: str | None = None      # how the model writes tool calls (tool_choice "auto")
    reasoning_parser: str | None = None      # how a reasoning model marks its thinking


class BodyLimit:
    """ASGI middleware: refuse a body over ``limit`` bytes with 413, by header or by count."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise APIError(413, f"request body over {self.limit} bytes")
            return message

        try:
            await self.app(scope, counting_receive, send)
        except APIError:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        response = error_response(413, f"request body over the limit of {self.limit} bytes "
                                       "(--max-request-bytes)", code="request_too_large")
        await response(scope, receive, send)


class APIKeyGuard:
    """ASGI middleware: every route but /health needs ``Authorization: Bearer <key>`` (compared in
    constant time)."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.expected is None or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def _validation_param(exc: RequestValidationError) -> tuple[str | None, str]:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a parameter
        position = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
        where = f" at character {position}" if position is not None else ""
        return None, f"the request body is not valid JSON{where}: {first.get('ctx', {}).get('error', 'invalid')}"
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return param, f"invalid value for {param or 'the request body'}: {first.get('msg', 'invalid')}"


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the engine when shutdown begins so that it can end the
    requests still running at the deadline cleanly, before uvicorn would cancel them."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets=None) -> None:
        self.engine.begin_drain(self.drain_timeout)
        await super().shutdown(sockets)


def create_app(engine_config: EngineConfig, server: ServerConfig, disagg: DisaggConfig | None = None,
               cluster: ClusterConfig | None = None) -> FastAPI:
    engine = AsyncEngine(engine_config, server.max_queue_len, disagg, cluster)
    metrics = ServerMetrics()
    engine.on_output.append(metrics.observe_output)
    engine.on_stats.append(metrics.observe_stats)
    engine.on_place.append(metrics.observe_placement)
    engine.on_migrate.append(metrics.observe_migration)
    engine.on_resume.append(metrics.migration_resume.observe)
    engine.on_engine_down.append(metrics.engine_down)
    openai = OpenAIServing(engine, server.served_model_name)
    chat = ChatServing(openai, server.tool_call_parser, server.reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        start = time.monotonic()
        await engine.start(wait=False)   # already done by `duoserve serve`; remote engines come later
        logger.info("serving %s: %s in %.1fs", server.served_model_name,
                    "ready" if engine.ready else engine.not_ready_reason(), time.monotonic() - start)
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="duoserve", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(BodyLimit, limit=server.max_request_bytes)
    app.add_middleware(APIKeyGuard, api_key=server.api_key)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        param, message = _validation_param(exc)
        return error_response(400, message, param)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        logger.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}")

    def check_fields(body) -> None:
        """Refuse a known field we do not implement by name; warn about the others."""
        refused = body.not_implemented_field()
        if refused is not None:
            raise APIError(400, f"'{refused}' is not supported by this server yet: leave it out, or give it its "
                                "default (the answer would not be what it asks for)", param=refused)
        unknown = body.unknown_fields()
        if unknown:
            logger.warning("ignoring unknown request fields: %s", ", ".join(unknown))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_fields(body)
        return await openai.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_fields(body)
        return await chat.chat(body, raw)

    @app.post("/generate")
    async def generate(body: GenerateRequest, raw: Request):
        check_fields(body)
        return await chat.generate(body, raw)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.served_model_name, "object": "model",
                                            "created": int(time.time()), "owned_by": "duoserve",
                                            "max_model_len": engine.max_model_len}]}

    def require_engine() -> None:
        if engine.tokenizer is None:
            raise APIError(503, f"the engine is unavailable: {engine.not_ready_reason()}")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        openai.check_model(body.model)
        require_engine()
        if body.messages is not None:
            ids = chat.chat_prompt(ChatCompletionRequest(messages=body.messages,
                                                         add_generation_prompt=body.add_generation_prompt))
        elif body.prompt is not None:
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        openai.check_model(body.model)
        require_engine()
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {engine.vocab_size})",
                           param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health():
        if engine.ready:
            slow = [c.name for c in engine.clients if c.slow_since is not None]
            if slow:  # still serving: a long step is not a dead engine
                return {"status": "slow", "slow_engines": slow}
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "reason": engine.not_ready_reason()}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        for client in engine.clients:
            if client.ready is not None and client.ready.memory:
                metrics.observe_memory(client.name, client.ready.memory)
        if engine.inputs is not None:
            metrics.observe_structured_requests(engine.inputs.num_constrained, engine.inputs.num_rejected_grammars)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/memory")
    async def memory():
        """Each engine's start-up memory report, and this API process's resident size."""
        from duoserve.worker.memory import rss_bytes

        return {"engines": {c.name: c.ready.memory for c in engine.clients if c.ready is not None},
                "api_process_rss_bytes": rss_bytes()}

    return app
