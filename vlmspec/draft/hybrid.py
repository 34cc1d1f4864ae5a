"""`--drafter hybrid` (`eagle+suffix`, `DIR+suffix`): an EAGLE head and the suffix drafter, the
likelier tree per step and per row.

    drafter = HybridDrafter(eagle, suffix)           # both built by the composition root (vlmspec.factory)
    trees = drafter.propose_batch(sessions, roots, max_depths, chains)

Each tree's expected accepted length E (`DraftTree.expected_accepted`: the suffix tree's summed node frequencies,
the head's summed cumulative draft probabilities) is uncalibrated, so each is scaled by the decayed ratio of tokens
accepted to tokens expected (`Calibration`), kept apart for the head, for `sure` suffix trees (the pool's match
covered the whole context) and for other suffix trees. A row's suffix tree comes first; where its scaled E reaches
`skip_at` of the most the head could give (one token per level, scaled alike) the head drafts nothing for that row
this step; elsewhere the head drafts (one batched forward per level) and the higher scaled E wins (chains for rows
asked for a chain). Either tree is verified as usual, so the output is the target's (lossless).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from vlmspec.draft.base import DraftSession, Drafter, PromptContext, TreeConfig
from vlmspec.draft.suffix import SuffixDrafter
from vlmspec.tree import DraftTree

KINDS = ("eagle", "suffix", "suffix_sure")  # the trees the calibration keeps apart


@dataclass(frozen=True)
class HybridConfig:
    """skip_at: the head skips a row whose suffix tree's scaled E reaches this share of the most the
    head could give it (1.0: only where the head cannot win); decay: per picked tree of a kind, older
    trees count this much less in its calibration; prior: the calibration's pseudo-tokens at ratio 1."""

    skip_at: float = 1.0
    decay: float = 0.95
    prior: float = 4.0

    def __post_init__(self) -> None:
        if not (self.skip_at > 0 and 0 < self.decay <= 1 and self.prior > 0):
            raise ValueError(f"need skip_at > 0, decay in (0, 1], prior > 0, got {self}")


@dataclass
class Calibration:
    """Per kind of tree (`KINDS`): decayed tokens accepted and tokens expected of the picked trees."""

    config: HybridConfig
    accepted: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    expected: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))

    def scale(self, kind: str) -> float:
        """accepted / expected, a `prior` of pseudo-tokens at 1.0 mixed in, within [0.05, 2]."""
        p = self.config.prior
        return min(2.0, max(0.05, (self.accepted[kind] + p) / (self.expected[kind] + p)))

    def observe(self, kind: str, expected: float, accepted: int) -> None:
        d = self.config.decay
        self.accepted[kind] = d * self.accepted[kind] + accepted
        self.expected[kind] = d * self.expected[kind] + expected


