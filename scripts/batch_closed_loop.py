"""The engine alone under closed-loop load: S slots, each refilled from the held-out mix as soon as
its request ends, plain rows against goodput rows, alternating round by round (no HTTP, so what the
batch's controller does shows without the service's own costs).

    PYTHONPATH=<checkout> .venv/bin/python scripts/batch_closed_loop.py [--slots 8] [--requests 32] [--rounds 2] \\
        [--dtype bfloat16] [--no-ignore-eos] [--no-check]

Per round and way: tokens/s over the round, steps, the steps that drafted, tokens per step, the
steps the batch's check held back (`BatchTiming.waits`), the median step, and the drafted steps'
times as the check saw them (median and the two slowest). `--no-check` lets every
step draft what the rows choose (the check always allows), to see what the check costs or saves.
Run it with PYTHONPATH set to two checkouts in turn to compare them. It measured the change of
`vlmspec.batch_control.BatchTiming` from decayed means to medians: with the means, a step carrying
the rows' first prompt reads held drafting back for most of a run at 8 slots.
"""
import argparse
import statistics
import time

import vlmspec.batch_control
from vlmspec.bench.batch import prompts
from vlmspec.control import SpeculationOptions
from vlmspec.engine import GenerationConfig
from vlmspec.factory import EngineSpec, build_engine

parser = argparse.ArgumentParser()
parser.add_argument("--slots", type=int, default=8)
parser.add_argument("--requests", type=int, default=32)
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
parser.add_argument("--no-check", action="store_true", help="the batch's check of its drafted steps always allows drafting")
args = parser.parse_args()
if args.no_check:
    vlmspec.batch_control.BatchTiming.allows_draft = lambda self, rows: True
_observe = vlmspec.batch_control.BatchTiming.observe
drafted_ms: list[float] = []


def observe(self, cost, rows, depth, seconds, emitted=None):  # the check's own view of each step, recorded
    if depth > 0:
        drafted_ms.append(1e3 * seconds)
    return _observe(self, cost, rows, depth, seconds, emitted)


vlmspec.batch_control.BatchTiming.observe = observe
engine = build_engine(EngineSpec(dtype=args.dtype, device="cpu", max_batch=max(16, args.slots)))
mix = prompts(engine.target, 12)
WAYS = {"plain": SpeculationOptions(policy="fixed", max_depth=0), "goodput": SpeculationOptions(policy="goodput")}


def run(spec: SpeculationOptions) -> str:
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, speculation=spec)
    batch = engine.batch(args.slots, capacity=1024)
    waiting = [mix[i % len(mix)] for i in range(args.requests)]
    tokens, drafted, step_s, t0 = 0, 0, [], time.perf_counter()
    drafted_ms.clear()
    while waiting or batch.requests:
        while waiting and not batch.full:
            batch.add(waiting.pop(0), config)
        t = time.perf_counter()
        events = batch.step()
        step_s.append(time.perf_counter() - t)
        tokens += sum(len(e.token_ids) for _, e in events)
        drafted += any(e.num_drafted for _, e in events)
    wall = time.perf_counter() - t0
    return (f"{tokens / wall:6.1f} tokens/s  {len(step_s)} steps, {drafted} drafted, {tokens / len(step_s):.2f} tokens a step, "
            f"{batch.draft_waits} held back, median step {1e3 * statistics.median(step_s):.0f} ms"
            + (f"; drafted steps {statistics.median(drafted_ms):.0f} ms, slowest {', '.join(f'{x:.0f}' for x in sorted(drafted_ms)[-2:])}"
               if drafted_ms else ""))


for r in range(args.rounds):
    for name in (WAYS if r % 2 == 0 else reversed(list(WAYS))):
        print(f"round {r + 1} {name:8s}" + run(WAYS[name]), flush=True)
