"""`vlmspec bench load`: the service under load, a concurrency sweep through the real HTTP server (#47 item 4).

At each concurrency C, C closed-loop clients send the batched benches' held-out mix
(`bench.batch.mixed_conversations`; streamed, T=0, `ignore_eos` unless told otherwise) until the
level's requests are done; with `repeat_share` (#73) a level also sends that share of repeats. The
ways differ only in each request's options: plain (`"speculative": false`), fixed and goodput
(`"speculation": {"policy": ...}`); the baseline is a server with max_batch 1. Per level: total
tokens/s, latency and time to first token (p50, p99), mean batch (also while every client was
busy: `run_level`), the prefills' share of the engine's time and the decode steps' tokens/s
(`vlmspec_engine_seconds_total{phase}`); in fp32 every answer must equal that request's at
concurrency 1. HTTP only: the CLI starts the servers (`vlmspec.app.serve.serving`), or `--url` sends
the sweep to a running service (`remote`, e.g. Ray Serve's proxy). Levels interleave the ways
(rotated); `sweep`'s `on_level` writes the report after each level. What it measured: docs/serving.md.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmspec.bench.batch import mixed_conversations
from vlmspec.bench.repeat import repeat_plan
from vlmspec.bench.server import chat_body, delta_text, sse_events
from vlmspec.stats import percentile, rotated

WAYS: dict[str, dict[str, Any]] = {  # a way's request fields (the OpenAI body's extensions)
    "plain": {"speculative": False},
    "fixed": {"speculation": {"policy": "fixed"}},
    "goodput": {"speculation": {"policy": "goodput"}},
    "baseline": {},  # the one-at-a-time server's default
}


LABELS = {"baseline": "one at a time (max_batch 1)"}
REPLICA_HEADER = "x-vlmspec-replica"  # vlmspec.app.ray_serve's (the bench does not import the app; a test keeps them equal)


@dataclass(frozen=True)
class LoadOptions:
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    requests: int = 8  # requests per level at least (and two per client)
    max_tokens: int = 64
    prompts: int = 12  # distinct held-out requests, sent in turn
    warmup: int = 1  # unmeasured requests per way before the sweep
    ignore_eos: bool = True  # every answer runs to max_tokens (False: answers end at the model's end of turn)
    repeat_share: float | None = None  # the repeating mix (`vlmspec.bench.repeat`): this share of each level's requests repeat earlier ones

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1 or min(self.requests, self.max_tokens, self.prompts) < 1 or self.warmup < 0:
            raise ValueError(f"concurrency levels, requests, max_tokens and prompts must be >= 1, warmup >= 0: {self}")
        if self.repeat_share is not None and not 0.0 <= self.repeat_share < 1.0:
            raise ValueError(f"repeat_share must be in [0, 1), got {self.repeat_share}")


@dataclass
class Endpoint:
    """A way on a server: where its requests go (the base URL, the `model` served) and that server's max_batch."""

    url: str
    model: str
    way: str  # a key of WAYS
    max_batch: int
    label: str = ""  # how the tables and plots name it (default: the way)
    metrics_path: str = "/metrics"  # where the batch-size histogram is read (summed over its label sets: replicas)

    def __post_init__(self) -> None:
        if self.way not in WAYS:
            raise ValueError(f"unknown way {self.way!r}: expected one of {list(WAYS)}")
        self.label = self.label or self.way


def bodies(model: str, opts: LoadOptions, way: str) -> list[dict[str, Any]]:
    """The requests of a level, in the order they are sent: the mix's `prompts` distinct ones, then,
    with `repeat_share`, that share of repeats of them (`repeat_plan`: a second pass at 0.5)."""
    extra = {"ignore_eos": opts.ignore_eos, "stream_options": {"include_usage": True}, **WAYS[way]}
    convs = mixed_conversations(opts.prompts)
    order = range(len(convs)) if opts.repeat_share is None else repeat_plan(len(convs), opts.repeat_share).items
    return [{**chat_body(convs[i], model, opts.max_tokens, stream=True), **extra} for i in order]


