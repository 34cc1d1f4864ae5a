"""The worker: one thread owns the engines and runs one generation at a time; a bounded queue in front.

    job = Job.on_loop(messages, images, config, speculative=True, timeout_s=60, stop=("\\n\\n",))
    service.submit(job)              # APIError 429 (queue full) / 503 (shutting down)
    kind, payload = await job.receive(timeout_s)

A job's messages, from the worker thread to the event loop, in order:
``("start", prompt_tokens: int)`` once the prefill is done, ``("event", TextEvent)`` per engine step,
then ``("done", Completion)`` or ``("error", APIError)`` (an error may also come first).

On the worker thread a job goes: `vlmspec.inputs.encode_messages` (the conversation -> model
inputs) -> `vlmspec.text.stream_text` (text, stop strings) around the engine. The worker checks
the job's cancel flag (client gone, timeout, shutdown) between engine steps. A job's speculation
knobs (policy, max depth, tree budget) travel in `job.config.speculation`; the shared engine and
drafter are never changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Union

from PIL import Image

from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.errors import ContextLengthError
from vlmspec.factory import plain_engine
from vlmspec.inputs import encode_messages
from vlmspec.text import TextEvent, TextGeneration, stream_text

from .metrics import Metrics
from .protocol import APIError, cancelled, internal, queue_full, shutting_down
from .settings import ServerSettings

logger = logging.getLogger("vlmspec.server")

# a SpecEngine (its plain twin is made here), a (speculative, plain) pair, or a zero-argument callable
# returning either (called on the worker thread when the service starts)
Engines = Union[SpecEngine, tuple[SpecEngine, SpecEngine], Callable[[], Any]]


@dataclass
class Job:
    messages: list[dict[str, Any]]  # HF chat-template messages
    images: list[Image.Image]
    config: GenerationConfig
    speculative: bool
    deadline: float  # time.monotonic()
    loop: asyncio.AbstractEventLoop
    inbox: asyncio.Queue
    stop: tuple[str, ...] = ()  # stop strings
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    submitted: float = field(default_factory=time.monotonic)
    cancel_reason: str | None = None  # "disconnect" | "timeout" | "shutdown"
    finished: bool = False

    @classmethod
    def on_loop(cls, messages: list[dict[str, Any]], images: list[Image.Image], config: GenerationConfig, *,
                speculative: bool, timeout_s: float, stop: tuple[str, ...] = ()) -> "Job":
        """A job whose messages arrive on the running event loop (call it from a coroutine)."""
        return cls(messages, images, config, speculative, time.monotonic() + timeout_s, asyncio.get_running_loop(),
                   asyncio.Queue(), stop=stop)

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

    async def receive(self, timeout_s: float) -> tuple[str, Any]:
        """The next message; ("error", a 504 APIError) once the deadline has passed (`timeout_s` is
        what the message says the limit was)."""
        remaining = self.deadline - time.monotonic() + 0.5  # the worker enforces the deadline first
        try:
            return await asyncio.wait_for(self.inbox.get(), timeout=max(remaining, 0.01))
        except asyncio.TimeoutError:
            self.cancel("timeout")
            return "error", cancelled("timeout", timeout_s)


class Service:
    """One worker thread that owns the engines; a bounded queue in front of it."""

    def __init__(self, engines: Engines, settings: ServerSettings, metrics: Metrics) -> None:
        self._source = engines
        self.settings = settings
        self.metrics = metrics
        self.spec: SpecEngine | None = None
        self.plain: SpecEngine | None = None
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
        src = self._source
        if callable(src) and not isinstance(src, (SpecEngine, tuple, list)):
            src = src()
        spec, plain = src if isinstance(src, (tuple, list)) else (src, plain_engine(src))
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
            job.fail(shutting_down())
        if self._thread is None:
            return
        self.queue.put(None)
        self._thread.join(grace_s)
        if self._thread.is_alive():
            current = self.current
            if current is not None:
                current.cancel("shutdown")
            self._thread.join(10.0)

    # -------------------------------------------------------------- what the routes and the UI read
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.closing

    @property
    def drafter_name(self) -> str:
        return self.spec.drafter.name if self.spec is not None else "?"

    @property
    def _tree(self):
        """The speculative drafter's default tree (None: no tree, or not loaded yet)."""
        return self.spec.drafter.tree if self.spec is not None else None

    @property
    def tree_total_tokens(self) -> int | None:
        """The speculative drafter's tree size; None when it has no tree (or is not loaded yet)."""
        return self._tree.total_tokens if self._tree is not None else None

    @property
    def tree_depth(self) -> int | None:
        """The speculative drafter's tree depth (the deepest a request may draft); None without a tree."""
        return self._tree.depth if self._tree is not None else None

    @property
    def default_policy(self) -> str:
        """The speculation policy a request that names none gets."""
        return self.spec.speculation.policy().name if self.spec is not None else "?"

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise APIError: 503 when shutting down, 429 (with Retry-After) when full."""
        with self._lock:
            if self.closing or not self.alive:
                self.metrics.rejected.labels("shutting_down").inc()
                raise shutting_down(retry_after=True)
            full = self.settings.max_queue == 0 and self.current is not None
            if not full:
                try:
                    self.queue.put_nowait(job)
                except queue.Full:
                    full = True
            if full:
                self.metrics.rejected.labels("queue_full").inc()
                raise queue_full(self.settings.max_queue, self.retry_after_s())
            self.metrics.queue_depth.set(self.queue.qsize())

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self._ema_s * (self.queue.qsize() + 1)))

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
            self._run_one(job)
        # stop() drained the queue before the sentinel; anything that slipped in is failed cleanly
        for job in self._drain_queue():
            job.fail(shutting_down())

    def _run_one(self, job: Job) -> None:
        self.current = job
        self.metrics.inflight.set(1)
        t0 = time.monotonic()
        try:
            self._process(job)
        except BaseException:  # never let the worker die
            logger.exception("worker: unexpected failure")
            job.fail(internal())
        finally:
            self.current = None
            self.metrics.inflight.set(0)
            self.stats["processed"] += 1
            self._ema_s = 0.8 * self._ema_s + 0.2 * (time.monotonic() - t0)

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

    def _check_deadline(self, job: Job) -> bool:
        """Whether the job must stop now (cancelled, or past its deadline)."""
        if job.cancel_reason is None and time.monotonic() > job.deadline:
            job.cancel("timeout")
        return job.cancel_reason is not None

    def _cancelled(self, job: Job, gen: TextGeneration | None = None) -> None:
        reason = job.cancel_reason or "timeout"
        if gen is not None:
            with contextlib.suppress(Exception):
                gen.close()
        self.stats["cancelled"] += 1
        self.metrics.cancelled.labels(reason).inc()
        job.fail(cancelled(reason, self.settings.request_timeout_s))

    def _failed(self, job: Job, err: APIError) -> None:
        self.stats["failed"] += 1
        job.fail(err)

    def _process(self, job: Job) -> None:
        self.metrics.queue_wait.observe(time.monotonic() - job.submitted)
        if self._check_deadline(job):
            self._cancelled(job)
            return
        opened = self._prefill(job)
        if opened is not None:
            self._decode(job, *opened)

    def _prefill(self, job: Job) -> tuple[TextGeneration, Iterator[TextEvent], TextEvent | None] | None:
        """Encode the conversation and run the prefill (the first event); None when it failed (reported)."""
        engine = self.spec if job.speculative else self.plain
        try:
            inputs = encode_messages(engine.target, job.messages, job.images)
            gen = stream_text(engine, inputs, job.config, job.stop)
            events = iter(gen)
            first = next(events, None)  # prefill + the first token
        except ContextLengthError as exc:
            self._failed(job, APIError(400, str(exc), param="messages", code="context_length_exceeded"))
            return None
        except ValueError as exc:  # the processor refused this input (an odd image, ...)
            self._failed(job, APIError(400, f"the input could not be processed: {exc}", param="messages", code="invalid_input"))
            return None
        except Exception:
            logger.exception("worker: prefill failed")
            self._failed(job, internal("internal error during prefill"))
            return None
        self.metrics.ttft.labels(job.mode).observe(time.monotonic() - job.submitted)
        job.post("start", int(inputs["input_ids"].shape[1]))
        return gen, events, first

    def _decode(self, job: Job, gen: TextGeneration, events: Iterator[TextEvent], event: TextEvent | None) -> None:
        """Post each event until the generation ends or the job is cancelled, then the Completion."""
        generated = self.metrics.generated_tokens.labels(job.mode)
        try:
            while event is not None:
                if event.step is not None:
                    generated.inc(len(event.step.token_ids))
                job.post("event", event)
                if self._check_deadline(job):  # checked between engine steps
                    self._cancelled(job, gen)
                    return
                event = next(events, None)
        except Exception:
            logger.exception("worker: generation failed")
            self._failed(job, internal("internal error during generation"))
            return
        completion = gen.completion
        assert completion is not None
        self.metrics.record_result(job.mode, completion.finish_reason, completion.result)
        self.stats["completed"] += 1
        job.post("done", completion)
