"""`vlmspec bench soak`: the service under a long mixed load, checked answer by answer (#47's soak).

`clients` closed-loop clients send requests for `minutes` through the real HTTP server, each drawn (seeded) from a
few held-out prompts (`bench.batch.mixed_conversations`) and option sets (`VARIANTS`), of one of four kinds:
complete (read to the end; its text must be the same request's text alone, in fp32, while sampled rows that draft
need only finish; one cut at the server's request timeout is counted apart as "cut", judged as a prefix), cancel
(the client closes after a few chunks: a prefix, the slot freed), client-timeout (a read timeout far under a step:
as a cancel) and server-timeout (`ignore_eos`, far past the server's timeout: a 504 `timeout` event, a prefix; or,
when a repeated answer is drafted whole, all of it in time, extending its reference). Every body is first answered
alone (the reference); resident memory (and a suffix store's size) is sampled during the soak (the server runs in
this process). Pass: no answer changed, no cut answer off its prefix, no unexpected status, nothing hung, memory
after warm-up within `rss_growth_limit`, the server's timeout cut at least one request, a suffix store within its
budget, and `/healthz` then showing every slot free and nothing waiting. Runs and findings: docs/serving.md.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmspec.bench.batch import mixed_conversations
from vlmspec.bench.server import chat_body, delta_text, sse_events
from vlmspec.runtime.memory import heap_bytes, rss_bytes
from vlmspec.stats import percentile

if TYPE_CHECKING:
    from vlmspec.draft.suffix_index import SuffixStore

KINDS = ("complete", "cancel", "client-timeout", "server-timeout")


@dataclass(frozen=True)
class Variant:
    """One option set of the soak's requests (the body's fields over `chat_body`'s)."""

    name: str
    fields: dict[str, Any]
    stream: bool
    exact: bool  # its text alone is its text under load (False: sampled rows that draft)


VARIANTS = (
    Variant("plain", {"speculative": False}, True, True),
    Variant("goodput+stop", {"speculation": {"policy": "goodput"}, "stop": ["\n\n", "!"]}, False, True),
    Variant("fixed", {"speculation": {"policy": "fixed"}}, True, True),
    Variant("goodput-sampled", {"speculation": {"policy": "goodput"}, "temperature": 0.8, "top_p": 0.9, "seed": 7}, True, False),
    Variant("plain-sampled", {"speculative": False, "temperature": 0.8, "seed": 11}, False, True),
    Variant("default-short", {"max_tokens": 12}, True, True),
)


@dataclass(frozen=True)
class SoakOptions:
    minutes: float = 10.0
    clients: int = 8
    prompts: int = 6  # distinct held-out prompts
    max_tokens: int = 48
    shares: tuple[float, float, float] = (0.1, 0.05, 0.05)  # cancel, client-timeout, server-timeout (the rest complete)
    long_tokens: int = 1024  # the server-timeout kind's max_tokens (ignore_eos)
    warmup_fraction: float = 0.2  # memory is compared after this share of the soak
    rss_growth_limit: float = 0.05
    sample_s: float = 2.0  # memory sampling period
    seed: int = 0

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.clients < 1 or self.prompts < 1 or self.max_tokens < 1 or sum(self.shares) >= 1 or min(self.shares) < 0:
            raise ValueError(f"a soak needs minutes > 0, clients, prompts and max_tokens >= 1, shares summing under 1: {self}")


def bodies(model: str, opts: SoakOptions) -> dict[tuple[int, str], dict[str, Any]]:
    """{(prompt, variant name): body}, plus (prompt, "long") for the server-timeout kind and
    (prompt, "long-ref"), its reference cut to max_tokens."""
    out = {}
    for p, conv in enumerate(mixed_conversations(opts.prompts)):
        for v in VARIANTS:
            out[(p, v.name)] = {**chat_body(conv, model, opts.max_tokens, v.stream), **v.fields}
        out[(p, "long")] = {**chat_body(conv, model, opts.long_tokens, True), "ignore_eos": True}
        out[(p, "long-ref")] = {**chat_body(conv, model, opts.max_tokens, True), "ignore_eos": True}
    return out


