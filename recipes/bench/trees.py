"""`python -m recipes trees`: which draft-tree shape pays on this device, dtype and drafter (#20).

A research suite: it chose the drafters' measured tree defaults (their configs' `tree_defaults`). The tree default is a trade between acceptance (deeper, wider trees accept more) and the verify
forward's cost (a tree of N nodes costs `bench verify-cost`'s ratio of a one-token step) plus the
drafting (one head level per depth). This bench measures the trade end to end instead of
modelling it: one target and drafter, each shape a fresh engine over the same weights, every
shape and plain decoding on every prompt in a rotating order (`vlmspec.bench.runner.run_ways`). Generations stop at the target's
own end of turn (the answers the service returns; at T=0 every shape writes the same tokens),
so the per-prompt time ratio to plain decoding is the speedup a user sees past the prompt.
"""

from __future__ import annotations

from typing import Any

from vlmspec.bench.runner import WaysRun, run_ways
from vlmspec.policy.control import FixedPolicy
from vlmspec.data.heldout import Conversation
from vlmspec.draft.base import TreeConfig
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.factory import plain_engine
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams

# chains (top_k 1) and small trees: what a CPU verify affords, up to the CPU default (5, 4, 16)
SHAPES = (TreeConfig(4, 1, 4), TreeConfig(5, 1, 5), TreeConfig(6, 1, 6), TreeConfig(5, 2, 8), TreeConfig(6, 2, 10),
          TreeConfig(5, 4, 16))


def shape_name(tree: TreeConfig) -> str:
    return f"d{tree.depth} k{tree.top_k} n{tree.total_tokens}"


def measure(engine: SpecEngine, prompts: list[Conversation], shapes: tuple[TreeConfig, ...] = SHAPES,
            temperature: float = 0.0, max_new_tokens: int = 96, repeats: int = 1, progress: bool = True) -> dict[str, Any]:
    """engine: a target with a drafter that drafts; each shape runs it with `start(prompt, tree)`'s tree."""
    assert engine.drafter.tree is not None, "trees needs a drafter that drafts"
    ways: dict[str, tuple[SpecEngine, TreeConfig | None]] = {"plain": (plain_engine(engine), None)}
    ways.update({shape_name(t): (engine, t) for t in shapes})
    names = list(ways)
    encoded = [encode_prompt(engine.target, conv.prompt, conv.images) for conv in prompts]

    def way(name: str):
        eng, tree = ways[name]

        def call(i: int, rnd: int):
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=temperature),
                                   seed=1000 * rnd + i, policy=FixedPolicy(), tree=tree)
            return eng.generate(encoded[i], cfg)

        return call

    run = run_ways({n: way(n) for n in names}, len(prompts), "plain", repeats, progress="trees" if progress else None)
    rows = [{"shape": t.way, "prompt": t.item, "repeat": t.repeat, "seconds": t.seconds, "tokens": len(t.result.token_ids),
             "steps": t.result.stats.num_drafts, "accepted": t.result.stats.num_accepted_tokens} for t in run.runs]
    return {"rows": rows, "summary": summarise(run, rows, names), "temperature": temperature, "max_new_tokens": max_new_tokens,
            "repeats": repeats, "shapes": {shape_name(t): vars(t) for t in shapes}}


def summarise(run: WaysRun, rows: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per shape: tokens/s, the per-prompt speed ratio to plain (geometric mean, worst, best), tau, ms per step."""
    out = []
    for name in names:
        sel = [r for r in rows if r["shape"] == name]
        vs_plain = run.paired(name)
        steps = sum(r["steps"] for r in sel)
        out.append({"shape": name, "runs": len(sel), "tok_s": sum(r["tokens"] for r in sel) / sum(r["seconds"] for r in sel),
                    "vs_plain": vs_plain.geomean, "vs_plain_worst": vs_plain.lowest, "vs_plain_best": vs_plain.highest,
                    "tau": (steps + sum(r["accepted"] for r in sel)) / steps if steps and name != "plain" else 1.0,
                    "ms_per_step": 1000 * sum(r["seconds"] for r in sel) / max(steps, 1)})
    return out


def format_table(report: dict[str, Any]) -> str:
    lines = [f"T={report['temperature']:g}, up to {report['max_new_tokens']} new tokens (end of turn kept), "
             f"{report['repeats']} run(s) per prompt and shape",
             "| shape | tok/s | vs plain: geomean (worst, best) | tau | ms / step |", "|---|---:|---:|---:|---:|"]
    for s in report["summary"]:
        lines.append(f"| {s['shape']} | {s['tok_s']:.1f} | {s['vs_plain']:.2f}x ({s['vs_plain_worst']:.2f}x, {s['vs_plain_best']:.2f}x) | "
                     f"{s['tau']:.2f} | {s['ms_per_step']:.0f} |")
    return "\n".join(lines)


def parse_shape(text: str) -> TreeConfig:
    """'5,4,16' -> TreeConfig(depth=5, top_k=4, total_tokens=16) (ValueError otherwise)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"a tree shape is DEPTH,TOP_K,TOKENS (e.g. 5,4,16), got {text!r}")
    return TreeConfig(*(int(p) for p in parts))


__all__ = ["SHAPES", "format_table", "measure", "parse_shape", "shape_name", "summarise"]
