"""`python -m recipes adaptive`: adaptive speculation against plain decoding and the fixed tree (#21).

A research suite (it answered issue #21's question once). Three ways through the same engine code
and target, on each prompt, in a rotating order (`vlmspec.bench.runner.run_ways`):
plain (the `none` drafter), fixed (the drafter's full tree every step) and goodput
(`control.GoodputPolicy`, its cost model measured at start-up through the engine). Categories: the
held-out ToyWorld image prompts (in domain) and the adversarial sets of `heldout.adversarial`,
each at every temperature asked for. Every generation runs to `max_new_tokens` (EOS ignored), so
the three emit the same number of tokens and time compares directly.

Per category and temperature: tokens/s of each way, the speed ratio goodput / plain (geometric mean
over prompts and runs; each prompt's median over its interleaved runs, and the worst prompt's),
fixed / plain, the share of the fixed tree's speedup goodput keeps, and the depths the controller
chose.

    report = measure(engine, categories, temperatures=(0.0, 1.5), max_new_tokens=64, repeats=2)
    print(format_table(report))
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vlmspec.bench.runner import WaysRun, run_ways
from vlmspec.policy.control import FixedPolicy, GoodputPolicy
from vlmspec.policy.cost import COST_PROMPT, measure_cost
from vlmspec.data.heldout import ADVERSARIAL, Conversation, adversarial, heldout
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.factory import plain_engine
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams

WAYS = ("plain", "fixed", "goodput")
NO_PROBE = "goodput-no-probe"  # with `no_probe`: goodput whose first drafts and retries go full depth (GoodputPolicy.probe_depth None)


@dataclass(frozen=True)
class _Item:
    """What every way answers once per round: one prompt of a category, at one temperature."""

    category: str
    prompt: int  # index within its category
    inputs: dict[str, Any]  # the encoded prompt (shared by its temperatures)
    temperature: float


def categories(target: Any, n: int, seed: int = 0) -> dict[str, list[Conversation]]:
    """The in-domain set (held-out ToyWorld bench prompts) and each adversarial set, `n` prompts each."""
    tok = target.tokenizer
    cats = {"in_domain": heldout("bench", n)}
    cats.update({kind: adversarial(kind, n, tok, seed) for kind in ADVERSARIAL})
    return cats


def measure(engine: SpecEngine, cats: dict[str, list[Conversation]], temperatures: tuple[float, ...] = (0.0, 1.5),
            max_new_tokens: int = 64, repeats: int = 2, progress: bool = True, no_probe: bool = False) -> dict[str, Any]:
    target = engine.target
    cost = engine.speculation.cost or measure_cost(engine, encode_prompt(target, COST_PROMPT))  # the one the engine serves with
    items = []
    for cat, convs in cats.items():
        for i, conv in enumerate(convs):
            inputs = encode_prompt(target, conv.prompt, conv.images)  # once per prompt, for every temperature
            items += [_Item(cat, i, inputs, temp) for temp in temperatures]
    ways = {"plain": (plain_engine(engine), None), "fixed": (engine, FixedPolicy()), "goodput": (engine, GoodputPolicy(cost))}
    if no_probe:
        ways[NO_PROBE] = (engine, GoodputPolicy(cost, probe_depth=None))

    def way(name: str):
        eng, policy = ways[name]

        def call(k: int, rnd: int):
            it = items[k]
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, sampling=SamplingParams(temperature=it.temperature),
                                   seed=1000 * rnd + it.prompt, policy=policy)
            r = eng.generate(it.inputs, cfg)
            assert len(r.token_ids) == max_new_tokens, (name, len(r.token_ids))
            return r

        return call

    run = run_ways({w: way(w) for w in ways}, len(items), "plain", repeats, progress="adaptive" if progress else None)
    rows = [{"category": items[k].category, "temperature": items[k].temperature, "prompt": items[k].prompt, "repeat": rep,
             **{f"{w}_s": got[w].seconds for w in ways},
             "depths": dict(sorted(Counter(got["goodput"].result.depths).items()))}  # the depth goodput chose at each step
            for (k, rep), got in run.rounds().items()]
    return {"rows": rows, "summary": summarise(run, items, rows, max_new_tokens, tuple(ways)), "max_new_tokens": max_new_tokens,
            "repeats": repeats, "cost_model": cost.as_dict(),
            "tree": vars(engine.drafter.tree) if engine.drafter.tree is not None else None, "drafter": engine.drafter.name}


def summarise(run: WaysRun, items: list[_Item], rows: list[dict[str, Any]], max_new_tokens: int,
              ways: tuple[str, ...] = WAYS) -> list[dict[str, Any]]:
    """Per category and temperature: each way's tokens/s, goodput's and fixed's speed ratios to
    plain (geometric mean over prompts and runs), goodput's median ratio per prompt over its runs
    (and the worst prompt's), the share of fixed's gain goodput keeps."""
    out = []
    for key in dict.fromkeys((it.category, it.temperature) for it in items):
        def keep(k: int) -> bool:
            return (items[k].category, items[k].temperature) == key

        sel = [r for r in rows if (r["category"], r["temperature"]) == key]
        tps = {w: max_new_tokens * len(sel) / sum(r[f"{w}_s"] for r in sel) for w in ways}
        good, fixed = run.paired("goodput", keep), run.paired("fixed", keep)

        def per_prompt(way: str) -> list[float]:  # each prompt's median ratio to plain over its runs
            return [statistics.median(run.paired(way, lambda j, k=k: j == k).ratios) for k in range(len(items)) if keep(k)]

        extra = {}
        if NO_PROBE in ways:
            extra = {"no_probe_vs_plain": run.paired(NO_PROBE, keep).geomean, "no_probe_vs_plain_per_prompt": per_prompt(NO_PROBE),
                     "no_probe_vs_plain_worst_prompt": min(per_prompt(NO_PROBE))}
        depths: Counter = Counter()
        for r in sel:
            depths.update({int(d): c for d, c in r["depths"].items()})
        out.append({"category": key[0], "temperature": key[1], "prompts": len(sel), **{f"{w}_tok_s": tps[w] for w in ways},
                    "goodput_vs_plain": good.geomean, "goodput_vs_plain_worst": good.lowest, "fixed_vs_plain": fixed.geomean,
                    "goodput_vs_plain_per_prompt": per_prompt("goodput"), "goodput_vs_plain_worst_prompt": min(per_prompt("goodput")),
                    "goodput_keeps_of_fixed": good.geomean / fixed.geomean if fixed.geomean > 0 else float("nan"),
                    "depths": dict(sorted(depths.items())), **extra})
    return out


def format_table(report: dict[str, Any]) -> str:
    lines = ["| category | T | plain tok/s | fixed tok/s | goodput tok/s | goodput / plain (worst run) | worst prompt (median of its runs) "
             "| fixed / plain | goodput / fixed | depths chosen |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in report["summary"]:
        depths = ", ".join(f"{d}: {c}" for d, c in s["depths"].items())
        lines.append(f"| {s['category']} | {s['temperature']:g} | {s['plain_tok_s']:.1f} | {s['fixed_tok_s']:.1f} | {s['goodput_tok_s']:.1f} | "
                     f"{s['goodput_vs_plain']:.2f}x ({s['goodput_vs_plain_worst']:.2f}x) | {s['goodput_vs_plain_worst_prompt']:.2f}x | {s['fixed_vs_plain']:.2f}x | "
                     f"{s['goodput_keeps_of_fixed']:.2f} | {depths} |")
    if any("no_probe_vs_plain" in s for s in report["summary"]):
        lines += ["", "| category | T | goodput / plain | worst prompt | goodput, no probe / plain | worst prompt |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {s['category']} | {s['temperature']:g} | {s['goodput_vs_plain']:.2f}x | {s['goodput_vs_plain_worst_prompt']:.2f}x | "
                  f"{s['no_probe_vs_plain']:.2f}x | {s['no_probe_vs_plain_worst_prompt']:.2f}x |" for s in report["summary"]]
    return "\n".join(lines)


__all__ = ["NO_PROBE", "WAYS", "categories", "format_table", "measure", "summarise"]