def send(client: Any, url: str, body: dict[str, Any], stop_after: int | None = None, deadline_s: float = 600.0) -> dict[str, Any]:
    """One request. Returns {"status", "text", "error" (a stream's error event code, or None),
    "closed" (the client stopped reading), "seconds"}. `stop_after`: close after that many text chunks."""
    import httpx

    t0, parts, error, closed, status = time.perf_counter(), [], None, False, 0
    try:
        if not body["stream"]:
            r = client.post(f"{url}/v1/chat/completions", json=body, timeout=deadline_s)
            status = r.status_code
            if status == 200:
                parts.append(r.json()["choices"][0]["message"]["content"] or "")
            else:
                error = r.json().get("error", {}).get("code")
        else:
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                status = r.status_code
                if status != 200:
                    r.read()
                    error = r.json().get("error", {}).get("code")
                for event in sse_events(r) if status == 200 else ():
                    if time.perf_counter() - t0 > deadline_s:
                        raise TimeoutError(f"no end after {deadline_s:g} s")
                    if "error" in event:
                        error = event["error"].get("code")
                        continue
                    text = delta_text(event)
                    if text:
                        parts.append(text)
                        if stop_after is not None and len(parts) >= stop_after:
                            closed = True
                            break
    except httpx.ReadTimeout:
        closed = True  # the client's own timeout: it stops reading, as a cancel
    return {"status": status, "text": "".join(parts), "error": error, "closed": closed, "seconds": time.perf_counter() - t0}


def judge(kind: str, got: dict[str, Any], ref: str, exact: bool) -> str | None:
    """None when the outcome is right for its kind, else what is wrong."""
    text = got["text"]
    if kind == "complete" and got["error"] == "timeout":  # the server's deadline cut it (a machine too loaded for it): counted apart
        return None if not exact or ref.startswith(text) else f"cut off its prefix: {text[:60]!r} vs {ref[:60]!r}"
    if kind == "complete":
        if got["status"] != 200 or got["error"] is not None:
            return f"status {got['status']}, error {got['error']}"
        if exact and text != ref:
            return f"changed: {text[:60]!r} != {ref[:60]!r}"
        return None
    if kind == "server-timeout":
        if got["status"] == 200 and got["error"] is None:  # all of it before the deadline (a repeated answer drafted whole): it extends its reference
            return None if text.startswith(ref) else f"finished before the server's timeout but off its reference: {text[:60]!r} vs {ref[:60]!r}"
        if got["error"] != "timeout":
            return f"expected the server's timeout event, got status {got['status']}, error {got['error']}"
        return None if (text.startswith(ref) or ref.startswith(text)) else f"off its prefix: {text[:60]!r} vs {ref[:60]!r}"
    if got["status"] != 200 and not (kind == "client-timeout" and got["status"] == 0 and got["closed"]):  # 0: timed out before the headers
        return f"status {got['status']}"
    if not exact:  # a sampled row that drafts: its text alone is another sample
        return None
    return None if ref.startswith(text) else f"off its prefix: {text[:60]!r} vs {ref[:60]!r}"


def draw(rng: random.Random, opts: SoakOptions) -> tuple[str, tuple[int, str], tuple[int, str], int | None]:
    """A client's next request: (kind, body key, reference key, close after that many chunks or None)."""
    p, u = rng.randrange(opts.prompts), rng.random()
    cut = [sum(opts.shares[:i + 1]) for i in range(3)]
    kind = "cancel" if u < cut[0] else "client-timeout" if u < cut[1] else "server-timeout" if u < cut[2] else "complete"
    if kind == "server-timeout":
        return kind, (p, "long"), (p, "long-ref"), None
    v = rng.choice(VARIANTS if kind == "complete" else [v for v in VARIANTS if v.stream]).name
    return kind, (p, v), (p, v), rng.randint(1, 4) if kind == "cancel" else None


