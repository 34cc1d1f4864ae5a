"""The worker: one thread owns the engine and decodes up to `max_batch` requests together
(continuous batching); a bounded queue in front.

    job = Job.on_loop(messages, images, config, speculative=True, timeout_s=60, stop=("\\n\\n",))
    service.submit(job)              # APIError 429 (queue full) / 503 (shutting down)
    kind, payload = await job.receive(timeout_s)

A job's messages, from the worker thread to the event loop, in order:
``("start", prompt_tokens: int)`` once it has joined the batch (prefill done), ``("event", TextEvent)``
per engine step, then ``("done", Completion)`` or ``("error", APIError)`` (an error may also come first).

The worker loop: take waiting jobs while the batch has free slots (each is encoded
(`vlmspec.inputs.encode_messages`), checked against the context (a 400 when prompt + max_tokens
cannot fit, never a truncated answer) and prefilled into a free slot: `Batch.add`), then run ONE
`Batch.step` over every request in the batch and hand each its events through its own
`vlmspec.text.TextStream` (detokenization, stop strings). A request leaves the batch at once when
it finishes (EOS, max tokens, a stop string), when its client goes away or when its deadline
passes (checked between steps); its slot takes the next waiting job before the next step.

Everything a request asks for travels in its own `GenerationConfig` (sampling, seed, speculation
policy, max depth, tree budget) and stop strings, so requests with different options share a batch;
the shared engine and drafter are never changed. A plain request (``"speculative": false``) is a
row of the same batch that never drafts (`SpeculationOptions(max_depth=0)`): its tokens are those
of plain decoding, and its result says policy "none" with no depths, as plain decoding reports.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

from PIL import Image

from vlmspec.control import SpeculationOptions
from vlmspec.engine import Batch, GenerationConfig, GenerationResult, SpecEngine, StepEvent
from vlmspec.errors import ConfigError, ContextLengthError
from vlmspec.inputs import encode_messages
from vlmspec.openmp import release_thread_pool
from vlmspec.text import TextStream

from .metrics import Metrics
from .protocol import APIError, cancelled, internal, queue_full, shutting_down
from .settings import ServerSettings

logger = logging.getLogger("vlmspec.server")

TRIM_EVERY = 32  # requests between returns of freed heap memory to the system


def _libc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another C library, another system)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def release_free_memory() -> None:
    """Hand the heap memory freed by finished requests back to the system (glibc keeps it in its
    arenas otherwise: tensors of every prompt length, freed from several threads, leave holes, and a
    long-running service's resident memory creeps up although nothing is alive: the soak,
    `vlmspec bench soak`, measures it). A no-op where malloc_trim is not available."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)

# a SpecEngine, a (speculative, plain) pair (both over one Target; plain requests run as rows of the
# speculative engine's batch that never draft, so the plain engine is only checked), or a
# zero-argument callable returning either (called on the worker thread when the service starts)
Engines = Union[SpecEngine, tuple[SpecEngine, SpecEngine], Callable[[], Any]]
PLAIN = SpeculationOptions(policy="fixed", max_depth=0)  # a plain request's row: never drafts


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
    max_tokens_given: bool = True  # False: config.max_new_tokens is the server's default (clamped to the context left)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    submitted: float = field(default_factory=time.monotonic)
    cancel_reason: str | None = None  # "disconnect" | "timeout" | "shutdown"
    finished: bool = False

    @classmethod
    def on_loop(cls, messages: list[dict[str, Any]], images: list[Image.Image], config: GenerationConfig, *,
                speculative: bool, timeout_s: float, stop: tuple[str, ...] = (), max_tokens_given: bool = True) -> "Job":
        """A job whose messages arrive on the running event loop (call it from a coroutine)."""
        return cls(messages, images, config, speculative, time.monotonic() + timeout_s, asyncio.get_running_loop(),
                   asyncio.Queue(), stop=stop, max_tokens_given=max_tokens_given)

    @property
    def mode(self) -> str:
        return "speculative" if self.speculative else "plain"

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None and not self.finished:
            self.cancel_reason = reason

    def expired(self) -> bool:
        """Whether the job must stop now (cancelled, or past its deadline: then cancelled as "timeout")."""
        if self.cancel_reason is None and time.monotonic() > self.deadline:
            self.cancel("timeout")
        return self.cancel_reason is not None

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


