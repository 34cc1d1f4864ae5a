"""The service: a bounded queue of jobs (app/job.py) in front of one worker thread
(`app.worker.Worker`) that owns the engine and decodes up to `max_batch` requests together.

    service = Service(engine, settings, metrics); service.start()   # the engine is built on the worker's thread
    service.submit(job)          # queued, or APIError: 503 shutting down / worker gone, 429 queue full (Retry-After)
    service.health()             # None while it serves (/healthz, Ray's health check)
    service.stop(grace_s)        # drain: new requests 503, the accepted ones finish within the grace period

The routes, the demo and the Ray replica read it (`active`, `waiting`, `pool`, `engine_info`); the
worker thread alone changes the batch.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Union

from vlmspec.engine import SpecEngine

from .job import Inbox, Job
from .metrics import Metrics
from .protocol import queue_full, shutting_down, unavailable
from .settings import ServerSettings
from .worker import Worker

# a SpecEngine, or a zero-argument callable returning one (called on the worker thread when the
# service starts); plain requests are rows of its batch that never draft
EngineSource = Union[SpecEngine, Callable[[], SpecEngine]]


@dataclass(frozen=True)
class EngineInfo:
    """What /healthz, /v1/models and the demo say about the engine."""

    drafter: str = "?"
    tree_total_tokens: int | None = None  # the drafter's tree size (None: no tree)
    tree_depth: int | None = None  # the deepest a request may draft (None: no tree)
    policy: str = "?"  # the speculation policy a request that names none gets


class Service:
    """A bounded queue in front of one worker thread that owns the engine and its batch."""

    def __init__(self, engine: EngineSource, settings: ServerSettings, metrics: Metrics) -> None:
        self.settings, self.metrics = settings, metrics
        self.inbox = Inbox()  # accepted jobs waiting for a free place in the batch; `closing`
        self.started_at = int(time.time())
        self.worker = Worker(self.inbox, settings, metrics, engine)
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self.worker.run, name="vlmspec-worker", daemon=True)
        self._thread.start()
        self.worker.ready.wait()
        if self.worker.start_error is not None:
            raise RuntimeError(f"the engine could not be created: {self.worker.start_error}") from self.worker.start_error

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
        with self.inbox.cond:
            self.inbox.closing = True
            self.inbox.cond.notify_all()

    def cancel_all(self, reason: str) -> None:
        """Cancel every accepted request (the worker answers each between two steps)."""
        with self.inbox.cond:
            for job in self.worker.jobs() + list(self.inbox.queue):
                job.cancel(reason)
            self.inbox.cond.notify_all()

    # -------------------------------------------------------------- what the routes and the UI read
    def broken(self) -> str | None:
        """Why the worker cannot serve although nobody stopped it (None: it serves, or it is stopping)."""
        if self.worker.failure is not None:
            return f"the worker thread died: {self.worker.failure}"
        if not self.closing and (self._thread is None or not self._thread.is_alive()):
            return "the worker thread is not running"
        return None

    def health(self) -> str | None:
        """None while the worker serves; otherwise why not (what /healthz says with its 503)."""
        return self.broken() or ("shutting down: new requests get 503, the accepted ones are finishing" if self.closing else None)

    @property
    def closing(self) -> bool:
        """Whether the service refuses new requests (it drains or has stopped)."""
        return self.inbox.closing

    @property
    def active(self) -> int:
        """Requests given to the batch (decoding, prefilling, or waiting in it for a slot)."""
        return len(self.worker.jobs())

    @property
    def waiting(self) -> int:
        """Requests in the queue, waiting for a free place in the batch."""
        return len(self.inbox.queue)

    @property
    def max_batch(self) -> int:
        """Requests decoded together (1 for a model that decodes one request at a time: set at start)."""
        return self.worker.max_batch

    @property
    def stats(self) -> dict[str, int]:
        """Requests completed, failed, cancelled, processed (counters)."""
        return self.worker.stats

    def pool(self) -> dict[str, int] | None:
        """The KV pool's size and use (None before the engine is loaded): /healthz and /metrics."""
        worker, batch = self.worker, self.worker.batch
        if batch is None:
            return None
        live = list(batch.requests)
        return {"slots": worker.max_batch, "entries_per_slot": worker.slot_entries, "max_model_len": worker.max_model_len,
                "used_slots": len(live), "used_entries": sum(r.state.seq_len for r in live), "bytes": batch.cache.nbytes()}

    def drafter_metrics(self) -> dict[str, Any] | None:
        """The counters of a drafter that keeps its own (`suffix`, `hybrid`): /metrics reads them."""
        spec = self.worker.spec
        read = getattr(spec.drafter, "metrics", None) if spec is not None else None
        return read() if read is not None else None

    def prompt_cache_metrics(self) -> dict[str, int] | None:
        """The prompt cache's counters and bytes (None: the engine keeps none): /metrics reads them."""
        cache = self.worker.spec.prompt_cache if self.worker.spec is not None else None
        return None if cache is None else {"hits": cache.hits, "misses": cache.misses, "bytes": cache.bytes}

    def engine_info(self) -> EngineInfo:
        """The drafter, its tree and the default policy ("?" before the engine is loaded)."""
        spec = self.worker.spec
        if spec is None:
            return EngineInfo()
        tree = spec.drafter.tree
        return EngineInfo(spec.drafter.name, tree.total_tokens if tree else None, tree.depth if tree else None,
                          spec.speculation.policy().name)

    # -------------------------------------------------------------- admission
    def submit(self, job: Job) -> None:
        """Queue `job`, or raise APIError: 503 when shutting down (or the worker is gone), 429 (with
        Retry-After) when the batch and the queue are full."""
        with self.inbox.cond:
            if (why := self.broken()) is not None:
                self.metrics.rejected.labels("unavailable").inc()
                raise unavailable(why)
            if self.closing:
                self.metrics.rejected.labels("shutting_down").inc()
                raise shutting_down(retry_after=True)
            if self.waiting + self.active >= self.max_batch + self.settings.max_queue:
                self.metrics.rejected.labels("queue_full").inc()
                raise queue_full(self.settings.max_queue, self.retry_after_s())
            self.inbox.queue.append(job)
            self.metrics.queue_depth.set(self.waiting)
            self.inbox.cond.notify()

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.worker.ema_s * (self.waiting + 1) / self.max_batch))