def _one(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: seconds to the first text and to the end, its text and token count."""
    t0 = time.perf_counter()
    first, parts, tokens = None, [], 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"the server answered {r.status_code}: {r.text[:300]}")
        replica = r.headers.get(REPLICA_HEADER)
        for event in sse_events(r):
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            text = delta_text(event)
            if text and first is None:
                first = time.perf_counter() - t0
            parts.append(text)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter() - t0
    return {"ttft_s": end if first is None else first, "latency_s": end, "text": "".join(parts), "tokens": tokens, "replica": replica}


COUNTS = ("vlmspec_batch_size_sum", "vlmspec_batch_size_count", "vlmspec_generated_tokens_total")
ENGINE_SECONDS = "vlmspec_engine_seconds_total"  # {phase}: the worker's seconds in the engine


def _server_counts(client: Any, url: str) -> dict[str, float]:
    """The server's `COUNTS` at `url` (a metrics URL): requests over all steps, steps, tokens emitted;
    each summed over its label sets (modes; one per replica in an aggregated view); and the engine's
    seconds by phase (`ENGINE_SECONDS`), as "engine:<phase>" (a server without them: none)."""
    out = dict.fromkeys(COUNTS, 0.0)
    for line in client.get(url).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
        elif name == ENGINE_SECONDS and 'phase="' in line:
            key = "engine:" + line.split('phase="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _engine_time(before: dict[str, float], after: dict[str, float], tokens: int, requests: int) -> dict[str, float]:
    """Where a level's engine time went: its seconds in the engine (summed over replicas), the share
    of them spent prefilling joining requests, and the tokens per second of the decode steps alone
    (every token but each request's first, which its prefill gives, over the engine's seconds
    without prefills). Empty for a server that does not count its engine's seconds."""
    phases = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("engine:")}
    engine_s, prefill_s = sum(phases.values()), phases.get("engine:prefill", 0.0)
    if engine_s <= 0 or engine_s <= prefill_s:
        return {}
    return {"engine_s": engine_s, "prefill_share": prefill_s / engine_s, "decode_tokens_per_s": (tokens - requests) / (engine_s - prefill_s)}


def _mean_batch(before: dict[str, float], after: dict[str, float]) -> float:
    steps = after["vlmspec_batch_size_count"] - before["vlmspec_batch_size_count"]
    return (after["vlmspec_batch_size_sum"] - before["vlmspec_batch_size_sum"]) / steps if steps else 0.0


def remote(url: str, ways: list[str]) -> tuple[list[Endpoint], dict[str, Any]]:
    """Endpoints for `ways` on a service already running at `url`, and what it says about itself (its
    served model and drafter, /v1/models; its max_batch, /healthz; an aggregated metrics view if any)."""
    import httpx

    url = url.rstrip("/")
    with httpx.Client(timeout=60) as c:
        card = c.get(f"{url}/v1/models").raise_for_status().json()["data"][0]
        health = c.get(f"{url}/healthz").raise_for_status().json()
        aggregated = c.get(f"{url}/metrics/replicas").status_code == 200
    path = "/metrics/replicas" if aggregated else "/metrics"
    endpoints = [Endpoint(url, card["id"], w, health["max_batch"], metrics_path=path) for w in ways]
    env = {"model": card["id"], "drafter": card.get("drafter", "?"), "url": url, "max_batch": [health["max_batch"]],
           "metrics": path}
    return endpoints, env


