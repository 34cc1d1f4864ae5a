"""Prometheus metrics of the service, in a per-app registry (several apps may live in one process).

The cumulative acceptance figures are `vlmspec.stats.SpecStats` added up over generations, read
through its derived `mean_accepted_length` and `acceptance_by_position` (defined there, once).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vlmspec.engine import GenerationResult
from vlmspec.stats import SpecStats

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
    "vlmspec_speculation_depth",  # histogram {policy}: the depth the controller chose, per verify forward (0: no draft)
)
MODES = ("speculative", "plain")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_SPEED_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
_DEPTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        lat = _LATENCY_BUCKETS
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
                                      buckets=_SPEED_BUCKETS, registry=r)
        self.forwards = Counter("vlmspec_target_forwards", "target forwards (prefill + verify)", ["mode"], registry=r)
        self.drafted = Counter("vlmspec_drafted_tokens", "drafted tokens sent to verification", registry=r)
        self.accepted = Counter("vlmspec_accepted_tokens", "drafted tokens accepted", registry=r)
        self.mean_accepted = Gauge("vlmspec_mean_accepted_length", "tokens per verify forward (bonus included), all requests so far", ["mode"], registry=r)
        self.acceptance = Gauge("vlmspec_acceptance_rate", "P(drafted token at this depth accepted | depth reached), all requests so far", ["position"], registry=r)
        self.depth = Histogram("vlmspec_speculation_depth", "depth chosen by the speculation controller per verify forward (0: no draft)",
                               ["policy"], buckets=_DEPTH_BUCKETS, registry=r)
        self._lock = threading.Lock()
        self._totals = {mode: SpecStats() for mode in MODES}  # all completed generations so far, per mode
        for mode in MODES:  # the series exist from the start
            self.mean_accepted.labels(mode)
            self.generated_tokens.labels(mode)
        self.queue_depth.set(0)

    def record_result(self, mode: str, finish_reason: str, result: GenerationResult) -> None:
        """A completed generation (`finish_reason` is the text layer's: a stop string counts as "stop")."""
        self.generations.labels(mode, finish_reason).inc()
        self.prompt_tokens.labels(mode).inc(result.prompt_tokens)
        self.forwards.labels(mode).inc(result.num_target_forwards)
        self.drafted.inc(result.num_drafted)
        self.accepted.inc(result.num_accepted)
        if result.elapsed_s > 0 and result.token_ids:
            self.tokens_per_s.labels(mode).observe(result.tokens_per_s)
        if mode == "speculative":
            depth = self.depth.labels(result.policy)
            for d in result.depths:
                depth.observe(d)
        with self._lock:
            self._totals[mode] += result.stats
            total = self._totals[mode]
            if total.num_drafts:
                self.mean_accepted.labels(mode).set(total.mean_accepted_length)
            overall = SpecStats()
            for stats in self._totals.values():
                overall += stats
            for d, rate in enumerate(overall.acceptance_by_position):
                self.acceptance.labels(str(d + 1)).set(rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)
