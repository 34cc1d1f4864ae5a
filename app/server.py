"""The vlmspec service: an OpenAI-compatible REST API over a speculative and a plain engine.

    create_app(engines, ServerSettings(...)) -> FastAPI     (nothing is loaded at import time)
    main(["--model", DIR, "--port", "8000"])                (what `vlmspec serve` runs)

Routes
------
``POST /v1/chat/completions``  OpenAI chat completions (stream or not) with images as data URLs;
                                extensions: ``speculative`` (bool, default true), ``top_k``, ``ignore_eos``.
``GET  /v1/models``            the served model.
``GET  /healthz``              liveness (never needs the API key).
``GET  /metrics``              Prometheus text (a per-app registry).
``GET  /docs``                 OpenAPI UI.
``GET  /ui``                   Gradio demo (app/demo_ui.py) when gradio is installed and ``ServerSettings.ui``;
                                it runs its generations through the same worker and queue as the API.

Status codes: 200; 400 bad input (also for what FastAPI would answer 422); 401 missing/wrong API key;
404 unknown model or route; 405; 413 body too large; 429 queue full (with Retry-After);
503 shutting down; 504 request timeout; 500 only for a genuine internal failure. Every error body is
``{"error": {"message", "type", "param", "code"}}``. A stream that fails after it started gets an
``data: {"error": ...}`` chunk and then ``data: [DONE]``.

Concurrency: one worker thread owns both engines (which share one Target) and runs one generation
at a time; requests wait in a bounded queue. The worker checks the request's cancel flag (client
gone, timeout, shutdown) between engine steps.

Metrics (all prefixed ``vlmspec_``): see METRIC_NAMES.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import queue
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger("vlmspec.server")

METRIC_NAMES = (
    "vlmspec_requests_total",  # counter {endpoint, code}: every HTTP request by status code
    "vlmspec_request_latency_seconds",  # histogram {endpoint}: until the last byte is sent
    "vlmspec_time_to_first_token_seconds",  # histogram {mode}: submit -> first token
    "vlmspec_queue_wait_seconds",  # histogram: submit -> the worker picks the request up
    "vlmspec_queue_depth",  # gauge: requests waiting for the worker
    "vlmspec_inflight_requests",  # gauge: generations running (0 or 1)
    "vlmspec_rejected_requests_total",  # counter {reason}: queue_full, shutting_down
    "vlmspec_cancelled_generations_total",  # counter {reason}: disconnect, timeout, shutdown
    "vlmspec_generations_total",  # counter {mode, finish_reason}: completed generations
    "vlmspec_prompt_tokens_total",  # counter {mode}
    "vlmspec_generated_tokens_total",  # counter {mode}: tokens emitted (cancelled ones included)
    "vlmspec_tokens_per_second",  # histogram {mode}: per completed generation
    "vlmspec_target_forwards_total",  # counter {mode}: prefill + verify forwards
    "vlmspec_drafted_tokens_total",  # counter
    "vlmspec_accepted_tokens_total",  # counter
    "vlmspec_mean_accepted_length",  # gauge {mode}: tokens per verify forward, over all requests so far
    "vlmspec_acceptance_rate",  # gauge {position}: P(drafted token at depth d accepted | depth reached)
)

# ------------------------------------------------------------------------------------------ settings


@dataclass
class ServerSettings:
    model: str = "vlmspec"  # the name clients pass as `model`
    model_aliases: tuple[str, ...] = ()  # other accepted names (e.g. the model's full path)
    api_key: str | None = None  # None = open
    allow_remote_images: bool = False
    max_queue: int = 16  # requests waiting for the worker (the running one excluded)
    request_timeout_s: float = 120.0  # from arrival to the last token
    max_tokens_cap: int = 1024
    default_max_tokens: int = 256  # when the request gives no max_tokens (clamped to the cap)
    max_images: int = 4
    max_image_pixels: int = 4096 * 4096
    max_image_aspect_ratio: float = 100.0
    max_body_bytes: int = 20 * 1024 * 1024
    remote_image_timeout_s: float = 10.0
    shutdown_grace_s: float = 30.0  # lifespan shutdown: how long the running generation may finish
    ui: bool = True  # mount the Gradio demo at /ui when gradio is importable (with api_key: a login page)

    def __post_init__(self) -> None:
        if self.max_queue < 0 or self.max_tokens_cap < 1 or self.max_images < 0 or self.max_body_bytes < 1:
            raise ValueError(f"invalid server settings: {self}")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")


# ------------------------------------------------------------------------------------------ schemas


class _Strict(BaseModel):
    # strict: "8" is not an int, 1 is not a bool; unknown fields are ignored (OpenAI clients send many)
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)]
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = None


_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class ChatCompletionRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)  # OpenAI default: 1
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)  # extension (vLLM-style)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    speculative: bool = True  # extension: false = plain autoregressive decoding
    ignore_eos: bool = False  # extension (vLLM-style)
    logprobs: bool | None = None
    tools: list[Any] | None = None


# ------------------------------------------------------------------------------------------ errors


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    # the deepest error: for a union (str | list of parts) that is the branch the client meant
    err = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {"type": "invalid", "loc": (), "msg": str(exc)}
    if err["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", code="invalid_json")
    loc = [str(p) for p in err.get("loc", ()) if p not in ("function-after", "union")]
    # drop pydantic's union-member tags ("str", "list[...]", "text", ...) for a readable parameter path
    loc = [p for p in loc if p.isidentifier() or p.isdigit()]
    loc = [p for p in loc if p not in ("str", "TextPart", "ImagePart") and not p.startswith("list")]
    # and the discriminated union's tag: messages.0.content.1.image_url.image_url.url -> ...content.1.image_url.url
    param = re.sub(r"(content\.\d+)\.(?:text|image_url)\.", r"\1.", ".".join(loc)) or None
    if err["type"] == "model_type" and not loc:
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    if err["type"] == "missing":
        return APIError(400, f"missing required parameter: {param}", param=param, code="missing_required_parameter")
    return APIError(400, f"invalid value for {param or 'the request'}: {err['msg']}", param=param, code="invalid_value")


# ------------------------------------------------------------------------------------------ metrics


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        lat = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.requests = Counter("vlmspec_requests", "HTTP requests by endpoint and status code", ["endpoint", "code"], registry=r)
        self.latency = Histogram("vlmspec_request_latency_seconds", "HTTP request latency (until the last byte)", ["endpoint"], buckets=lat, registry=r)
        self.ttft = Histogram("vlmspec_time_to_first_token_seconds", "submit -> first token", ["mode"], buckets=lat, registry=r)
        self.queue_wait = Histogram("vlmspec_queue_wait_seconds", "submit -> picked up by the worker", buckets=lat, registry=r)
        self.queue_depth = Gauge("vlmspec_queue_depth", "requests waiting for the worker", registry=r)
        self.inflight = Gauge("vlmspec_inflight_requests", "generations running", registry=r)
        self.rejected = Counter("vlmspec_rejected_requests", "requests refused before queueing", ["reason"], registry=r)
        self.cancelled = Counter("vlmspec_cancelled_generations", "generations stopped early", ["reason"], registry=r)
        self.generations = Counter("vlmspec_generations", "completed generations", ["mode", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("vlmspec_prompt_tokens", "prompt tokens", ["mode"], registry=r)
        self.generated_tokens = Counter("vlmspec_generated_tokens", "generated tokens", ["mode"], registry=r)
        self.tokens_per_s = Histogram("vlmspec_tokens_per_second", "decode speed per generation", ["mode"],
                                      buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000), registry=r)
        self.forwards = Counter("vlmspec_target_forwards", "target forwards (prefill + verify)", ["mode"], registry=r)
        self.drafted = Counter("vlmspec_drafted_tokens", "drafted tokens sent to verification", registry=r)
        self.accepted = Counter("vlmspec_accepted_tokens", "drafted tokens accepted", registry=r)
        self.mean_accepted = Gauge("vlmspec_mean_accepted_length", "tokens per verify forward (bonus included), all requests so far", ["mode"], registry=r)
        self.acceptance = Gauge("vlmspec_acceptance_rate", "P(drafted token at this depth accepted | depth reached), all requests so far", ["position"], registry=r)
        self._lock = threading.Lock()
        self._tok: dict[str, int] = {"speculative": 0, "plain": 0}
        self._verify: dict[str, int] = {"speculative": 0, "plain": 0}
        self._reached: list[int] = []
        self._hits: list[int] = []
        for mode in ("speculative", "plain"):  # the series exist from the start
            self.mean_accepted.labels(mode)
            self.generated_tokens.labels(mode)
        self.queue_depth.set(0)

    def record_result(self, mode: str, result: Any) -> None:
        self.generations.labels(mode, result.finish_reason).inc()
        self.prompt_tokens.labels(mode).inc(result.prompt_tokens)
        self.forwards.labels(mode).inc(result.num_target_forwards)
        self.drafted.inc(result.num_drafted)
        self.accepted.inc(result.num_accepted)
        if result.elapsed_s > 0 and result.token_ids:
            self.tokens_per_s.labels(mode).observe(result.tokens_per_s)
        with self._lock:
            verify = result.num_target_forwards - 1
            if verify > 0:
                self._verify[mode] += verify
                self._tok[mode] += result.num_accepted + verify
                self.mean_accepted.labels(mode).set(self._tok[mode] / self._verify[mode])
            for d, (reach, hit) in enumerate(zip(result.depth_reached, result.depth_accepted)):
                if d >= len(self._reached):
                    self._reached.append(0)
                    self._hits.append(0)
                self._reached[d] += reach
                self._hits[d] += hit
                if self._reached[d]:
                    self.acceptance.labels(str(d + 1)).set(self._hits[d] / self._reached[d])

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ------------------------------------------------------------------------------------------ worker


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass
class Job:
    messages: list[dict[str, Any]]  # HF chat-template messages
    images: list[Any]
    config: Any  # GenerationConfig
    speculative: bool
    deadline: float  # time.monotonic()
    loop: asyncio.AbstractEventLoop
    inbox: asyncio.Queue
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    submitted: float = field(default_factory=time.monotonic)
    cancel_reason: str | None = None
    finished: bool = False
    tree_total_tokens: int | None = None  # the demo UI's tree-size knob (None: the drafter's own)

    @property
    def mode(self) -> str:
        return "speculative" if self.speculative else "plain"

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None and not self.finished:
            self.cancel_reason = reason

    def post(self, kind: str, payload: Any = None) -> None:
        """From the worker thread to the request's handler on the event loop."""
        if kind in ("done", "error"):
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server stopped): nobody is listening any more
            pass

    def fail(self, err: APIError) -> None:
        self.post("error", err)


