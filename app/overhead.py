"""`vlmspec bench server`: what the HTTP service adds to a request (#22 item 5).

The same engines answer the same held-out prompts two ways, interleaved prompt by prompt and
repeat by repeat: directly, as `vlmspec generate` does (prompt encoding -> engine -> text), and
through the running service (`POST /v1/chat/completions`, the image as a PNG data URL built before
the clock starts). Both answers must be the same at temperature 0. Reported per request: the
wall-clock time of each path, and the ratio server / direct with its spread. The order of the two
paths alternates, so the geometric mean of the ratios cancels a first-of-pair effect; its 90%
interval is a bootstrap over the requests (fixed seed).

    report = measure(engines, prompts, max_tokens=64, repeats=3)
"""

from __future__ import annotations

import base64
import io
import json
import statistics
import time
from typing import Any

from vlmspec.data.heldout import Conversation
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.stats import bootstrap_geomean, geomean
from vlmspec.testing.live_server import LiveServer
from vlmspec.text import generate_text

from . import ServerSettings, create_app

MODEL_NAME = "bench"


def _body(conv: Conversation, max_tokens: int, stream: bool) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    for image in conv.images:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        content.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}})
    content.append({"type": "text", "text": conv.prompt})
    return {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": content}]}


def _direct(engine: SpecEngine, conv: Conversation, max_tokens: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    inputs = encode_prompt(engine.target, conv.prompt, conv.images)
    text = generate_text(engine, inputs, GenerationConfig(max_new_tokens=max_tokens)).text
    return time.perf_counter() - t0, text


def _served(client: Any, url: str, body: dict[str, Any]) -> tuple[float, str]:
    t0 = time.perf_counter()
    if body["stream"]:
        parts = []
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    parts.append(choices[0].get("delta", {}).get("content") or "")
        return time.perf_counter() - t0, "".join(parts)
    r = client.post(f"{url}/v1/chat/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["choices"][0]["message"]["content"]


def measure(engine: SpecEngine, prompts: list[Conversation], max_tokens: int = 64, repeats: int = 3,
            stream: bool = False, warmup: int = 1, progress: bool = False) -> dict[str, Any]:
    """Per prompt and repeat: direct seconds, served seconds (interleaved; the order alternates
    between repeats). Raises AssertionError when an answer differs between the two paths."""
    import httpx
    from tqdm import tqdm

    rows = []
    app = create_app(engine, ServerSettings(model=MODEL_NAME, max_queue=4, request_timeout_s=600, ui=False))
    bar = tqdm(total=len(prompts) * repeats, desc="server vs engine", unit="pair", disable=not progress, dynamic_ncols=True)
    with LiveServer(app) as srv, httpx.Client(timeout=600) as client, bar:
        for i, conv in enumerate(prompts):
            body = _body(conv, max_tokens, stream)
            for _ in range(warmup):
                _direct(engine, conv, max_tokens)
                _served(client, srv.url, body)
            for rep in range(repeats):
                order = ("direct", "served") if (i + rep) % 2 == 0 else ("served", "direct")
                got = {}
                for way in order:
                    got[way] = _direct(engine, conv, max_tokens) if way == "direct" else _served(client, srv.url, body)
                (d, d_text), (s, s_text) = got["direct"], got["served"]
                assert d_text == s_text, f"prompt {i}: the service answered {s_text!r}, the engine {d_text!r}"
                rows.append({"prompt": i, "repeat": rep, "direct_s": d, "served_s": s, "ratio": s / d})
                bar.update(1)
    ratios = [r["ratio"] for r in rows]
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    lo, hi = bootstrap_geomean(ratios)
    return {"geomean_ratio": geomean(ratios), "geomean_lo": lo, "geomean_hi": hi, "rows": rows, "stream": stream, "max_tokens": max_tokens, "prompts": len(prompts), "repeats": repeats,
            "median_ratio": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
            "min_ratio": min(ratios), "max_ratio": max(ratios),
            "direct_s_total": sum(r["direct_s"] for r in rows), "served_s_total": sum(r["served_s"] for r in rows)}


def format_report(report: dict[str, Any]) -> str:
    r = report
    total = r["served_s_total"] / r["direct_s_total"]
    return (f"server vs engine, {r['prompts']} prompts x {r['repeats']} repeats, {r['max_tokens']} tokens, "
            f"{'streamed' if r['stream'] else 'one response'}:\n"
            f"  served / direct per request: geometric mean {r['geomean_ratio']:.3f} (90% bootstrap {r['geomean_lo']:.3f}-{r['geomean_hi']:.3f}); "
            f"median {r['median_ratio']:.3f} (quartiles {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}, "
            f"range {r['min_ratio']:.3f}-{r['max_ratio']:.3f}); totals {r['served_s_total']:.2f} s / {r['direct_s_total']:.2f} s = {total:.3f}")


__all__ = ["format_report", "measure"]
