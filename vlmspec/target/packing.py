"""A target's linear layers over weights packed once for oneDNN, where that changes no number.

In bf16 a CPU linear layer goes to oneDNN, which reorders the weight into its blocked layout on
every call; at a decode step's few rows the reorder is a large part of the call. A weight packed
once skips it (`vlmspec.kernels.packed_linear`), and at those few rows oneDNN computes the same
numbers either way, but not at every row count of a prompt, where it picks other kernels. The
target's tokens are the answer, so `pack_exact_linears` probes each weight shape once, at every row
count up to a bound, and a layer multiplies by its packed copy only for inputs of at most as many
rows as the probe found equal to the bit (`ExactPackedLinear`); everything else runs F.linear as
before. In float32 F.linear goes to MKL, which no packed product equals: nothing is packed.
`load_target` calls it on a CPU (`--no-packed-weights` to skip); the price is a packed copy of
every linear weight kept beside the weight. `python -m recipes kernels packing --model DIR` times a
target's decode steps both ways and compares their logits.
"""

from __future__ import annotations

import torch

from vlmspec.kernels.packed_linear import ExactPackedLinear, exact_rows


def pack_exact_linears(model: torch.nn.Module, most: int = 64) -> dict[str, int]:
    """Every plain `nn.Linear` of `model` whose packed product equals F.linear's at 1 to R rows
    (`exact_rows`, probed once per weight shape, with this process's threads) becomes an
    `ExactPackedLinear` up to R rows, in place. Returns {'NxK[+bias]': R} per shape probed (R = 0:
    left as it was). Call it after the model has its final device and dtype, before hooks."""
    found: dict[str, int] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            key = f"{child.out_features}x{child.in_features}{'+bias' if child.bias is not None else ''}:{child.weight.dtype}"
            if key not in found:
                found[key] = exact_rows(child, most)
            if found[key]:
                setattr(parent, name, ExactPackedLinear.wrap(child, found[key]))
    return found


__all__ = ["pack_exact_linears"]
