"""Host work of the batched EAGLE drafting: operations dispatched per draft step, by batch size.

    PYTHONPATH=<checkout> .venv/bin/python scripts/draft_ops.py [--model toy] [--depth 4]

Where a GPU waits on its host (small models, e.g. the default one on an H100), each dispatched
operation is host time, and what a batch adds per row is what batching pays for. B copies of one
held-out request decode 24 tokens together at a fixed depth; every operation the drafter's
proposals dispatch is counted (views excluded: they launch nothing), and the median over the steps
after the first (which runs the prompts) is printed per B, with the growth per row. For comparing
two checkouts; it uses only APIs that exist in both the batched engine and the stacked growth.
"""
import argparse
import statistics

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlmspec.policy.control import FixedPolicy
from vlmspec.data.heldout import heldout
from vlmspec.engine import GenerationConfig
from vlmspec.factory import EngineSpec, build_engine
from vlmspec.inputs import encode_prompt


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view
        return func(*args, **(kwargs or {}))


parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="default: the default model")
parser.add_argument("--depth", type=int, default=4)
parser.add_argument("--sizes", default="1,4,8,16")
args = parser.parse_args()
engine = build_engine(EngineSpec(model=args.model, dtype="float32", device="cpu"))
conv = heldout("bench", 1, split="test")[0]
inputs = encode_prompt(engine.target, conv.prompt, conv.images)
counts: list[int] = []
propose = type(engine.drafter).propose_batch


def counted(self, *a, **k):
    with Ops() as ops:
        out = propose(self, *a, **k)
    counts.append(ops.n)
    return out


type(engine.drafter).propose_batch = counted
first = None
for b in (int(x) for x in args.sizes.split(",")):
    counts.clear()
    batch = engine.batch(b)
    for _ in range(b):
        batch.submit(inputs, GenerationConfig(max_new_tokens=24, ignore_eos=True, policy=FixedPolicy(args.depth)))
    with torch.no_grad():
        while not batch.idle:
            batch.step()
    ops = statistics.median(counts[1:])
    first = first if first is not None else (b, ops)
    per_row = f"{(ops - first[1]) / (b - first[0]):.0f}" if b != first[0] else "-"
    print(f"B={b:<3} operations per draft step: {ops:.0f}  (per row beyond B={first[0]}: {per_row})")
