"""Acceptance of two drafters of one target on the same prompts: per prompt, the mean accepted length
(tau, bonus token included) of each, and their paired difference with a 90% bootstrap interval
(over prompts). Held-out ToyWorld image prompts (`heldout("drafter-eval", per_task=True)`) and
the held-out text-only instructions (`heldout.TEXT_PROMPTS`, which no drafter here trained on); T=0
and T=1 (seeded per prompt, the same seed for both drafters); the fixed policy (every step drafts
the drafter's full tree), so tau measures the drafter, not the depth policy.

    .venv/bin/python docs/measured/eagle3-vs-eagle1/compare.py --a runs/cmp-e3/drafter --b runs/cmp-e1/drafter \
        --n-image 2 --n-text 8 --max-new-tokens 64 --json docs/measured/eagle3-vs-eagle1/tau.json
"""

import argparse
import json
import random
import time

import torch

from vlmspec import factory
from vlmspec.policy.control import FixedPolicy
from vlmspec.data.heldout import TEXT_PROMPTS, Conversation, heldout
from vlmspec.draft import load_drafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams


def paired_interval(diffs: list[float], draws: int = 4000, level: float = 0.9, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=len(diffs))) / len(diffs) for _ in range(draws))
    cut = int(draws * (1 - level) / 2)
    return means[cut], means[draws - 1 - cut]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--a", required=True)
    p.add_argument("--b", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--n-image", type=int, default=2, help="held-out ToyWorld prompts per task")
    p.add_argument("--n-text", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    torch.set_num_threads(2)
    target = factory.load(factory.EngineSpec(model=args.model, dtype=args.dtype, device="cpu"))
    drafters = {"a": load_drafter(args.a, target), "b": load_drafter(args.b, target)}
    sets = {"image": heldout("drafter-eval", args.n_image, per_task=True),
            "text": [Conversation(t, "", [], "text") for t in TEXT_PROMPTS[: args.n_text]]}
    rows, summary = [], {}
    t0 = time.perf_counter()
    for temp in (float(t) for t in args.temperatures.split(",")):
        for name, prompts in sets.items():
            taus = {"a": [], "b": []}
            for i, c in enumerate(prompts):
                inputs = encode_prompt(target, c.prompt, c.images)
                for key, drafter in drafters.items():
                    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=temp), seed=1000 + i,
                                           policy=FixedPolicy())
                    r = SpecEngine(target, drafter).generate(inputs, cfg)
                    taus[key].append(r.mean_accepted_length)
                    rows.append({"set": name, "T": temp, "prompt": i, "task": c.task, "drafter": key, "tau": r.mean_accepted_length,
                                 "steps": r.stats.num_drafts, "tokens": len(r.token_ids),
                                 "reached_per_pos": list(r.stats.reached_per_pos), "accepted_per_pos": list(r.stats.accepted_per_pos)})
            diffs = [a - b for a, b in zip(taus["a"], taus["b"])]
            by_depth = {}  # acceptance at depth d given a node there was drafted, over the set's steps
            for key in ("a", "b"):
                mine = [r for r in rows if r["set"] == name and r["T"] == temp and r["drafter"] == key]
                width = max(len(r["reached_per_pos"]) for r in mine)
                reached = [sum(r["reached_per_pos"][d] for r in mine if d < len(r["reached_per_pos"])) for d in range(width)]
                accepted = [sum(r["accepted_per_pos"][d] for r in mine if d < len(r["accepted_per_pos"])) for d in range(width)]
                by_depth[key] = [round(a / n, 3) if n else None for a, n in zip(accepted, reached)]
            lo, hi = paired_interval(diffs)
            key = f"{name}_T{temp:g}"
            summary[key] = {"n": len(prompts), "tau_a": sum(taus["a"]) / len(prompts), "tau_b": sum(taus["b"]) / len(prompts),
                            "diff_mean": sum(diffs) / len(diffs), "diff_90": [lo, hi],
                            "acceptance_by_depth_a": by_depth["a"], "acceptance_by_depth_b": by_depth["b"]}
            print(key, json.dumps(summary[key]), flush=True)
    out = {"a": args.a, "b": args.b, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "policy": "fixed",
           "summary": summary, "rows": rows, "seconds": time.perf_counter() - t0}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