def run_level(target: Endpoint, requests: list[dict[str, Any]], clients: int, n: int) -> dict[str, Any]:
    """`clients` closed-loop clients share `n` requests (request i is `requests[i % len(requests)]`).

    Besides the whole level it measures the part while every client was busy: from the start to the
    moment the first client found no request left (the server's counts read then). After it the
    level winds down with fewer clients than `clients`, for as long as the slowest requests take;
    ways whose requests finish on the same step (plain decoding, every answer `max_tokens` long)
    have almost no wind-down, ways whose requests finish apart (speculation) a long one."""
    import httpx

    lock, nxt, done, errors = threading.Lock(), [0], [], []
    metrics_url = target.url + target.metrics_path
    busy: dict[str, Any] = {}  # "end": when the first client ran out of requests, "counts": the server's counts then

    def ran_out(c: Any) -> None:
        with lock:
            if "end" in busy:
                return
            busy["end"] = time.perf_counter()
        busy["counts"] = _server_counts(c, metrics_url)

    def client_loop() -> None:
        with httpx.Client(timeout=3600) as c:
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= n or errors:
                    if not errors:
                        ran_out(c)
                    return
                try:
                    got = _one(c, target.url, requests[i % len(requests)])
                except Exception as exc:  # reported after the level: the bench fails with the server's answer
                    errors.append(f"request {i}: {exc}")
                    return
                with lock:
                    done.append({"index": i % len(requests), **got})

    with httpx.Client(timeout=60) as c:
        before = _server_counts(c, metrics_url)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client_loop) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        after = _server_counts(c, metrics_url)
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed at {clients} clients: {errors[0]}")
    lat, ttft = [d["latency_s"] for d in done], [d["ttft_s"] for d in done]
    busy_s = busy["end"] - t0
    busy_tokens = busy["counts"]["vlmspec_generated_tokens_total"] - before["vlmspec_generated_tokens_total"]
    tokens = sum(d["tokens"] for d in done)
    return {"clients": clients, "requests": len(done), "seconds": wall, "tokens": tokens, **_engine_time(before, after, tokens, len(done)),
            "tokens_per_s": tokens / wall, "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "mean_batch": _mean_batch(before, after),
            "busy_s": busy_s, "busy_tokens_per_s": busy_tokens / busy_s, "busy_mean_batch": _mean_batch(before, busy["counts"]),
            "replicas": len({d["replica"] for d in done if d["replica"] is not None}),  # replicas that served the level (0: one process)
            "answers": {d["index"]: d["text"] for d in sorted(done, key=lambda d: d["index"])},
            "latencies": {i: [d["latency_s"] for d in done if d["index"] == i] for i in sorted({d["index"] for d in done})}}