def health(client: Any, url: str) -> dict[str, Any]:
    return client.get(f"{url}/healthz", timeout=30).json()


def soak(url: str, model: str, opts: SoakOptions, server_timeout_s: float, progress: bool = True,
         store: "SuffixStore | None" = None) -> dict[str, Any]:
    """References alone, then the soak. Returns the report (`passed` says whether every check held).
    `store`: the service's suffix store (a `suffix` / `hybrid` drafter's), its size sampled beside memory."""
    import httpx

    reqs = bodies(model, opts)
    refs: dict[tuple[int, str], str] = {}
    with httpx.Client(timeout=600) as c:
        for key, body in reqs.items():
            if key[1] != "long":
                got = send(c, url, body)
                assert got["status"] == 200 and got["error"] is None, (key, got)
                refs[key] = got["text"]
    if progress:
        print(f"  {len(refs)} references answered alone; soaking {opts.clients} clients for {opts.minutes:g} min", flush=True)
    exact = {v.name: v.exact for v in VARIANTS}
    lock, results, samples, heap, stored = threading.Lock(), [], [], [], []
    t0 = time.perf_counter()
    end = t0 + 60 * opts.minutes
    stop_sampling = threading.Event()

    def sampler() -> None:
        while not stop_sampling.is_set():
            t, h = time.perf_counter() - t0, heap_bytes()
            samples.append((t, rss_bytes()))
            if h is not None:
                heap.append((t, *h))
            if store is not None:
                stored.append((t, store.tokens))
            stop_sampling.wait(opts.sample_s)

    def client_loop(k: int) -> None:
        rng = random.Random(opts.seed * 1000 + k)
        with httpx.Client(timeout=httpx.Timeout(server_timeout_s + 60)) as c:
            while time.perf_counter() < end:
                kind, key, ref_key, stop_after = draw(rng, opts)
                client, p = c, key[0]
                started = time.perf_counter() - t0
                try:
                    if kind == "client-timeout":
                        with httpx.Client(timeout=httpx.Timeout(60, read=rng.uniform(0.01, 0.1))) as quick:
                            got = send(quick, url, reqs[key], deadline_s=server_timeout_s + 60)
                    else:
                        got = send(client, url, reqs[key], stop_after, deadline_s=server_timeout_s + 60)
                except Exception as exc:  # a broken connection, a body that is not JSON, no end in time: a wrong outcome, said
                    got = {"status": -1, "text": "", "error": f"{type(exc).__name__}: {exc}", "closed": False,
                           "seconds": time.perf_counter() - t0 - started}
                wrong = judge(kind, got, refs[ref_key], exact.get(key[1], True))
                with lock:
                    results.append({"kind": kind, "prompt": p, "variant": key[1], "start_s": started, "wrong": wrong, **got})

    threads = [threading.Thread(target=sampler, daemon=True)] + [threading.Thread(target=client_loop, args=(k,)) for k in range(opts.clients)]
    for t in threads:
        t.start()
    if progress:
        from tqdm import tqdm

        with tqdm(total=int(60 * opts.minutes), desc="soak", unit="s", dynamic_ncols=True) as bar:
            while time.perf_counter() < end:
                time.sleep(min(5.0, max(end - time.perf_counter(), 0.0)))
                bar.n = min(int(time.perf_counter() - t0), bar.total)
                bar.set_postfix(requests=len(results), wrong=sum(r["wrong"] is not None for r in results))
    hung = []
    for t in threads[1:]:
        t.join(timeout=server_timeout_s + 120)
        if t.is_alive():
            hung.append(t.name)
    stop_sampling.set()
    wall = time.perf_counter() - t0
    with httpx.Client() as c:  # a cancel is noticed between steps: give the worker a moment
        for _ in range(50):
            state = health(c, url)
            if state["active"] == 0 and state["waiting"] == 0:
                break
            time.sleep(0.2)
    report = summarise(results, samples, state, hung, wall, opts, server_timeout_s, heap)
    return report if store is None else with_store(report, store, stored)


