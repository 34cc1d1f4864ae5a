"""What batch invariance would take on this CPU, in fp32 (docs/batching.md, "Exact on any CPU").

1. F.linear at the default model's shapes: at how many row counts M a row's result differs, to the
   bit, from the same row multiplied alone (M = 1), and from the same row among 2.
2. A tiny LLaVA's tree logits for one row alone and beside 1, 3 and 7 other rows: equal to the bit?
   the largest gap.
3. The price of a linear layer that gives every row its numbers alone (each row multiplied on its
   own, M calls of one row) against one call over M rows.

    PYTHONPATH=. .venv/bin/python scripts/batch_invariance.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 PYTHONPATH=. .venv/bin/python scripts/batch_invariance.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from vlmspec.stats import median_ms  # noqa: E402

SHAPES = {"q|k|v": (960, 576), "gate|up": (3072, 576), "down": (576, 1536)}  # the default model's (out, in)


def rows_that_differ(out_f: int, in_f: int, most: int = 64) -> tuple[int, int]:
    """(row counts 2..most at which some row differs from itself alone, ... from itself among 2)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(out_f, in_f, generator=g), torch.randn(most, in_f, generator=g)
    alone = torch.cat([F.linear(x[i : i + 1], w) for i in range(most)])
    pairs = torch.cat([F.linear(x[i : i + 2], w)[:1] for i in range(most - 1)] + [F.linear(x[most - 2 :], w)[1:]])
    vs_alone = sum(not torch.equal(F.linear(x[:m], w), alone[:m]) for m in range(2, most + 1))
    vs_two = sum(not torch.equal(F.linear(x[:m], w), pairs[:m]) for m in range(2, most + 1))
    return vs_alone, vs_two


def main() -> None:
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "default")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATEN_CPU_CAPABILITY={isa}, fp32")
    print("1. F.linear: row counts 2..64 at which a row's result differs to the bit (from alone, from among 2)")
    for name, (o, i) in SHAPES.items():
        print(f"   {name:8s} [{o} x {i}]: {rows_that_differ(o, i)}")
    from conftest import tiny_target
    from test_batch import _row_logits_beside
    from vlmspec.tree import DraftTree

    target = tiny_target("llava")
    tree = DraftTree(torch.tensor([5, 6, 7, 9, 2]), torch.tensor([-1, 0, 0, 1, 3]))
    alone = _row_logits_beside(target, 0, tree)
    print("2. tiny LLaVA, one row's tree logits beside other rows: (equal to the bit, largest gap)")
    for others in (1, 3, 7):
        beside = _row_logits_beside(target, others, tree)
        print(f"   beside {others}: {torch.equal(beside, alone)}, {float((beside - alone).abs().max()):.1e}")
    print("3. one linear layer (gate|up) over M rows: ms for one call, ms for M calls of one row, ratio")
    o, i = SHAPES["gate|up"]
    w = torch.randn(o, i)
    for m in (4, 8, 16, 32):
        x = torch.randn(m, i)
        one = median_ms(x.device, lambda: F.linear(x, w), repeats=100, warmup=10)
        each = median_ms(x.device, lambda: [F.linear(x[r : r + 1], w) for r in range(m)], repeats=100, warmup=10)
        print(f"   M = {m:2d}: {one:.3f} ms, {each:.3f} ms, {each / one:.1f}x")


if __name__ == "__main__":
    with torch.no_grad():
        main()
