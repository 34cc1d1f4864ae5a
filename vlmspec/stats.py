"""Speculation statistics, defined once: counters (as vLLM keeps them), ratios derived on read.

One `SpecStats` per generation (the engine fills it); the bench, the server's /metrics and the
trainer's evaluation add generations up with `+=` and read the same derived figures:

    mean_accepted_length   = (accepted + drafts) / drafts     tokens per verify forward, bonus included
    acceptance_by_position = accepted_per_pos[d] / reached_per_pos[d]
                             P(the drafted token at depth d+1 is accepted | the tree reached depth d+1)

"drafts" counts verify forwards (empty trees too), so plain decoding through the engine has mean accepted length 1.0.

Also the small statistics every bench and report shares: percentiles, geometric means with a
bootstrap interval, and the median time of a call (`median_ms`, synchronising CUDA around it).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class SpecStats:
    num_drafts: int = 0  # verify forwards (one proposed tree each, possibly the root alone)
    num_draft_tokens: int = 0  # drafted tokens sent to verification (roots excluded)
    num_accepted_tokens: int = 0  # drafted tokens accepted (recovered / bonus tokens excluded)
    reached_per_pos: list[int] = field(default_factory=list)  # [d]: drafts whose tree had a node at depth d+1
    accepted_per_pos: list[int] = field(default_factory=list)  # [d]: drafts that accepted a token at depth d+1

    def observe(self, num_drafted: int, num_accepted: int, tree_depth: int) -> None:
        """One verify forward: `num_drafted` tree nodes (root excluded), `num_accepted` of them on the
        accepted path, the tree `tree_depth` levels deep."""
        assert 0 <= num_accepted <= tree_depth and num_accepted <= num_drafted, (num_drafted, num_accepted, tree_depth)
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self._grow(tree_depth)
        for d in range(tree_depth):
            self.reached_per_pos[d] += 1
            self.accepted_per_pos[d] += d < num_accepted

    def _grow(self, depth: int) -> None:
        while len(self.reached_per_pos) < depth:
            self.reached_per_pos.append(0)
            self.accepted_per_pos.append(0)

    def __iadd__(self, other: "SpecStats") -> "SpecStats":
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._grow(len(other.reached_per_pos))
        for d, (r, a) in enumerate(zip(other.reached_per_pos, other.accepted_per_pos)):
            self.reached_per_pos[d] += r
            self.accepted_per_pos[d] += a
        return self

    @property
    def num_emitted_tokens(self) -> int:
        """Tokens the verify forwards emitted: the accepted ones plus one recovered or bonus token each."""
        return self.num_accepted_tokens + self.num_drafts

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify forward, bonus included (1.0 when nothing was verified yet)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / r for a, r in zip(self.accepted_per_pos, self.reached_per_pos) if r]

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "reached_per_pos": list(self.reached_per_pos),
            "accepted_per_pos": list(self.accepted_per_pos),
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": self.acceptance_by_position,
        }


def posterior_acceptance(accepted: float, reached: float, prior_mean: float, prior_weight: float) -> float:
    """The acceptance rate estimated from (decayed) counts under a Beta prior: the posterior mean
    (accepted + prior_mean * prior_weight) / (reached + prior_weight), where `prior_weight` is the
    prior's strength in pseudo-observations (the prior mean itself with no observation). The
    goodput controller's per-depth rates and self-speculation's per-exit rates are this estimate."""
    return (accepted + prior_mean * prior_weight) / (reached + prior_weight)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(device: torch.device, run: Callable[[], object], repeats: int, warmup: int,
              after: Callable[[], object] = lambda: None) -> float:
    """Median ms of `run()` over `repeats` timed calls after `warmup` untimed ones; `after()` runs
    untimed after each call (to undo what it changed)."""
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        after()
    return statistics.median(times)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (linear between order statistics; with few samples p99 is about the largest)."""
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def geomean(xs: list[float]) -> float:
    """Geometric mean of positive numbers (speed ratios); nan for none."""
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def bootstrap_geomean(xs: list[float], draws: int = 2000, level: float = 0.9, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval (`level`) of the geometric mean over the items of `xs` (fixed seed)."""
    rng = random.Random(seed)
    means = sorted(geomean(rng.choices(xs, k=len(xs))) for _ in range(draws))
    cut = int(draws * (1 - level) / 2)
    return means[cut], means[draws - 1 - cut]


def rotated(items: tuple | list, k: int) -> list:
    """`items` rotated left by k (mod its length): run k's order of the methods a bench interleaves,
    so no method always goes first on a noisy machine."""
    k %= len(items)
    return list(items[k:]) + list(items[:k])
