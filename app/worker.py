"""The worker: one thread owns the engine and its batch, carries jobs in and tokens out (the queue
in front is `app.service.Service`'s). Each turn: waiting jobs join the batch while it has free
places (`rows.Row.join`), then ONE engine step, its prefill (`Batch.prefill`: pieces of long
prompts, joining prompts, under the step's token budget) and its decode round (`Batch.decode`),
each phase's tokens handed out at once (`Row.emit`); rows that are done, stopped, cancelled or past
their deadline leave. What serving one request raises ends it alone (a 500 naming its id, the
traceback logged under it); what the batched step raises answers every row with a 500 and the batch
starts afresh; should the thread die anyway, `failure` says why (/healthz: 503).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from vlmspec.engine import Batch, GenerationConfig, SpecEngine
from vlmspec.errors import ConfigError
from vlmspec.runtime.memory import release_free_memory
from vlmspec.runtime.openmp import release_thread_pool

from .job import Inbox, Job
from .metrics import Metrics
from .protocol import APIError, cancelled, internal
from .rows import Row
from .settings import DEFAULT_MAX_MODEL_LEN, ServerSettings

logger = logging.getLogger("vlmspec.server")

TRIM_EVERY = 32  # requests between returns of freed heap memory to the system (`vlmspec.runtime.memory.release_free_memory`)


class Worker:
    """The worker thread's state and loop: the engine, its batch, the rows (jobs) in it."""

    def __init__(self, inbox: Inbox, settings: ServerSettings, metrics: Metrics, engine: SpecEngine | Callable[[], SpecEngine]) -> None:
        if isinstance(engine, SpecEngine):  # built on this thread, run on the worker's: this thread's OpenMP pool goes (vlmspec.runtime.openmp)
            release_thread_pool()
        self.inbox, self.settings, self.metrics, self._source = inbox, settings, metrics, engine
        self.spec: SpecEngine | None = None
        self.max_batch = self.settings.max_batch  # 1 for a model that decodes one request at a time (set at start)
        self.batch: Batch | None = None
        self.max_model_len = self.slot_entries = 0  # set with the engine: the KV pool's size (`pool`)
        self.rows: list[Row] = []  # jobs given to the batch (changed on the worker thread, under the service's lock)
        self.joining: list[Job] = []  # jobs taken from the queue, not yet rows
        self.ready = threading.Event()
        self.start_error: BaseException | None = None
        self.failure: str | None = None  # why the worker thread died (None: it did not)
        self.stats = {"completed": 0, "failed": 0, "cancelled": 0, "processed": 0}
        self.ema_s = 1.0  # smoothed seconds a request spends in the batch, for Retry-After

    def jobs(self) -> list[Job]:  # every job the worker holds: rows, joining ones
        return [r.job for r in self.rows] + self.joining

    def run(self) -> None:
        try:
            self._resolve_engine()
        except BaseException as exc:  # reported to Service.start()
            logger.exception("engine creation failed")
            self.start_error = exc
            self.ready.set()
            return
        self.ready.set()
        try:
            while self._take():
                if self.rows:
                    self._step()
        except Exception as exc:  # the thread's last resort: what no request's or batch's boundary took stops it, said (health)
            self._died(exc)

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
        self.batch = self._new_batch()
        logger.info("KV pool: %d slots x %d entries (prompt + answer up to %d tokens: --max-model-len), fixed", slots,
                    self.slot_entries, self.max_model_len)

    def _new_batch(self) -> Batch:
        assert self.spec is not None
        return self.spec.batch(self.max_batch, capacity=self.slot_entries, prefill_chunk=self.settings.prefill_chunk,
                               prefill_first=self.settings.prefill_first)

    def _take(self) -> bool:
        """Waiting jobs join the batch while it has free places (waits for one while the batch is
        empty); False once the service is closing and every accepted job has been answered. Queued
        jobs that were cancelled or timed out leave the queue here."""
        inbox = self.inbox
        with inbox.cond:
            while True:
                for job in [j for j in inbox.queue if j.expired()]:
                    inbox.queue.remove(job)
                    self._cancelled(job)
                if self.rows or inbox.queue or inbox.closing:
                    break
                release_thread_pool()  # idle: another service's worker in this process gets the cores (vlmspec.runtime.openmp)
                inbox.cond.wait()
            if inbox.closing and not self.rows and not inbox.queue:
                return False
            self.joining = [inbox.queue.popleft() for _ in range(min(self.max_batch - len(self.rows), len(inbox.queue)))]
            self.metrics.queue_depth.set(len(inbox.queue))
        for job in list(self.joining):
            self._join(job)
        return True

    def _join(self, job: Job) -> None:
        """Encode the conversation, check it fits, queue it in the batch; on failure the job alone is answered."""
        assert self.spec is not None and self.batch is not None
        try:
            if job.expired():
                self._cancelled(job)
                return
            self.metrics.queue_wait.observe(time.monotonic() - job.submitted)
            row = Row.join(job, self.spec, self.batch)
            with self.inbox.cond:
                self.rows.append(row)
            job.post("start", row.ticket.prompt_tokens)
        except Exception as exc:  # the isolation boundary of one request's admission: it alone ends (a 400 of its own, or a 500)
            self._fail(job, "prefill", exc)
        finally:
            with self.inbox.cond:
                self.joining.remove(job)

    def _step(self) -> None:
        """One engine step: its prefill, then its decode round, each phase's events to their rows at
        once; then rows that are done leave."""
        assert self.batch is not None
        try:
            size = len(self.rows)
            self.metrics.batch_size.observe(size)
            waits, before = self.batch.draft_waits, dict(self.batch.timings)
            for phase in (self.batch.prefill, self.batch.decode):
                if phase == self.batch.decode and not self.batch.decode_due:
                    break  # prefill first: the waiting requests' prefills before the next decode round
                events = phase()
                rows, now = {id(r.req): r for r in self.rows if r.req is not None}, time.monotonic()
                for req, event in events:
                    row = rows[id(req)]
                    if not row.text.stopped:  # a stop string ends the text: later tokens are not shown
                        with self._isolated(row):
                            row.emit(event, size, now, self.metrics)
            self.metrics.draft_waits.inc(self.batch.draft_waits - waits)
            self.metrics.record_engine_time(before, self.batch.timings)
            for row in list(self.rows):
                with self._isolated(row):
                    self._settle(row)
            self.metrics.inflight.set(len(self.rows))
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
        assert self.batch is not None
        job, req = row.job, row.req
        failure = row.failure()
        if failure is not None:  # its prefill (it never took a slot) or a step failed for this request alone
            self._fail(job, *failure)
        elif req is not None and req.result is not None:
            self._leave(row)
            row.finish(self.metrics)
            self.stats["completed"] += 1
        elif row.text.stopped or job.expired():  # a stop string ended its text, or its client left / its deadline passed
            self.batch.cancel(row.ticket)
            self._leave(row)
            if req is not None and row.text.stopped:
                row.finish(self.metrics)
                self.stats["completed"] += 1
            else:
                self._cancelled(job)

    def _leave(self, row: Row) -> None:
        with self.inbox.cond:
            self.rows.remove(row)
        self.stats["processed"] += 1
        self.ema_s = 0.8 * self.ema_s + 0.2 * (time.monotonic() - row.joined)
        if row.req is not None and row.req.result is not None:
            self.metrics.record_spec(row.job.mode, row.req.result.stats)
        if self.stats["processed"] % TRIM_EVERY == 0:
            release_free_memory()

    def _fail(self, job: Job, stage: str, exc: BaseException) -> None:
        """End one request with a 500 that names it (a 400 for an APIError of its own), its traceback
        logged under its id; its row (if it has one) leaves the batch, and the other rows go on."""
        assert self.batch is not None
        row = next((r for r in self.rows if r.job is job), None)
        if row is not None:
            self.batch.cancel(row.ticket)
            self._leave(row)
        if isinstance(exc, APIError):
            self.stats["failed"] += 1
            job.fail(exc)
            return
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
        with self.inbox.cond:
            rows, self.rows = self.rows, []
        logger.error("the batched step failed; the batch is reset and its requests answered with 500: %s",
                     " ".join(r.job.id for r in rows), exc_info=exc)
        self.stats["processed"] += len(rows)
        for row in rows:
            self._answer_500(row.job, "step")
        self.metrics.batch_resets.inc()
        self.metrics.inflight.set(0)
        self.batch = self._new_batch()

    def _died(self, exc: Exception) -> None:
        """The worker thread ends: `failure` says why (health), and every request it held gets a 500."""
        with self.inbox.cond:
            self.failure = f"{type(exc).__name__}: {exc}"
            jobs = self.jobs() + list(self.inbox.queue)
            self.rows, self.joining = [], []
            self.inbox.queue.clear()
        logger.critical("the worker thread died; its requests are answered with 500: %s", " ".join(j.id for j in jobs), exc_info=exc)
        for job in jobs:
            self._answer_500(job, "worker")
        self.metrics.inflight.set(0)

    def _cancelled(self, job: Job) -> None:
        reason = job.cancel_reason or "timeout"
        self.stats["cancelled"] += 1
        self.metrics.cancelled.labels(reason).inc()
        job.fail(cancelled(reason, self.settings.request_timeout_s))
