"""`vlmspec bench server`: what the HTTP service adds to a request (#22 item 5).

The same engine answers the same held-out prompts two ways, interleaved prompt by prompt and repeat
by repeat (`runner.run_ways`): directly, as `vlmspec generate` does (prompt encoding -> engine ->
text), and through the running service at `url` (`POST /v1/chat/completions`, the image as a PNG
data URL built before the clock starts), which must serve that same engine as `model`; both answers
must be the same at temperature 0. Reported per request: each path's wall-clock time and the ratio
served / direct; the paths' order alternates, so the geometric mean of the ratios cancels a
first-of-pair effect (its 90% interval a bootstrap over the requests, fixed seed). The bench talks
HTTP only (the service is above the benches): the CLI starts it in a thread and passes its URL.

    with serving(engine, ServerSettings(model="bench", ui=False)) as url:
        report = measure(engine, prompts, url, "bench", max_tokens=64, repeats=3)
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any, Iterator

from vlmspec.bench.runner import run_ways
from vlmspec.data.heldout import Conversation
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.runtime.openmp import release_thread_pool
from vlmspec.text import generate_text


def chat_body(conv: Conversation, model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    for image in conv.images:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        content.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}})
    content.append({"type": "text", "text": conv.prompt})
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": content}]}


def _direct(engine: SpecEngine, conv: Conversation, max_tokens: int) -> str:
    inputs = encode_prompt(engine.target, conv.prompt, conv.images)
    text = generate_text(engine, inputs, GenerationConfig(max_new_tokens=max_tokens)).text
    release_thread_pool()  # the served run next gets the cores to the worker's threads alone (vlmspec.runtime.openmp)
    return text


def sse_events(response: Any) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed chat completion (an httpx streaming response), [DONE] left out."""
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def delta_text(event: dict[str, Any]) -> str:
    """A chunk's text ("" for the role, finish and usage chunks)."""
    return (event["choices"][0].get("delta", {}).get("content") or "") if event.get("choices") else ""


def _served(client: Any, url: str, body: dict[str, Any]) -> str:
    if body["stream"]:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            return "".join(delta_text(e) for e in sse_events(r))
    r = client.post(f"{url}/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def measure(engine: SpecEngine, prompts: list[Conversation], url: str, model: str, max_tokens: int = 64, repeats: int = 3,
            stream: bool = False, warmup: int = 1, progress: bool = False) -> dict[str, Any]:
    """Per prompt and repeat: direct seconds, served seconds (interleaved; the order alternates
    between repeats). url: the service's base URL, serving `engine` as `model`. Raises
    AssertionError when an answer differs between the two paths."""
    import httpx

    bodies = [chat_body(conv, model, max_tokens, stream) for conv in prompts]
    with httpx.Client(timeout=600) as client:
        ways = {"direct": lambda i, _: _direct(engine, prompts[i], max_tokens),
                "served": lambda i, _: _served(client, url, bodies[i])}
        run = run_ways(ways, len(prompts), "served", repeats, warmup, progress="server vs engine" if progress else None)
    rows = []
    for (i, rep), got in run.rounds().items():
        d, s = got["direct"], got["served"]
        assert d.result == s.result, f"prompt {i}: the service answered {s.result!r}, the engine {d.result!r}"
        rows.append({"prompt": i, "repeat": rep, "direct_s": d.seconds, "served_s": s.seconds, "ratio": s.seconds / d.seconds})
    ratio = run.paired("direct")  # served seconds / direct seconds, per request
    (lo, hi), (q1, q3) = ratio.interval(), ratio.quartiles()
    return {"geomean_ratio": ratio.geomean, "geomean_lo": lo, "geomean_hi": hi, "rows": rows, "stream": stream, "max_tokens": max_tokens,
            "prompts": len(prompts), "repeats": repeats, "median_ratio": ratio.median, "ratio_q1": q1, "ratio_q3": q3,
            "min_ratio": ratio.lowest, "max_ratio": ratio.highest,
            "direct_s_total": sum(r["direct_s"] for r in rows), "served_s_total": sum(r["served_s"] for r in rows)}


def format_report(report: dict[str, Any]) -> str:
    r = report
    total = r["served_s_total"] / r["direct_s_total"]
    return (f"server vs engine, {r['prompts']} prompts x {r['repeats']} repeats, {r['max_tokens']} tokens, "
            f"{'streamed' if r['stream'] else 'one response'}:\n"
            f"  served / direct per request: geometric mean {r['geomean_ratio']:.3f} (90% bootstrap {r['geomean_lo']:.3f}-{r['geomean_hi']:.3f}); "
            f"median {r['median_ratio']:.3f} (quartiles {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}, "
            f"range {r['min_ratio']:.3f}-{r['max_ratio']:.3f}); totals {r['served_s_total']:.2f} s / {r['direct_s_total']:.2f} s = {total:.3f}")


__all__ = ["chat_body", "format_report", "measure"]
