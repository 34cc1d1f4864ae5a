"""Timing the target's own forwards: the verify cost that sizes trees (`vlmspec bench verify-cost`)
and the cost model of the goodput policy (`vlmspec.policy.cost.measure_cost`) read the same measurement; the
LM head's cost by draft vocabulary size is what sizes a trimmed drafter's vocabulary."""

from __future__ import annotations

import statistics

import torch

from vlmspec.stats import median_ms
from vlmspec.target.model import Target
from vlmspec.target.sdpa import decoding_sdpa
from vlmspec.tree import DraftTree


@torch.no_grad()
def time_tree_forward(target: Target, prefix: int, n: int, repeats: int, warmup: int) -> float:
    """Median ms of one `forward_tree` over a chain of n nodes (n = 1: a one-token decode step) on
    a prefix of `prefix` random tokens. Trees are chains: the mask pattern does not change the cost
    of the dense path."""
    ids = torch.randint(1, target.vocab_size, (1, prefix), device=target.device)
    with decoding_sdpa(target.device):  # the engine's attention backends
        state, _ = target.prefill({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        tree = DraftTree.chain(1, [2] * (n - 1))
        # a tree forward leaves the row's committed length as it was: the next one overwrites its entries
        return median_ms(target.device, lambda: target.forward_tree(state, tree), repeats, warmup)


@torch.no_grad()
def time_tree_extras(target: Target, prefix: int, sizes: list[int], rounds: int, warmup: int) -> dict[int, float]:
    """{n: median ms that one `forward_tree` over a chain of n nodes costs over a one-token step},
    on one prefix of `prefix` random tokens. Each round times the one-token step and every size
    back to back, and the extra is the median over rounds of the same round's difference, so a
    machine that drifts (a shared CPU) moves both sides of each difference together."""
    ids = torch.randint(1, target.vocab_size, (1, prefix), device=target.device)
    trees = {n: DraftTree.chain(1, [2] * (n - 1)) for n in sorted({1, *sizes})}
    diffs: dict[int, list[float]] = {n: [] for n in sizes}
    with decoding_sdpa(target.device):  # the engine's attention backends
        state, _ = target.prefill({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        for i in range(warmup + rounds):
            ms = {n: median_ms(target.device, lambda t=tree: target.forward_tree(state, t), 1, 0) for n, tree in trees.items()}
            if i >= warmup:
                for n in sizes:
                    diffs[n].append(ms[n] - ms[1])
    return {n: statistics.median(d) for n, d in diffs.items()}


@torch.no_grad()
def time_ragged_forward(target: Target, prefix: int, sizes: list[int], repeats: int, warmup: int) -> dict[str, float]:
    """Median ms of one `forward_batch` over rows whose trees (chains) have `sizes` nodes, each row
    after its own prompt of `prefix` random tokens: padded to the largest tree, and laid end to end
    (`Target.verifies_ragged`), the two called in turn so a drifting machine moves both."""
    cache = target.new_cache(len(sizes), prefix + max(sizes) + 1)
    trees = [DraftTree.chain(1, [2] * (n - 1)) for n in sizes]
    times: dict[bool, list[float]] = {False: [], True: []}
    with decoding_sdpa(target.device):
        states = []
        for slot in range(len(sizes)):
            ids = torch.randint(1, target.vocab_size, (1, prefix), device=target.device)
            states.append(target.prefill({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, cache=cache, slot=slot)[0])
        for i in range(warmup + repeats):
            for laid in (False, True):
                ms = median_ms(target.device, lambda: target.forward_batch(states, trees, ragged=laid), 1, 0)
                if i >= warmup:
                    times[laid].append(ms)
    return {"padded": statistics.median(times[False]), "laid end to end": statistics.median(times[True])}


@torch.no_grad()
def time_lm_head_rows(target: Target, k: int, rows: int, repeats: int, warmup: int) -> float:
    """Median ms of the target's LM head restricted to k output rows (a draft vocabulary of k
    tokens, as a trimmed EAGLE head applies it) over `rows` hidden states."""
    weight = target.output_embeddings().weight.detach()[:k].contiguous()  # [k, H]
    hidden = torch.randn(rows, weight.shape[1], device=weight.device, dtype=weight.dtype)  # [rows, H]
    return median_ms(target.device, lambda: torch.nn.functional.linear(hidden, weight), repeats, warmup)


__all__ = ["time_lm_head_rows", "time_ragged_forward", "time_tree_extras", "time_tree_forward"]
