"""Where a batched step's time goes, by phase, at each drafted depth: what a drafted step costs
over a plain one.

    PYTHONPATH=<checkout> .venv/bin/python scripts/step_phases.py [--slots 8] [--depths 0,1,3] [--rounds 2] [--dtype bfloat16]

S rows of the batched benches' held-out mix (ToyWorld scenes, photographs, text) decode together
under the fixed policy, every row drafting a chain of D levels at every step (D = 0: plain steps);
after two steps (the prefills, the drafter's read of the prompts) it times 30 steps and prints the
median step and the median of each phase the engine times (`Batch.timings`: draft, verify with
the target's forward, commit, other). The depths take turns, round after round, so a machine
that slows down for a while slows them alike.
"""
import argparse
import statistics
import time

from vlmspec.bench.batch import prompts
from vlmspec.policy.control import SpeculationOptions
from vlmspec.draft.base import TreeConfig
from vlmspec.engine import GenerationConfig
from vlmspec.factory import EngineSpec, build_engine

parser = argparse.ArgumentParser()
parser.add_argument("--slots", type=int, default=8)
parser.add_argument("--depths", default="0,1,3")
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--dtype", default="bfloat16")
args = parser.parse_args()
engine = build_engine(EngineSpec(dtype=args.dtype, device="cpu", policy="fixed"))
mix = prompts(engine.target, 12)


def run(depth: int) -> str:
    chain = TreeConfig(depth=max(depth, 1), top_k=1, total_tokens=max(depth, 1))
    config = GenerationConfig(max_new_tokens=(args.steps + 2) * (depth + 1) + 1, ignore_eos=True,
                              speculation=SpeculationOptions(policy="fixed", max_depth=depth), tree=chain)
    batch = engine.batch(args.slots, capacity=1024)
    for i in range(args.slots):
        batch.submit(mix[i % len(mix)], config)
    batch.step()
    batch.step()
    steps, phases = [], {key: [] for key in batch.timings}
    for _ in range(args.steps):
        before, t0 = dict(batch.timings), time.perf_counter()
        batch.step()
        steps.append(time.perf_counter() - t0)
        for key in phases:
            phases[key].append(batch.timings[key] - before[key])
    for req in list(batch.requests):
        batch.cancel(req)
    return f"step {1e3 * statistics.median(steps):.1f} ms; " + ", ".join(
        f"{key} {1e3 * statistics.median(v):.1f}" for key, v in phases.items() if key != "prefill")


for r in range(args.rounds):
    for depth in (int(d) for d in args.depths.split(",")):
        print(f"round {r + 1}, {args.slots} rows, chains of {depth} levels: {run(depth)}", flush=True)
