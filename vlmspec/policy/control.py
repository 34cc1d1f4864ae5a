"""Adaptive speculation: how many levels to draft at each step of a request (SmartSpec's goodput;
docs/adaptive.md). The policy is shared and stateless, the acceptance history the request's own:
`ctl = policy.start()`, `depth = ctl.choose(max_depth)`, `ctl.observe(depth, num_accepted, secs)`.

`FixedPolicy` drafts the drafter's full depth. `GoodputPolicy` maximises emitted tokens per second:

    E[D] = 1 + sum_{k=1..D} prod_{d=1..k} a_d     a_d = P(the depth-d token is accepted | depth d-1 was)
    D*   = argmax_{D in 0..max_depth} E[D] / T[D], and 0 unless E[D*] / T[D*] >= (1 + min_gain) E[0] / T[0]

a_d comes from decayed counts under a Beta prior; T[D] from a `CostModel` measured at start-up and corrected by the
request's own step times. While nothing is drafted the estimates drift back to the prior (`idle_decay`), so drafting
is retried, with a backoff that doubles after each losing retry (up to 2 ** `max_backoff`); a probe (a first draft, a
retry) drafts at most `probe_depth` levels. Batch rows' depths are chosen together: `vlmspec.policy.batch_control`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from vlmspec.stats import posterior_acceptance


@dataclass(frozen=True)
class CostModel:
    """Seconds of one engine step that drafts `depth` levels: step_s for depth 0 (the target's
    one-token step with the drafter's bookkeeping); a drafted depth reads `by_depth` where it was
    measured, else the line step_s + draft_s + per_level_s * depth.

    The table is what the goodput policy should use: a step's verify cost follows the tree's nodes,
    not its depth (an EAGLE-2 tree of depth 1 has top_k nodes, every deeper one its full budget), so
    on this project's CPU a depth-1 step costs about 1.35 plain steps and a depth-2 step already
    1.7-1.8, close to depth 5's 1.8-1.95; a line through depths 0, 1 and 5 priced depth 2 under what
    it costs, and the policy drafted 2 levels where they did not pay (docs/measured/adaptive/)."""

    step_s: float
    draft_s: float = 0.0
    per_level_s: float = 0.0
    by_depth: tuple[float, ...] = ()  # [d - 1]: measured seconds of a step drafting d levels (d = 1..len)

    def __post_init__(self) -> None:
        if not self.step_s > 0 or self.draft_s < 0 or self.per_level_s < 0 or any(not s > 0 for s in self.by_depth):
            raise ValueError(f"a cost model needs step_s > 0, non-negative extras and positive measured seconds, got {self}")

    def seconds(self, depth: int) -> float:
        if depth <= 0:
            return self.step_s
        if depth <= len(self.by_depth):
            return self.by_depth[depth - 1]
        return self.step_s + self.draft_s + self.per_level_s * depth

    def as_dict(self) -> dict[str, Any]:
        """What the benches write beside their figures."""
        return {"step_s": self.step_s, "draft_s": self.draft_s, "per_level_s": self.per_level_s, "by_depth": list(self.by_depth)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        """The inverse of `as_dict`."""
        return cls(data["step_s"], data["draft_s"], data["per_level_s"], tuple(data["by_depth"]))

    @classmethod
    def fit(cls, samples: dict[int, float]) -> "CostModel":
        """{depth: measured seconds per step} with depth 0 and at least one depth >= 1 -> the model:
        the line (per-level slope by least squares over the drafted depths, clipped at 0) for depths
        past the deepest measured, and the table for depths 1..deepest, read between measured depths
        linearly. The table never goes below a plain step and never falls with depth (a deeper step
        verifies at least the shallower one's tree: a dip is noise)."""
        if 0 not in samples or not any(d > 0 for d in samples):
            raise ValueError(f"fit needs depth 0 and a drafted depth, got {sorted(samples)}")
        base = samples[0]
        drafted = sorted((d, s - base) for d, s in samples.items() if d > 0)
        if len(drafted) == 1:
            d, extra = drafted[0]
            line = (0.0, max(extra, 0.0) / d)
        else:
            n = len(drafted)
            mx, my = sum(d for d, _ in drafted) / n, sum(e for _, e in drafted) / n
            slope = max(sum((d - mx) * (e - my) for d, e in drafted) / sum((d - mx) ** 2 for d, _ in drafted), 0.0)
            line = (max(my - slope * mx, 0.0), slope)
        points = [(0, base)] + [(d, base + e) for d, e in drafted]
        table, top = [], base
        for depth in range(1, drafted[-1][0] + 1):
            (d0, s0), (d1, s1) = next((a, b) for a, b in zip(points, points[1:]) if a[0] < depth <= b[0])
            top = max(top, s0 + (s1 - s0) * (depth - d0) / (d1 - d0))
            table.append(top)
        return cls(base, *line, by_depth=tuple(table))


@dataclass(frozen=True)
class BatchCost:
    """Seconds of one batched step by batch size: a `CostModel` (depth -> seconds of a step whose
    deepest row drafts that deep) per measured size B, first B = 1. Between measured sizes it reads
    linearly in B; past the largest it extends the last two sizes' line (never below the largest's)."""

    by_size: tuple[tuple[int, CostModel], ...]

    def __post_init__(self) -> None:
        sizes = [b for b, _ in self.by_size]
        if not sizes or sizes[0] != 1 or sizes != sorted(set(sizes)):
            raise ValueError(f"a batch cost needs increasing batch sizes starting at 1, got {sizes}")

    def seconds(self, batch: int, depth: int) -> float:
        pts = self.by_size
        if len(pts) == 1 or batch <= 1:
            return pts[0][1].seconds(depth)
        (b0, m0), (b1, m1) = next(((a, b) for a, b in zip(pts, pts[1:]) if batch <= b[0]), pts[-2:])
        s0, s1 = m0.seconds(depth), m1.seconds(depth)
        return max(s0 + (s1 - s0) * (batch - b0) / (b1 - b0), min(s0, s1))

    def step_seconds(self, depths: list[int]) -> float:
        """Seconds of a step whose rows draft `depths` (0: a plain row), every row verified as deep as
        the deepest: `seconds(B, max)`."""
        return self.seconds(len(depths), max(depths))

    def as_dict(self) -> dict[str, Any]:
        return {str(b): m.as_dict() for b, m in self.by_size}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BatchCost":
        return cls(tuple((int(b), CostModel.from_dict(m)) for b, m in sorted(data.items(), key=lambda kv: int(kv[0]))))


class Controller(Protocol):
    def choose(self, max_depth: int) -> int:
        """Levels to draft this step, 0..max_depth."""
        ...

    def observe(self, depth: int, num_accepted: int, seconds: float | None = None, chain_accepted: int | None = None,
                chain: bool = False) -> None:
        """The step drafted `depth` levels, `num_accepted` tokens of its path were accepted, and it
        took `seconds` (None: not timed); `chain_accepted` of them lay along the tree's first children
        (`DraftTree.first_chain_run`), and `chain` says the step drafted that chain only."""
        ...


class Policy(Protocol):
    name: str

    def start(self) -> Controller:
        """One request's controller."""
        ...


@dataclass(frozen=True)
class FixedPolicy:
    """Always the same depth (None: as deep as the drafter's tree goes)."""

    depth: int | None = None
    name: str = "fixed"

    def start(self) -> Controller:
        return _Fixed(self.depth)


class _Fixed:
    def __init__(self, depth: int | None) -> None:
        self.depth = depth

    def choose(self, max_depth: int) -> int:
        return max_depth if self.depth is None else min(self.depth, max_depth)

    def observe(self, depth: int, num_accepted: int, seconds: float | None = None, chain_accepted: int | None = None,
                chain: bool = False) -> None:
        return None


@dataclass(frozen=True)
class GoodputPolicy:
    """SmartSpec's choice of depth by expected goodput (see the module docstring)."""

    cost: CostModel
    prior_accept: float = 0.8  # prior mean of a_1 (optimistic: a request starts by drafting and learns)
    prior_weight: float = 2.0  # its strength in pseudo-observations
    decay: float = 0.8  # per drafted step: older observations count this much less (memory of about 5 steps)
    idle_decay: float = 0.97  # per step without a draft: the drift back to the prior (a retry after ~10-50 steps)
    time_weight: float = 0.3  # weight of each timed step in the request's cost correction (0: the model as given)
    max_backoff: int = 4  # failed retries in a row, counted up to this many, slow the drift back by 2 ** count
    min_gain: float = 0.1  # a drafted step must promise this much more goodput than a plain one (estimates lean optimistic)
    probe_depth: int | None = 1  # a request's first drafted step and every retry draft at most this deep (None: no cap)
    name: str = "goodput"

    def __post_init__(self) -> None:
        if not (0 < self.prior_accept < 1 and self.prior_weight > 0 and 0 < self.decay <= 1 and 0 < self.idle_decay <= 1
                and 0 <= self.time_weight <= 1 and self.max_backoff >= 0 and self.min_gain >= 0
                and (self.probe_depth is None or self.probe_depth >= 1)):
            raise ValueError(f"goodput policy: prior in (0, 1), weight > 0, decays in (0, 1], time weight in [0, 1], "
                             f"max_backoff >= 0, min_gain >= 0, probe_depth >= 1 or None, got {self}")

    def start(self) -> Controller:
        return AcceptanceTracker(self)


@dataclass
class AcceptanceTracker:
    """One request's decayed per-depth counts and the goodput choice over them."""

    policy: GoodputPolicy
    reached: list[float] = field(default_factory=list)  # [d]: decayed steps that drafted depth d+1
    accepted: list[float] = field(default_factory=list)  # [d]: of those, decayed accepts at depth d+1
    chain_reached: list[float] = field(default_factory=list)  # the same for the tree's first-child chain (`DraftTree.first_chain`)
    chain_accepted: list[float] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)  # the depth of every step, in order
    plain_scale: float = 1.0  # measured / modelled seconds of this request's plain steps (decayed mean)
    draft_scale: float = 1.0  # the same for its drafted steps
    retry_misses: int = 0  # retries in a row (drafted steps right after a plain one) that paid less than a plain step
    last_depth: int | None = None  # the depth of the step observed last (None: none yet)
    last_accepted: int = 0  # the tokens it accepted

    def accept_rates(self, depth: int, chain: bool = False) -> list[float]:
        """Posterior means of a_1..a_depth (of the first-child chain's tokens with `chain`). a_1's
        prior mean is `prior_accept`; each deeper a_d's is a_(d-1)'s estimate, so depths a collapse
        keeps from being reached are not left at an optimistic prior."""
        p = self.policy
        reached, accepted = (self.chain_reached, self.chain_accepted) if chain else (self.reached, self.accepted)
        rates, prior = [], p.prior_accept
        for d in range(depth):
            r = reached[d] if d < len(reached) else 0.0
            a = accepted[d] if d < len(accepted) else 0.0
            prior = posterior_acceptance(a, r, prior, p.prior_weight)
            rates.append(prior)
        return rates

    def expected_tokens(self, depth: int, chain: bool = False) -> float:
        """E[D]: the step's root token plus the expected accepted run (of a first-child chain of D
        tokens with `chain`, else of the request's tree cut at depth D)."""
        total, run = 1.0, 1.0
        for a in self.accept_rates(depth, chain):
            run *= a
            total += run
        return total

    def seconds(self, depth: int) -> float:
        """The cost model's seconds for a step of `depth` levels, corrected by this request's timings."""
        return self.policy.cost.seconds(depth) * (self.draft_scale if depth > 0 else self.plain_scale)

    def goodput(self, depth: int) -> float:
        return self.expected_tokens(depth) / self.seconds(depth)

    def probing(self) -> bool:
        """The next drafted step is a probe: the request's first, a retry after plain steps, or one
        after a drafted step that accepted nothing (a plain step, and no step, accepted nothing too:
        only a drafted step that paid leads deeper)."""
        return self.last_accepted == 0

    def retry_price(self) -> float:
        """What a retry (a drafted step at the probe depth, else at the deepest depth seen) costs over
        a plain one, in plain steps (at least 1), doubled for each failed retry in a row (up to
        `max_backoff` doublings): the drift back to the prior slows by this factor, so a retry that
        costs three steps comes three times less often than one that costs one, and a retry that
        failed twice four times less often."""
        deepest = max(len(self.reached), 1)
        if self.policy.probe_depth is not None:
            deepest = min(deepest, self.policy.probe_depth)
        price = max(1.0, (self.seconds(deepest) - self.seconds(0)) / self.seconds(0))
        return price * 2.0 ** self.retry_misses

    def choose(self, max_depth: int) -> int:
        plain = self.goodput(0)
        best = max(range(max(max_depth, 0) + 1), key=lambda d: (self.goodput(d), -d))
        if best > 0 and self.goodput(best) < (1.0 + self.policy.min_gain) * plain:
            best = 0  # a gain inside the estimates' optimism is not worth the risk
        if best > 0 and self.probing() and self.policy.probe_depth is not None:
            best = min(best, self.policy.probe_depth)  # a probe: shallow and cheap, the next step goes deep if it paid
        self.chosen.append(best)
        return best

    def observe(self, depth: int, num_accepted: int, seconds: float | None = None, chain_accepted: int | None = None,
                chain: bool = False) -> None:
        """`chain_accepted`: what the step's first-child chain had accepted (None: num_accepted);
        `chain`: the step drafted that chain only (a batched step), so it says nothing of the tree."""
        assert 0 <= num_accepted <= depth, (depth, num_accepted)
        chain_accepted = num_accepted if chain_accepted is None else chain_accepted
        assert 0 <= chain_accepted <= num_accepted, (chain_accepted, num_accepted)
        if seconds is not None and seconds > 0 and self.policy.time_weight > 0:
            w, ratio = self.policy.time_weight, seconds / self.policy.cost.seconds(depth)
            if depth > 0:
                self.draft_scale += w * (ratio - self.draft_scale)
            else:
                self.plain_scale += w * (ratio - self.plain_scale)
        if depth > 0:  # a retry that emitted fewer tokens per second than a plain step backs the next one off
            paid = (1 + num_accepted) * self.seconds(0) >= self.seconds(depth)
            self.retry_misses = 0 if paid else min(self.retry_misses + int(self.last_depth == 0), self.policy.max_backoff)
        self.last_depth, self.last_accepted = depth, num_accepted
        idle = self.policy.idle_decay ** (1.0 / self.retry_price())
        _count(self.chain_reached, self.chain_accepted, depth, chain_accepted, self.policy.decay if depth > 0 else idle)
        _count(self.reached, self.accepted, 0 if chain else depth, num_accepted, self.policy.decay if depth > 0 and not chain else idle)


def _count(reached: list[float], accepted: list[float], depth: int, num_accepted: int, decay: float) -> None:
    """Decay a request's per-depth counts, then count a step that drafted `depth` levels and had
    `num_accepted` accepted (depth 0: a plain step, nothing counted)."""
    reached[:] = [x * decay for x in reached]
    accepted[:] = [x * decay for x in accepted]
    while len(reached) < depth:
        reached.append(0.0)
        accepted.append(0.0)
    for d in range(min(depth, num_accepted + 1)):  # depths past the first rejection were not reached on the path
        reached[d] += 1.0
        accepted[d] += float(d < num_accepted)


POLICIES = ("goodput", "fixed")


@dataclass(frozen=True)
class SpeculationOptions:
    """One request's speculation knobs; they travel with the request (the API's extension fields,
    the CLI's flags, the demo's controls) and never change the engine."""

    policy: str | None = None  # "goodput" | "fixed"; None: the engine's default
    max_depth: int | None = None  # drafted levels per step at most (0: never draft); None: the tree's depth
    tree_tokens: int | None = None  # drafted nodes per step at most; None: the tree's own

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"speculation policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_depth is not None and self.max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {self.max_depth}")
        if self.tree_tokens is not None and self.tree_tokens < 1:
            raise ValueError(f"tree_tokens must be >= 1, got {self.tree_tokens}")


