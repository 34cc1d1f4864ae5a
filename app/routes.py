"""The FastAPI app: the edge (API key, request metrics), routes, error handlers, and the lifespan
that starts and stops the worker.

    app = create_app(engine, ServerSettings(...))   # nothing is loaded here; the worker starts with the app

The handlers are plain functions; they reach the service, the metrics and the settings through
``request.app.state`` (set by create_app), so several apps can live in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.util
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmspec.text import Completion

from .metrics import Metrics
from .protocol import (DONE_EVENT, APIError, ChatCompletionRequest, ChatInputs, Reply, error_body, error_event, model_not_found,
                       prepare_chat)
from .settings import ServerSettings
from .site import DOCS_OPENAPI_URL, add_site_routes
from .job import Job
from .service import EngineSource, Service

logger = logging.getLogger("vlmspec.server")
UI_PATH = "/ui"  # where the Gradio demo is mounted


def create_app(engine: EngineSource, settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI app. `engine`: a SpecEngine (plain requests are rows of its batch that never
    draft) or a zero-argument callable returning one; a callable is called on the worker thread when
    the app starts (lifespan), not here."""
    settings = settings or ServerSettings()
    metrics = Metrics()
    service = Service(engine, settings, metrics)
    metrics.watch_drafter(service.drafter_metrics)
    metrics.watch_prompt_cache(service.prompt_cache_metrics)
    app = FastAPI(title="vlmspec", version="0.1.0", lifespan=_lifespan, docs_url=None, redoc_url=None,
                  description="OpenAI-compatible chat completions with lossless speculative decoding for VLMs")
    app.state.service, app.state.metrics, app.state.settings = service, metrics, settings
    ui_path = UI_PATH if settings.ui and importlib.util.find_spec("gradio") is not None else None
    app.state.ui_path = ui_path  # where the demo UI is mounted (None: not mounted)
    app.add_middleware(EdgeMiddleware, settings=settings, metrics=metrics, ui_path=ui_path)
    _add_error_handlers(app)
    _add_routes(app)
    app.state.docs_path = _add_docs(app)
    add_site_routes(app)
    app.openapi = functools.partial(_openapi, app)  # type: ignore[method-assign]
    if ui_path is not None:
        from .ui import mount_ui
        from .ui_runner import ServiceRunner

        mount_ui(app, ServiceRunner(service, settings), path=ui_path)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    service: Service = app.state.service
    await anyio.to_thread.run_sync(service.start)
    try:
        yield
    finally:
        await anyio.to_thread.run_sync(service.stop)


def _add_routes(app: FastAPI) -> None:
    # response_model=None: the handlers return plain dicts / responses, shaped by protocol.py
    for path, handler, method in (("/healthz", healthz, "GET"), ("/metrics", prometheus_metrics, "GET"),
                                  ("/v1/models", list_models, "GET"), ("/v1/models/{model_id:path}", get_model, "GET"),
                                  ("/v1/chat/completions", chat_completions, "POST")):
        app.add_api_route(path, handler, methods=[method], response_model=None)


DOCS_ASSETS = "/docs/assets"


