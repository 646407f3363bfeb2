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
import signal
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from duoserve.config import ClusterConfig, DisaggConfig, EngineConfig
from duoserve.entrypoints.anthropic_protocol import CountTokensRequest, MessagesRequest
from duoserve.entrypoints.errors import APIError, error_response
from duoserve.entrypoints.model_registry import ModelRegistry
from duoserve.entrypoints.served_model import ModelSpec
from duoserve.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                           EmbeddingRequest, GenerateRequest, LoadLoRARequest, ModelRequest,
                                           RerankRequest, ScoreRequest, TokenizeRequest, UnloadLoRARequest)
from duoserve.entrypoints.responses_protocol import ResponsesRequest
from duoserve.entrypoints.serving_responses import ResponsesServing
from duoserve.entrypoints.server_config import ModelsConfig, ServerConfig
from duoserve.entrypoints.tenants import KEY_TENANT, key_tenant, split_keys
from duoserve.frontend.async_engine import AsyncEngine

logger = logging.getLogger("duoserve.api")


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
                                       "(--max-request-bytes)", code="request_too_large", path=scope["path"])
        await response(scope, receive, send)


class APIKeyGuard:
    """ASGI middleware: every route but /health needs a key, as ``Authorization: Bearer <key>``
    (OpenAI's SDK) or ``x-api-key: <key>`` (Anthropic's), compared in constant time. With several
    keys, the request's key names its tenant (``duoserve.entrypoints.tenants``)."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.keys = [key.encode() for key in split_keys(api_key)]
        self.tenants = [key_tenant(key) for key in split_keys(api_key)] if len(self.keys) > 1 else None

    def _match(self, headers: dict) -> int | None:
        """The index of the key the request carries (every key compared, in constant time)."""
        found = None
        for i, key in enumerate(self.keys):
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + key)
            if bearer | hmac.compare_digest(headers.get(b"x-api-key", b""), key):
                found = i
        return found

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or not self.keys or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        index = self._match(dict(scope.get("headers") or []))
        if index is None:
            if scope["type"] == "websocket":   # refused before it opens: the client sees HTTP 403
                return await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
            response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                      "or 'x-api-key: <key>'", code="invalid_api_key", path=scope["path"])
            return await response(scope, receive, send)
        if self.tenants is None:
            return await self.app(scope, receive, send)
        token = KEY_TENANT.set(self.tenants[index])
        try:
            return await self.app(scope, receive, send)
        finally:
            KEY_TENANT.reset(token)


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
    """uvicorn's server, telling the models' engines when shutdown begins so that they can end
    the requests still running at the deadline cleanly, before uvicorn would cancel them."""

    def __init__(self, config: uvicorn.Config, models: ModelRegistry, drain_timeout: float) -> None:
        super().__init__(config)
        self.models = models
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets=None) -> None:
        self.models.begin_drain(self.drain_timeout)
        await super().shutdown(sockets)
        if self.force_exit:   # uvicorn skipped the app's shutdown: the engines still stop before the exit
            await self.models.shutdown()

    def handle_exit(self, sig, frame) -> None:
        # in the signal handler, not at uvicorn's next tick: an engine the signal reached too
        # (Ctrl-C, kill -TERM -PGID) may drain and exit first, and must not be relaunched
        self.models.stop_relaunching()
        if self.should_exit and sig == signal.SIGTERM:   # a second SIGTERM forces, as a second Ctrl-C does
            self.force_exit = True
        super().handle_exit(sig, frame)


def create_app(engine_config: EngineConfig | list[ModelSpec], server: ServerConfig, disagg: DisaggConfig | None = None,
               cluster: ClusterConfig | None = None, limits: ModelsConfig | None = None) -> FastAPI:
    """The app: the models (``ModelRegistry``: one engine config, or several models' specs) in
    ``app.state.models``, the guards, the error shapes and the routes of this module's ``router``."""
    specs = engine_config if isinstance(engine_config, list) else [
        ModelSpec(server.served_model_name, engine_config, server)]
    models = ModelRegistry(specs, server, disagg, cluster, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        start = time.monotonic()
        keys = split_keys(server.api_key)
        if len(keys) > 1:
            logger.info("API keys name tenants: %s", ", ".join(f"key {i + 1}: {key_tenant(k)}"
                                                                for i, k in enumerate(keys)))
        await models.start()   # already done by `duoserve serve`; remote engines come later
        for entry in models.entries.values():
            engine = entry.served.engine if entry.served is not None else None
            logger.info("serving %s: %s in %.1fs", entry.spec.name, entry.state if engine is None else
                        "ready" if engine.ready else engine.not_ready_reason(), time.monotonic() - start)
        try:
            yield
        finally:
            await models.shutdown()

    app = FastAPI(title="duoserve", lifespan=lifespan)
    app.state.models, app.state.server = models, server
    # what needs no model: stored responses (shared by every model's Responses API)
    app.state.stored_responses = ResponsesServing(None, models.store)
    app.add_middleware(BodyLimit, limit=server.max_request_bytes)
    app.add_middleware(APIKeyGuard, api_key=server.api_key)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)
    app.include_router(router)
    return app


# ---- error shapes --------------------------------------------------------------------------

async def http_error(request: Request, exc: StarletteHTTPException):
    message = {404: f"no route {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None), path=request.url.path)


async def api_error(request: Request, exc: APIError):
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers, path=request.url.path)


async def validation_error(request: Request, exc: RequestValidationError):
    param, message = _validation_param(exc)
    return error_response(400, message, param, path=request.url.path)


async def internal_error(request: Request, exc: Exception):
    logger.exception("internal error")
    return error_response(500, f"internal error: {type(exc).__name__}", path=request.url.path)


# ---- routes ----------------------------------------------------------------------------------

router = APIRouter()


def check_fields(body) -> None:
    """Refuse a known field we do not implement by name; warn about the others."""
    refused = body.not_implemented_field()
    if refused is not None:
        raise APIError(400, f"'{refused}' is not supported by this server yet: leave it out, or give it its "
                            "default (the answer would not be what it asks for)", param=refused)
    unknown = body.unknown_fields()
    if unknown:
        logger.warning("ignoring unknown request fields: %s", ", ".join(unknown))


def require_engine(engine: AsyncEngine) -> None:
    if engine.tokenizer is None:
        raise APIError(503, f"the engine is unavailable: {engine.not_ready_reason()}")


def model_of(raw: Request | WebSocket, name: str | None):
    """The model a request names, loaded and held while its handler runs (``ModelRegistry.use``)."""
    return raw.app.state.models.use(name)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request):
    check_fields(body)
    async with model_of(raw, body.model) as served:
        return await served.openai.completions(body, raw)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request):
    check_fields(body)
    async with model_of(raw, body.model) as served:
        return await served.chat.chat(body, raw)


