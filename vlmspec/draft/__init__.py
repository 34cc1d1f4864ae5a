"""Drafters behind one protocol (vlmspec.draft.base.Drafter) and the factory the CLI/server use."""

from __future__ import annotations

from pathlib import Path

from vlmspec.draft.base import Drafter, DraftSession, PlainDrafter, PromptContext, TreeConfig
from vlmspec.draft.ngram import NgramDrafter
from vlmspec.draft.suffix import SuffixDrafter, suffix_tree_config
from vlmspec.draft.suffix_index import SuffixStore
from vlmspec.errors import ConfigError, DrafterLoadError

PLAIN = "plain"  # the one word for not drafting (plain decoding through the same engine)
MODEL_FREE = (PLAIN, "ngram", "self", "suffix")
HYBRID_SUFFIX = "+suffix"  # `X+suffix`: drafter X (an EAGLE drafter) beside the suffix drafter, the likelier tree per row


def canonical_drafter(spec: str) -> str:
    """`spec` with the old spelling of not drafting, `none`, read as `plain` (still accepted where users send it)."""
    return PLAIN if spec == "none" else spec


def load_drafter(spec: str, target, tree: TreeConfig | None = None, store: SuffixStore | None = None) -> Drafter:
    """`plain` (or `none`) | `ngram` | `suffix` (SuffixDecoding over `store`, the cross-request memory the caller
    made; None: each request's own text only) | `X+suffix` (drafter X beside it, `HybridDrafter`)
    | `self` (self-speculation, DEL's dynamic exit) | `self:E` (exit after layer E)
    | `self:E:K` / `self:auto:K` (over the first K token ids) | a drafter folder | a drafter's hub id
    ("org/name"), checked against target.

    A hub id is fetched when the hub answers, else read from the local Hugging Face cache.
    """
    spec = canonical_drafter(spec)
    if spec == PLAIN:
        return PlainDrafter()
    if spec == "ngram":
        return NgramDrafter(tree)
    if spec == "suffix":
        return SuffixDrafter(tree, store=store)
    if spec.endswith(HYBRID_SUFFIX) and spec != HYBRID_SUFFIX:
        from vlmspec.draft.hybrid import HybridDrafter

        model = load_drafter(spec[: -len(HYBRID_SUFFIX)], target, tree)
        if model.tree is None or isinstance(model, SuffixDrafter):
            raise DrafterLoadError(f"drafter {spec!r}: the part before {HYBRID_SUFFIX} must be a drafter that drafts a tree (eagle, a folder)")
        return HybridDrafter(model, SuffixDrafter(suffix_tree_config(target.device), store=store))
    if spec == "self" or spec.startswith("self:"):
        from vlmspec.draft.self_spec import SelfSpecConfig, SelfSpecDrafter

        parts = spec.split(":")[1:]  # self[:E|auto[:K]]
        ok = len(parts) <= 2 and (not parts or parts[0] == "auto" or parts[0].isdigit()) and (len(parts) < 2 or parts[1].isdigit())
        if not ok:
            raise DrafterLoadError(f"drafter {spec!r}: write self, self:E (exit after layer E, e.g. self:8) or self:E:K / self:auto:K "
                                   "(draft over the first K token ids)")
        exit_layer = int(parts[0]) if parts and parts[0] != "auto" else None
        vocab = int(parts[1]) if len(parts) == 2 else None
        try:
            return SelfSpecDrafter(target, tree, SelfSpecConfig(exit_layer=exit_layer, draft_vocab=vocab))
        except ConfigError as exc:
            raise DrafterLoadError(f"drafter {spec!r}: {exc}") from None
    from vlmspec.draft.eagle import EagleDrafter

    check_drafter_name(spec)
    return EagleDrafter.from_pretrained(spec, target, tree)


def check_drafter_name(spec: str) -> None:
    """DrafterLoadError, listing every choice, when `spec` cannot name a drafter: none of the names,
    not a folder, not a hub id. Needs no target, so the CLI says it before loading a model."""
    from vlmspec.draft.eagle import looks_like_hub_id

    spec = canonical_drafter(spec)
    if spec.endswith(HYBRID_SUFFIX) and spec != HYBRID_SUFFIX:
        spec = spec[: -len(HYBRID_SUFFIX)]  # the model drafter beside the suffix drafter
    named = spec in ("auto", "eagle", "hybrid") or spec.split(":")[0] in MODEL_FREE
    if not named and not Path(spec).expanduser().is_dir() and not looks_like_hub_id(spec):
        raise DrafterLoadError(f"drafter {spec!r} is none of 'auto', 'eagle', 'plain', 'ngram', 'self', 'self:E', 'self:E:K', "
                               "nor a drafter folder or a hub id (org/name), nor 'suffix', 'hybrid', 'eagle+suffix' or 'DIR+suffix'")


def default_tree(spec: str, device: str) -> TreeConfig | None:
    """The tree shape drafter `spec` was measured best with on `device`'s type (an EAGLE drafter's
    config, `tree_defaults`; the suffix drafter's own, `suffix_tree_config`; `X+suffix`: X's); None
    for the other model-free drafters and drafters that record none."""
    spec = canonical_drafter(spec)
    if spec == "suffix":
        return suffix_tree_config(device)
    if spec.endswith(HYBRID_SUFFIX) and spec != HYBRID_SUFFIX:
        spec = spec[: -len(HYBRID_SUFFIX)]
    if spec.split(":")[0] in MODEL_FREE:  # plain, ngram, self[:E[:K]]
        return None
    from vlmspec.draft.eagle import CONFIG_NAME, EagleDrafter, looks_like_hub_id

    path = Path(spec).expanduser()
    if (path.is_dir() and not (path / CONFIG_NAME).is_file()) or (not path.is_dir() and not looks_like_hub_id(spec)):
        return None  # not a drafter folder: load_drafter says what is wrong with it
    return EagleDrafter.default_tree(spec, device)


def recorded_target(spec: str) -> dict | None:
    """The target drafter folder `spec` records it was trained for (`vlmspec.draft.eagle.config.recorded_target`:
    {"model", "path", ...}), read without loading anything; None for a drafter name, a hub id, or a
    drafter that records none (one written before drafters recorded their target). `DIR+suffix`: DIR's."""
    spec = canonical_drafter(spec)
    if spec.endswith(HYBRID_SUFFIX) and spec != HYBRID_SUFFIX:
        spec = spec[: -len(HYBRID_SUFFIX)]
    if spec in ("auto", "eagle", "hybrid") or spec.split(":")[0] in MODEL_FREE:
        return None
    from vlmspec.draft.eagle.config import recorded_target as read_record

    path = Path(spec).expanduser()
    return read_record(path) if path.is_dir() else None


__all__ = ["HYBRID_SUFFIX", "PLAIN", "Drafter", "DraftSession", "PlainDrafter", "NgramDrafter", "PromptContext", "SuffixDrafter", "SuffixStore",
           "TreeConfig", "canonical_drafter", "check_drafter_name", "default_tree", "load_drafter", "recorded_target"]