@dataclass
class HybridCounters:
    """Plain counters: which drafter's tree each drafted row got."""

    suffix_trees: int = 0  # rows given the suffix tree
    eagle_trees: int = 0  # rows given the head's tree
    eagle_skipped: int = 0  # of the suffix trees, those proposed without running the head for the row

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class HybridDrafter:
    """An EAGLE drafter (any with `propose_batch`, or sessions with `propose`) beside a suffix drafter."""

    name = "hybrid"

    def __init__(self, eagle: Drafter, suffix: SuffixDrafter, config: HybridConfig | None = None) -> None:
        assert eagle.tree is not None, "the hybrid's model drafter needs a tree"
        self.eagle, self.suffix, self.config = eagle, suffix, config or HybridConfig()
        self.counters = HybridCounters()
        self.calibration = Calibration(self.config)
        e, s = eagle.tree, suffix.tree
        self.tree = TreeConfig(depth=max(e.depth, s.depth), top_k=e.top_k, total_tokens=max(e.total_tokens, s.total_tokens))

    @property
    def needs_visual(self) -> bool:
        return self.eagle.needs_visual

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        return getattr(self.eagle, "feature_layers", None)

    @property
    def store(self):  # noqa: ANN201 - the suffix drafter's SuffixStore (None: no cross-request memory)
        return self.suffix.store

    def metrics(self) -> dict[str, Any]:
        return {**self.suffix.metrics(), **self.counters.as_dict(), **{f"scale_{k}": self.calibration.scale(k) for k in KINDS}}

    def observe(self, tokens: list[int], tenant: str | None = None) -> None:
        self.suffix.observe(tokens, tenant)

    def start(self, prompt: PromptContext, tree: TreeConfig | None = None) -> DraftSession:
        """Each part's own tree; a request's other `tree` (the engine passes the drafter's own when the
        request names none) is the suffix part's, and caps the head's depth and nodes."""
        own = tree is None or tree == self.tree
        mine = self.suffix.tree if own else tree
        head = self.eagle.tree if own else dataclasses.replace(
            tree, depth=min(tree.depth, self.eagle.tree.depth), total_tokens=min(tree.total_tokens, self.eagle.tree.total_tokens))
        return _HybridSession(self, self.eagle.start(prompt, head), self.suffix.start(prompt, mine), head.depth)

    def propose_batch(self, sessions: list["_HybridSession"], roots: list[int], max_depths: list[int],
                      chains: list[bool] | None = None) -> list[DraftTree]:
        """Every row's tree (module docstring); rows whose suffix tree the head cannot beat run no head."""
        chains = chains or [False] * len(sessions)
        cal = self.calibration
        mine = [s.suffix.propose(root, d) for s, root, d in zip(sessions, roots, max_depths)]
        kinds = ["suffix_sure" if s.suffix.sure else "suffix" for s in sessions]
        scored = [cal.scale(k) * _expected(t, d, c) for t, k, d, c in zip(mine, kinds, max_depths, chains)]
        ceiling = [self.config.skip_at * cal.scale("eagle") * min(s.eagle_depth, d) for s, d in zip(sessions, max_depths)]
        head_depths = [0 if t.size > 1 and e >= top else d for t, e, top, d in zip(mine, scored, ceiling, max_depths)]
        heads = [s.eagle for s in sessions]
        batched = getattr(self.eagle, "propose_batch", None)
        if batched is not None:
            theirs = batched(heads, roots, head_depths, chains)
        else:
            theirs = [h.propose(root, d) for h, root, d in zip(heads, roots, head_depths)]
        out = []
        for s, t_s, kind, e_s, t_e, hd, d, c in zip(sessions, mine, kinds, scored, theirs, head_depths, max_depths, chains):
            s.picked = None
            if d <= 0 or (t_s.size == 1 and t_e.size == 1):
                out.append(t_e if t_e.size > 1 else t_s)
                continue
            e_e = _expected(t_e, d, c)
            suffix_wins = t_e.size == 1 or (t_s.size > 1 and e_s >= cal.scale("eagle") * e_e)
            self.counters.suffix_trees += suffix_wins
            self.counters.eagle_trees += not suffix_wins
            self.counters.eagle_skipped += hd == 0
            s.picked = (kind, _expected(t_s, d, c)) if suffix_wins else ("eagle", e_e)
            if not suffix_wins:
                s.suffix.discard()
            out.append(t_s if suffix_wins else t_e)
        return out


def _expected(tree: DraftTree, depth: int, chain: bool) -> float:
    """The tree's expected accepted length as it will be verified (its first chain for a chain row);
    a tree without estimates counts each drafted node as certain."""
    if tree.size == 1:
        return 0.0
    cut = tree.first_chain(depth) if chain else tree
    expected = cut.expected_accepted()
    return float(cut.size - 1) if expected is None else expected


class _HybridSession:
    """One request's two sessions: both see every commit; the answer joins the suffix store."""

    def __init__(self, drafter: HybridDrafter, eagle: DraftSession, suffix: DraftSession, eagle_depth: int) -> None:
        self.drafter, self.eagle, self.suffix, self.eagle_depth = drafter, eagle, suffix, eagle_depth
        self.picked: tuple[str, float] | None = None  # the last step's tree: its kind and expected accepted length

    def propose(self, root: int, max_depth: int) -> DraftTree:
        """A batch of one of `HybridDrafter.propose_batch`."""
        return self.drafter.propose_batch([self], [root], [max_depth])[0]

    def commit(self, token_ids, features) -> None:  # noqa: ANN001 - as DraftSession.commit
        """Both parts see the committed tokens; the picked tree's kind learns how far it was accepted."""
        if self.picked is not None:
            self.drafter.calibration.observe(*self.picked, int(token_ids.shape[0]) - 1)
            self.picked = None
        self.eagle.commit(token_ids, features)
        self.suffix.commit(token_ids, features)

    def finish(self, tokens: list[int]) -> None:
        self.suffix.finish(tokens)  # type: ignore[attr-defined]


__all__ = ["Calibration", "HybridConfig", "HybridCounters", "HybridDrafter"]
