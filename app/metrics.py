"""Prometheus metrics of the service, in a per-app registry (several apps may live in one process).

Counters, not ratio gauges: a rate over any window is `rate(a) / rate(b)` in PromQL. The speculative
decoding counters follow vLLM's spec-decode names (`num_drafts`, `num_draft_tokens`,
`num_accepted_tokens`, `num_accepted_tokens_per_pos{position}`), prefixed `vlmspec_spec_decode_`,
and are `vlmspec.stats.SpecStats`'s counters added up over the speculative requests:

    mean accepted length (tokens per verify forward)  = 1 + rate(num_accepted_tokens) / rate(num_drafts)
    acceptance at position p (given the tree reached it) = rate(num_accepted_tokens_per_pos{position=p})
                                                         / rate(num_drafts_reaching_pos{position=p})

A "draft token" is a node of the drafted tree sent to verification (root excluded): a tree drafts several candidates
per depth, so num_accepted_tokens / num_draft_tokens is not vLLM's acceptance rate for a chain of k tokens.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vlmspec.engine import TIMING_KEYS, GenerationResult
from vlmspec.stats import SpecStats

from .protocol import FAILURE_STAGES

# every metric as exposed (counters with their `_total` suffix) -> its Prometheus type
METRICS = {
    "vlmspec_requests_total": "counter",  # {endpoint, code}: every HTTP request by status code
    "vlmspec_request_latency_seconds": "histogram",  # {endpoint}: until the last byte is sent
    "vlmspec_time_to_first_token_seconds": "histogram",  # {mode}: submit -> the first token is handed to the request
    "vlmspec_inter_token_latency_seconds": "histogram",  # {mode}: seconds per output token between two emissions
    "vlmspec_queue_wait_seconds": "histogram",  # submit -> the request joins the batch
    "vlmspec_batch_size": "histogram",  # requests decoded by one engine step
    "vlmspec_queue_depth": "gauge",  # requests waiting for a free slot
    "vlmspec_inflight_requests": "gauge",  # requests in the batch (0..max_batch)
    "vlmspec_kv_pool_entries": "gauge",  # KV entries of the pool: slots x entries per slot (--max-model-len + the tree), fixed
    "vlmspec_kv_pool_used_entries": "gauge",  # KV entries the requests in the batch hold
    "vlmspec_kv_pool_bytes": "gauge",  # bytes of the pool's buffers (0 until the first request; never grown)
    "vlmspec_rejected_requests_total": "counter",  # {reason}: queue_full, shutting_down, unavailable (the worker died)
    "vlmspec_cancelled_generations_total": "counter",  # {reason}: disconnect, timeout, shutdown
    "vlmspec_failed_requests_total": "counter",  # {stage}: requests answered 500 by where serving them failed (protocol.FAILURE_STAGES)
    "vlmspec_batch_resets_total": "counter",  # batched steps that failed for no one row: the batch started afresh
    "vlmspec_generations_total": "counter",  # {mode, finish_reason}: completed generations
    "vlmspec_prompt_tokens_total": "counter",  # {mode}
    "vlmspec_generated_tokens_total": "counter",  # {mode}: tokens emitted (cancelled ones included)
    "vlmspec_tokens_per_second": "histogram",  # {mode}: per completed generation
    "vlmspec_target_forwards_total": "counter",  # {mode}: prefill + verify forwards
    "vlmspec_spec_decode_num_drafts_total": "counter",  # verify forwards of speculative requests
    "vlmspec_spec_decode_num_draft_tokens_total": "counter",  # drafted tree nodes sent to verification
    "vlmspec_spec_decode_num_accepted_tokens_total": "counter",  # drafted tokens accepted
    "vlmspec_spec_decode_num_accepted_tokens_per_pos_total": "counter",  # {position}: accepted at each depth (0: the first drafted token)
    "vlmspec_spec_decode_num_drafts_reaching_pos_total": "counter",  # {position}: drafts whose tree reached that depth
    "vlmspec_speculation_depth": "histogram",  # {policy, batch_size}: the depth chosen per verify forward (0: no draft)
    "vlmspec_batch_draft_waits_total": "counter",  # steps whose goodput rows would have drafted, held back: that batch size's drafted steps delivered less than plain ones
    "vlmspec_engine_seconds_total": "counter",  # {phase}: the worker's seconds in the engine: prefill, draft, verify, commit, other
}
# a drafter that learns from traffic (`suffix`, `hybrid`; read from the drafter at each scrape): these exist with one only
DRAFTER_METRICS = {
    "vlmspec_suffix_proposals_total": "counter",  # suffix drafts asked for (a row's step with depth > 0)
    "vlmspec_suffix_hits_total": "counter",  # {source}: of those, drafts of >= 1 token, from the request's own text or the store
    "vlmspec_suffix_drafted_tokens_total": "counter",  # suffix tree nodes sent to verification
    "vlmspec_suffix_accepted_tokens_total": "counter",  # of those, accepted
    "vlmspec_suffix_store_tokens": "gauge",  # tokens of earlier answers held, all tenants (at most --suffix-memory)
    "vlmspec_suffix_store_tenants": "gauge",  # tenants (API keys) with answers in the store
    "vlmspec_suffix_store_evicted_tokens_total": "counter",  # tokens dropped, oldest first, to stay within --suffix-memory
    "vlmspec_hybrid_trees_total": "counter",  # {drafter}: rows of the hybrid given the suffix tree or the EAGLE head's
}
# an engine with a prompt cache (`--prompt-cache`; read from the cache at each scrape): these exist with one only
PROMPT_CACHE_METRICS = {
    "vlmspec_prompt_cache_hits_total": "counter",  # prefills served from the cache (a prompt seen before)
    "vlmspec_prompt_cache_misses_total": "counter",  # prefills run (and kept) by an engine with a cache
    "vlmspec_prompt_cache_bytes": "gauge",  # bytes it holds (at most --prompt-cache MiB)
}
METRIC_NAMES = tuple(METRICS) + tuple(DRAFTER_METRICS) + tuple(PROMPT_CACHE_METRICS)

MODES = ("speculative", "plain")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
_SPEED_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
_DEPTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        lat = _LATENCY_BUCKETS
        self.requests = Counter("vlmspec_requests", "HTTP requests by endpoint and status code", ["endpoint", "code"], registry=r)
        self.latency = Histogram("vlmspec_request_latency_seconds", "HTTP request latency (until the last byte)", ["endpoint"], buckets=lat, registry=r)
        self.ttft = Histogram("vlmspec_time_to_first_token_seconds", "submit -> the first token is handed to the request", ["mode"],
                              buckets=lat, registry=r)
        self.inter_token_latency = Histogram(
            "vlmspec_inter_token_latency_seconds", "seconds per output token between two emissions of a request (a step that emits "
            "k tokens t seconds after the previous one counts k observations of t / k)", ["mode"], buckets=_ITL_BUCKETS, registry=r)
        self.queue_wait = Histogram("vlmspec_queue_wait_seconds", "submit -> the request joins the batch", buckets=lat, registry=r)
        self.batch_size = Histogram("vlmspec_batch_size", "requests decoded together by one engine step", buckets=_BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("vlmspec_queue_depth", "requests waiting for a free slot of the batch", registry=r)
        self.inflight = Gauge("vlmspec_inflight_requests", "requests in the batch", registry=r)
        self.kv_pool_entries = Gauge("vlmspec_kv_pool_entries", "KV cache entries of the pool: slots x entries per slot, "
                                     "fixed at start-up (--max-model-len)", registry=r)
        self.kv_pool_used_entries = Gauge("vlmspec_kv_pool_used_entries", "KV cache entries the requests in the batch hold",
                                          registry=r)
        self.kv_pool_bytes = Gauge("vlmspec_kv_pool_bytes", "bytes of the KV pool's buffers (allocated at the first request, "
                                   "never grown)", registry=r)
        self.rejected = Counter("vlmspec_rejected_requests", "requests refused before queueing", ["reason"], registry=r)
        self.cancelled = Counter("vlmspec_cancelled_generations", "generations stopped early", ["reason"], registry=r)
        self.failed = Counter("vlmspec_failed_requests", "requests answered with a 500, by where serving them failed: prefill, "
                              "draft, commit, output (that request alone), step (every request of a batched step that failed), "
                              "worker (the worker thread stopped)", ["stage"], registry=r)
        self.batch_resets = Counter("vlmspec_batch_resets", "batched engine steps that failed for no one request: each request "
                                    "of the step got a 500 and the batch started afresh", registry=r)
        self.generations = Counter("vlmspec_generations", "completed generations", ["mode", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("vlmspec_prompt_tokens", "prompt tokens", ["mode"], registry=r)
        self.generated_tokens = Counter("vlmspec_generated_tokens", "generated tokens", ["mode"], registry=r)
        self.tokens_per_s = Histogram("vlmspec_tokens_per_second", "decode speed per generation", ["mode"],
                                      buckets=_SPEED_BUCKETS, registry=r)
        self.forwards = Counter("vlmspec_target_forwards", "target forwards (prefill + verify)", ["mode"], registry=r)
        self.num_drafts = Counter("vlmspec_spec_decode_num_drafts", "verify forwards of speculative requests, one proposed tree each "
                                  "(a step the controller chose depth 0 for counts, with no draft tokens): 1 + num_accepted_tokens / "
                                  "num_drafts is the mean accepted length, tokens per forward", registry=r)
        self.num_draft_tokens = Counter("vlmspec_spec_decode_num_draft_tokens", "drafted tokens sent to verification: each is a node "
                                        "of a draft tree (root excluded), several per depth, so num_accepted_tokens / num_draft_tokens "
                                        "is not vLLM's acceptance rate of a k-token chain", registry=r)
        self.num_accepted_tokens = Counter("vlmspec_spec_decode_num_accepted_tokens", "drafted tokens accepted (on the accepted path of "
                                           "their tree; the recovered or bonus token of each forward not counted)", registry=r)
        self.accepted_per_pos = Counter("vlmspec_spec_decode_num_accepted_tokens_per_pos", "drafted tokens accepted at each depth of the "
                                        "tree (position 0: the first token after the root)", ["position"], registry=r)
        self.reaching_pos = Counter("vlmspec_spec_decode_num_drafts_reaching_pos", "drafts whose tree had a node at this depth "
                                    "(position 0: the first token after the root); accepted_per_pos / this = acceptance given the depth "
                                    "was drafted", ["position"], registry=r)
        self.depth = Histogram("vlmspec_speculation_depth", "depth chosen by the speculation controller per verify forward "
                               "(0: no draft), by the number of requests in that step", ["policy", "batch_size"],
                               buckets=_DEPTH_BUCKETS, registry=r)
        self.draft_waits = Counter("vlmspec_batch_draft_waits", "engine steps whose goodput rows would have drafted but did not: at "
                                   "that batch size the batch's drafted steps had emitted fewer tokens per second than plain steps "
                                   "(vlmspec.policy.batch_control.BatchTiming)", registry=r)
        self.engine_seconds = Counter("vlmspec_engine_seconds", "seconds the worker spent in the engine, by phase: prefill (a joining "
                                      "request's prompt, alone), draft, verify (the target's forward and the acceptance), commit, "
                                      "other; the rest of the wall time it waited or served HTTP", ["phase"], registry=r)
        for mode in MODES:  # the series exist from the start
            self.generated_tokens.labels(mode)
        for phase in TIMING_KEYS:
            self.engine_seconds.labels(phase)
        for stage in FAILURE_STAGES:
            self.failed.labels(stage)
        self.queue_depth.set(0)

    def record_result(self, mode: str, finish_reason: str, result: GenerationResult) -> None:
        """A completed generation (`finish_reason` is the text layer's: a stop string counts as "stop")."""
        self.generations.labels(mode, finish_reason).inc()
        self.prompt_tokens.labels(mode).inc(result.prompt_tokens)
        self.forwards.labels(mode).inc(result.num_target_forwards)
        if result.elapsed_s > 0 and result.token_ids:
            self.tokens_per_s.labels(mode).observe(result.tokens_per_s)

    def record_spec(self, mode: str, stats: SpecStats) -> None:
        """The speculation counters of a request that left the batch (completed or cancelled);
        plain requests draft nothing and are not counted."""
        if mode != "speculative":
            return
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        for pos, (reached, accepted) in enumerate(zip(stats.reached_per_pos, stats.accepted_per_pos)):
            self.reaching_pos.labels(str(pos)).inc(reached)
            self.accepted_per_pos.labels(str(pos)).inc(accepted)

    def observe_pool(self, pool: dict[str, int] | None) -> None:
        """The KV pool's gauges from `Service.pool()` (None: no engine yet, nothing set)."""
        if pool is not None:
            self.kv_pool_entries.set(pool["slots"] * pool["entries_per_slot"])
            self.kv_pool_used_entries.set(pool["used_entries"])
            self.kv_pool_bytes.set(pool["bytes"])

    def record_engine_time(self, before: dict[str, float], after: dict[str, float]) -> None:
        """The engine's seconds between two readings of a batch's `timings` (by phase)."""
        for phase, seconds in after.items():
            if seconds > before[phase]:
                self.engine_seconds.labels(phase).inc(seconds - before[phase])

    def watch_drafter(self, read: Callable[[], dict[str, Any] | None]) -> None:
        """Expose the counters of a drafter that learns from traffic (`SuffixDrafter.metrics`, the
        hybrid's), read by `read` at each scrape (None: nothing to expose)."""
        self.registry.register(_DrafterCollector(read))

    def watch_prompt_cache(self, read: Callable[[], dict[str, int] | None]) -> None:
        """Expose the prompt cache's counters (`PromptCache`), read by `read` at each scrape."""
        self.registry.register(_PromptCacheCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PromptCacheCollector:
    """The prompt cache's hits, misses and bytes (plain ints it keeps), read per scrape."""

    def __init__(self, read: Callable[[], dict[str, int] | None]) -> None:
        self.read = read

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self.read()
        if not m:
            return
        yield CounterMetricFamily("vlmspec_prompt_cache_hits", "prefills served from the prompt cache (a prompt seen before)", m["hits"])
        yield CounterMetricFamily("vlmspec_prompt_cache_misses", "prefills run (and kept) by an engine with a prompt cache", m["misses"])
        yield GaugeMetricFamily("vlmspec_prompt_cache_bytes", "bytes the prompt cache holds (at most --prompt-cache MiB)", m["bytes"])


class _DrafterCollector:
    """The suffix drafter's own counters (plain ints it keeps) as Prometheus series, read per scrape."""

    def __init__(self, read: Callable[[], dict[str, Any] | None]) -> None:
        self.read = read

    def describe(self) -> list[Metric]:
        return []  # read at collection: the series exist only for a drafter that has them

    def collect(self) -> Iterator[Metric]:
        m = self.read()
        if not m or "proposals" not in m:
            return
        yield CounterMetricFamily("vlmspec_suffix_proposals", "suffix drafts asked for (a row's step with depth > 0)", m["proposals"])
        hits = CounterMetricFamily("vlmspec_suffix_hits", "suffix drafts of at least one token, by where the tree came from: the "
                                   "request's own prompt and answer, or the store of earlier answers", labels=["source"])
        hits.add_metric(["request"], m["hits"] - m["global_hits"])
        hits.add_metric(["store"], m["global_hits"])
        yield hits
        yield CounterMetricFamily("vlmspec_suffix_drafted_tokens", "suffix tree nodes sent to verification", m["drafted_tokens"])
        yield CounterMetricFamily("vlmspec_suffix_accepted_tokens", "suffix tree nodes accepted", m["accepted_tokens"])
        yield GaugeMetricFamily("vlmspec_suffix_store_tokens", "tokens of earlier answers held, all tenants (at most --suffix-memory)",
                                m["index_tokens"])
        yield GaugeMetricFamily("vlmspec_suffix_store_tenants", "tenants (API keys) with answers in the store", m.get("store_tenants", 0))
        yield CounterMetricFamily("vlmspec_suffix_store_evicted_tokens", "tokens dropped from the store, oldest first, to stay "
                                  "within --suffix-memory", m.get("store_evicted_tokens", 0))
        if "suffix_trees" in m:
            trees = CounterMetricFamily("vlmspec_hybrid_trees", "rows of the hybrid drafter given each drafter's tree", labels=["drafter"])
            trees.add_metric(["suffix"], m["suffix_trees"])
            trees.add_metric(["eagle"], m["eagle_trees"])
            yield trees
