"""Goodput over a batch (SmartSpec): every row's depth for one step of a batch, chosen together (docs/adaptive.md,
"Over a batch"). One step drafts every level for its drafting rows at once and verifies every row's tree in one
forward, so its cost follows the batch size and the rows' depths (`BatchCost`, measured at start-up per batch
size). A goodput row of a batch drafts its first-child chain (`batch_chains`), its E_b the chain's, from its own
acceptance history; the goodput rows of a step share one depth D, the step priced padded to the largest tree:

    D* = argmax_D  sum_b E_b[min(D, cap_b)] / T_B[max(min(D, cap_b) over b, deepest fixed row)]

with a margin over plain decoding (`min_gain`); a row's cap is its max depth, or `probe_depth`
while it probes. The batch's own step times correct the batch cost (`BatchTiming`: medians of
measured / modelled seconds, drafted and plain steps apart), and per batch-size bucket it checks
what its drafted steps delivered (`BatchTiming.allows_draft`): where they emitted fewer tokens per
second than plain steps would, drafting waits, retried now and then.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from vlmspec.policy.control import AcceptanceTracker, BatchCost, Controller, GoodputPolicy


def _median(values: deque[float], least: int = 1) -> float:
    """The median of `values`, or 1.0 (the model as it is) while there are fewer than `least`."""
    return statistics.median(values) if len(values) >= max(least, 1) else 1.0


@dataclass
class _Bucket:
    """What one batch-size bucket's drafted steps delivered (`BatchTiming`)."""

    tokens: deque[float]  # the last drafted steps' emitted tokens per row (a plain step: 1), the window's worth
    times: deque[float]  # the same steps' seconds, in the seconds of a plain step of their rows
    since: int = 0  # plain steps since the last drafted one
    wait: int = 0  # plain steps before a retry, while the gain is under 1

    @property
    def gain(self) -> float:
        """Tokens per second of the last drafted steps over plain steps': their mean tokens per row
        over their median time in plain steps (1.0 before any)."""
        return statistics.fmean(self.tokens) / statistics.median(self.times) if self.times else 1.0


@dataclass
class BatchTiming:
    """A batch's correction of its `BatchCost`: the median of measured / modelled seconds over its
    last `window` steps, drafted and plain steps apart (`draft`, `plain`); and its check of what
    drafted steps deliver, per batch-size bucket (2, 3-4, 5-8, 9-16, ... rows): over the last
    `window` drafted steps, the mean of their emitted tokens per row over the median of their
    seconds in plain steps of their rows (the corrected plain seconds; a plain step emits one token
    a row), their gain over plain steps. Once `min_steps` drafted steps of a bucket have been
    measured and that gain is under 1, drafting there waits: a drafted step is allowed again after
    `retry` plain steps of the bucket, a wait that doubles (up to `max_retry`) with each retry that
    loses and returns to `retry` after one that pays.

    The median of the seconds: some drafted steps carry a one-off cost, the head's first read of
    the prompts of rows that just joined, or of the pairs that waited while drafting did: on the
    default model at 8 rows the slowest drafted steps took 92-150 ms where their median took 68
    (bf16, this CPU). With decayed means, such a step held drafting back for the rest of a run whose
    drafted steps paid. The mean of the tokens: they are skewed, a few steps whose rows' drafts are
    accepted deep emit several tokens a row and the rest a little over one, and the mean is what
    throughput sees; the median of each step's gain held drafting back at 4 rows of real answers
    where every fixed depth paid (docs/adaptive.md has the figures and their commands)."""

    window: int = 5
    min_steps: int = 4
    retry: int = 8
    max_retry: int = 128
    buckets: dict[int, _Bucket] = field(default_factory=dict)  # `_key(rows)` -> its drafted steps' record
    waits: int = 0  # steps whose rows would have drafted but drafting waited (a counter: the service's metrics read it)
    ratios: dict[bool, deque[float]] = field(default_factory=dict)  # drafted?: the last steps' measured / modelled seconds

    def __post_init__(self) -> None:
        assert 1 <= self.min_steps <= self.window, (self.min_steps, self.window)  # a window holds the steps judged
        self.ratios = {False: deque(maxlen=self.window), True: deque(maxlen=self.window)}

    def _key(self, rows: int) -> int:
        """The bucket of a step of `rows` rows: 2, 3-4, 5-8, 9-16, ..."""
        return (rows - 1).bit_length()

    @property
    def plain(self) -> float:
        """Measured / modelled seconds of plain steps: the median of the last `window`, once
        `min_steps` are measured (the model's own seconds, 1.0, before)."""
        return _median(self.ratios[False], self.min_steps)

    @property
    def draft(self) -> float:
        """The same of drafted steps. Before `min_steps` of them the model stands: a batch's first
        drafted step also reads every row's prompt, and taken alone it would price drafting out
        before any other drafted step could correct it."""
        return _median(self.ratios[True], self.min_steps)

    def observe(self, cost: BatchCost, rows: int, depth: int, seconds: float, emitted: int | None = None,
                modelled: float | None = None) -> None:
        """A step of `rows` rows, the deepest drafting `depth` levels, took `seconds` and emitted
        `emitted` tokens; `modelled`: its seconds by the cost model (None: `cost.seconds(rows, depth)`,
        a padded step's)."""
        self.ratios[depth > 0].append(seconds / (cost.seconds(rows, depth) if modelled is None else modelled))
        key = self._key(rows)
        if key not in self.buckets:
            self.buckets[key] = _Bucket(deque(maxlen=self.window), deque(maxlen=self.window), wait=self.retry)
        b = self.buckets[key]
        if depth == 0:
            b.since += 1
            return
        if emitted is None:
            return
        retried = self._losing(b)  # drafted while drafting waited: a retry
        tokens, in_plain_steps = emitted / rows, seconds / (cost.seconds(rows, 0) * self.plain)
        b.tokens.append(tokens)
        b.times.append(in_plain_steps)
        gain = tokens / in_plain_steps
        b.since = 0
        if b.gain >= 1.0 or gain >= 1.0:  # the bucket pays again, or this step did: the next retry comes soon
            b.wait = self.retry
        elif retried:
            b.wait = min(2 * b.wait, self.max_retry)

    def _losing(self, b: _Bucket) -> bool:
        """Enough drafted steps measured, and the last ones delivered less than plain steps."""
        return len(b.times) >= self.min_steps and b.gain < 1.0

    def allows_draft(self, rows: int) -> bool:
        """Whether a step of `rows` rows may draft: its bucket is not losing, or a retry is due."""
        b = self.buckets.get(self._key(rows))
        return b is None or not self._losing(b) or b.since >= b.wait

    def scale(self, depth: int) -> float:
        return self.draft if depth > 0 else self.plain


