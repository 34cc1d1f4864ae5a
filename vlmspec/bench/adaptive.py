"""`vlmspec bench adaptive`: adaptive speculation against plain decoding and the fixed tree (#21).

Three ways through the same engine code and target, on each prompt, in a rotating order:
plain (the `none` drafter), fixed (the drafter's full tree every step) and goodput
(`control.GoodputPolicy`, its cost model measured at start-up through the engine). Categories: the
held-out ToyWorld image prompts (in domain) and the adversarial sets of `heldout.adversarial`,
each at every temperature asked for. Every generation runs to `max_new_tokens` (EOS ignored), so
the three emit the same number of tokens and time compares directly.

Per category and temperature: tokens/s of each way, the per-prompt speed ratio goodput / plain
(geometric mean and worst prompt), fixed / plain, the share of the fixed tree's speedup goodput
keeps, and the depths the controller chose.

    report = measure(engine, categories, temperatures=(0.0, 1.5), max_new_tokens=64, repeats=2)
    print(format_table(report))
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from vlmspec.control import FixedPolicy, GoodputPolicy
from vlmspec.data.heldout import ADVERSARIAL, Conversation, adversarial, heldout
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.cost import COST_PROMPT, measure_cost
from vlmspec.factory import plain_engine
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams
from vlmspec.stats import geomean, rotated

WAYS = ("plain", "fixed", "goodput")


def categories(target: Any, n: int, seed: int = 0) -> dict[str, list[Conversation]]:
    """The in-domain set (held-out ToyWorld bench prompts) and each adversarial set, `n` prompts each."""
    tok = target.tokenizer
    cats = {"in_domain": heldout("bench", n)}
    cats.update({kind: adversarial(kind, n, tok, seed) for kind in ADVERSARIAL})
    return cats


def measure(engine: SpecEngine, cats: dict[str, list[Conversation]], temperatures: tuple[float, ...] = (0.0, 1.5),
            max_new_tokens: int = 64, repeats: int = 2, progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    target = engine.target
    cost = engine.speculation.cost or measure_cost(engine, encode_prompt(target, COST_PROMPT))  # the one the engine serves with
    plain = plain_engine(engine)
    rows: list[dict[str, Any]] = []
    total = sum(len(v) for v in cats.values()) * len(temperatures) * repeats
    bar = tqdm(total=total, desc="bench adaptive", unit="prompt", disable=not progress, dynamic_ncols=True)
    for cat, convs in cats.items():
        for i, conv in enumerate(convs):
            inputs = encode_prompt(target, conv.prompt, conv.images)  # once per prompt, for every temperature
            for temp in temperatures:
                for rep in range(repeats):
                    ways = {"plain": (plain, None), "fixed": (engine, FixedPolicy()), "goodput": (engine, GoodputPolicy(cost))}
                    order = rotated(WAYS, i + rep)
                    secs, depths = {}, Counter()
                    for way in order:
                        eng, policy = ways[way]
                        cfg = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, sampling=SamplingParams(temperature=temp),
                                               seed=1000 * rep + i, policy=policy)
                        t0 = time.perf_counter()
                        r = eng.generate(inputs, cfg)
                        secs[way] = time.perf_counter() - t0
                        assert len(r.token_ids) == max_new_tokens, (way, len(r.token_ids))
                        if way == "goodput":
                            depths = Counter(r.depths)  # the depth goodput chose at each step
                    rows.append({"category": cat, "temperature": temp, "prompt": i, "repeat": rep, **{f"{w}_s": secs[w] for w in WAYS},
                                 "depths": dict(sorted(depths.items()))})
                    bar.update(1)
    bar.close()
    return {"rows": rows, "summary": summarise(rows, max_new_tokens), "max_new_tokens": max_new_tokens, "repeats": repeats,
            "cost_model": cost.as_dict(),
            "tree": vars(engine.drafter.tree) if engine.drafter.tree is not None else None, "drafter": engine.drafter.name}


def summarise(rows: list[dict[str, Any]], max_new_tokens: int) -> list[dict[str, Any]]:
    out = []
    for key in dict.fromkeys((r["category"], r["temperature"]) for r in rows):
        sel = [r for r in rows if (r["category"], r["temperature"]) == key]
        tps = {w: max_new_tokens * len(sel) / sum(r[f"{w}_s"] for r in sel) for w in WAYS}
        g_vs_plain = [r["plain_s"] / r["goodput_s"] for r in sel]
        f_vs_plain = [r["plain_s"] / r["fixed_s"] for r in sel]
        depths: Counter = Counter()
        for r in sel:
            depths.update({int(k): v for k, v in r["depths"].items()})
        fixed_gain, good_gain = geomean(f_vs_plain), geomean(g_vs_plain)
        out.append({"category": key[0], "temperature": key[1], "prompts": len(sel), **{f"{w}_tok_s": tps[w] for w in WAYS},
                    "goodput_vs_plain": good_gain, "goodput_vs_plain_worst": min(g_vs_plain), "fixed_vs_plain": fixed_gain,
                    "goodput_keeps_of_fixed": good_gain / fixed_gain if fixed_gain > 0 else float("nan"),
                    "depths": dict(sorted(depths.items()))})
    return out


def format_table(report: dict[str, Any]) -> str:
    lines = ["| category | T | plain tok/s | fixed tok/s | goodput tok/s | goodput / plain (worst) | fixed / plain | goodput / fixed | depths chosen |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in report["summary"]:
        depths = ", ".join(f"{d}: {c}" for d, c in s["depths"].items())
        lines.append(f"| {s['category']} | {s['temperature']:g} | {s['plain_tok_s']:.1f} | {s['fixed_tok_s']:.1f} | {s['goodput_tok_s']:.1f} | "
                     f"{s['goodput_vs_plain']:.2f}x ({s['goodput_vs_plain_worst']:.2f}x) | {s['fixed_vs_plain']:.2f}x | "
                     f"{s['goodput_keeps_of_fixed']:.2f} | {depths} |")
    return "\n".join(lines)


__all__ = ["WAYS", "categories", "format_table", "measure", "summarise"]