@dataclass(frozen=True)
class Speculation:
    """An engine's speculation defaults, shared read-only by its requests: the policy of a request
    that names none, and the cost model the goodput policy needs. Without a cost model (an engine
    that never drafts, or one built without measuring) a request asking for goodput runs the fixed
    policy, and its result says which policy ran."""

    default: str = "fixed"
    cost: CostModel | None = None
    batch_cost: BatchCost | None = None  # per batch size, for rows decoded together (None: each row chooses alone)

    def __post_init__(self) -> None:
        if self.default not in POLICIES:
            raise ValueError(f"default speculation policy must be one of {POLICIES}, got {self.default!r}")

    def policy(self, name: str | None = None) -> Policy:
        """The policy a request naming `name` (None: the default) runs."""
        if (name or self.default) == "goodput" and self.cost is not None:
            return GoodputPolicy(self.cost)
        return FixedPolicy()


def depth_summary(depths: list[int]) -> str:
    """[0, 0, 5, 5, 5] -> '0x2 5x3': how often a request's controller chose each depth."""
    return " ".join(f"{d}x{depths.count(d)}" for d in sorted(set(depths)))


__all__ = ["AcceptanceTracker", "BatchCost", "Controller", "CostModel", "FixedPolicy", "GoodputPolicy", "POLICIES", "Policy", "Speculation",
           "SpeculationOptions", "depth_summary"]
