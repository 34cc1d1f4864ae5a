"""The one Drafter protocol every drafter implements, and the tree knobs they share.

A Drafter is stateless model/config; ``start`` opens a DraftSession holding one request's state
(its own KV cache, the token history, the request's tree shape). The engine reads ``needs_visual`` and calls:

    session = drafter.start(prompt, tree)    # after the target's prefill; tree None = drafter.tree
    tree = session.propose(root, max_depth)  # root = last emitted token, not yet in the target KV
    session.commit(tokens, features)         # tokens [k] now in the target KV (root + accepted), features [k, H]
    session.finish(tokens)                   # optional: once, when the request leaves, every token it emitted
    trees = propose_all(drafter, sessions, roots, max_depths, chains)  # a batch step: propose_batch, else each propose

With `feature_layers` (target layer ids, EAGLE-3) the features are those layers' hidden states concatenated, [k, m x H]
(`vlmspec.target.model.layer_features`); else the last hidden state. Batch rows may ask any depth (0 too) or a chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from vlmspec.tree import DraftTree


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree (EAGLE-2 style): grow `depth` levels, expanding the `top_k` best
    nodes by cumulative draft log-prob with `top_k` children each, keep the best `total_tokens`
    drafted nodes (root excluded)."""

    depth: int = 5
    top_k: int = 4
    total_tokens: int = 16

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise ValueError(f"tree knobs must be >= 1, got {self}")

    @classmethod
    def for_device(cls, device: str | torch.device) -> "TreeConfig":
        """CPU: verifying a node costs nearly as much as a decode step, keep trees small.
        GPU: a 60-node tree costs about one decode step (EAGLE-2's defaults)."""
        if torch.device(device).type == "cuda":
            return cls(depth=7, top_k=10, total_tokens=60)
        return cls(depth=5, top_k=4, total_tokens=16)


@dataclass
class PromptContext:
    """What a drafter may look at when a request starts."""

    token_ids: torch.Tensor  # [L] prompt token ids
    features: torch.Tensor  # [L, H] target features of the prompt tokens
    inputs: dict[str, Any] = field(default_factory=dict)  # the processor's tensors (pixels, grids, ...)
    # filled when the drafter sets `needs_visual = True` (VLM-aware drafters):
    image_mask: torch.Tensor | None = None  # [L] bool, image-token positions
    image_embeds: torch.Tensor | None = None  # [n_img, H] projected image embeddings, in order
    attention: torch.Tensor | None = None  # [L] target's last-layer attention of the last prompt token
    # the request's committed target KV entries of layers < n, live (`TargetState.entries`: per layer
    # (keys, values) [1, kv_heads, L, head_dim]): read, never written, by drafters that reuse the
    # target's own layers (self-speculation)
    kv: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
    # for drafters that learn from traffic (`vlmspec.draft.suffix`): whose earlier answers this request
    # may be drafted from, and whose pool its answer joins (None: the shared pool); `remember` False:
    # its answer is kept for nothing once it ends (GenerationConfig.tenant / .remember)
    tenant: str | None = None
    remember: bool = True


@runtime_checkable
class DraftSession(Protocol):
    def propose(self, root: int, max_depth: int) -> DraftTree:
        """A tree rooted at `root` with depth <= max_depth (0 means root only)."""
        ...

    def commit(self, token_ids: torch.Tensor, features: torch.Tensor) -> None:
        """token_ids [k]: committed to the target KV (the root, then the accepted tokens);
        features [k, H]: the target's features at those tokens."""
        ...


@runtime_checkable
class Drafter(Protocol):
    name: str
    needs_visual: bool  # the target's prefill must capture image embeddings and attention (PromptContext)
    tree: TreeConfig | None  # the default tree shape; None for a drafter that proposes no tree

    def start(self, prompt: PromptContext, tree: TreeConfig | None = None) -> DraftSession:
        """One request's session; `tree` overrides the default shape for this request only."""
        ...


def feature_layers(drafter: Drafter) -> tuple[int, ...] | None:
    """The target layers whose hidden states `drafter` reads as its features; None: the last hidden state."""
    return getattr(drafter, "feature_layers", None)


def propose_all(drafter: Drafter, sessions: list[DraftSession], roots: list[int], max_depths: list[int],
                chains: list[bool] | None = None, failed: dict[int, Exception] | None = None) -> list[DraftTree]:
    """One tree per row (session), each after its root and within its own max depth; a row with
    `chains[b]` gets its first-child chain (`DraftTree.first_chain`: one node per level), which a
    drafter with `propose_batch` grows alone (EAGLE: top-1 per level, a row-sized slice of each
    level's forward instead of top_k).

    failed: given, a session whose own `propose` raises is recorded there by row (its tree: the
    root alone) and the other rows are drafted as usual; a drafter with `propose_batch` drafts the
    rows together, so what it raises belongs to no one row and is raised."""
    chains = chains or [False] * len(sessions)
    batched = getattr(drafter, "propose_batch", None)
    if batched is not None:
        trees = batched(sessions, roots, max_depths, chains)
    else:
        trees = [_propose_row(b, s, root, depth, failed) for b, (s, root, depth) in enumerate(zip(sessions, roots, max_depths))]
    return [t.first_chain(d) if c else t for t, d, c in zip(trees, max_depths, chains)]


def _propose_row(row: int, session: DraftSession, root: int, max_depth: int, failed: dict[int, Exception] | None) -> DraftTree:
    if failed is None:
        return session.propose(root, max_depth)
    try:
        return session.propose(root, max_depth)
    except Exception as exc:  # one row's session: recorded for the engine, which ends that request alone (`Batch`)
        failed[row] = exc
        return DraftTree.root_only(root)


class PlainDrafter:
    """`none`: proposes nothing, so the engine runs plain autoregressive decoding (the oracle)."""

    name = "plain"
    needs_visual = False
    tree = None

    def start(self, prompt: PromptContext, tree: TreeConfig | None = None) -> DraftSession:
        return _NoDraftSession()


class _NoDraftSession:
    def propose(self, root: int, max_depth: int) -> DraftTree:
        return DraftTree.root_only(root)

    def commit(self, token_ids: torch.Tensor, features: torch.Tensor) -> None:
        return None
