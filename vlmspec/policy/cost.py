"""The goodput policy's cost model, measured through the engine: seconds per step at each drafted
depth (`measure_cost`), next to the controller that reads it (`vlmspec.policy.control`) and the target's
own tree timing it falls back on (`vlmspec.target.timing`).

    cost = measure_cost(engine, encode_prompt(engine.target, COST_PROMPT))   # CostModel
    SpecEngine(target, drafter, Speculation("goodput", cost))
    cost, batch_cost = measured_costs(engine, batch_sizes=(2, 4, 8))          # both, through the cache

Measuring takes tens of seconds on a CPU, so `measured_costs` keeps what it measured in a cache file
per model, drafter, device, dtype, attention, thread count and versions (`cost_cache_dir()`), and measures
again when any of them changes. A table measured while another process had the cores would be kept
for good, so a batched table that cannot be this machine's (`implausible`: fewer rows measured far
slower than more rows) is measured again, and kept only once it is plausible.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vlmspec.policy.control import BatchCost, CostModel, FixedPolicy
from vlmspec.draft.base import TreeConfig
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.stats import percentile
from vlmspec.target.timing import time_tree_extras

COST_PROMPT = "Write a short story about a lighthouse keeper."
IMPLAUSIBLE = 2.0  # a step of fewer rows measured this many times one of more rows, same depth: the machine was busy
MEASURE_ATTEMPTS = 2  # measurements of an implausible table before the last is used for the run (and not kept)
CACHE_VERSION = 6  # bump when what is measured, or how, changes, or what a step costs (older files are then not read)


def tree_nodes(tree: TreeConfig, depth: int) -> int:
    """Drafted nodes of a `tree` cut at `depth` levels with top_k new nodes per level (the n-gram
    drafter's branches; the fewest an EAGLE-2 tree of that depth verifies)."""
    return min(tree.total_tokens, depth * tree.top_k)


def cost_depths(depth: int) -> tuple[int, ...]:
    """The depths a cost model is measured at: every one up to 8, then every half again (12, 18, ...)
    and `depth` itself; `CostModel.fit` reads between them linearly. A deep tree (the suffix
    drafter's 24 levels) is then measured at 12 depths, not 25."""
    out, d = list(range(min(depth, 8) + 1)), 8
    while d * 3 // 2 < depth:
        d = d * 3 // 2
        out.append(d)
    return tuple(sorted({*out, depth}))


def measure_cost(engine: SpecEngine, inputs: dict, depths: tuple[int, ...] | None = None, tokens: int = 16, repeats: int = 3,
                 prefix: int = 256) -> CostModel:
    """The cost model of the goodput policy: seconds per engine step at each drafted depth (default
    every depth from 0 to the drafter's full depth, or the default tree's for a drafter without
    one; past depth 8 at `cost_depths`), fitted into a `CostModel` (its table holds each measured depth).

    Each depth's step is timed through the engine on `inputs` (greedy, `tokens` new tokens, the
    fastest of `repeats` rounds over all depths, so a drifting machine moves them together): the
    drafter and the verify of the trees it really proposed (an EAGLE-2 tree fills its whole budget
    from depth 2 on). A drafter that proposed fewer nodes per step than `tree_nodes` there (n-gram
    on a fresh text finds nothing to propose) would look free to the policy, so the verify cost of
    the missing nodes is added, timed on the target directly (`time_tree_extras`, a `prefix`-token
    context, the one-token step and each tree back to back)."""
    tree = engine.drafter.tree or TreeConfig()
    depths = tuple(sorted({0, *(depths or cost_depths(tree.depth))}))
    best = dict.fromkeys(depths, float("inf"))  # [depth]: fastest seconds per step
    nodes = dict.fromkeys(depths, float("inf"))  # [depth]: fewest nodes drafted per step at that depth (mean of a run)
    for _ in range(repeats):
        for depth in depths:
            gen = engine.stream(inputs, GenerationConfig(max_new_tokens=max(tokens, depth + 2), ignore_eos=True, policy=FixedPolicy(depth),
                                                     remember=False))
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


def measure_batch_cost(engine: SpecEngine, inputs: dict, sizes: tuple[int, ...], depths: tuple[int, ...] | None = None,
                       tokens: int = 12, repeats: int = 2, single: CostModel | None = None) -> BatchCost:
    """Seconds per batched step by batch size: for each B in `sizes`, B copies of `inputs` decoded
    together, the step's depth taking each of `depths` in turn (default 0, 1, 2 and the tree's full
    depth; `tokens * repeats` steps at each), each step timed and filed under the depth it really
    drafted (a drafter's stop rule ends a chain early), the lower quartile of each depth's steps
    fitted into one `CostModel` per size. The depths alternate step by step in one batch, so a machine
    that slows down for a while (another process, a clock change) slows them alike and the table's
    ratios between depths, which the controller reads, hold. B = 1 is `single` (measured by
    `measure_cost` when not given). In a batch a goodput row drafts a chain (`control.batch_chains`),
    so the rows here draft chains: one node per level, D nodes at depth D."""
    tree = engine.drafter.tree or TreeConfig()
    depths = tuple(sorted({0, *(depths or (1, 2, tree.depth))} & set(range(tree.depth + 1))))
    by_size = [(1, single or measure_cost(engine, inputs))]
    steps = tokens * repeats * len(depths)
    chain = dataclasses.replace(tree, top_k=1, total_tokens=max(max(depths), 1))
    config = GenerationConfig(max_new_tokens=steps * (max(depths) + 1) + 2, ignore_eos=True, policy=_TakingTurns(depths), tree=chain,
                              remember=False)
    for size in sorted({b for b in sizes if b > 1}):
        seconds: dict[int, list[float]] = {}  # [depth the step really drafted]: its seconds
        asked: dict[int, list[float]] = {}  # [depth asked for]: the same (a drafter that proposed nothing here)
        batch = engine.batch(size)
        for _ in range(size):
            batch.submit(inputs, config)
        batch.step()  # the prefills' tokens and the first round (it drafts over the whole prompt)
        for _ in range(steps):
            t0 = time.perf_counter()
            events = batch.step()
            took = time.perf_counter() - t0
            if len(events) < size:  # a row had left (its context was full): no longer a step of B rows
                break
            drafted = max((e.num_drafted for _, e in events), default=0)  # a chain's nodes are its levels
            depth = max(e.depth for _, e in events)  # the depth this step's turn asked for
            asked.setdefault(depth, []).append(took)
            if drafted > 0 or depth == 0:
                seconds.setdefault(drafted, []).append(took)
        for req in list(batch.requests):
            batch.cancel(req)
        samples = seconds if len(seconds) > 1 else asked  # an n-gram drafter on a fresh prompt proposes nothing
        by_size.append((size, CostModel.fit({d: percentile(ts, 25) for d, ts in samples.items()})))  # a fast step, not a lucky one
    return BatchCost(tuple(by_size))


@dataclasses.dataclass(frozen=True)
class _TakingTurns:
    """A policy whose controller drafts `depths` in turn, one per step (`measure_batch_cost`): every
    row of a batch started together takes the same depth at each step."""

    depths: tuple[int, ...]
    name: str = "fixed"

    def start(self) -> "_Turns":
        return _Turns(self.depths)


class _Turns:
    def __init__(self, depths: tuple[int, ...]) -> None:
        self.depths, self.steps = depths, 0

    def choose(self, max_depth: int) -> int:
        depth = self.depths[self.steps % len(self.depths)]
        self.steps += 1
        return min(depth, max_depth)

    def observe(self, depth: int, num_accepted: int, seconds: float | None = None, chain_accepted: int | None = None,
                chain: bool = False) -> None:
        return None


def cost_cache_dir() -> Path:
    """Where measured cost models are kept: $VLMSPEC_CACHE_DIR, else $XDG_CACHE_HOME/vlmspec, else ~/.cache/vlmspec."""
    if os.environ.get("VLMSPEC_CACHE_DIR"):
        return Path(os.environ["VLMSPEC_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlmspec"


def fingerprint(module: torch.nn.Module | None) -> str:
    """A short digest of a module's weights (names, shapes and sums of its first and last tensors):
    other weights in the same folder give another digest. '' for no module."""
    if module is None:
        return ""
    params = list(module.state_dict().items())
    h = hashlib.sha256()
    for name, t in params[:4] + params[-4:]:
        t = t.detach().float()
        h.update(f"{name}{tuple(t.shape)}{float(t.sum()):.9e}{float(t.abs().sum()):.9e}".encode())
    h.update(str(len(params)).encode())
    return h.hexdigest()[:16]


def cost_key(engine: SpecEngine, batch_sizes: tuple[int, ...]) -> dict[str, Any]:
    """What a measured cost depends on: the model and its weights, the drafter and its weights and
    tree, the device, dtype, attention, packed layers and thread count, torch's and transformers' versions, the sizes measured."""
    import transformers

    target, drafter = engine.target, engine.drafter
    tree = drafter.tree
    head = getattr(drafter, "head", None)  # a trained head's weights (self-speculation reads the target's own: its name says which)
    return {"version": CACHE_VERSION, "model": target.name, "model_weights": fingerprint(target.model),
            "drafter": drafter.name, "drafter_weights": fingerprint(head if isinstance(head, torch.nn.Module) else None),
            "drafter_options": repr(getattr(drafter, "stop_threshold", None)),
            "tree": None if tree is None else [tree.depth, tree.top_k, tree.total_tokens],
            "device": str(target.device), "dtype": str(target.dtype), "attention": target.attention, "threads": torch.get_num_threads(),
            "packed_layers": target.packed_layers,
            "torch": torch.__version__, "transformers": transformers.__version__, "batch_sizes": sorted(set(batch_sizes) | {1})}


def implausible(batch: BatchCost | None) -> list[str]:
    """What in a measured batch cost cannot be the machine's own, one line each: a step of fewer rows
    measured at least `IMPLAUSIBLE` times a step of more rows at the same depth (batch sizes above
    one, which are measured the same way). A step never gets cheaper with more rows; a table
    measured while another process took the cores for a while shows it (a 4-row plain step at
    102 ms beside an 8-row one at 41 ms, bf16 on the default model, with the test suite running)."""
    sizes = [(b, m) for b, m in (batch.by_size if batch else ()) if b > 1]
    found = []
    for i, (few, small) in enumerate(sizes):
        for many, large in sizes[i + 1:]:
            for depth in range(min(len(small.by_depth), len(large.by_depth)) + 1):
                if small.seconds(depth) >= IMPLAUSIBLE * large.seconds(depth):
                    found.append(f"a step of {few} rows drafting {depth} levels measured {1e3 * small.seconds(depth):.1f} ms, "
                                 f"one of {many} rows {1e3 * large.seconds(depth):.1f} ms")
    return found


def measured_costs(engine: SpecEngine, batch_sizes: tuple[int, ...] = (), cache_dir: Path | None = None,
                   log=None) -> tuple[CostModel, BatchCost | None]:
    """The goodput policy's cost model (batch 1) and, for `batch_sizes` beyond 1, the batched one:
    read from the cache when measured before for the same `cost_key` (and plausible), else measured
    (saying so on `log`, default stderr, with how long it took), again while `implausible`, up to
    `MEASURE_ATTEMPTS` times, and saved once plausible."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    key = cost_key(engine, batch_sizes)
    folder = cache_dir or cost_cache_dir()
    path = folder / f"cost-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if data["key"] == key:
                batch = BatchCost.from_dict(data["batch"]) if data.get("batch") else None
                kept_problems = implausible(batch)
                if not kept_problems:
                    return CostModel.from_dict(data["single"]), batch
                log(f"vlmspec: the cost model kept in {path} is implausible ({kept_problems[0]}); measuring again")
        except (OSError, ValueError, KeyError, TypeError) as err:
            log(f"vlmspec: ignoring an unreadable cost cache {path} ({err}); measuring again")
    sizes = tuple(b for b in sorted(set(batch_sizes)) if b > 1)
    log(f"vlmspec: measuring the goodput policy's cost model for {engine.target.name} with {engine.drafter.name} "
        f"on {engine.target.device} ({str(engine.target.dtype).replace('torch.', '')})"
        + (f", batch sizes 1, {', '.join(map(str, sizes))}" if sizes else "") + ": once, kept in " + str(folder))
    inputs = encode_prompt(engine.target, COST_PROMPT)
    for attempt in range(1, MEASURE_ATTEMPTS + 1):
        t0 = time.perf_counter()
        single = measure_cost(engine, inputs)
        batch = measure_batch_cost(engine, inputs, sizes, single=single) if sizes else None
        log(f"vlmspec: cost model measured in {time.perf_counter() - t0:.1f} s")
        problems = implausible(batch)
        if not problems:
            break
        log(f"vlmspec: the cost model measured implausibly ({problems[0]}: was another process busy?); "
            + ("measuring again" if attempt < MEASURE_ATTEMPTS else "using it for this run only, not kept: the next start measures again"))
    if problems:
        return single, batch
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "single": single.as_dict(), "batch": batch.as_dict() if batch else None}, indent=1))
        tmp.replace(path)
    except OSError as err:
        log(f"vlmspec: could not keep the cost model in {folder} ({err}); the next start measures again")
    return single, batch


__all__ = ["COST_PROMPT", "cost_cache_dir", "cost_key", "fingerprint", "implausible", "measure_batch_cost", "measure_cost", "measured_costs",
           "tree_nodes"]