def sweep(endpoints: list[Endpoint], opts: LoadOptions, progress: bool = True,
          on_level: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every endpoint (a way on a server) at every concurrency, interleaved. Returns the report.
    on_level: called after each level with the report so far (`planned` levels, `len(levels)` of
    them measured), so that a run stopped part way leaves what it measured."""
    reqs = {e.label: bodies(e.model, opts, e.way) for e in endpoints}
    for e in endpoints:  # warm-up: each way's first requests are not measured
        if opts.warmup:
            run_level(e, reqs[e.label], 1, opts.warmup)
    levels: list[dict[str, Any]] = []
    report = {"options": {"concurrency": list(opts.concurrency), "requests": opts.requests, "max_tokens": opts.max_tokens,
                          "prompts": opts.prompts, "warmup": opts.warmup, "ignore_eos": opts.ignore_eos, "repeat_share": opts.repeat_share}, "planned": len(endpoints) * len(opts.concurrency), "levels": levels}
    for k, clients in enumerate(opts.concurrency):
        for e in rotated(endpoints, k):
            whole = len(reqs[e.label]) if opts.repeat_share is not None else 0  # the repeating mix: every request of it
            level = run_level(e, reqs[e.label], clients, max(opts.requests, 2 * clients, whole))
            levels.append({"way": e.way, "max_batch": e.max_batch, "series": e.label, **level})
            if progress:
                print(f"  {e.label:>18} x{clients:<3} {level['tokens_per_s']:7.1f} tokens/s  p50 {level['latency_p50_s']:.2f} s  "
                      f"p99 {level['latency_p99_s']:.2f} s  TTFT p50 {level['ttft_p50_s']:.2f} s  batch {level['mean_batch']:.1f}  "
                      f"(all busy: {level['busy_tokens_per_s']:.1f} tokens/s, batch {level['busy_mean_batch']:.1f})"
                      + (f"  prefill {level['prefill_share']:.0%} of the engine's time" if "prefill_share" in level else ""), flush=True)
            _check_answers(levels)
            if on_level is not None:
                on_level(report)
    return report


def _check_answers(levels: list[dict[str, Any]]) -> None:
    """Each level's `changed`: its answers that differ from the same series' answers at the lowest concurrency."""
    for series in dict.fromkeys(lv["series"] for lv in levels):
        mine = [lv for lv in levels if lv["series"] == series]
        ref = min(mine, key=lambda lv: lv["clients"])["answers"]
        for lv in mine:
            lv["changed"] = sum(1 for i, text in lv["answers"].items() if i in ref and ref[i] != text)


def ratios(report: dict[str, Any]) -> dict[str, float]:
    """The issue's figures that a sweep gives: throughput at 8 clients over 1, goodput over plain,
    p99 at 8 clients over the 1-client latency, and 1 client over the one-at-a-time service (the
    batched ways on the first max_batch of the run)."""
    first = next((lv["max_batch"] for lv in report["levels"] if lv["way"] != "baseline"), None)
    cell = {(lv["way"], lv["clients"]): lv for lv in report["levels"] if lv["way"] == "baseline" or lv["max_batch"] == first}
    out: dict[str, float | None] = {}
    ways = sorted({w for w, _ in cell} - {"baseline"})

    def over(a: tuple[str, int], b: tuple[str, int], key: str = "tokens_per_s") -> float | None:
        """Cell a's `key` over cell b's; None without either cell, or without the key (older reports)."""
        return cell[a][key] / cell[b][key] if a in cell and b in cell and key in cell[a] and key in cell[b] else None

    busy = ", while all clients were busy"
    for way in ways:
        if (way, 8) in cell and (way, 1) in cell:
            out[f"{way}: tokens/s at 8 clients / at 1"] = over((way, 8), (way, 1))
            out[f"{way}: p99 latency at 8 clients / p50 at 1"] = cell[(way, 8)]["latency_p99_s"] / cell[(way, 1)]["latency_p50_s"]
            if "latencies" in cell[(way, 1)]:  # reports written before per-request latencies were kept have none
                out[f"{way}: p99 over requests of latency at 8 clients / the same request's at 1"] = same_request_p99(cell[(way, 1)], cell[(way, 8)])
    for c in (4, 8, 16):
        out[f"goodput / plain at {c} clients"] = over(("goodput", c), ("plain", c))
    for way in ways:
        out[f"{way}: tokens/s at 8 clients / at 1{busy}"] = over((way, 8), (way, 1), "busy_tokens_per_s")
    for c in (4, 8, 16):
        out[f"goodput / plain at {c} clients{busy}"] = over(("goodput", c), ("plain", c), "busy_tokens_per_s")
    for c in (4, 8, 16):
        out[f"goodput / plain at {c} clients, decode steps alone (the engine's seconds without prefills)"] = over(
            ("goodput", c), ("plain", c), "decode_tokens_per_s")
    out["goodput at 1 client / the one-at-a-time service"] = over(("goodput", 1), ("baseline", 1))
    return {k: v for k, v in out.items() if v is not None}


def same_request_p99(alone: dict[str, Any], loaded: dict[str, Any]) -> float:
    """The 99th percentile, over the requests both levels ran, of a request's latency in `loaded` over
    its latency in `alone` (each the median of that request's runs in the level)."""
    mine = {str(i): v for i, v in alone["latencies"].items()}
    per_request = [statistics.median(v) / statistics.median(mine[str(i)]) for i, v in loaded["latencies"].items() if str(i) in mine]
    return percentile(per_request, 99)


def markdown(report: dict[str, Any]) -> str:
    env, o = report.get("env", {}), report["options"]
    length = "(ignore_eos)" if o.get("ignore_eos", True) else "at most, each answer ending at the model's end of turn"
    if "url" in env:  # a running service (--url): what it said about itself
        head = (f"the service at {env['url']} (model {env.get('model', '?')}, drafter {env.get('drafter', '?')}, max_batch "
                f"{env.get('max_batch', ['?'])[0]} in each server process); {o['max_tokens']} tokens per request {length}, at least "
                f"{o['requests']} requests per level (2 per client); mean batch from {env.get('metrics', '/metrics')}")
    else:
        packed = f", {env['packed_layers']} linear layers packed" if env.get("packed_layers") else ""
        head = (f"{env.get('model', '?')}, {env.get('dtype', '?')} on {env.get('device', '?')} ({env.get('threads', '?')} threads{packed}), drafter "
                f"{env.get('drafter', '?')}; {o['max_tokens']} tokens per request {length}, at least {o['requests']} requests per level "
                f"(2 per client); baseline: the one-at-a-time service (max_batch 1) with its default policy ({env.get('default_policy', '?')})")
    if o.get("repeat_share") is not None:
        head += (f"; the repeating mix: {o['prompts']} distinct requests, then {o['repeat_share']:.0%} of each level's requests "
                 "repeating them")
    replicas = any(lv.get("replicas") for lv in report["levels"])  # a column when the service names its replicas
    if len(report["levels"]) < report.get("planned", 0):
        head += f"\n\n**Stopped part way: {len(report['levels'])} of {report['planned']} levels measured.**"
    lines = [head, "", "| way | max batch | clients | requests | tokens/s | latency p50 / p99 (s) | TTFT p50 / p99 (s) | mean batch | "
                       "all clients busy: tokens/s, mean batch | engine: prefill share, decode tokens/s | answers changed |"
                       + (" replicas serving |" if replicas else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if replicas else "")]
    for lv in sorted(report["levels"], key=lambda lv: (list(WAYS).index(lv["way"]), lv["max_batch"], lv["clients"])):
        busy = f"{lv['busy_tokens_per_s']:.1f}, {lv['busy_mean_batch']:.1f}" if "busy_tokens_per_s" in lv else "-"  # older reports: none
        engine = f"{100 * lv['prefill_share']:.0f}%, {lv['decode_tokens_per_s']:.1f}" if "prefill_share" in lv else "-"  # likewise
        lines.append(f"| {lv['way']} | {lv['max_batch']} | {lv['clients']} | {lv['requests']} | {lv['tokens_per_s']:.1f} | {lv['latency_p50_s']:.2f} / "
                     f"{lv['latency_p99_s']:.2f} | {lv['ttft_p50_s']:.2f} / {lv['ttft_p99_s']:.2f} | {lv['mean_batch']:.1f} | {busy} | {engine} | "
                     f"{lv['changed']}/{lv['requests']} |" + (f" {lv.get('replicas', 0)} |" if replicas else ""))
    lines += ["", *(f"- {k}: {v:.2f}x" for k, v in ratios(report).items())]
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    """Throughput vs concurrency, and p50 latency vs throughput (one line per way and max_batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env = report.get("env", {})
    title = f"{env.get('model', '')} ({env.get('dtype', '')}, {env.get('device', '')})"
    series = list(dict.fromkeys(lv["series"] for lv in report["levels"]))
    paths = []
    for name, x, y, xlabel, ylabel in (("load_throughput.png", "clients", "tokens_per_s", "concurrent clients", "tokens/s in total"),
                                       ("load_latency.png", "tokens_per_s", "latency_p50_s", "tokens/s in total", "latency p50 (s)")):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for one in series:
            cells = sorted((lv for lv in report["levels"] if lv["series"] == one), key=lambda lv: lv["clients"])
            ax.plot([c[x] for c in cells], [c[y] for c in cells], marker="o", label=LABELS.get(one, one))
            if x != "clients":
                for c in cells:
                    ax.annotate(str(c["clients"]), (c[x], c[y]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if x == "clients":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


__all__ = ["LoadOptions", "Endpoint", "WAYS", "bodies", "markdown", "plot", "ratios", "remote", "run_level", "sweep"]