def with_store(report: dict[str, Any], store: "SuffixStore", stored: list[tuple[float, int]]) -> dict[str, Any]:
    """The report with the suffix store's samples (seconds, tokens held), counters and its check."""
    peak = max((n for _, n in stored), default=0)
    report["suffix_store"] = {"max_tokens": store.max_tokens, "samples": stored, "peak_tokens": peak, **asdict(store.stats)}
    report["checks"][f"the suffix store stayed within {store.max_tokens:,} tokens"] = peak <= store.max_tokens
    report["passed"] = all(report["checks"].values())
    return report


def summarise(results: list[dict[str, Any]], samples: list[tuple[float, int]], state: dict[str, Any], hung: list[str],
              wall: float, opts: SoakOptions, server_timeout_s: float,
              heap: list[tuple[float, int, int]] | None = None) -> dict[str, Any]:
    warm = 60 * opts.minutes * opts.warmup_fraction

    def start_end(values: list[float]) -> tuple[float, float]:
        """Medians of the first and last fifth of `values` (the samples after warm-up)."""
        span = max(len(values) // 5, 1)
        return (statistics.median(values[:span]), statistics.median(values[-span:])) if values else (0.0, 0.0)

    rss_start, rss_end = start_end([r for t, r in samples if t >= warm])
    growth = rss_end / rss_start - 1 if rss_start else float("nan")
    heap_after = [(used, free) for t, used, free in heap or [] if t >= warm]
    used, free = start_end([u for u, _ in heap_after]), start_end([f for _, f in heap_after])
    done = [r for r in results if r["kind"] == "complete" and r["wrong"] is None]
    lat = [r["seconds"] for r in done]
    counts = {k: {"sent": sum(r["kind"] == k for r in results), "cut": sum(r["kind"] == k and r["error"] == "timeout" for r in results),
                  "wrong": sum(r["kind"] == k and r["wrong"] is not None for r in results)} for k in KINDS}
    slots_free = state["active"] == 0 and state["waiting"] == 0 and state["free_slots"] == state["max_batch"]
    checks = {"no answer changed or cut off its prefix": all(c["wrong"] == 0 for c in counts.values()),
              "nothing hung": not hung,
              f"memory after warm-up grew under {opts.rss_growth_limit:.0%}": growth < opts.rss_growth_limit,
              "all slots free at the end": slots_free,
              "every kind was sent": all(c["sent"] > 0 for c in counts.values()),
              "the server's timeout cut a long request": counts["server-timeout"]["cut"] > 0}
    return {"options": {**vars(opts), "shares": list(opts.shares), "server_timeout_s": server_timeout_s},
            "wall_s": wall, "requests": len(results), "counts": counts, "hung": hung,
            "complete_latency_p50_s": percentile(lat, 50) if lat else None, "complete_latency_p99_s": percentile(lat, 99) if lat else None,
            "rss": {"samples": samples, "after_warmup_mib": rss_start / 2**20, "end_mib": rss_end / 2**20, "growth": growth},
            "heap": {"samples": heap or [], "in_use_after_warmup_mib": used[0] / 2**20, "in_use_end_mib": used[1] / 2**20,
                     "free_after_warmup_mib": free[0] / 2**20, "free_end_mib": free[1] / 2**20} if heap_after else None,
            "health_at_end": state, "wrong": [r for r in results if r["wrong"] is not None][:20],
            "timeline": [{k: r[k] for k in ("kind", "variant", "start_s", "seconds", "status", "error", "closed")} | {"chars": len(r["text"])}
                         for r in results],
            "checks": checks, "passed": all(checks.values())}


def markdown(report: dict[str, Any]) -> str:
    env, o = report.get("env", {}), report["options"]
    lines = [f"{env.get('model', '?')}, {env.get('dtype', '?')} on {env.get('device', '?')} ({env.get('threads', '?')} threads), drafter "
             f"{env.get('drafter', '?')}; {o['clients']} clients for {o['minutes']:g} min, max_batch {env.get('max_batch', '?')}, "
             f"server request timeout {o['server_timeout_s']:g} s, {o['max_tokens']} tokens per answer at most"
             + "".join(f"; {name}={value}" for name, value in (env.get("onednn_caches") or {}).items()), "",
             "| kind | sent | cut by the server's timeout | wrong |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {c['sent']} | {c['cut']} | {c['wrong']} |" for k, c in report["counts"].items()]
    r = report["rss"]
    lines += ["", f"- requests: {report['requests']} in {report['wall_s']:.0f} s; completed answers' latency p50 "
                  f"{report['complete_latency_p50_s'] or 0:.2f} s, p99 {report['complete_latency_p99_s'] or 0:.2f} s",
              f"- resident memory after warm-up {r['after_warmup_mib']:.0f} MiB, at the end {r['end_mib']:.0f} MiB: {r['growth']:+.1%}",
              *([f"- glibc's heap in use after warm-up {h['in_use_after_warmup_mib']:.0f} MiB, at the end {h['in_use_end_mib']:.0f} MiB; "
                 f"free inside its arenas {h['free_after_warmup_mib']:.0f} MiB, then {h['free_end_mib']:.0f} MiB"]
                if (h := report.get("heap")) else []),
              *([f"- the suffix store: at most {st['peak_tokens']:,} of its {st['max_tokens']:,} tokens held; {st['added_tokens']:,} "
                 f"taken in, {st['evicted_tokens']:,} evicted ({st['evicted_docs']:,} answers)"] if (st := report.get("suffix_store")) else []),
              f"- `/healthz` at the end: active {report['health_at_end']['active']}, waiting {report['health_at_end']['waiting']}, "
              f"free slots {report['health_at_end']['free_slots']} of {report['health_at_end']['max_batch']}", ""]
    lines += [f"- {'pass' if ok else 'FAIL'}: {name}" for name, ok in report["checks"].items()]
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    """Resident memory (and glibc's heap in use) over time above; below, every request's seconds at the time it ended, by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(6.4, 5.6), sharex=True)
    ts = [t / 60 for t, _ in report["rss"]["samples"]]
    a.plot(ts, [m / 2**20 for _, m in report["rss"]["samples"]], lw=1, label="resident")
    if report.get("heap"):
        heap = report["heap"]["samples"]
        a.plot([t / 60 for t, _, _ in heap], [u / 2**20 for _, u, _ in heap], lw=1, ls=":", label="glibc heap in use")
    a.axvline(report["options"]["minutes"] * report["options"]["warmup_fraction"], color="grey", ls="--", lw=1, label="end of warm-up")
    a.set_ylabel("memory (MiB)")
    a.legend(loc="lower right")
    a.grid(alpha=0.3)
    for kind in KINDS:
        rows = [r for r in report["timeline"] if r["kind"] == kind]
        b.scatter([(r["start_s"] + r["seconds"]) / 60 for r in rows], [r["seconds"] for r in rows], s=6, label=kind)
    b.set_xlabel("minutes into the soak")
    b.set_ylabel("request seconds (at its end)")
    b.legend(fontsize=7, ncol=2)
    b.grid(alpha=0.3)
    env = report.get("env", {})
    a.set_title(f"soak: {env.get('model', '')} ({env.get('dtype', '')}), {report['options']['clients']} clients")
    fig.tight_layout()
    path = out / "soak.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


__all__ = ["KINDS", "SoakOptions", "VARIANTS", "bodies", "judge", "markdown", "plot", "soak", "summarise"]