_CANCEL_ERRORS = {
    "timeout": lambda s: APIError(504, f"the request did not finish within {s:g} s", type="timeout", code="timeout"),
    "disconnect": lambda s: APIError(499, "the client disconnected", type="cancelled", code="client_disconnected"),
    "shutdown": lambda s: APIError(503, "the server is shutting down", type="server_error", code="shutting_down"),
}


class Service:
    """One worker thread that owns the engines; a bounded queue in front of it."""

    def __init__(self, engines: Any, settings: ServerSettings, metrics: Metrics) -> None:
        self._source = engines
        self.settings = settings
        self.metrics = metrics
        self.spec: Any = None
        self.plain: Any = None
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max(settings.max_queue, 1))
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.closing = False
        self.current: Job | None = None
        self.started_at = int(time.time())
        self.stats = {"completed": 0, "failed": 0, "cancelled": 0, "processed": 0}
        self._ema_s = 1.0  # smoothed service time per request, for Retry-After

    # -------------------------------------------------------------- lifecycle
    def _resolve_engines(self) -> None:
        from vlmspec.draft.base import NoDrafter
        from vlmspec.engine import SpecEngine

        src = self._source
        if callable(src) and not isinstance(src, (SpecEngine, tuple, list)):
            src = src()
        if isinstance(src, (tuple, list)):
            spec, plain = src
        else:
            spec = src
            plain = SpecEngine(spec.target, NoDrafter())
        if plain.target is not spec.target:
            raise ValueError("the speculative and plain engines must share one Target")
        self.spec, self.plain = spec, plain

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="vlmspec-worker", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise RuntimeError(f"the engines could not be created: {self._start_error}") from self._start_error

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.closing

    @property
    def drafter_name(self) -> str:
        return getattr(getattr(self.spec, "drafter", None), "name", "?")

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.closing or not self.alive:
                self.metrics.rejected.labels("shutting_down").inc()
                raise ShuttingDown()
            if self.settings.max_queue == 0 and self.current is not None:
                self.metrics.rejected.labels("queue_full").inc()
                raise QueueFull()
            try:
                self.queue.put_nowait(job)
            except queue.Full:
                self.metrics.rejected.labels("queue_full").inc()
                raise QueueFull() from None
            self.metrics.queue_depth.set(self.queue.qsize())

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self._ema_s * (self.queue.qsize() + 1)))

    def stop(self, grace_s: float | None = None) -> None:
        """Refuse new work, fail what is queued (503), let the running generation finish for up to
        `grace_s`, then cancel it."""
        grace_s = self.settings.shutdown_grace_s if grace_s is None else grace_s
        with self._lock:
            if self.closing:  # already stopped (or stopping)
                return
            self.closing = True
            drained = self._drain_queue()
            self.metrics.queue_depth.set(0)
        for job in drained:
            self.stats["cancelled"] += 1
            self.metrics.cancelled.labels("shutdown").inc()
            job.fail(_CANCEL_ERRORS["shutdown"](0))
        if self._thread is None:
            return
        self.queue.put(None)
        self._thread.join(grace_s)
        if self._thread.is_alive():
            current = self.current
            if current is not None:
                current.cancel("shutdown")
            self._thread.join(10.0)

    # -------------------------------------------------------------- the worker thread
    def _main(self) -> None:
        try:
            self._resolve_engines()
        except BaseException as exc:  # reported to start()
            logger.exception("engine creation failed")
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self.queue.get()
            self.metrics.queue_depth.set(self.queue.qsize())
            if job is None:
                break
            self.current = job
            self.metrics.inflight.set(1)
            t0 = time.monotonic()
            try:
                with self._tree_size(job):
                    self._process(job)
            except BaseException:  # never let the worker die
                logger.exception("worker: unexpected failure")
                job.fail(APIError(500, "internal error", type="server_error", code="internal_error"))
            finally:
                self.current = None
                self.metrics.inflight.set(0)
                self.stats["processed"] += 1
                self._ema_s = 0.8 * self._ema_s + 0.2 * (time.monotonic() - t0)
        # stop() drained the queue before the sentinel; anything that slipped in is failed cleanly
        for job in self._drain_queue():
            job.fail(_CANCEL_ERRORS["shutdown"](0))

    def _drain_queue(self) -> list[Job]:
        """Take every job still queued (the worker's stop sentinel, None, is dropped)."""
        drained: list[Job] = []
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return drained
            if job is not None:
                drained.append(job)

    @property
    def tree_total_tokens(self) -> int | None:
        """The speculative drafter's tree size, or None when it has no TreeConfig (or is not loaded yet)."""
        from vlmspec.draft.base import TreeConfig

        tree = getattr(getattr(self.spec, "drafter", None), "tree", None)
        return tree.total_tokens if isinstance(tree, TreeConfig) else None

    @contextlib.contextmanager
    def _tree_size(self, job: Job):
        """For one job on the worker thread: the drafter's tree with job.tree_total_tokens drafted nodes."""
        from dataclasses import replace

        drafter = getattr(self.spec, "drafter", None)
        tree = getattr(drafter, "tree", None)
        if not job.speculative or job.tree_total_tokens is None or self.tree_total_tokens is None:
            yield
            return
        drafter.tree = replace(tree, total_tokens=max(1, int(job.tree_total_tokens)))
        try:
            yield
        finally:
            drafter.tree = tree

    def _cancelled(self, job: Job, gen_iter: Any = None) -> None:
        reason = job.cancel_reason or "timeout"
        if gen_iter is not None:
            with contextlib.suppress(Exception):
                gen_iter.close()
        self.stats["cancelled"] += 1
        self.metrics.cancelled.labels(reason).inc()
        job.fail(_CANCEL_ERRORS[reason](self.settings.request_timeout_s))

    def _process(self, job: Job) -> None:
        from app.chat import encode_conversation
        from vlmspec.target import ContextLengthError

        m = self.metrics
        m.queue_wait.observe(time.monotonic() - job.submitted)
        if job.cancel_reason is None and time.monotonic() > job.deadline:
            job.cancel("timeout")
        if job.cancel_reason is not None:
            self._cancelled(job)
            return
        engine = self.spec if job.speculative else self.plain
        try:
            inputs = encode_conversation(engine.target, job.messages, job.images)
            gen = engine.stream(inputs, job.config)
            it = iter(gen)
            first = next(it)  # prefill + the first token
        except ContextLengthError as exc:
            self.stats["failed"] += 1
            job.fail(APIError(400, str(exc), param="messages", code="context_length_exceeded"))
            return
        except ValueError as exc:  # the processor refused this input (an odd image, ...)
            self.stats["failed"] += 1
            job.fail(APIError(400, f"the input could not be processed: {exc}", param="messages", code="invalid_input"))
            return
        except Exception:
            logger.exception("worker: prefill failed")
            self.stats["failed"] += 1
            job.fail(APIError(500, "internal error during prefill", type="server_error", code="internal_error"))
            return
        m.ttft.labels(job.mode).observe(time.monotonic() - job.submitted)
        job.post("start", int(inputs["input_ids"].shape[1]))
        job.post("event", first)
        m.generated_tokens.labels(job.mode).inc(len(first.token_ids))
        try:
            while True:
                if job.cancel_reason is None and time.monotonic() > job.deadline:
                    job.cancel("timeout")
                if job.cancel_reason is not None:  # checked between engine steps
                    self._cancelled(job, it)
                    return
                try:
                    event = next(it)
                except StopIteration:
                    break
                m.generated_tokens.labels(job.mode).inc(len(event.token_ids))
                job.post("event", event)
        except Exception:
            logger.exception("worker: generation failed")
            self.stats["failed"] += 1
            job.fail(APIError(500, "internal error during generation", type="server_error", code="internal_error"))
            return
        result = gen.result
        m.record_result(job.mode, result)
        self.stats["completed"] += 1
        job.post("done", result)


