"""`vlmspec train`'s evaluations: the mean accepted length on held-out prompts, and SpecDec++'s
stop threshold chosen on validation prompts by modelled goodput."""

from __future__ import annotations

from typing import Any

import torch

from vlmspec.policy.control import CostModel, FixedPolicy
from vlmspec.data.heldout import Conversation
from vlmspec.draft.eagle import EagleDrafter, EagleHead, build_head
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_messages, encode_prompt, user_turn
from vlmspec.sampling import SamplingParams
from vlmspec.stats import SpecStats
from vlmspec.target import Target
from vlmspec.train.data import messages


@torch.no_grad()
def accepted_length(
    target: Target,
    drafter: Any,
    prompts: list[Conversation],
    temperature: float = 0.0,
    max_new_tokens: int = 96,
) -> dict[str, float]:
    """Mean accepted length (bonus included, `SpecStats.mean_accepted_length`) per task and
    overall ("all"), over the given prompts: each generation's stats added up per task."""
    return {task: stats.mean_accepted_length for task, stats in speculation_stats(target, drafter, prompts, temperature, max_new_tokens).items()}


def speculation_stats(target: Target, drafter: Any, prompts: list[Conversation], temperature: float = 0.0,
                      max_new_tokens: int = 96) -> dict[str, SpecStats]:
    """Each task's `SpecStats` and all of them ("all"), over the given prompts. A conversation with
    a follow-up turn whose answer is empty (`heldout.eval_set("followup")`) is a dialogue: its first
    answer is the target's own, written greedily first (not counted), and the follow-up's is measured."""
    engine = SpecEngine(target, drafter)
    per: dict[str, SpecStats] = {}
    total = SpecStats()
    for i, c in enumerate(prompts):
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=temperature), seed=i)
        inputs = encode_prompt(target, c.prompt, c.images)
        if c.followups and not c.followups[-1][1]:
            first = engine.generate(inputs, GenerationConfig(max_new_tokens=max_new_tokens))
            answer = target.tokenizer.decode(first.token_ids, skip_special_tokens=True)
            turns = messages(c.prompt, len(c.images), answer, list(c.followups[:-1])) + user_turn(c.followups[-1][0])
            inputs = encode_messages(target, turns, c.images)
        r = engine.generate(inputs, cfg)
        task = per.setdefault(c.task, SpecStats())
        task += r.stats
        total += r.stats
    return {**per, "all": total}


STOP_GRID = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def choose_stop_threshold(target: Target, drafter: EagleDrafter, prompts: list[Conversation], cost: CostModel,
                          grid: tuple[float, ...] = STOP_GRID, max_new_tokens: int = 96) -> tuple[float, list[dict[str, float]]]:
    """SpecDec++'s threshold, chosen on validation prompts: greedy generations at the drafter's
    full depth under each threshold of `grid`, scored by modelled goodput = emitted tokens /
    the `cost` model's seconds for the levels each step grew (counted, so the choice does not ride
    on this machine's timing noise). Returns (best threshold, one row per threshold); ties go to
    the lower threshold."""
    rows = []
    for thr in grid:
        engine = SpecEngine(target, EagleDrafter(drafter.head, drafter.tree, thr))
        total = SpecStats()
        for i, c in enumerate(prompts):
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, seed=i, policy=FixedPolicy())
            total += engine.generate(encode_prompt(target, c.prompt, c.images), cfg).stats
        levels = sum(total.reached_per_pos)
        reached = [total.num_drafts, *total.reached_per_pos, 0]  # [d]: steps that grew at least d levels
        seconds = sum((reached[d] - reached[d + 1]) * cost.seconds(d) for d in range(len(reached) - 1))  # steps of exactly d levels
        rows.append({"threshold": thr, "tau": total.mean_accepted_length, "levels_per_step": levels / max(total.num_drafts, 1),
                     "drafted_per_accepted": total.num_draft_tokens / max(total.num_accepted_tokens, 1),
                     "modelled_tokens_per_s": total.num_emitted_tokens / seconds})
    best = max(rows, key=lambda r: (r["modelled_tokens_per_s"], -r["threshold"]))
    return best["threshold"], rows


def inference_copy(head: EagleHead, target: Target) -> EagleHead:
    """`head` as inference runs it: itself for a float32 target, else a copy in the target's dtype
    (evaluation during training must not round the float32 weights it trains)."""
    if target.dtype == torch.float32:
        return head
    twin = build_head(head.config, target.input_embeddings(), target.output_embeddings(), target.attention)
    twin.load_state_dict(head.state_dict(), strict=True)
    return twin.to(device=target.device, dtype=target.dtype).eval()
