"""Drafters behind one protocol (vlmspec.draft.base.Drafter) and the factory the CLI/server use."""

from __future__ import annotations

from pathlib import Path

from vlmspec.draft.base import Drafter, DraftSession, NoDrafter, PromptContext, TreeConfig
from vlmspec.draft.ngram import NgramDrafter
from vlmspec.errors import DrafterLoadError

MODEL_FREE = ("none", "ngram")


def load_drafter(spec: str, target, tree: TreeConfig | None = None) -> Drafter:
    """`none` | `ngram` | a drafter folder (config.json + model.safetensors), checked against target."""
    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter(tree)
    path = Path(spec)
    if not path.is_dir():
        raise DrafterLoadError(f"drafter {spec!r} is neither 'none', 'ngram' nor a drafter folder")
    from vlmspec.draft.eagle import EagleDrafter

    return EagleDrafter.load(path, target, tree)


__all__ = ["Drafter", "DraftSession", "NoDrafter", "NgramDrafter", "PromptContext", "TreeConfig", "load_drafter"]
