"""The goodput policy's cost model, measured through the engine: seconds per step at each drafted
depth (`measure_cost`), next to the controller that reads it (`vlmspec.control`) and the target's
own tree timing it falls back on (`vlmspec.target.timing`).

    cost = measure_cost(engine, encode_prompt(engine.target, COST_PROMPT))   # CostModel
    SpecEngine(target, drafter, Speculation("goodput", cost))
"""

from __future__ import annotations

from vlmspec.control import CostModel, FixedPolicy
from vlmspec.draft.base import TreeConfig
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.target.timing import time_tree_extras

COST_PROMPT = "Write a short story about a lighthouse keeper."


def tree_nodes(tree: TreeConfig, depth: int) -> int:
    """Drafted nodes of a `tree` cut at `depth` levels with top_k new nodes per level (the n-gram
    drafter's branches; the fewest an EAGLE-2 tree of that depth verifies)."""
    return min(tree.total_tokens, depth * tree.top_k)


def measure_cost(engine: SpecEngine, inputs: dict, depths: tuple[int, ...] | None = None, tokens: int = 16, repeats: int = 3,
                 prefix: int = 256) -> CostModel:
    """The cost model of the goodput policy: seconds per engine step at each drafted depth (default
    every depth from 0 to the drafter's full depth, or the default tree's for a drafter without
    one), fitted into a `CostModel` (its table holds each measured depth).

    Each depth's step is timed through the engine on `inputs` (greedy, `tokens` new tokens, the
    fastest of `repeats` rounds over all depths, so a drifting machine moves them together): the
    drafter and the verify of the trees it really proposed (an EAGLE-2 tree fills its whole budget
    from depth 2 on). A drafter that proposed fewer nodes per step than `tree_nodes` there (n-gram
    on a fresh text finds nothing to propose) would look free to the policy, so the verify cost of
    the missing nodes is added, timed on the target directly (`time_tree_extras`, a `prefix`-token
    context, the one-token step and each tree back to back)."""
    tree = engine.drafter.tree or TreeConfig()
    depths = tuple(sorted({0, *(depths or range(tree.depth + 1))}))
    best = dict.fromkeys(depths, float("inf"))  # [depth]: fastest seconds per step
    nodes = dict.fromkeys(depths, float("inf"))  # [depth]: fewest nodes drafted per step at that depth (mean of a run)
    for _ in range(repeats):
        for depth in depths:
            gen = engine.stream(inputs, GenerationConfig(max_new_tokens=max(tokens, depth + 2), ignore_eos=True, policy=FixedPolicy(depth)))
            drafted = [e.num_drafted for e in gen if e.depth == depth]  # steps at this depth (not the prefill, not the capped last ones)
            r = gen.result
            assert r is not None
            best[depth] = min(best[depth], sum(v for k, v in r.timings.items() if k != "prefill") / max(r.stats.num_drafts, 1))
            nodes[depth] = min(nodes[depth], sum(drafted) / max(len(drafted), 1))
    short = {d: (1 + round(nodes[d]), 1 + tree_nodes(tree, d)) for d in depths if d > 0 and nodes[d] < tree_nodes(tree, d)}
    extra_ms: dict[int, float] = {}
    if short:
        prefix = max(1, min(prefix, engine.target.max_positions - 2 - tree.total_tokens))  # a short context's model
        extra_ms = time_tree_extras(engine.target, prefix, sorted({n for pair in short.values() for n in pair} - {1}), rounds=5, warmup=1)
        extra_ms[1] = 0.0
    samples = {d: best[d] for d in depths}
    for depth, (drafted, full) in short.items():
        samples[depth] += max(extra_ms[full] - extra_ms[drafted], 0.0) / 1e3
    return CostModel.fit(samples)


__all__ = ["COST_PROMPT", "measure_cost", "tree_nodes"]
