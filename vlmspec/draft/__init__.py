"""Drafters behind one protocol (vlmspec.draft.base.Drafter) and the factory the CLI/server use."""

from __future__ import annotations

from pathlib import Path

from vlmspec.draft.base import Drafter, DraftSession, NoDrafter, PromptContext, TreeConfig
from vlmspec.draft.ngram import NgramDrafter
from vlmspec.errors import DrafterLoadError

MODEL_FREE = ("none", "ngram")


def load_drafter(spec: str, target, tree: TreeConfig | None = None) -> Drafter:
    """`none` | `ngram` | a drafter folder | a drafter's hub id ("org/name"), checked against target.

    A hub id is fetched when the hub answers, else read from the local Hugging Face cache.
    """
    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter(tree)
    from vlmspec.draft.eagle import EagleDrafter, looks_like_hub_id

    if not Path(spec).expanduser().is_dir() and not looks_like_hub_id(spec):
        raise DrafterLoadError(f"drafter {spec!r} is neither 'none', 'ngram' nor a drafter folder (or a hub id: org/name)")
    return EagleDrafter.from_pretrained(spec, target, tree)


__all__ = ["Drafter", "DraftSession", "NoDrafter", "NgramDrafter", "PromptContext", "TreeConfig", "load_drafter"]
