"""`--drafter hybrid` (`eagle+suffix`, `DIR+suffix`): an EAGLE head and the suffix drafter, the
likelier tree per step and per row.

    drafter = HybridDrafter(eagle, suffix)           # both built by the composition root (vlmspec.factory)
    trees = drafter.propose_batch(sessions, roots, max_depths, chains)

Each row's suffix tree comes first (a few dict lookups). Its expected accepted length E_s (the sum
of its nodes' observed probabilities, `DraftTree.expected_accepted`) is compared with what the
EAGLE head could give: no more than one token per level of its depth, so where E_s reaches that
ceiling (`HybridConfig.skip_at` of it) the head drafts nothing for the row this step (its pairs
wait for its next draft, as a plain step's do) and the suffix tree is proposed; a repeated answer
is drafted from the store at the cost of the lookups. Elsewhere the head drafts (every such row in
its one batched forward per level), and each row gets the tree of the higher expected accepted
length, the head's being the sum of its nodes' cumulative draft probabilities: the head keeps its
wins on fresh text. Rows asked for a chain compare chains. Either tree is verified as usual, so
the output is the target's (lossless).

The goodput policy (`vlmspec.control`) prices the row as it prices any drafter: from what the
row's proposals had accepted; the hybrid's choice raises that acceptance where either drafter is
sure, and an empty suffix tree beside a head that drafts is never proposed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vlmspec.draft.base import DraftSession, Drafter, PromptContext, TreeConfig
from vlmspec.draft.suffix import SuffixDrafter
from vlmspec.tree import DraftTree


@dataclass(frozen=True)
class HybridConfig:
    """skip_at: the head skips a row whose suffix tree's expected accepted length reaches this share
    of the most the head could give it (its depth this step); 1.0: only where the head cannot win."""

    skip_at: float = 1.0

    def __post_init__(self) -> None:
        if not self.skip_at > 0:
            raise ValueError(f"skip_at must be > 0, got {self.skip_at}")


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
        return {**self.suffix.metrics(), **self.counters.as_dict()}

    def observe(self, tokens: list[int], tenant: str | None = None) -> None:
        self.suffix.observe(tokens, tenant)

    def start(self, prompt: PromptContext, tree: TreeConfig | None = None) -> DraftSession:
        """Each part's own tree, or both the request's `tree`."""
        return _HybridSession(self, self.eagle.start(prompt, tree), self.suffix.start(prompt, tree), (tree or self.eagle.tree).depth)

    def propose_batch(self, sessions: list["_HybridSession"], roots: list[int], max_depths: list[int],
                      chains: list[bool] | None = None) -> list[DraftTree]:
        """Every row's tree (module docstring); rows whose suffix tree the head cannot beat run no head."""
        chains = chains or [False] * len(sessions)
        mine = [s.suffix.propose(root, d) for s, root, d in zip(sessions, roots, max_depths)]
        mine_e = [_expected(t, d, c) for t, d, c in zip(mine, max_depths, chains)]
        head_depths = [0 if e >= self.config.skip_at * min(s.eagle_depth, d) else d
                       for s, e, d in zip(sessions, mine_e, max_depths)]
        heads = [s.eagle for s in sessions]
        batched = getattr(self.eagle, "propose_batch", None)
        if batched is not None:
            theirs = batched(heads, roots, head_depths, chains)
        else:
            theirs = [h.propose(root, d) for h, root, d in zip(heads, roots, head_depths)]
        out = []
        for t_s, e_s, t_e, hd, d, c in zip(mine, mine_e, theirs, head_depths, max_depths, chains):
            if d <= 0 or (t_s.size == 1 and t_e.size == 1):
                out.append(t_e if t_e.size > 1 else t_s)
                continue
            suffix_wins = hd == 0 or t_e.size == 1 or (t_s.size > 1 and e_s >= _expected(t_e, d, c))
            self.counters.suffix_trees += suffix_wins
            self.counters.eagle_trees += not suffix_wins
            self.counters.eagle_skipped += hd == 0
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

    def propose(self, root: int, max_depth: int) -> DraftTree:
        """A batch of one of `HybridDrafter.propose_batch`."""
        return self.drafter.propose_batch([self], [root], [max_depth])[0]

    def commit(self, token_ids, features) -> None:  # noqa: ANN001 - as DraftSession.commit
        self.eagle.commit(token_ids, features)
        self.suffix.commit(token_ids, features)

    def finish(self, tokens: list[int]) -> None:
        self.suffix.finish(tokens)  # type: ignore[attr-defined]


__all__ = ["HybridConfig", "HybridCounters", "HybridDrafter"]
