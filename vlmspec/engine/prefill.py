"""Chunked prefill: a long prompt enters its slot in pieces, one step's budget at a time, so rows
already decoding wait for at most one piece between their steps (vLLM's chunked prefill, on this
engine's tree path).

    req = engine._open(inputs, config, cache, slot, chunk)   # the first piece (every image in it)
    done = run_pieces(target, reqs, sizes, layers)           # the next piece of each, ONE forward
    engine._begin(req)                                       # once the last is in: drafter + first token

The first piece runs through `Target.prefill` (`vlmspec.target.pieces.first_piece` says where it
ends); each later piece is text and goes in as a chain, the explicit-mask forward that verifies draft
trees (`Target.forward_batch`, the pieces of every prefilling row of a step together), committed
whole. The drafter's session starts on the features of every piece, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlmspec.target import ForwardOut, Target
from vlmspec.tree import DraftTree


@dataclass
class PromptPieces:
    """A request's prompt while it enters its slot piece by piece."""

    inputs: dict[str, torch.Tensor]  # the whole prompt's processor outputs
    first: ForwardOut  # the first piece's outputs (with the image mask / embeddings a drafter asked for)
    done: int  # prompt tokens in the slot
    features: list[torch.Tensor] = field(default_factory=list)  # each piece's features [n_i, H], in order
    logits: torch.Tensor | None = None  # [1, V] after the last token in the slot

    @property
    def length(self) -> int:
        return int(self.inputs["input_ids"].shape[1])

    @property
    def left(self) -> int:
        return self.length - self.done

    def prompt_features(self) -> torch.Tensor:
        """[L, H]: every prompt token's features."""
        return self.features[0] if len(self.features) == 1 else torch.cat(self.features)


def run_pieces(target: Target, reqs: list[Any], sizes: list[int], layers: tuple[int, ...] | None) -> None:
    """The next `sizes[b]` prompt tokens of each request in `reqs` (the batch's `_Request`s, each with
    its `state` and `pieces`) into its slot, in one forward, each
    a chain after the tokens it has in; commits them and keeps their features and the last logits."""
    trees = []
    for r, n in zip(reqs, sizes):
        ids = r.pieces.inputs["input_ids"][0, r.pieces.done : r.pieces.done + n].tolist()
        trees.append(DraftTree.chain(ids[0], ids[1:]))
    out = target.forward_batch([r.state for r in reqs], trees, layers)  # logits [B, N, V], features [B, N, H]
    target.commit_batch([r.state for r in reqs], [list(range(n)) for n in sizes])
    for b, (r, n) in enumerate(zip(reqs, sizes)):
        r.pieces.features.append(out.features[b, :n])
        r.pieces.logits = out.logits[b, n - 1 : n]
        r.pieces.done += n
