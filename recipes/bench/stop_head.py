"""`python -m recipes stop-head`: SpecDec++'s stop rule against the same drafter without it (#21).

A research suite (it answered one question of issue #21 once). One trained EAGLE drafter with an acceptance head (`vlmspec train --acceptance-head`), so "with"
and "without" share every weight (equal training steps by construction). Five ways through the
same engine code and target, on each prompt, in a rotating order (`vlmspec.bench.runner.run_ways`):

    plain         the `none` drafter
    fixed         the drafter's full tree every step, no stop rule (EAGLE-2)
    fixed+stop    the same, deepening stopped by the acceptance head at the drafter's threshold
    goodput       the goodput policy choosing each step's depth, no stop rule
    goodput+stop  the goodput policy, then the stop rule within the chosen depth

Every generation runs to `max_new_tokens` (EOS ignored), so time compares directly. Per
temperature and way: tokens/s, the per-prompt speed ratio to plain (geometric mean and worst),
mean accepted length, drafted tokens per accepted token, and the levels each step grew.
"""

from __future__ import annotations

from typing import Any

from vlmspec.bench.runner import WaysRun, run_ways
from vlmspec.policy.control import FixedPolicy, GoodputPolicy
from vlmspec.policy.cost import COST_PROMPT, measure_cost
from vlmspec.data.heldout import Conversation
from vlmspec.draft.eagle import EagleDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.factory import plain_engine
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams
from vlmspec.stats import SpecStats

WAYS = ("plain", "fixed", "fixed+stop", "goodput", "goodput+stop")


def measure(engine: SpecEngine, prompts: list[Conversation], temperatures: tuple[float, ...] = (0.0, 1.0),
            max_new_tokens: int = 64, repeats: int = 2, progress: bool = True) -> dict[str, Any]:
    """engine: a target with an EAGLE drafter that has an acceptance head and a stop threshold."""
    drafter = engine.drafter
    assert isinstance(drafter, EagleDrafter) and drafter.head.accept is not None and drafter.stop_threshold > 0, \
        "stop-head needs a drafter trained with --acceptance-head"
    target = engine.target
    no_stop = SpecEngine(target, EagleDrafter(drafter.head, drafter.tree, 0.0))
    stop = SpecEngine(target, drafter)
    cost = measure_cost(no_stop, encode_prompt(target, COST_PROMPT))  # the cost of levels, without the rule
    ways = {"plain": (plain_engine(engine), None), "fixed": (no_stop, FixedPolicy()), "fixed+stop": (stop, FixedPolicy()),
            "goodput": (no_stop, GoodputPolicy(cost)), "goodput+stop": (stop, GoodputPolicy(cost))}
    encoded = [encode_prompt(target, conv.prompt, conv.images) for conv in prompts]
    items = [(i, temp) for i in range(len(prompts)) for temp in temperatures]  # (prompt, temperature)

    def way(name: str):
        eng, policy = ways[name]

        def call(k: int, rnd: int):
            i, temp = items[k]
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, sampling=SamplingParams(temperature=temp),
                                   seed=1000 * rnd + i, policy=policy)
            r = eng.generate(encoded[i], cfg)
            assert len(r.token_ids) == max_new_tokens, (name, len(r.token_ids))
            return r.stats

        return call

    run = run_ways({w: way(w) for w in WAYS}, len(items), "plain", repeats, progress="stop-head" if progress else None)
    rows = [{"way": t.way, "temperature": items[t.item][1], "prompt": items[t.item][0], "repeat": t.repeat, "seconds": t.seconds,
             "steps": t.result.num_drafts, "drafted": t.result.num_draft_tokens, "accepted": t.result.num_accepted_tokens,
             "levels": sum(t.result.reached_per_pos)} for t in run.runs]
    return {"rows": rows, "summary": summarise(run, items, rows, max_new_tokens), "max_new_tokens": max_new_tokens, "repeats": repeats,
            "stop_threshold": drafter.stop_threshold, "tree": vars(drafter.tree),
            "cost_model": cost.as_dict()}


def summarise(run: WaysRun, items: list[tuple[int, float]], rows: list[dict[str, Any]], max_new_tokens: int) -> list[dict[str, Any]]:
    """Per temperature and way: tokens/s, the per-prompt speed ratio to plain (geometric mean and
    worst), tau, drafted tokens per accepted token, levels grown per step."""
    out = []
    for temp in dict.fromkeys(t for _, t in items):
        at = [r for r in rows if r["temperature"] == temp]
        for way in WAYS:
            sel = [r for r in at if r["way"] == way]
            vs_plain = run.paired(way, lambda k: items[k][1] == temp)
            stats = SpecStats(num_drafts=sum(r["steps"] for r in sel), num_draft_tokens=sum(r["drafted"] for r in sel),
                              num_accepted_tokens=sum(r["accepted"] for r in sel))
            out.append({"temperature": temp, "way": way, "runs": len(sel),
                        "tok_s": max_new_tokens * len(sel) / sum(r["seconds"] for r in sel),
                        "vs_plain": vs_plain.geomean, "vs_plain_worst": vs_plain.lowest,
                        "tau": stats.mean_accepted_length if way != "plain" else 1.0,
                        "drafted_per_accepted": stats.num_draft_tokens / stats.num_accepted_tokens if stats.num_accepted_tokens else None,
                        "levels_per_step": sum(r["levels"] for r in sel) / max(stats.num_drafts, 1)})
    return out


def format_table(report: dict[str, Any]) -> str:
    lines = [f"stop threshold {report['stop_threshold']:g}, tree {report['tree']}",
             "| T | way | tok/s | vs plain (worst) | tau | drafted / accepted | levels / step |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for s in report["summary"]:
        lines.append(f"| {s['temperature']:g} | {s['way']} | {s['tok_s']:.1f} | {s['vs_plain']:.2f}x ({s['vs_plain_worst']:.2f}x) | "
                     f"{s['tau']:.2f} | {'-' if s['drafted_per_accepted'] is None else format(s['drafted_per_accepted'], '.2f')} | {s['levels_per_step']:.2f} |")
    return "\n".join(lines)


__all__ = ["WAYS", "format_table", "measure", "summarise"]
