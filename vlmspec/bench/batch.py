"""`vlmspec bench batch`: the batched engine alone (no HTTP), B requests decoded together.

For each batch size B and each way (plain decoding through the same engine, or the EAGLE drafter
with a fixed tree of N nodes), B held-out requests (ToyWorld scenes, photographs and text-only
instructions, in turn) join at once and run to their max tokens. Measured per run: tokens/s in
total (prefills included), the mean per-request latency, the batch's time by phase, and the slot
cache's memory. Every request's tokens are checked against the same way's batch-1 run: in fp32
they must be identical; in bf16 a batched matmul may flip a near-tie, and divergences are counted.
Ways are interleaved (rotated per repeat) so a drifting machine moves them together.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlmspec.stats import rotated
from vlmspec.bench.harness import divergence
from vlmspec.policy.control import SpeculationOptions
from vlmspec.data.heldout import Conversation, adversarial, heldout
from vlmspec.draft.base import Drafter, PlainDrafter
from vlmspec.engine import TIMING_KEYS, GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.target import Target


@dataclass(frozen=True)
class BatchBenchOptions:
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16)  # batch sizes B
    trees: tuple[int, ...] = (4, 8, 16)  # fixed tree sizes (drafted nodes) of the drafting ways
    max_new_tokens: int = 64
    repeats: int = 2  # measured runs per (B, way); a warm-up run of each way at B=1 comes first

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1 or self.max_new_tokens < 1 or self.repeats < 1 or min(self.trees, default=1) < 1:
            raise ValueError(f"batch sizes, tree sizes, max_new_tokens and repeats must be >= 1: {self}")


@dataclass
class _Way:
    name: str
    engine: SpecEngine
    tree_tokens: int | None  # None: plain decoding

    def config(self, max_new_tokens: int) -> GenerationConfig:
        spec = SpeculationOptions(policy="fixed", tree_tokens=self.tree_tokens)
        return GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, speculation=spec)


@dataclass
class _Cell:
    tokens_per_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)  # seconds by phase, per run
    rounds: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # every step's wall time, all runs (a one-off cost shows as an outlier)
    cache_mb: float = 0.0
    mismatched: int = 0  # requests whose tokens differ from their batch-1 run
    divergences: list[dict[str, Any]] = field(default_factory=list)  # where, and the batch-1 run's top-2 margin there


def mixed_conversations(n: int) -> list[Conversation]:
    """n held-out requests: ToyWorld scenes, photographs, text-only instructions, in turn (the
    batched benches' mix: `bench batch` here, `bench load` through the service)."""
    sets = [heldout("bench", n, split="test"), adversarial("photo_unknown", n), adversarial("unseen_text", n)]
    return [sets[i % 3][i // 3] for i in range(n)]


def prompts(target: Target, n: int) -> list[dict[str, torch.Tensor]]:
    """`mixed_conversations(n)` encoded for `target`."""
    return [encode_prompt(target, c.prompt, c.images) for c in mixed_conversations(n)]


def ways(target: Target, drafter: Drafter, trees: tuple[int, ...]) -> list[_Way]:
    out = [_Way("plain", SpecEngine(target, PlainDrafter()), None)]
    if not isinstance(drafter, PlainDrafter):
        engine = SpecEngine(target, drafter)
        out += [_Way(f"{drafter.name} {n} nodes", engine, n) for n in trees]
    return out


def _run(way: _Way, requests: list[dict[str, torch.Tensor]], max_new_tokens: int) -> tuple[float, list[Any], Any, list[float]]:
    """One batch of `requests` joining at once -> (seconds, results, the batch, each step's ms)."""
    batch = way.engine.batch(len(requests))
    cfg = way.config(max_new_tokens)
    t0 = time.perf_counter()
    running = [batch.submit(inputs, cfg) for inputs in requests]
    steps = []
    while not batch.idle:
        t_step = time.perf_counter()
        batch.step()
        steps.append(1e3 * (time.perf_counter() - t_step))
    return time.perf_counter() - t0, [r.result for r in running], batch, steps


def measure(target: Target, drafter: Drafter, opts: BatchBenchOptions, progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    all_ways = ways(target, drafter, opts.trees)
    requests = prompts(target, max(opts.sizes))
    alone: dict[str, list[list[int]]] = {}  # way -> each request's batch-1 tokens (the oracle)
    bar = tqdm(total=len(all_ways) * (len(requests) + len(opts.sizes) * opts.repeats), desc="bench batch", disable=not progress)
    for way in all_ways:  # the batch-1 runs: oracle of every batch, and a warm-up
        alone[way.name] = []
        for inputs in requests:
            alone[way.name].append(way.engine.generate(inputs, way.config(opts.max_new_tokens)).token_ids)
            bar.update(1)
    cells = {(b, w.name): _Cell() for b in opts.sizes for w in all_ways}
    for rep in range(opts.repeats):
        for b in opts.sizes:
            for way in rotated(all_ways, rep + b):
                seconds, results, batch, steps = _run(way, requests[:b], opts.max_new_tokens)
                cell = cells[(b, way.name)]
                cell.tokens_per_s.append(sum(len(r.token_ids) for r in results) / seconds)
                cell.latency_s.append(statistics.mean(r.elapsed_s for r in results))
                cell.phases.append(dict(batch.timings))
                cell.rounds.append(batch.rounds)
                cell.step_ms += steps
                cell.cache_mb = max(cell.cache_mb, batch.cache.nbytes() / 2**20)
                for inputs, r, ref in zip(requests, results, alone[way.name]):
                    if r.token_ids != ref:
                        cell.mismatched += 1
                        cell.divergences.append(divergence(target, inputs, ref, r.token_ids))
                bar.update(1)
    bar.close()
    return {"env": {"model": model_label(target), "dtype": str(target.dtype).replace("torch.", ""), "device": str(target.device),
                    "max_new_tokens": opts.max_new_tokens, "repeats": opts.repeats, "threads": torch.get_num_threads()},
            "cells": [_summary(b, name, c) for (b, name), c in cells.items()]}


def model_label(target: Target) -> str:
    """How a bench names the model: a folder by its last two parts (not the machine's path), else its name."""
    name = Path(target.name)
    return f"{name.parent.name}/{name.name}" if name.is_dir() else target.name


def _summary(b: int, way: str, c: _Cell) -> dict[str, Any]:
    runs = len(c.tokens_per_s)
    phases = {k: statistics.median(p[k] for p in c.phases) for k in TIMING_KEYS}
    rounds = statistics.median(c.rounds)
    return {"batch": b, "way": way, "tokens_per_s": statistics.median(c.tokens_per_s),
            "tokens_per_s_range": [min(c.tokens_per_s), max(c.tokens_per_s)], "latency_s": statistics.median(c.latency_s),
            "phases_s": phases, "ms_per_round": {k: 1e3 * v / rounds for k, v in phases.items() if k != "prefill"} if rounds else {},
            "rounds": rounds, "step_ms": {"median": statistics.median(c.step_ms), "max": max(c.step_ms)} if c.step_ms else {},
            "cache_mb": round(c.cache_mb, 1), "requests": b * runs, "mismatched": c.mismatched,
            "near_ties": sum(d["near_tie"] for d in c.divergences), "divergences": c.divergences}


def ratios(report: dict[str, Any]) -> dict[str, float]:
    """The issue's goals: best batched way at B=8 over the batch-1 speculative engine and over batched
    plain decoding; the batch-1 engine's own speed (for the release-to-release check)."""
    cells = {(c["batch"], c["way"]): c["tokens_per_s"] for c in report["cells"]}
    spec_ways = sorted({w for _, w in cells if w != "plain"})
    out: dict[str, float] = {}
    sizes = sorted({b for b, _ in cells})
    big = 8 if 8 in sizes else sizes[-1]
    if spec_ways:
        best = max(spec_ways, key=lambda w: cells[(big, w)])
        if 1 in sizes:  # a sweep without B = 1 (--sizes 8,16) has no batch-1 engine to compare with
            out[f"B={big} best tree ({best}) / B=1 speculative"] = cells[(big, best)] / max(cells[(1, w)] for w in spec_ways)
        out[f"B={big} best tree / B={big} plain"] = cells[(big, best)] / cells[(big, "plain")]
    return out


def markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"{env['model']}, {env['dtype']} on {env['device']} ({env['threads']} threads), {env['max_new_tokens']} new tokens "
             f"per request, median of {env['repeats']} runs (range in brackets)", "",
             "| B | way | tokens/s in total | latency per request (s) | ms per step: draft / verify / commit / other | "
             "step ms: median / slowest | prefill s | cache MB | answers that differ from batch 1 |", "|---:|---|---:|---:|---|---|---:|---:|---:|"]
    for c in report["cells"]:
        lo, hi = c["tokens_per_s_range"]
        ms = c["ms_per_round"]
        split = " / ".join(f"{ms.get(k, 0):.1f}" for k in ("draft", "verify", "commit", "other"))
        step = c.get("step_ms") or {}
        steps = f"{step['median']:.1f} / {step['max']:.1f}" if step else "-"
        lines.append(f"| {c['batch']} | {c['way']} | {c['tokens_per_s']:.1f} [{lo:.1f}-{hi:.1f}] | {c['latency_s']:.2f} | {split} | {steps} | "
                     f"{c['phases_s']['prefill']:.2f} | {c['cache_mb']} | {_differ(c)} |")
    lines += ["", *(f"- {k}: {v:.2f}x" for k, v in ratios(report).items())]
    return "\n".join(lines)


def _differ(c: dict[str, Any]) -> str:
    text = f"{c['mismatched']}/{c['requests']}"
    return text + (f" ({c['near_ties']} at near-ties)" if c["mismatched"] else "")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for way in dict.fromkeys(c["way"] for c in report["cells"]):
        cells = [c for c in report["cells"] if c["way"] == way]
        ax.plot([c["batch"] for c in cells], [c["tokens_per_s"] for c in cells], marker="o", label=way)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests decoded together (B)")
    ax.set_ylabel("tokens/s in total")
    env = report["env"]
    ax.set_title(f"{env['model']} ({env['dtype']}, {env['device']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["BatchBenchOptions", "markdown", "measure", "mixed_conversations", "model_label", "plot", "prompts", "ratios", "ways"]