@dataclass
class _Row:
    """A job decoding in the batch: its engine request and its text."""

    job: Job
    req: Any  # the engine's request (what `Batch.add` returned)
    text: TextStream
    joined: float  # time.monotonic() when it joined the batch
    last_emit: float | None = None  # when it last emitted tokens (None: not yet; its first event carries the prefill's token)


def context_error(prompt_tokens: int, max_tokens: int, limit: int) -> APIError:
    """The 400 for a request that cannot fit the model's context (as vLLM words it)."""
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                         f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
                         f"Please reduce the length of the messages or the completion (max_tokens).",
                    param="messages" if prompt_tokens >= limit else "max_tokens", code="context_length_exceeded")


def fitted(config: GenerationConfig, prompt_tokens: int, limit: int, max_tokens_given: bool) -> GenerationConfig:
    """`config` if prompt + max tokens fit the context `limit`; a request that gave no max_tokens has
    the server's default lowered to the context left; otherwise the 400 `context_error`."""
    room = limit - prompt_tokens
    if config.max_new_tokens <= room:
        return config
    if not max_tokens_given and room >= 1:
        return dataclasses.replace(config, max_new_tokens=room)
    raise context_error(prompt_tokens, config.max_new_tokens, limit)


class Service:
    """One worker thread that owns the engine and its batch; a bounded queue in front of it."""

    def __init__(self, engines: Engines, settings: ServerSettings, metrics: Metrics) -> None:
        if not callable(engines):  # built on this thread, run on the worker's: this thread's OpenMP pool goes (vlmspec.openmp)
            release_thread_pool()
        self._source = engines
        self.settings = settings
        self.metrics = metrics
        self.spec: SpecEngine | None = None
        self.max_batch = settings.max_batch  # 1 for a model that decodes one request at a time (set at start)
        self._batch: Batch | None = None
        self._waiting: deque[Job] = deque()
        self._rows: list[_Row] = []  # the batch's jobs (changed by the worker thread, under the lock)
        self._admitting = 0  # jobs taken from the queue, not yet in the batch
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.closing = False
        self.started_at = int(time.time())
        self.stats = {"completed": 0, "failed": 0, "cancelled": 0, "processed": 0}
        self._ema_s = 1.0  # smoothed seconds a request spends in the batch, for Retry-After

    # -------------------------------------------------------------- lifecycle
    def _resolve_engine(self) -> None:
        src = self._source
        if callable(src) and not isinstance(src, (SpecEngine, tuple, list)):
            src = src()
        spec = src[0] if isinstance(src, (tuple, list)) else src
        if isinstance(src, (tuple, list)) and src[1].target is not spec.target:
            raise ValueError("the speculative and plain engines must share one Target")
        slots = self.settings.max_batch
        if slots > 1:
            try:
                spec.target.check_batching()
            except ConfigError as exc:
                logger.warning("%s The service runs one request at a time (max_batch 1).", exc)
                slots = 1
        self.spec, self.max_batch = spec, slots
        self._batch = spec.batch(slots)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="vlmspec-worker", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise RuntimeError(f"the engines could not be created: {self._start_error}") from self._start_error

    def stop(self, grace_s: float | None = None) -> None:
        """Refuse new work, fail what is queued (503), let the running generations finish for up to
        `grace_s`, then cancel them."""
        grace_s = self.settings.shutdown_grace_s if grace_s is None else grace_s
        with self._cond:
            if self.closing:  # already stopped (or stopping)
                return
            self.closing = True
            drained = list(self._waiting)
            self._waiting.clear()
            self.metrics.queue_depth.set(0)
            self._cond.notify_all()
        for job in drained:
            self._cancel_waiting(job, "shutdown")
        if self._thread is None:
            return
        self._thread.join(grace_s)
        if self._thread.is_alive():
            for row in list(self._rows):
                row.job.cancel("shutdown")
            self._thread.join(10.0)

    # -------------------------------------------------------------- what the routes and the UI read
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.closing

    @property
    def active(self) -> int:
        """Requests in the batch (joining ones included)."""
        return len(self._rows) + self._admitting

    @property
    def waiting(self) -> int:
        """Requests in the queue, waiting for a free slot."""
        return len(self._waiting)

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
        """Queue `job`, or raise APIError: 503 when shutting down, 429 (with Retry-After) when the
        batch and the queue are full."""
        with self._cond:
            if self.closing or not self.alive:
                self.metrics.rejected.labels("shutting_down").inc()
                raise shutting_down(retry_after=True)
            if self.waiting + self.active >= self.max_batch + self.settings.max_queue:
                self.metrics.rejected.labels("queue_full").inc()
                raise queue_full(self.settings.max_queue, self.retry_after_s())
            self._waiting.append(job)
            self.metrics.queue_depth.set(self.waiting)
            self._cond.notify()

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self._ema_s * (self.waiting + 1) / self.max_batch))

    # -------------------------------------------------------------- the worker thread
    def _main(self) -> None:
        try:
            self._resolve_engine()
        except BaseException as exc:  # reported to start()
            logger.exception("engine creation failed")
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        while True:
            jobs = self._take()
            if jobs is None:
                break
            for job in jobs:
                self._admit(job)
            if self._rows:
                self._step()
        with self._cond:  # stop() drained the queue; anything that slipped in is failed cleanly
            left, self._waiting = list(self._waiting), deque()
        for job in left:
            job.fail(shutting_down())

    def _take(self) -> list[Job] | None:
        """The waiting jobs that fit the batch's free slots (waits for one while the batch is empty);
        None once the service is closing and the batch has drained. Waiting jobs that were cancelled
        or timed out leave the queue here."""
        with self._cond:
            while True:
                for job in [j for j in self._waiting if j.expired()]:
                    self._waiting.remove(job)
                    self._cancel_waiting(job, job.cancel_reason or "timeout")
                if self._rows or self._waiting or self.closing:
                    break
                release_thread_pool()  # idle: another service's worker in this process gets the cores (vlmspec.openmp)
                self._cond.wait()
            if self.closing and not self._rows:
                return None
            jobs = [self._waiting.popleft() for _ in range(min(self.max_batch - len(self._rows), len(self._waiting)))]
            self._admitting = len(jobs)
            self.metrics.queue_depth.set(self.waiting)
            return jobs

    def _admit(self, job: Job) -> None:
        """Encode the conversation, check it fits, prefill it into a free slot; on failure the job is answered."""
        try:
            if job.expired():
                self._cancel_waiting(job, job.cancel_reason or "timeout")
                return
            self.metrics.queue_wait.observe(time.monotonic() - job.submitted)
            try:
                row = self._join(job)
            except APIError as err:
                self._failed(job, err)
                return
            except ContextLengthError as exc:
                self._failed(job, APIError(400, str(exc), param="messages", code="context_length_exceeded"))
                return
            except ValueError as exc:  # the processor refused this input (an odd image, ...)
                self._failed(job, APIError(400, f"the input could not be processed: {exc}", param="messages", code="invalid_input"))
                return
            except Exception:
                logger.exception("worker: prefill failed")
                self._failed(job, internal("internal error during prefill"))
                return
            with self._cond:
                self._rows.append(row)
            self.metrics.inflight.set(len(self._rows))
            job.post("start", row.req.prompt_tokens)
        finally:
            with self._cond:
                self._admitting -= 1

    def _join(self, job: Job) -> _Row:
        """The job's request in a free slot of the batch (prefilled), or an error (raised)."""
        assert self.spec is not None and self._batch is not None
        target = self.spec.target
        inputs = encode_messages(target, job.messages, job.images)
        config = fitted(job.config, int(inputs["input_ids"].shape[1]), target.max_positions, job.max_tokens_given)
        if not job.speculative:  # a row that never drafts: plain decoding's tokens, in the same batch
            config = dataclasses.replace(config, speculation=PLAIN, policy=None, tree=None)
        before = dict(self._batch.timings)
        ticket = self._batch.submit(inputs, config)
        self._batch.admit()  # the batch's own admission, now (the worker takes no more jobs than it has free slots)
        self.metrics.record_engine_time(before, self._batch.timings)
        if ticket.error is not None:
            raise ticket.error
        req = ticket.request
        assert req is not None
        return _Row(job, req, TextStream(target.tokenizer, job.stop), time.monotonic())

    def _step(self) -> None:
        """One engine step over the batch; each row's events to its job; rows that are done leave."""
        assert self._batch is not None
        size = len(self._rows)
        self.metrics.batch_size.observe(size)
        waits, before = self._batch.draft_waits, dict(self._batch.timings)
        try:
            events = self._batch.step()
        except Exception:
            logger.exception("worker: batch step failed")
            self._reset_batch()
            return
        self.metrics.draft_waits.inc(self._batch.draft_waits - waits)
        self.metrics.record_engine_time(before, self._batch.timings)
        rows = {id(r.req): r for r in self._rows}
        now = time.monotonic()
        for req, event in events:
            row = rows[id(req)]
            if not row.text.stopped:  # a stop string ends the text: later tokens of the step are not shown
                self._emit(row, event, size, now)
        for row in list(self._rows):
            self._settle(row)
        self.metrics.inflight.set(len(self._rows))

    def _emit(self, row: _Row, event: StepEvent, batch_size: int, now: float) -> None:
        job, n = row.job, len(event.token_ids)
        if row.last_emit is None:  # the prefill's token
            self.metrics.ttft.labels(job.mode).observe(now - job.submitted)
        else:
            if job.speculative:
                self.metrics.depth.labels(row.req.policy, str(batch_size)).observe(event.depth)
            if n:
                gap = (now - row.last_emit) / n
                itl = self.metrics.inter_token_latency.labels(job.mode)
                for _ in range(n):
                    itl.observe(gap)
        if n:
            row.last_emit = now
            self.metrics.generated_tokens.labels(job.mode).inc(n)
        job.post("event", row.text.push(event))

    def _settle(self, row: _Row) -> None:
        """After a step: a row that finished, hit a stop string, was cancelled or timed out leaves the batch."""
        assert self._batch is not None
        job, req = row.job, row.req
        if req.result is None:
            if not row.text.stopped and not job.expired():
                return
            self._batch.cancel(req)
            if not row.text.stopped:
                self._leave(row)
                self._cancelled(job)
                return
        self._leave(row)
        result: GenerationResult = req.result
        if not job.speculative:  # plain decoding chooses no depth
            result = dataclasses.replace(result, policy="none", depths=[])
        tail, completion = row.text.finish(result)
        if tail is not None:
            job.post("event", tail)
        self.metrics.record_result(job.mode, completion.finish_reason, result)
        self.stats["completed"] += 1
        job.post("done", completion)

    def _leave(self, row: _Row) -> None:
        with self._cond:
            self._rows.remove(row)
        self.stats["processed"] += 1
        self._ema_s = 0.8 * self._ema_s + 0.2 * (time.monotonic() - row.joined)
        self.metrics.record_spec(row.job.mode, row.req.result.stats)
        if self.stats["processed"] % TRIM_EVERY == 0:
            release_free_memory()

    def _reset_batch(self) -> None:
        """After a failed step: every row gets a 500 and the batch starts afresh (its cache may be half written)."""
        assert self.spec is not None
        for row in list(self._rows):
            with self._cond:
                self._rows.remove(row)
            self.stats["processed"] += 1
            self._failed(row.job, internal("internal error during generation"))
        self._batch = self.spec.batch(self.max_batch)
        self.metrics.inflight.set(0)

    def _cancel_waiting(self, job: Job, reason: str) -> None:
        job.cancel(reason)
        self._cancelled(job)

    def _cancelled(self, job: Job) -> None:
        reason = job.cancel_reason or "timeout"
        self.stats["cancelled"] += 1
        self.metrics.cancelled.labels(reason).inc()
        job.fail(cancelled(reason, self.settings.request_timeout_s))

    def _failed(self, job: Job, err: APIError) -> None:
        self.stats["failed"] += 1
        job.fail(err)