# ------------------------------------------------------------------------------------------ app


def _json_response(status: int, body: Any, headers: dict[str, str] | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(body, status_code=status, headers=headers)


def _endpoint_label(path: str) -> str:
    known = ("/v1/chat/completions", "/v1/models", "/healthz", "/metrics", "/docs", "/openapi.json")
    if path in known:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path == UI_PATH or path.startswith(UI_PATH + "/"):
        return UI_PATH
    return "other"


class _EdgeMiddleware:
    """Pure ASGI (streams untouched): API-key check, and per-request status/latency metrics."""

    def __init__(self, app: Any, settings: ServerSettings, metrics: Metrics, ui_path: str | None = None) -> None:
        self.app, self.settings, self.metrics = app, settings, metrics
        self.ui_path = ui_path  # the mounted demo UI checks the key itself (Gradio login: password = API key)

    def _authorized(self, scope: dict) -> bool:
        key = self.settings.api_key
        if key is None or scope["path"] == "/healthz":
            return True
        if self.ui_path is not None and (scope["path"] == self.ui_path or scope["path"].startswith(self.ui_path + "/")):
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
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
                resp = _json_response(401, body, {"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            endpoint = _endpoint_label(scope["path"])
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)


UI_PATH = "/ui"


def _ui_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("gradio") is not None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _speculative_block(enabled: bool, drafter: str, result: Any) -> dict[str, Any]:
    return {
        "enabled": enabled,
        "drafter": drafter if enabled else "none",
        "target_forwards": result.num_target_forwards,
        "drafted_tokens": result.num_drafted,
        "accepted_tokens": result.num_accepted,
        "mean_accepted_length": result.mean_accepted_length,
        "acceptance_by_position": result.acceptance_by_position,
    }


def create_app(engines: Any, settings: ServerSettings | None = None):
    """The FastAPI app. `engines`: a SpecEngine (a plain NoDrafter engine over the same Target is
    added), a (speculative, plain) pair, or a zero-argument callable returning either; a callable is
    called on the worker thread when the app starts (lifespan), not here."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    settings = settings or ServerSettings()
    metrics = Metrics()
    service = Service(engines, settings, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        import anyio

        await anyio.to_thread.run_sync(service.start)
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(service.stop)

    app = FastAPI(title="vlmspec", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible chat completions with lossless speculative decoding for VLMs")
    app.state.service = service
    app.state.metrics = metrics
    app.state.settings = settings
    ui_path = UI_PATH if settings.ui and _ui_available() else None
    app.state.ui_path = ui_path  # where the demo UI is mounted (None: not mounted)
    app.add_middleware(_EdgeMiddleware, settings=settings, metrics=metrics, ui_path=ui_path)

    # ---------------------------------------------------------------- error handlers
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _json_response(exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        return _json_response(400, error_body(f"invalid request: {first.get('msg', 'validation error')}", param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _json_response(exc.status_code, error_body(str(exc.detail), param=None, code=code), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return _json_response(500, error_body("internal server error", "server_error", None, "internal_error"))

    # ---------------------------------------------------------------- routes
    @app.get("/healthz")
    async def healthz():
        ok = service.alive
        body = {
            "status": "ok" if ok else "unavailable",
            "model": settings.model,
            "drafter": service.drafter_name,
            "queue_depth": service.queue.qsize(),
            "max_queue": settings.max_queue,
            "inflight": int(service.current is not None),
        }
        return _json_response(200 if ok else 503, body)

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        metrics.queue_depth.set(service.queue.qsize())
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def _model_card() -> dict[str, Any]:
        return {"id": settings.model, "object": "model", "created": service.started_at, "owned_by": "vlmspec",
                "drafter": service.drafter_name}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id not in (settings.model, *settings.model_aliases):
            raise APIError(404, f"the model {model_id!r} does not exist (this server serves {settings.model!r})",
                           param="model", code="model_not_found")
        return _model_card()

    async def _read_body(request: Request) -> bytes:
        limit = settings.max_body_bytes
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

    def _load_images(urls: list[tuple[str, str]]) -> list[Any]:
        from app.chat import ImageLimits, load_image_url

        limits = ImageLimits(max_pixels=settings.max_image_pixels, max_aspect_ratio=settings.max_image_aspect_ratio,
                             allow_remote=settings.allow_remote_images, remote_max_bytes=settings.max_body_bytes,
                             remote_timeout_s=settings.remote_image_timeout_s)
        return [load_image_url(url, limits, param) for param, url in urls]

    def _generation_config(req: ChatCompletionRequest):
        from vlmspec.engine import GenerationConfig
        from vlmspec.sampling import SamplingParams

        if req.n is not None and req.n != 1:
            raise APIError(400, "only n=1 is supported", param="n", code="unsupported_value")
        if req.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools", code="unsupported_value")
        if req.model is not None and req.model not in (settings.model, *settings.model_aliases):
            raise APIError(404, f"the model {req.model!r} does not exist (this server serves {settings.model!r})",
                           param="model", code="model_not_found")
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(req, name)
            if value is not None and value > settings.max_tokens_cap:
                raise APIError(400, f"{name} must be <= {settings.max_tokens_cap}, got {value}", param=name, code="invalid_value")
        max_tokens = req.max_completion_tokens or req.max_tokens or min(settings.default_max_tokens, settings.max_tokens_cap)
        if not any(m.role == "user" for m in req.messages):
            raise APIError(400, "messages must contain at least one user message", param="messages", code="invalid_value")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        sampling = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
        )
        return GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, seed=req.seed, stop=stop, ignore_eos=req.ignore_eos)

    async def _next(job: Job) -> tuple[str, Any]:
        """The job's next message, or a timeout error once its deadline has passed."""
        remaining = job.deadline - time.monotonic() + 0.5  # the worker enforces the deadline first
        try:
            return await asyncio.wait_for(job.inbox.get(), timeout=max(remaining, 0.01))
        except asyncio.TimeoutError:
            job.cancel("timeout")
            return "error", _CANCEL_ERRORS["timeout"](settings.request_timeout_s)

    async def _watch_disconnect(request: Request, job: Job) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel("disconnect")
                return

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        import anyio

        from app.chat import InputError, to_hf_messages

        body = await _read_body(request)
        try:
            req = ChatCompletionRequest.model_validate_json(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        config = _generation_config(req)
        hf_messages, urls = to_hf_messages([m.model_dump() for m in req.messages])
        if len(urls) > settings.max_images:
            raise APIError(400, f"too many images: {len(urls)} (at most {settings.max_images} per request)",
                           param="messages", code="too_many_images")
        try:
            images = await anyio.to_thread.run_sync(_load_images, urls)
        except InputError as exc:
            raise APIError(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code) from None

        loop = asyncio.get_running_loop()
        job = Job(hf_messages, images, config, req.speculative, time.monotonic() + settings.request_timeout_s, loop, asyncio.Queue())
        try:
            service.submit(job)
        except QueueFull:
            retry = str(service.retry_after_s())
            raise APIError(429, f"the server is busy ({settings.max_queue} requests queued): retry after {retry} s",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": retry}) from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                           headers={"Retry-After": "5"}) from None
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        handed_over = False
        try:
            kind, payload = await _next(job)
            if kind == "error":
                raise payload
            prompt_tokens = int(payload)
            created = int(time.time())
            if req.stream:
                handed_over = True
                return StreamingResponse(_sse(job, watcher, prompt_tokens, created), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            text_parts: list[str] = []
            while True:
                kind, payload = await _next(job)
                if kind == "event":
                    text_parts.append(payload.text)
                elif kind == "error":
                    raise payload
                else:
                    result = payload
                    break
            return {
                "id": job.id,
                "object": "chat.completion",
                "created": created,
                "model": settings.model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                             "logprobs": None, "finish_reason": result.finish_reason}],
                "usage": _usage(prompt_tokens, len(result.token_ids)),
                "speculative": _speculative_block(job.speculative, service.drafter_name, result),
            }
        finally:
            if not handed_over:
                job.cancel("disconnect")  # a no-op once the job finished
                watcher.cancel()

    def _chunk(job: Job, created: int, delta: dict | None, finish: str | None = None, **extra: Any) -> str:
        obj: dict[str, Any] = {"id": job.id, "object": "chat.completion.chunk", "created": created, "model": settings.model,
                               "system_fingerprint": None}
        obj["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        obj.update(extra)
        return f"data: {json.dumps(obj)}\n\n"

    async def _sse(job: Job, watcher: asyncio.Task, prompt_tokens: int, created: int):
        try:
            yield _chunk(job, created, {"role": "assistant", "content": ""})
            while True:
                kind, payload = await _next(job)
                if kind == "event":
                    if payload.text:
                        yield _chunk(job, created, {"content": payload.text})
                elif kind == "done":
                    result = payload
                    yield _chunk(job, created, {}, result.finish_reason)
                    yield _chunk(job, created, None, usage=_usage(prompt_tokens, len(result.token_ids)),
                                 speculative=_speculative_block(job.speculative, service.drafter_name, result))
                    break
                else:
                    yield f"data: {json.dumps(payload.body())}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel("disconnect")  # a no-op when the job has finished
            watcher.cancel()

    def openapi() -> dict[str, Any]:
        # the body is validated by hand (size limit first, strict types, OpenAI-shaped errors): document it here
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

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

    app.openapi = openapi  # type: ignore[method-assign]

    if ui_path is not None:
        from app.demo_ui import ServiceRunner, mount_ui

        mount_ui(app, ServiceRunner(service, settings), path=ui_path)
    return app


# ------------------------------------------------------------------------------------------ main


def _number(name: str, kind: type, low: float, high: float = math.inf):
    def parse(value: str):
        try:
            x = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {value!r}") from None
        if not low <= x <= high:
            raise argparse.ArgumentTypeError(f"{name} must be in [{low:g}, {high:g}], got {value}")
        return x

    return parse


def build_parser() -> argparse.ArgumentParser:
    from vlmspec import cli

    p = argparse.ArgumentParser(prog="vlmspec serve", description="OpenAI-compatible REST API with speculative decoding")
    cli._add_model_args(p)  # --model --drafter --device --dtype --attention --tree-*
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=_number("--port", int, 0, 65535), default=8000)
    p.add_argument("--api-key", default=os.environ.get("VLMSPEC_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /healthz (default: $VLMSPEC_API_KEY, else open)")
    p.add_argument("--allow-remote-images", action="store_true", help="let clients pass http(s) image URLs (the server fetches them)")
    p.add_argument("--served-model-name", default=None, help="the `model` name clients send (default: the model folder's name)")
    p.add_argument("--max-queue", type=_number("--max-queue", int, 0), default=16)
    p.add_argument("--request-timeout", type=_number("--request-timeout", float, 0.001, 1e6), default=120.0)
    p.add_argument("--max-tokens-cap", type=_number("--max-tokens-cap", int, 1), default=1024)
    p.add_argument("--max-images", type=_number("--max-images", int, 0), default=4)
    p.add_argument("--no-ui", action="store_true", help="do not mount the Gradio demo at /ui")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def main(argv: list[str] | None = None) -> int:
    """`vlmspec serve`: load the engines, print the URLs, run uvicorn until interrupted."""
    from pathlib import Path

    from vlmspec import cli

    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        import uvicorn
    except ImportError:
        print("vlmspec serve: error: the server needs fastapi, uvicorn and prometheus_client: pip install 'vlmspec[serve]'", file=sys.stderr)
        return cli.EXIT_USAGE
    try:
        model, drafter = cli.resolve_model_and_drafter(args.model, args.drafter)
        args.model, args.drafter = model, drafter
        print(f"loading {model} (drafter: {drafter}) ...", file=sys.stderr)
        engine = cli.load_engine(args)
    except cli.UsageError as exc:
        print(f"vlmspec serve: error: {exc}", file=sys.stderr)
        return cli.EXIT_USAGE
    name = args.served_model_name or (Path(model).name if Path(model).is_dir() else model)
    settings = ServerSettings(
        model=name, model_aliases=(model,), api_key=args.api_key, allow_remote_images=args.allow_remote_images,
        max_queue=args.max_queue, request_timeout_s=args.request_timeout, max_tokens_cap=args.max_tokens_cap,
        max_images=args.max_images, ui=not args.no_ui,
    )
    app = create_app(engine, settings)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    base = f"http://{shown}:{args.port}"
    print(f"vlmspec serve: model {name!r}, drafter {engine.drafter.name!r}", file=sys.stderr)
    print(f"  API base: {base}/v1", file=sys.stderr)
    print(f"  docs:     {base}/docs", file=sys.stderr)
    print(f"  metrics:  {base}/metrics", file=sys.stderr)
    print(f"  health:   {base}/healthz", file=sys.stderr)
    if app.state.ui_path is not None:
        print(f"  demo UI:  {base}{app.state.ui_path}" + ("  (login: any user name, the API key as password)" if args.api_key else ""),
              file=sys.stderr)
    elif settings.ui:
        print("  demo UI:  not mounted (pip install gradio)", file=sys.stderr)
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        print("  warning: listening beyond loopback without --api-key", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=int(settings.request_timeout_s))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
