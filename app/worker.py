"""The worker: one thread owns the engine and decodes up to `max_batch` requests together
(continuous batching); a bounded queue (`Job`s, app/job.py) in front.

The loop: take waiting jobs while the batch has free slots (each joins: `rows.Row.join`), then run
ONE `Batch.step` over every request in the batch and hand each its events (`Row.emit`). A request
leaves the batch at once when it finishes (EOS, max tokens, a stop string), when its client goes
away or when its deadline passes (checked between steps); its slot takes the next waiting job
before the next step.

Failures stay with the request they belong to. What serving one request raises (its prefill, its
drafter, its detokenizer or stop strings) ends that request alone with a 500 naming its id, logged
with the traceback under that id; the other rows go on untouched. What the batched step raises
belongs to no one request: each row of the batch gets a 500 and the batch starts afresh. Should the
thread die anyway, `health()` says why (/healthz answers 503, Ray's health check fails).
`stop()` drains: new requests get 503, the accepted ones finish within the grace period.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Union

from vlmspec.engine import Batch, GenerationConfig, SpecEngine
from vlmspec.errors import ConfigError
from vlmspec.memory import release_free_memory
from vlmspec.openmp import release_thread_pool

from .job import Job
from .metrics import Metrics
from .protocol import APIError, cancelled, internal, queue_full, shutting_down, unavailable
from .rows import Row
from .settings import DEFAULT_MAX_MODEL_LEN, ServerSettings

logger = logging.getLogger("vlmspec.server")

TRIM_EVERY = 32  # requests between returns of freed heap memory to the system (`vlmspec.memory.release_free_memory`)

# a SpecEngine, or a zero-argument callable returning one (called on the worker thread when the
# service starts); plain requests are rows of its batch that never draft
EngineSource = Union[SpecEngine, Callable[[], SpecEngine]]


class Service:
    """One worker thread that owns the engine and its batch; a bounded queue in front of it."""

    def __init__(self, engine: EngineSource, settings: ServerSettings, metrics: Metrics) -> None:
        if isinstance(engine, SpecEngine):  # built on this thread, run on the worker's: this thread's OpenMP pool goes (vlmspec.openmp)
            release_thread_pool()
        self._source = engine
        self.settings, self.metrics = settings, metrics
        self.spec: SpecEngine | None = None
        self.max_batch = settings.max_batch  # 1 for a model that decodes one request at a time (set at start)
        self._batch: Batch | None = None
        self.max_model_len = self.slot_entries = 0  # set with the engine: the KV pool's size (`pool`)
        self._waiting: deque[Job] = deque()
        self._rows: list[Row] = []  # the batch's jobs (changed by the worker thread, under the lock)
        self._joining: list[Job] = []  # jobs taken from the queue, not yet in the batch
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.closing = False
        self.failure: str | None = None  # why the worker thread died (None: it did not)
        self.started_at = int(time.time())
        self.stats = {"completed": 0, "failed": 0, "cancelled": 0, "processed": 0}
        self._ema_s = 1.0  # smoothed seconds a request spends in the batch, for Retry-After

    # -------------------------------------------------------------- lifecycle
    def _resolve_engine(self) -> None:
        spec = self._source if isinstance(self._source, SpecEngine) else self._source()
        slots = self.settings.max_batch
        if slots > 1:
            try:
                spec.target.check_batching()
            except ConfigError as exc:
                logger.warning("%s The service runs one request at a time (max_batch 1).", exc)
                slots = 1
        self.spec, self.max_batch = spec, slots
        self.max_model_len = min(self.settings.max_model_len or DEFAULT_MAX_MODEL_LEN, spec.target.max_positions)
        self.slot_entries = self.max_model_len + spec.tree_room(GenerationConfig())  # a request asking a larger tree gets a 400
        self._batch = self._new_batch()
        logger.info("KV pool: %d slots x %d entries (requests up to %d tokens, prompt + answer: --max-model-len), allocated at "
                    "the first request and never grown", slots, self.slot_entries, self.max_model_len)

    def _new_batch(self) -> Batch:
        assert self.spec is not None
        return self.spec.batch(self.max_batch, capacity=self.slot_entries)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="vlmspec-worker", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise RuntimeError(f"the engine could not be created: {self._start_error}") from self._start_error

    def stop(self, grace_s: float | None = None, cut: threading.Event | None = None) -> None:
        """Drain and stop: new requests get 503 from now on; the accepted ones (in the batch and
        queued) go on for up to `grace_s` (or until `cut` is set); what is left then is cancelled
        (503). Returns once the worker thread has ended."""
        grace_s = self.settings.shutdown_grace_s if grace_s is None else grace_s
        self.close()
        if self._thread is None:
            return
        deadline = time.monotonic() + grace_s
        while self._thread.is_alive() and time.monotonic() < deadline and not (cut is not None and cut.is_set()):
            self._thread.join(min(0.05, max(deadline - time.monotonic(), 0.0)))
        if self._thread.is_alive():
            self.cancel_all("shutdown")
            self._thread.join(10.0)

    def close(self) -> None:
        """Refuse new requests from now on (503); the accepted ones go on, and the worker thread ends
        once each has its answer."""
        with self._cond:
            self.closing = True
            self._cond.notify_all()

    def cancel_all(self, reason: str) -> None:
        """Cancel every accepted request (the worker answers each between two steps)."""
        with self._cond:
            for job in [r.job for r in self._rows] + self._joining + list(self._waiting):
                job.cancel(reason)
            self._cond.notify_all()

    # -------------------------------------------------------------- what the routes and the UI read
    def broken(self) -> str | None:
        """Why the worker cannot serve although nobody stopped it (None: it serves, or it is stopping)."""
        if self.failure is not None:
            return f"the worker thread died: {self.failure}"
        if not self.closing and (self._thread is None or not self._thread.is_alive()):
            return "the worker thread is not running"
        return None

    def health(self) -> str | None:
        """None while the worker serves; otherwise why not (what /healthz says with its 503)."""
        return self.broken() or ("shutting down: new requests get 503, the accepted ones are finishing" if self.closing else None)

    @property
    def active(self) -> int:
        """Requests in the batch (joining ones included)."""
        return len(self._rows) + len(self._joining)

    @property
    def waiting(self) -> int:
        """Requests in the queue, waiting for a free slot."""
        return len(self._waiting)

    def pool(self) -> dict[str, int] | None:
        """The KV pool's size and use (None before the engine is loaded): /healthz and /metrics."""
        batch = self._batch
        if batch is None:
            return None
        live = list(batch.requests)
        return {"slots": self.max_batch, "entries_per_slot": self.slot_entries, "max_model_len": self.max_model_len,
                "used_slots": len(live), "used_entries": sum(r.state.seq_len for r in live), "bytes": batch.cache.nbytes()}

    def drafter_metrics(self) -> dict[str, Any] | None:
        """The counters of a drafter that keeps its own (`suffix`, `hybrid`): /metrics reads them."""
        read = getattr(self.spec.drafter, "metrics", None) if self.spec is not None else None
        return read() if read is not None else None

    @property
    def drafter_name(self) -> str:
        return self.spec.drafter.name if self.spec is not None else "?"

    @property
    def tree_total_tokens(self) -> int | None:
        """The speculative drafter's tree size; None when it has no tree (or is not loaded yet)."""
        tree = self.spec.drafter.tree if self.spec is not None else None
        return tree.total_tokens if tree is not None else None

    @property
    def tree_depth(self) -> int | None:
        """The speculative drafter's tree depth (the deepest a request may draft); None without a tree."""
        tree = self.spec.drafter.tree if self.spec is not None else None
        return tree.depth if tree is not None else None

    @property
    def default_policy(self) -> str:
        """The speculation policy a request that names none gets."""
        return self.spec.speculation.policy().name if self.spec is not None else "?"

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise APIError: 503 when shutting down (or the worker is gone), 429 (with
        Retry-After) when the batch and the queue are full."""
        with self._cond:
            if (why := self.broken()) is not None:
                self.metrics.rejected.labels("unavailable").inc()
                raise unavailable(why)
            if self.closing:
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
        try:
            while (jobs := self._take()) is not None:
                for job in jobs:
                    self._admit(job)
                if self._rows:
                    self._step()
        except Exception as exc:  # the thread's last resort: what no request's or batch's boundary took stops it, said (health)
            self._died(exc)

    def _take(self) -> list[Job] | None:
        """The waiting jobs that fit the batch's free slots (waits for one while the batch is empty);
        None once the service is closing and every accepted job has been answered. Waiting jobs that
        were cancelled or timed out leave the queue here."""
        with self._cond:
            while True:
                for job in [j for j in self._waiting if j.expired()]:
                    self._waiting.remove(job)
                    self._cancelled(job)
                if self._rows or self._waiting or self.closing:
                    break
                release_thread_pool()  # idle: another service's worker in this process gets the cores (vlmspec.openmp)
                self._cond.wait()
            if self.closing and not self._rows and not self._waiting:
                return None
            self._joining = [self._waiting.popleft() for _ in range(min(self.max_batch - len(self._rows), len(self._waiting)))]
            self.metrics.queue_depth.set(self.waiting)
            return list(self._joining)

    def _admit(self, job: Job) -> None:
        """Encode the conversation, check it fits, prefill it into a free slot; on failure the job alone is answered."""
        assert self.spec is not None and self._batch is not None
        try:
            if job.expired():
                self._cancelled(job)
                return
            self.metrics.queue_wait.observe(time.monotonic() - job.submitted)
            before = dict(self._batch.timings)
            try:
                row = Row.join(job, self.spec, self._batch)
            finally:
                self.metrics.record_engine_time(before, self._batch.timings)
            with self._cond:
                self._rows.append(row)
            self.metrics.inflight.set(len(self._rows))
            job.post("start", row.req.prompt_tokens)
            with self._isolated(row):  # the prefill's token goes out now, not after the other joiners' prefills and a step
                for event in self._batch.take_pending(row.req):
                    row.emit(event, len(self._rows), time.monotonic(), self.metrics)
        except APIError as err:  # a 400 of the request's own (its input, its context)
            self.stats["failed"] += 1
            job.fail(err)
        except Exception as exc:  # the isolation boundary of one request's admission: it alone ends (a 500 naming it)
            self._fail(job, "prefill", exc)
        finally:
            with self._cond:
                self._joining.remove(job)

    def _step(self) -> None:
        """One engine step over the batch; each row's events to its job; rows that are done leave."""
        assert self._batch is not None
        try:
            size = len(self._rows)
            self.metrics.batch_size.observe(size)
            waits, before = self._batch.draft_waits, dict(self._batch.timings)
            events = self._batch.step()
            self.metrics.draft_waits.inc(self._batch.draft_waits - waits)
            self.metrics.record_engine_time(before, self._batch.timings)
            rows, now = {id(r.req): r for r in self._rows}, time.monotonic()
            for req, event in events:
                row = rows[id(req)]
                if row in self._rows and not row.text.stopped:  # a stop string ends the text: later tokens are not shown
                    with self._isolated(row):
                        row.emit(event, size, now, self.metrics)
            for row in list(self._rows):
                with self._isolated(row):
                    self._settle(row)
            self.metrics.inflight.set(len(self._rows))
        except Exception as exc:  # the isolation boundary of the batch: the batched step failed, for no one request
            self._reset_batch(exc)

    @contextlib.contextmanager
    def _isolated(self, row: Row) -> Iterator[None]:
        try:
            yield
        except Exception as exc:  # the isolation boundary of one request's output (detokenizer, stop strings, result)
            self._fail(row.job, "output", exc)

    def _settle(self, row: Row) -> None:
        """After a step: a row that finished, hit a stop string, failed, was cancelled or timed out leaves the batch."""
        assert self._batch is not None
        job, req = row.job, row.req
        if req.failure is not None:  # the step failed for this request alone; the engine took it out
            self._fail(job, req.failure.stage, req.failure.error)
            return
        if req.result is None:
            if not row.text.stopped and not job.expired():
                return
            self._batch.cancel(req)
            if not row.text.stopped:
                self._leave(row)
                self._cancelled(job)
                return
        self._leave(row)
        row.finish(self.metrics)
        self.stats["completed"] += 1

    def _leave(self, row: Row) -> None:
        with self._cond:
            self._rows.remove(row)
        self.stats["processed"] += 1
        self._ema_s = 0.8 * self._ema_s + 0.2 * (time.monotonic() - row.joined)
        self.metrics.record_spec(row.job.mode, row.req.result.stats)
        if self.stats["processed"] % TRIM_EVERY == 0:
            release_free_memory()

    # -------------------------------------------------------------- failures
    def _fail(self, job: Job, stage: str, exc: BaseException) -> None:
        """End one request with a 500 that names it, its traceback logged under its id; its row (if
        it has one) leaves the batch, and the other rows go on."""
        assert self._batch is not None
        row = next((r for r in self._rows if r.job is job), None)
        if row is not None:
            self._batch.cancel(row.req)
            with self._cond:
                self._rows.remove(row)
            self.stats["processed"] += 1
        logger.error("request %s failed (%s): %s: %s", job.id, stage, type(exc).__name__, exc, exc_info=exc)
        self._answer_500(job, stage)

    def _answer_500(self, job: Job, stage: str) -> None:
        if job.finished:  # answered already
            return
        self.stats["failed"] += 1
        self.metrics.failed.labels(stage).inc()
        job.fail(internal(stage, job.id))

    def _reset_batch(self, exc: Exception) -> None:
        """After the batched step failed: every row gets a 500 and the batch starts afresh (its cache may be half written)."""
        assert self.spec is not None
        with self._cond:
            rows, self._rows = self._rows, []
        logger.error("the batched step failed; the batch is reset and its requests answered with 500: %s",
                     " ".join(r.job.id for r in rows), exc_info=exc)
        self.stats["processed"] += len(rows)
        for row in rows:
            self._answer_500(row.job, "step")
        self.metrics.batch_resets.inc()
        self.metrics.inflight.set(0)
        self._batch = self._new_batch()

    def _died(self, exc: Exception) -> None:
        """The worker thread ends: `failure` says why (health), and every request it held gets a 500."""
        with self._cond:
            self.failure = f"{type(exc).__name__}: {exc}"
            jobs = [r.job for r in self._rows] + self._joining + list(self._waiting)
            self._rows, self._joining = [], []
            self._waiting.clear()
        logger.critical("the worker thread died; its requests are answered with 500: %s", " ".join(j.id for j in jobs), exc_info=exc)
        for job in jobs:
            self._answer_500(job, "worker")
        self.metrics.inflight.set(0)

    def _cancelled(self, job: Job) -> None:
        reason = job.cancel_reason or "timeout"
        self.stats["cancelled"] += 1
        self.metrics.cancelled.labels(reason).inc()
        job.fail(cancelled(reason, self.settings.request_timeout_s))
