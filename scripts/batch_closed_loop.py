"""The engine alone under closed-loop load: S slots, each refilled from the held-out mix as soon as
its request ends, plain rows against goodput rows, alternating round by round (no HTTP, so what the
batch's controller does shows without the service's own costs).

    PYTHONPATH=<checkout> .venv/bin/python scripts/batch_closed_loop.py [--slots 8] [--requests 32] [--rounds 2] \\
        [--dtype bfloat16] [--no-ignore-eos] [--no-check] [--chains 1,2,3,4] [--kind-chains 3/0/0]

Per round and way: tokens/s over the round, steps, the steps that drafted, tokens per step, the
steps the batch's check held back (`BatchTiming.waits`), the median step, the drafted steps'
times as the check saw them (median and the two slowest), and how many drafted tokens each row's
drafted steps had accepted. `--no-check` lets every step draft what the rows choose (the check
always allows), to see what the check costs or saves. `--chains`
adds ways whose every row drafts a chain of that many levels at every step (the fixed policy): the best of them is what one depth for the whole batch, chosen in hindsight, would have
given, the yardstick of the goodput controller's choice. `--kind-chains 3/0/0,...` adds ways whose rows draft by
their kind (ToyWorld scenes / photographs / text): depths per row, chosen in hindsight per kind. Tokens/s are also given over the decode
steps alone (the round's time less its prefills), and each way's ratio to plain decoding. Run it
with PYTHONPATH set to two checkouts in turn to compare them. It measured the change of
`vlmspec.policy.batch_control.BatchTiming` from decayed means to medians: with the means, a step carrying
the rows' first prompt reads held drafting back for most of a run at 8 slots.
"""
import argparse
import collections
import re
import statistics
import time

import vlmspec.policy.batch_control
from vlmspec.bench.batch import prompts
from vlmspec.policy.control import SpeculationOptions
from vlmspec.draft.base import TreeConfig
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
parser.add_argument("--chains", default="", help="comma-separated depths: a way per depth whose rows draft that deep a chain every step")
parser.add_argument("--kind-chains", default="", help="comma-separated t/p/x plans: a way per plan whose ToyWorld rows draft a chain of t "
                    "levels every step, photographs p, text x (0: plain steps)")
args = parser.parse_args()
for plan in (p for p in args.kind_chains.split(",") if p):
    if not re.fullmatch(r"\d+/\d+/\d+", plan):
        parser.error(f"--kind-chains: a plan is t/p/x, three depths (ToyWorld/photographs/text), e.g. 3/0/0; got {plan!r}")
if args.no_check:
    vlmspec.policy.batch_control.BatchTiming.allows_draft = lambda self, rows: True
_observe = vlmspec.policy.batch_control.BatchTiming.observe
drafted_ms: list[float] = []


def observe(self, cost, rows, depth, seconds, emitted=None, modelled=None):  # the check's own view of each step, recorded
    if depth > 0:
        drafted_ms.append(1e3 * seconds)
    return _observe(self, cost, rows, depth, seconds, emitted, modelled)


vlmspec.policy.batch_control.BatchTiming.observe = observe
engine = build_engine(EngineSpec(dtype=args.dtype, device="cpu", max_batch=max(16, args.slots)))
mix = prompts(engine.target, 12)
Way = tuple[SpeculationOptions, TreeConfig | None]


def chain(depth: int) -> Way:
    """Every step a chain of `depth` levels (0: plain steps)."""
    if depth == 0:
        return SpeculationOptions(policy="fixed", max_depth=0), None
    return SpeculationOptions(policy="fixed"), TreeConfig(depth=depth, top_k=1, total_tokens=depth)


# a way: its options for the mix's ToyWorld rows, photographs and text (row i of the mix is of kind i % 3)
WAYS: dict[str, list[Way]] = {"plain": [chain(0)] * 3, "goodput": [(SpeculationOptions(policy="goodput"), None)] * 3}
for depth in (int(d) for d in args.chains.split(",") if d):
    WAYS[f"chain-{depth}"] = [chain(depth)] * 3
for plan in (p for p in args.kind_chains.split(",") if p):
    WAYS[f"kinds-{plan}"] = [chain(int(d)) for d in plan.split("/")]
rates: dict[str, list[float]] = {name: [] for name in WAYS}


def run(name: str) -> str:
    configs = [GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, speculation=spec, tree=tree)
               for spec, tree in WAYS[name]]
    batch = engine.batch(args.slots, capacity=1024)
    waiting = [(mix[i % len(mix)], configs[i % 3]) for i in range(args.requests)]
    tokens, drafted, step_s, t0 = 0, 0, [], time.perf_counter()
    accepted: collections.Counter[int] = collections.Counter()  # drafted tokens accepted -> row-steps
    drafted_ms.clear()
    while waiting or not batch.idle:
        while waiting and len(batch.waiting) + len(batch.requests) < args.slots:  # closed loop: a slot's next request is ready
            batch.submit(*waiting.pop(0))
        t = time.perf_counter()
        events = batch.step()
        step_s.append(time.perf_counter() - t)
        tokens += sum(len(e.token_ids) for _, e in events)
        drafted += any(e.num_drafted for _, e in events)
        accepted.update(e.num_accepted for _, e in events if e.num_drafted)
    wall = time.perf_counter() - t0
    decode = tokens / (wall - batch.timings["prefill"])
    rates[name].append(tokens / wall)
    return (f"{tokens / wall:6.1f} tokens/s ({decode:6.1f} over the decode steps)  {len(step_s)} steps, {drafted} drafted, {tokens / len(step_s):.2f} tokens a step, "
            f"{batch.draft_waits} held back, median step {1e3 * statistics.median(step_s):.0f} ms"
            + (f"; drafted steps {statistics.median(drafted_ms):.0f} ms, slowest {', '.join(f'{x:.0f}' for x in sorted(drafted_ms)[-2:])}"
               if drafted_ms else "")
            + (f"; row-steps that drafted, by tokens accepted: {', '.join(f'{k}: {n}' for k, n in sorted(accepted.items()))}" if accepted else ""))


for r in range(args.rounds):
    for name in (WAYS if r % 2 == 0 else reversed(list(WAYS))):
        print(f"round {r + 1} {name:11s}" + run(name), flush=True)
print("tokens/s over plain decoding's, round by round: " + "; ".join(
    f"{name} {', '.join(f'{a / p:.2f}' for a, p in zip(rates[name], rates['plain']))}" for name in WAYS if name != "plain"))
