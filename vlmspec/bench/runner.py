"""Ways against each other, one way for every bench: each way on each item, interleaved.

A "way" is one way to answer (HF generate, an engine with a drafter, a policy, a tree shape, the
HTTP service); an "item" is what they all answer (a prompt, or a prompt at a temperature). Every
item runs `warmup + repeats` rounds; each round runs every way once, in an order rotated by
item + round (`stats.rotated`), so no way always goes first on a noisy machine. Ratios are paired:
the reference way's seconds over a way's seconds, on the same item and round (> 1: faster than
the reference), summarised by their geometric mean and spread. A way is a callable
`(item, round) -> result` (`round` counts the warm-up rounds too; `Timed.repeat` does not).

    run = run_ways({"plain": plain_call, "fixed": fixed_call}, n_items=8, reference="plain", repeats=2)
    run.paired("fixed").geomean      # per-item speedup of "fixed" over "plain", geometric mean
    run.rounds()                     # {(item, repeat): {way: Timed}}, to build a bench's rows
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from vlmspec.stats import bootstrap_geomean, geomean, rotated

Way = Callable[[int, int], Any]  # (item, round) -> whatever the bench reads from a run


@dataclass(frozen=True)
class Timed:
    """One measured run of a way on an item."""

    way: str
    item: int
    repeat: int  # measured round, 0-based (warm-up rounds are not kept)
    seconds: float
    result: Any


@dataclass(frozen=True)
class Paired:
    """Per-run speed ratios against the reference way (its seconds / the way's), paired by item and round."""

    ratios: tuple[float, ...]

    @property
    def geomean(self) -> float:
        return geomean(list(self.ratios))

    @property
    def lowest(self) -> float:
        return min(self.ratios)

    @property
    def highest(self) -> float:
        return max(self.ratios)

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def quartiles(self) -> tuple[float, float]:
        """(first, third) quartile; the one ratio twice when there is one."""
        if len(self.ratios) < 2:
            return self.ratios[0], self.ratios[0]
        q = statistics.quantiles(self.ratios, n=4)
        return q[0], q[2]

    def interval(self, level: float = 0.9) -> tuple[float, float]:
        """Bootstrap interval (`level`, fixed seed) of the geometric mean over the runs."""
        return bootstrap_geomean(list(self.ratios), level=level)


@dataclass
class WaysRun:
    """What `run_ways` measured: every kept run, in the order they ran, and the ways that failed."""

    ways: tuple[str, ...]
    reference: str
    runs: list[Timed] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # way -> "ErrorClass: first line" (the way stopped there)

    def of(self, way: str, keep: Callable[[int], bool] | None = None) -> list[Timed]:
        """The runs of `way`, on the items `keep` accepts (all by default)."""
        return [t for t in self.runs if t.way == way and (keep is None or keep(t.item))]

    def rounds(self) -> dict[tuple[int, int], dict[str, Timed]]:
        """{(item, repeat): {way: its run}}, in the order the rounds ran."""
        out: dict[tuple[int, int], dict[str, Timed]] = {}
        for t in self.runs:
            out.setdefault((t.item, t.repeat), {})[t.way] = t
        return out

    def paired(self, way: str, keep: Callable[[int], bool] | None = None) -> Paired:
        """The reference's seconds over `way`'s, per item and round where both ran."""
        ref = {(t.item, t.repeat): t.seconds for t in self.of(self.reference, keep)}
        return Paired(tuple(ref[(t.item, t.repeat)] / t.seconds for t in self.of(way, keep) if (t.item, t.repeat) in ref))


def run_ways(ways: Mapping[str, Way], n_items: int, reference: str, repeats: int = 1, warmup: int = 0,
             fails: tuple[type[BaseException], ...] = (), sync: Callable[[], None] | None = None,
             progress: str | None = None) -> WaysRun:
    """Run every way on items 0 .. n_items - 1, `warmup` unkept then `repeats` kept rounds each.

    fails: exception types that mark a way as failed (its message in `errors`; it is skipped from
    then on) instead of ending the run. sync: called before the clock starts and before it stops
    (a GPU's queue). progress: a progress bar's label (None: no bar)."""
    if reference not in ways:
        raise ValueError(f"the reference way {reference!r} is not one of {list(ways)}")
    if n_items < 0 or repeats < 1 or warmup < 0:
        raise ValueError(f"n_items and warmup must be >= 0, repeats >= 1: got {n_items}, {warmup}, {repeats}")
    from tqdm import tqdm

    names = tuple(ways)
    out = WaysRun(names, reference)
    bar = tqdm(total=n_items * (warmup + repeats), desc=progress, unit="round", disable=progress is None, dynamic_ncols=True)
    with bar:
        for item in range(n_items):
            for rnd in range(warmup + repeats):
                for way in rotated(names, item + rnd):
                    if way in out.errors:
                        continue
                    try:
                        seconds, result = _timed(ways[way], item, rnd, sync)
                    except fails as exc:
                        out.errors[way] = f"{exc.__class__.__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
                        continue
                    if rnd >= warmup:
                        out.runs.append(Timed(way, item, rnd - warmup, seconds, result))
                bar.update(1)
    return out


def _timed(way: Way, item: int, rnd: int, sync: Callable[[], None] | None) -> tuple[float, Any]:
    if sync:
        sync()
    t0 = time.perf_counter()
    result = way(item, rnd)
    if sync:
        sync()
    return time.perf_counter() - t0, result


__all__ = ["Paired", "Timed", "Way", "WaysRun", "run_ways"]
