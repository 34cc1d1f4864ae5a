"""The draft tree: a flat, topologically ordered list of nodes.

Node 0 is the root: the last token the target emitted, not yet in the target's KV cache. Every
other node is a drafted token whose parent comes earlier in the list. Drafters build trees,
the target verifies all N nodes in one forward pass, the verifier picks a root-to-node path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long, tokens[0] = root
    parents: torch.Tensor  # [N] long, parents[0] = -1, parents[i] < i
    # q[i] = the draft distribution node i's children were drawn from WITHOUT replacement, in
    # child order ([N, V] float). None: children were chosen deterministically (q = one-hot per
    # child), which is what the verifier assumes for any drafter that gives no probabilities.
    draft_probs: torch.Tensor | None = None
    # path_probs[i] = the drafter's estimate that the target's path passes through node i ([N] float,
    # root 1.0): EAGLE's cumulative draft probability, the suffix drafter's observed frequency. Their
    # sum over the drafted nodes is the tree's expected accepted length. None: no estimate.
    path_probs: torch.Tensor | None = None
    depth: torch.Tensor = field(init=False)  # [N] long, depth[0] = 0

    def __post_init__(self) -> None:
        assert self.tokens.ndim == 1 and self.tokens.shape == self.parents.shape, "tokens/parents must be [N]"
        assert int(self.parents[0]) == -1, "node 0 must be the root"
        n = self.tokens.shape[0]
        idx = torch.arange(n)
        assert bool((self.parents[1:] < idx[1:]).all()) and bool((self.parents[1:] >= 0).all()), (
            "parents must come before their children"
        )
        par, depth = self.parents.tolist(), [0] * n  # on the host: one tensor op, not three per node
        for i in range(1, n):
            depth[i] = depth[par[i]] + 1
        self.depth = torch.tensor(depth, dtype=torch.long)
        if self.draft_probs is not None:
            assert self.draft_probs.shape[0] == n, "draft_probs must be [N, V]"
        if self.path_probs is not None:
            assert self.path_probs.shape == (n,), "path_probs must be [N]"

    @classmethod
    def root_only(cls, root: int) -> "DraftTree":
        return cls(torch.tensor([root], dtype=torch.long), torch.tensor([-1], dtype=torch.long))

    @classmethod
    def chain(cls, root: int, tokens: list[int]) -> "DraftTree":
        """A single path root -> tokens[0] -> tokens[1] -> ..."""
        n = len(tokens) + 1
        return cls(torch.tensor([root, *tokens], dtype=torch.long), torch.arange(-1, n - 1, dtype=torch.long))

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def expected_accepted(self) -> float | None:
        """The drafter's expected accepted length of this tree (drafted tokens, bonus excluded): the sum
        of its drafted nodes' `path_probs`; None when the drafter gave none."""
        return None if self.path_probs is None else float(self.path_probs[1:].sum())

    def children(self) -> list[list[int]]:
        """children[i] = node ids of i's children, in order (the order siblings are tried in)."""
        out: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                out[p].append(i)
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] is True iff j is i or an ancestor of i (i may attend to j)."""
        return ancestor_mask(self.parents)

    def path_to(self, node: int) -> list[int]:
        """Node ids from the root to `node`, both included."""
        path = []
        par = self.parents.tolist()
        while node >= 0:
            path.append(node)
            node = par[node]
        return path[::-1]

    def truncate_depth(self, max_depth: int) -> "DraftTree":
        """Drop nodes deeper than max_depth (e.g. to stay inside the context window)."""
        keep = (self.depth <= max_depth).nonzero().squeeze(-1)
        if keep.numel() == self.size:
            return self
        return self.select(keep)

    def first_chain(self, max_depth: int) -> "DraftTree":
        """The path of first children from the root, at most max_depth nodes: each node's child that
        is tried first (an EAGLE-2 tree's likeliest kept child, an n-gram's first match). A sub-tree
        whose every node keeps a prefix of its children in order, so verification stays lossless."""
        children, keep, node = self.children(), [0], 0
        while len(keep) <= max_depth and children[node]:
            node = children[node][0]
            keep.append(node)
        return self if len(keep) == self.size else self.select(torch.tensor(keep, dtype=torch.long))

    def first_chain_run(self, path: list[int]) -> int:
        """How many accepted nodes of `path` (root first) lead it along first children: what the
        `first_chain` of this tree would have had accepted at T=0 (the target's token at a node is
        the same whichever children it has)."""
        children, run = self.children(), 0
        for parent, node in zip(path, path[1:]):
            if children[parent][0] != node:
                break
            run += 1
        return run

    def select(self, keep: torch.Tensor) -> "DraftTree":
        """Keep the nodes `keep` ([M] ascending, 0 included, closed under parents)."""
        remap = torch.full((self.size,), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        new_parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        assert bool((new_parents[1:] >= 0).all()), "selection is not closed under parents"
        probs = None if self.draft_probs is None else self.draft_probs[keep]
        reach = None if self.path_probs is None else self.path_probs[keep]
        return DraftTree(self.tokens[keep], new_parents, probs, reach)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] (topologically ordered, parents[0] = -1) -> [N, N] bool ancestor-or-self mask."""
    par = parents.tolist()
    rows: list[list[bool]] = []
    for i, p in enumerate(par):  # on the host: a row is its parent's plus itself
        row = rows[p].copy() if p >= 0 else [False] * len(par)
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)  # [N, N]


def tree_attention_mask(tree_mask: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask [1, 1, N, prefix_len + M] for N tree queries over [prefix KV + M tree KV].

    tree_mask: [N, M] bool (M >= N; the queries are the last N of the M tree entries), e.g. the
    [N, N] ancestor mask. Every query sees the whole committed prefix and the tree entries its
    row allows. Additive (0 / dtype min) so it works for the eager and the SDPA attention paths.
    """
    n = tree_mask.shape[0]
    allowed = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool, device=tree_mask.device), tree_mask], dim=1)
    return additive_mask(allowed, dtype)


def windowed_tree_mask(tree_mask: torch.Tensor, prefix_len: int, depth: torch.Tensor, kind: str, window: int | None) -> torch.Tensor:
    """[N, prefix_len + N] bool: the ancestor mask cut by a layer's own window, for N tree queries.

    A node at depth d stands at sequence index prefix_len + d (the index it takes once its path is
    committed), and so does each of its ancestors; a prefix entry j stands at j. Kinds, as
    transformers' own masks define them for one-token steps:
      'full_attention'    every committed entry and every ancestor;
      'sliding_attention' only keys with q - k < window;
      'chunked_attention' only keys in the query's own chunk of `window` (k // window == q // window).
    tree_mask: [N, N] bool ancestor-or-self mask; depth: [N] long.
    """
    n = tree_mask.shape[0]
    allowed = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool, device=tree_mask.device), tree_mask], dim=1)
    if kind == "full_attention":
        return allowed
    assert window is not None and window > 0, (kind, window)
    q = prefix_len + depth.to(tree_mask.device)  # [N]
    k = torch.cat([torch.arange(prefix_len, device=tree_mask.device), q])  # [P + N]
    if kind == "sliding_attention":
        return allowed & (q[:, None] - k[None, :] < window)
    if kind == "chunked_attention":
        return allowed & (k[None, :] // window == q[:, None] // window)
    raise ValueError(f"no tree mask for layers of kind {kind!r}")


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] bool -> [1, 1, N, K] additive mask (0 where allowed, dtype min elsewhere)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
