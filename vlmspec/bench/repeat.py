"""A workload that repeats (#73): a stated share of the requests ask what an earlier one asked, as a
service sees the same questions, templates and retries again. What a drafter that learns from
traffic (`--drafter suffix`, `hybrid`) is measured on, beside the benches' other mixes.

    plan = repeat_plan(12, share=0.5)   # 12 distinct prompts once each, then each again: a second pass
    plan.items                          # (0, 1, ..., 11, 0, 1, ..., 11): the prompt each request asks
    plan.repeat                         # (False x 12, True x 12)

The distinct prompts come first, in order, then the repeats cycle over them: round(n * s / (1 - s))
repeats for n distinct prompts at share s. `bench run` measures each pass apart (`pass_report`);
`bench load` sends the plan's requests in order. In `bench run` a learning drafter keeps only what
each request's last round answered (the engine's `remember`), so every round of request i drafts
from the answers of requests 0..i-1 alone: a warm-up round never turns a fresh prompt into a repeat.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class RepeatPlan:
    items: tuple[int, ...]  # [request]: the distinct prompt it asks
    repeat: tuple[bool, ...]  # [request]: it asks what an earlier request asked

    @property
    def share(self) -> float:
        return sum(self.repeat) / len(self.repeat) if self.repeat else 0.0


def repeat_plan(distinct: int, share: float) -> RepeatPlan:
    """`distinct` prompts once each, then round(distinct * share / (1 - share)) repeats of them in order."""
    if distinct < 1 or not 0.0 <= share < 1.0:
        raise ValueError(f"need at least one prompt and a repeat share in [0, 1), got {distinct}, {share}")
    repeats = round(distinct * share / (1.0 - share))
    items = tuple(range(distinct)) + tuple(i % distinct for i in range(repeats))
    return RepeatPlan(items, (False,) * distinct + (True,) * repeats)


def spread(ratios: list[float]) -> dict[str, float]:
    """Median, quartiles and range of per-request speed ratios."""
    if not ratios:
        return {}
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3, "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def pass_report(plan: RepeatPlan, summarise: Callable[[Callable[[int], bool]], dict[str, Any]],
                paired: Callable[[str, Callable[[int], bool]], list[float]], methods: list[str]) -> dict[str, Any]:
    """Each pass apart: "first" (the requests that ask something new) and "repeat" (the others), each
    the bench's method summaries over its requests (`summarise(keep)`), and per method the spread of
    its per-request speed over hf_generate's on the same request and round (`paired(method, keep)`)."""
    out: dict[str, Any] = {}
    for name, want in (("first", False), ("repeat", True)):
        def keep(item: int, want: bool = want) -> bool:
            return plan.repeat[item] == want

        if not any(plan.repeat[i] == want for i in range(len(plan.items))):
            continue
        out[name] = {"methods": summarise(keep), "vs_hf_generate": {m: spread(paired(m, keep)) for m in methods}}
    return out


def pass_markdown(passes: dict[str, Any]) -> str:
    """One table per pass: tokens/s, tau, and the per-request speed-up over hf_generate (median, quartiles, range)."""
    lines = []
    for name, part in passes.items():
        title = "first pass (prompts not asked before)" if name == "first" else "repeats (prompts asked before)"
        lines += ["", f"{title}:", "", "| method | tok/s | vs hf_generate (tokens/s) | per request vs hf_generate: median [q1, q3] (min-max) | tau |",
                  "|---|---:|---:|---|---:|"]
        for m, s in part["methods"].items():
            if s.get("error"):
                continue
            sp, tau = part["vs_hf_generate"].get(m, {}), s.get("mean_accepted_length")
            per = f"{sp['median']:.2f}x [{sp['q1']:.2f}, {sp['q3']:.2f}] ({sp['min']:.2f}-{sp['max']:.2f})" if sp else "-"
            ratio = s.get("speedup_vs_hf_generate")
            lines.append(f"| {m} | {s['tokens_per_s']:.1f} | {'-' if ratio is None else f'{ratio:.2f}x'} | {per} | "
                         f"{'-' if tau is None else f'{tau:.2f}'} |")
    return "\n".join(lines)


__all__ = ["RepeatPlan", "pass_markdown", "pass_report", "repeat_plan", "spread"]