def _add_docs(app: FastAPI) -> str | None:
    """/docs: Swagger UI from the pip-packaged bundle (swagger-ui-bundle), never from a CDN, so it
    works offline; not mounted (None) when the package is missing. GET / links everything."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        swagger_ui_path = None
    docs_path = None
    if swagger_ui_path is not None:
        docs_path = "/docs"
        from fastapi.openapi.docs import get_swagger_ui_html
        from fastapi.staticfiles import StaticFiles

        app.mount(DOCS_ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

        async def docs() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url=DOCS_OPENAPI_URL, title="vlmspec API",
                                       swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                       swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                       swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")

        app.add_api_route(docs_path, docs, methods=["GET"], include_in_schema=False)

    async def index() -> HTMLResponse:
        links = [("/ui", "the demo (speculative and plain decoding side by side)")] if app.state.ui_path else []
        links += [("/docs", "the API reference")] if docs_path else []
        links += [("/v1/models", "the served model"), ("/metrics", "Prometheus metrics"), ("/healthz", "health")]
        items = "".join(f'<li><a href="{href}">{href}</a>: {what}</li>' for href, what in links)
        return HTMLResponse(f"<!doctype html><title>vlmspec</title><h1>vlmspec</h1><p>OpenAI-compatible API at "
                            f"<code>/v1</code> (POST /v1/chat/completions).</p><ul>{items}</ul>")

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    return docs_path


# ------------------------------------------------------------------------------------------ the edge

_KNOWN = ("/v1/chat/completions", "/v1/models", "/healthz", "/metrics", "/docs", "/openapi.json", DOCS_OPENAPI_URL, "/favicon.ico", "/")


def endpoint_label(path: str) -> str:
    """The `endpoint` label of a request path (a bounded set: unknown paths are "other")."""
    if path in _KNOWN:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path == UI_PATH or path.startswith(UI_PATH + "/"):
        return UI_PATH
    if path.startswith(DOCS_ASSETS + "/"):
        return DOCS_ASSETS
    return "other"


class EdgeMiddleware:
    """Pure ASGI: refuses a missing/wrong bearer key (401) on every route but /healthz and the demo
    UI (which has its own login), and counts every HTTP request by endpoint and status."""

    def __init__(self, app: Any, settings: ServerSettings, metrics: Metrics, ui_path: str | None = None) -> None:
        self.app, self.settings, self.metrics = app, settings, metrics
        self.ui_path = ui_path  # the mounted demo UI checks the key itself (Gradio login: password = API key)

    def _authorized(self, scope: dict) -> bool:
        """Whether the request may pass; a request with a valid key carries its tenant in
        `scope["state"]["tenant"]` (`ServerSettings.tenant`), read as `request.state.tenant`."""
        if self.settings.open or scope["path"] in ("/healthz", "/", "/favicon.ico") or scope["path"].startswith(DOCS_ASSETS + "/"):
            return True  # health, the index of links and Swagger UI's static files carry no data
        if self.ui_path is not None and (scope["path"] == self.ui_path or scope["path"].startswith(self.ui_path + "/")):
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                tenant = self.settings.tenant(token.strip()) if scheme.lower() == "bearer" else None
                scope.setdefault("state", {})["tenant"] = tenant
                return tenant is not None
        return False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if not self._authorized(scope):
                body = error_body("invalid or missing API key: send 'Authorization: Bearer <key>'", "invalid_request_error", None, "invalid_api_key")
                resp = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            endpoint = endpoint_label(scope["path"])
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------ errors


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {}
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    body = error_body(f"invalid request: {first.get('msg', 'validation error')}", param=param, code="invalid_value")
    return JSONResponse(body, status_code=400)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(error_body(str(exc.detail), param=None, code=code), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error on %s", request.url.path, exc_info=exc)
    return JSONResponse(error_body("internal server error", "server_error", None, "internal_error"), status_code=500)


# ------------------------------------------------------------------------------------------ small routes


async def healthz(request: Request) -> JSONResponse:
    service: Service = request.app.state.service
    settings: ServerSettings = request.app.state.settings
    why = service.health()  # None: serving
    active, waiting = service.active, service.waiting
    body = {
        "status": "ok" if why is None else "unavailable" if service.broken() else "draining",
        "model": settings.model,
        "drafter": service.engine_info().drafter,
        "active": active,  # requests decoding in the batch
        "waiting": waiting,  # requests queued for a free slot
        "free_slots": max(service.max_batch - active, 0),
        "max_batch": service.max_batch,
        "max_queue": settings.max_queue,
        "kv_pool": service.pool(),  # slots x entries per slot, fixed at start-up; bytes allocated at the first request
    }
    if why is not None:
        body["reason"] = why
    return JSONResponse(body, status_code=200 if why is None else 503)


async def prometheus_metrics(request: Request) -> Response:
    metrics: Metrics = request.app.state.metrics
    service = request.app.state.service
    metrics.queue_depth.set(service.waiting)
    metrics.observe_pool(service.pool())
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _model_card(request: Request) -> dict[str, Any]:
    service: Service = request.app.state.service
    return {"id": request.app.state.settings.model, "object": "model", "created": service.started_at,
            "owned_by": "vlmspec", "drafter": service.engine_info().drafter}


async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(request)]}


async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    settings: ServerSettings = request.app.state.settings
    if not settings.serves(model_id):
        raise model_not_found(model_id, settings)
    return _model_card(request)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI schema, with the chat request documented (its body is validated by hand: size
    limit first, strict types, OpenAI-shaped errors)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        req_schema = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(req_schema.pop("$defs", {}))
        components["ChatCompletionRequest"] = req_schema
        post = schema["paths"]["/v1/chat/completions"]["post"]
        post["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}}
        app.openapi_schema = schema
    return app.openapi_schema


# ------------------------------------------------------------------------------------------ chat completions


async def chat_completions(request: Request) -> Response | dict[str, Any]:
    """Body -> ChatInputs (in a thread: images may be fetched) -> a Job on the worker -> the answer,
    whole or as server-sent events. The job is cancelled when the client goes away."""
    settings: ServerSettings = request.app.state.settings
    service: Service = request.app.state.service
    body = await _read_body(request, settings.max_body_bytes)
    inputs = await anyio.to_thread.run_sync(prepare_chat, body, settings)
    given = inputs.request.max_tokens is not None or inputs.request.max_completion_tokens is not None
    config = dataclasses.replace(inputs.config, tenant=getattr(request.state, "tenant", None))  # its key's pool of answers
    job = Job.on_loop(inputs.messages, inputs.images, config, speculative=inputs.request.speculative,
                      timeout_s=settings.request_timeout_s, stop=inputs.stop, max_tokens_given=given)
    service.submit(job)
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    handed_over = False
    try:
        kind, payload = await job.receive(settings.request_timeout_s)
        if kind == "error":
            raise payload
        reply = Reply(job.id, int(time.time()), settings.model, job.speculative, service.engine_info().drafter, int(payload))
        if inputs.request.stream:
            handed_over = True
            return StreamingResponse(_sse(job, watcher, reply, settings, _include_usage(inputs)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return reply.completion_body(await _collect(job, settings))
    finally:
        if not handed_over:
            job.cancel("disconnect")  # a no-op once the job finished
            watcher.cancel()


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or APIError 413 as soon as it is known to be over `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise APIError(400, "invalid Content-Length header", code="invalid_request")
        if int(length) > limit:
            raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _watch_disconnect(request: Request, job: Job) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel("disconnect")
            return


async def _collect(job: Job, settings: ServerSettings) -> Completion:
    """Wait for the job's Completion (its text events are not needed: the Completion has the text)."""
    while True:
        kind, payload = await job.receive(settings.request_timeout_s)
        if kind == "done":
            return payload
        if kind == "error":
            raise payload


def _include_usage(inputs: ChatInputs) -> bool:
    options = inputs.request.stream_options
    return bool(options and options.include_usage)


async def _sse(job: Job, watcher: asyncio.Task, reply: Reply, settings: ServerSettings, include_usage: bool) -> AsyncIterator[str]:
    """The stream: a role chunk, a chunk per text event, the finish chunk and, when asked for, the
    usage chunk (or an error event), then [DONE]."""
    try:
        yield reply.chunk({"role": "assistant", "content": ""})
        while True:
            kind, payload = await job.receive(settings.request_timeout_s)
            if kind == "event":
                if payload.text:
                    yield reply.chunk({"content": payload.text})
            elif kind == "done":
                for chunk in reply.final_chunks(payload, include_usage):
                    yield chunk
                break
            else:
                yield error_event(payload)
                break
        yield DONE_EVENT
    finally:
        job.cancel("disconnect")  # a no-op when the job has finished
        watcher.cancel()