@router.post("/v1/messages")
async def anthropic_messages(body: MessagesRequest, raw: Request):
    async with model_of(raw, body.model) as served:
        return await served.anthropic.messages(body, raw)


@router.post("/v1/messages/count_tokens")
async def anthropic_count_tokens(body: CountTokensRequest, raw: Request):
    async with model_of(raw, body.model) as served:
        return await served.anthropic.count_tokens(body)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, raw: Request):
    check_fields(body)
    async with model_of(raw, body.model) as served:
        return await served.embeddings.embeddings(body, raw)


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, raw: Request):
    check_fields(body)
    async with model_of(raw, body.model) as served:
        return await served.scores.rerank(body, raw)


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, raw: Request):
    check_fields(body)
    async with model_of(raw, body.model) as served:
        return await served.scores.score(body, raw)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, raw: Request):
    async with model_of(raw, body.model) as served:
        return await served.responses.create(body, raw)


@router.websocket("/v1/responses")
async def responses_socket(ws: WebSocket):
    await ws.app.state.stored_responses.socket(ws, lambda name: model_of(ws, name))


@router.post("/v1/responses/compact")
async def responses_compact(body: ResponsesRequest, raw: Request):
    async with model_of(raw, body.model) as served:
        return await served.responses.compact(body)


@router.get("/v1/responses/{response_id}")
async def responses_get(response_id: str, raw: Request):
    return raw.app.state.stored_responses.get(response_id)