def choose_depths(controls: list[Controller], max_depths: list[int], cost: BatchCost | None,
                  timing: BatchTiming | None = None) -> list[int]:
    """Every row's depth for one step (see the module docstring: goodput over the batch), the batch
    cost corrected by the batch's own `timing` when given. Rows whose max depth is negative (a full
    context) get 0 and are not asked. The goodput rows share one depth, the step priced padded."""
    chains = batch_chains(controls, cost)
    tracked = [i for i, c in enumerate(controls) if chains[i] and max_depths[i] > 0]
    if not tracked:
        return [c.choose(m) if m >= 0 else 0 for c, m in zip(controls, max_depths)]
    assert cost is not None
    depths = [0 if (i in tracked or m < 0) else c.choose(m) for i, (c, m) in enumerate(zip(controls, max_depths))]
    floor, others = max(depths), len(controls) - len(tracked)  # the rows not chosen for here: a token each at least
    policy: GoodputPolicy = controls[tracked[0]].policy  # type: ignore[attr-defined]
    caps = {i: _batch_row_cap(controls[i], max_depths[i]) for i in tracked}  # type: ignore[arg-type]
    tokens = {i: [controls[i].expected_tokens(d, chain=True) for d in range(max_depths[i] + 1)] for i in tracked}  # type: ignore[attr-defined]

    def goodput(rows_at: dict[int, int]) -> float:
        step = [rows_at.get(i, d) for i, d in enumerate(depths)]
        seconds = cost.step_seconds(step) * (timing.scale(max(step)) if timing is not None else 1.0)
        return (others + sum(tokens[i][d] for i, d in rows_at.items())) / seconds

    def shared(depth: int) -> dict[int, int]:
        """Padded: the rows share `depth` within their caps, and a probing row drafts as deep as the
        step already is (its deeper levels cost nothing more)."""
        step = max([floor] + [min(depth, caps[i]) for i in tracked])
        return {i: min(depth, max_depths[i], max(caps[i], step)) for i in tracked}

    choices = [shared(depth) for depth in range(max(caps.values()) + 1)]
    best = max(choices, key=lambda rows_at: (goodput(rows_at), -max(rows_at.values())))
    rested = dict.fromkeys(tracked, 0)
    if best != rested and goodput(best) < (1.0 + policy.min_gain) * goodput(rested):
        best = rested
    elif best != rested and timing is not None and not timing.allows_draft(len(controls)):
        best, timing.waits = rested, timing.waits + 1
    for i, d in best.items():
        depths[i] = d
        controls[i].chosen.append(d)  # type: ignore[attr-defined]
    return depths


def batch_chains(controls: list[Controller], cost: BatchCost | None) -> list[bool]:
    """Which rows of a step draft their tree's first-child chain (`DraftTree.first_chain`) instead of
    the tree: the goodput rows of a batch of more than one row with a batch cost. One forward
    verifies every row padded to the largest tree, so there a node costs a row-sized slice of a
    batched forward, not the near-free extra query it is alone: a chain of D tokens is the
    narrowest D-level draft and what the batch cost is measured on (`vlmspec.policy.cost`)."""
    batched = len(controls) > 1 and cost is not None
    return [batched and isinstance(c, AcceptanceTracker) for c in controls]


def _batch_row_cap(control: AcceptanceTracker, max_depth: int) -> int:
    """The deepest a goodput row may draft this step in a batch: its max depth, or the probe depth
    while it is probing (as alone: a request's first draft and every retry are shallow)."""
    probe = control.policy.probe_depth
    return min(max_depth, probe) if probe is not None and control.probing() else max_depth


__all__ = ["BatchTiming", "batch_chains", "choose_depths"]
