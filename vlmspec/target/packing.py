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
every linear weight kept beside the weight. `python -m vlmspec.target.packing --model DIR` times a
target's decode steps both ways and compares their logits.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForImageTextToText, DynamicCache

from vlmspec.kernels.packed_linear import ExactPackedLinear, exact_rows
from vlmspec.kv_cache import cache_kwarg
from vlmspec.memory import rss_bytes
from vlmspec.onednn import bound_shape_caches
from vlmspec.stats import median_ms


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


def _time_target(model_dir: str, rounds: int) -> None:
    """A target's one-token step over a 200-token cache at 1 and 8 rows, bf16, with F.linear and
    with its exact packed layers, taking turns: ms per step, and whether the logits are equal."""
    bound_shape_caches()  # as the composition root does
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    plain = {(p, n): c for p in model.modules() for n, c in p.named_children() if type(c) is torch.nn.Linear}
    copies = sum(c.weight.numel() * c.weight.element_size() for c in plain.values()) / 2**20
    before, probe = rss_bytes(), time.perf_counter()
    found = pack_exact_linears(model)
    probe = time.perf_counter() - probe
    packed = {(p, n): getattr(p, n) for p, n in plain}
    print(f"probed in {probe:.1f} s; resident memory +{(rss_bytes() - before) / 2**20:.0f} MiB (the packed copies of "
          f"{len(plain)} layers' weights are {copies:.0f} MiB, the rest the primitives the probe built); rows packed per shape {found}")
    g = torch.Generator().manual_seed(0)
    for rows in (1, 8):
        ids = torch.randint(0, model.config.get_text_config().vocab_size, (rows, 201), generator=g)
        times: dict[str, list[float]] = {"F.linear": [], "packed": []}
        logits: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            cache = DynamicCache()
            model.get_decoder()(input_ids=ids[:, :200], use_cache=True, **cache_kwarg(model.get_decoder(), cache))

            def step() -> torch.Tensor:  # the 201st token's logits; `cache.crop(-1)` takes its entry out again
                return model(input_ids=ids[:, 200:], **cache_kwarg(model, cache)).logits

            for _ in range(rounds):
                for way, layers in (("F.linear", plain), ("packed", packed)):
                    for (p, n), layer in layers.items():
                        setattr(p, n, layer)
                    logits[way] = step()
                    cache.crop(-1)
                    times[way].append(median_ms(torch.device("cpu"), step, repeats=10, warmup=3, after=lambda: cache.crop(-1)))
        print(f"{rows} row(s), a one-token step, ms per round: " + "; ".join(f"{w} {', '.join(f'{t:.1f}' for t in ts)}" for w, ts in times.items())
              + f"; logits equal to the bit: {torch.equal(logits['F.linear'], logits['packed'])}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m vlmspec.target.packing", description=_time_target.__doc__)
    parser.add_argument("--model", required=True, help="a target folder (e.g. models/smolvlm-toyworld)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    _time_target(args.model, args.rounds)


__all__ = ["pack_exact_linears"]

if __name__ == "__main__":
    main()