@router.delete("/v1/responses/{response_id}")
async def responses_delete(response_id: str, raw: Request):
    return raw.app.state.stored_responses.delete(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def responses_cancel(response_id: str, raw: Request):
    return await raw.app.state.stored_responses.cancel(response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def responses_input_items(response_id: str, raw: Request, limit: int = 20, order: str = "desc",
                                after: str | None = None):
    return raw.app.state.stored_responses.input_items(response_id, limit, order, after)


@router.post("/generate")
async def generate(body: GenerateRequest, raw: Request):
    check_fields(body)
    async with model_of(raw, body.model) as served:
        return await served.chat.generate(body, raw)


@router.get("/v1/models")
@router.get("/models")
async def models(raw: Request):
    registry = raw.app.state.models
    return {"object": "list", "data": [registry.describe(entry) for entry in registry.entries.values()]
            + registry.describe_adapters()}


@router.post("/models/load")
async def load_model(body: ModelRequest, raw: Request):
    """llama.cpp's router: load a model now (unloading the least recently used past --models-max)."""
    registry = raw.app.state.models
    await registry.load_for_request(registry.entry(body.model))
    return {"success": True}


@router.post("/models/unload")
async def unload_model(body: ModelRequest, raw: Request):
    """llama.cpp's router: end a model's engines once the requests it holds finish."""
    await raw.app.state.models.unload(body.model)
    return {"success": True}


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, raw: Request):
    """vLLM's: load a LoRA adapter on every engine of its model (``model``: which, with several)."""
    check_fields(body)
    await raw.app.state.models.load_adapter(body.lora_name, body.lora_path, body.model, body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, raw: Request):
    """vLLM's: unload an adapter once its requests end (409 if they outlast --shutdown-timeout)."""
    check_fields(body)
    await raw.app.state.models.unload_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request):
    async with model_of(raw, body.model) as served:
        engine = served.engine
        served.openai.check_model(body.model, generates=False)
        require_engine(engine)
        if body.messages is not None:
            ids = served.chat.chat_prompt(ChatCompletionRequest(messages=body.messages,
                                                                add_generation_prompt=body.add_generation_prompt))
        elif body.prompt is not None:
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request):
    async with model_of(raw, body.model) as served:
        engine = served.engine
        served.openai.check_model(body.model, generates=False)
        require_engine(engine)
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {engine.vocab_size})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}


@router.get("/health")
async def health(raw: Request):
    """One model: its engines' health, as always (a sleeping model is healthy: /health never wakes
    it). Several: 200 with each model's state."""
    registry = raw.app.state.models
    if not registry.single:
        return {"status": "ok", "models": {name: e.state for name, e in registry.entries.items()}}
    entry = next(iter(registry.entries.values()))
    if entry.served is None:
        return {"status": "ok", "model": entry.state}
    engine = entry.served.engine
    if engine.ready:
        slow = engine.slow_engines()
        if slow:  # still serving: a long step is not a dead engine
            return {"status": "slow", "slow_engines": slow}
        return {"status": "ok"}
    return JSONResponse({"status": "unavailable", "reason": engine.not_ready_reason()}, status_code=503)


@router.get("/metrics")
async def prometheus(raw: Request):
    registry = raw.app.state.models
    for entry in registry.loaded():
        engine, metrics = entry.served.engine, entry.metrics
        for name, report in engine.engine_memory().items():
            if report:
                metrics.observe_memory(name, report)
        metrics.observe_structured_requests(*engine.structured_request_counts())
        metrics.observe_tenant_load(engine.tenant_load())
        if engine.kv_event_feed is not None:
            metrics.observe_kv_events(engine.kv_event_feed.received)
    registry.observe_adapters()
    # the requests by class are the server's, whatever their model: given once, unlabelled by model
    first = next(iter(registry.entries.values()))
    first.metrics.observe_classes(registry.admission.counts(), registry.admission.refused)
    return Response(generate_latest(registry.collector), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/engines/{name}/drain")
async def drain_engine(name: str, raw: Request, model: str | None = None):
    """Drain one engine this server launched: no new work goes to it, it finishes what it holds,
    stops, and is launched again (a rolling restart drains each engine in turn). 202 once it
    drains; 404 for no such engine; 409 for one that runs elsewhere (SIGTERM it on its host:
    it drains the same way) or that is not up. With several models, ``?model=`` names its model."""
    entry = raw.app.state.models.entry(model)
    if entry.served is None:
        raise APIError(409, f"the model `{entry.spec.name}` is {entry.state}: it has no engines", param="model")
    engine = entry.served.engine
    try:
        held = engine.drain_engine(name)
    except KeyError:
        raise APIError(404, f"no engine {name!r}: the engines are {', '.join(c.name for c in engine.clients)}",
                       param="name") from None
    except ValueError as exc:
        raise APIError(409, str(exc), param="name") from None
    return JSONResponse({"engine": name, "draining": True, "requests_held": held}, status_code=202)


@router.get("/v1/memory")
async def memory(raw: Request):
    """Each engine's start-up memory report, this API process's resident size, and each model's
    state with what its engines held when it last unloaded or slept (``freed_bytes``)."""
    from duoserve.worker.memory import rss_bytes

    registry = raw.app.state.models
    engines, models = {}, {}
    for name, entry in registry.entries.items():
        reports = entry.served.engine.engine_memory() if entry.served is not None else {}
        engines.update(reports if registry.single else {f"{name}/{engine}": r for engine, r in reports.items()})
        models[name] = {"state": entry.state, "engines_rss_bytes": entry.served.resident_bytes()
                        if entry.served is not None else 0, "freed_bytes": entry.freed_bytes}
    return {"engines": engines, "models": models, "api_process_rss_bytes": rss_bytes()}
