"""Where the models live.

- The real target (SmolLM2-135M-Instruct + EfficientNet-Lite0 in `fast_vlm`) is *built* on this
  machine by `vlmspec build-target` (`make setup` runs it) into $VLMSPEC_MODELS (default: the
  repository's models/ folder) from two pip packages:
  * `smolvlm-base`: the untrained assembly (projector at its seeded init), what `python -m
    vlmspec.recipes train-align` starts from and what the parity tests run on;
  * `smolvlm-toyworld`: the same with the trained parts committed in assets/smolvlm-toyworld/
    applied: the default model (issue #19). Where it is not built (no `make setup`), the default
    falls back to the toy.
- The toy (`toyworld-vlm`, 4 M parameters, 9 image tokens) and its EAGLE drafter are committed in
  assets/ (or $VLMSPEC_ASSETS); tests use them as a fast model. `--model toy` selects it.
- Each shipped EAGLE drafter is committed next to the model it was trained for
  (`shipped_drafter`): the toy's in assets/toyworld-vlm-drafter, the default model's in
  assets/smolvlm-toyworld-drafter (issue #20).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = Path(os.environ.get("VLMSPEC_ASSETS", ROOT / "assets"))
MODELS = Path(os.environ.get("VLMSPEC_MODELS", ROOT / "models"))

DEFAULT_TARGET_NAME = "smolvlm-toyworld"
DEFAULT_TARGET = MODELS / DEFAULT_TARGET_NAME  # built with the trained parts, never committed
DEFAULT_TARGET_PARTS = ASSETS / DEFAULT_TARGET_NAME / "trained.safetensors"  # committed once trained
BASE_TARGET = MODELS / "smolvlm-base"  # the untrained assembly, built by make setup
TOY_NAME = "toy"
BUNDLED_TARGET = ASSETS / "toyworld-vlm"  # the toy
BUNDLED_DRAFTER = ASSETS / "toyworld-vlm-drafter"  # the toy's EAGLE drafter
DEFAULT_DRAFTER = ASSETS / f"{DEFAULT_TARGET_NAME}-drafter"  # the default model's EAGLE drafter
SAMPLE_IMAGES = ASSETS / "images"


def default_target() -> Path | None:
    """The built, aligned real target, or None (not built, or its trained parts not shipped yet)."""
    return DEFAULT_TARGET if (DEFAULT_TARGET / "config.json").is_file() else None


def base_target() -> Path | None:
    """The built untrained assembly of the real target, or None before `make setup`."""
    return BASE_TARGET if (BASE_TARGET / "config.json").is_file() else None


def bundled_target() -> Path | None:
    """The toy target folder, or None when it is not there."""
    return BUNDLED_TARGET if (BUNDLED_TARGET / "config.json").is_file() else None


def bundled_drafter() -> Path | None:
    return BUNDLED_DRAFTER if (BUNDLED_DRAFTER / "config.json").is_file() else None


def shipped_drafter(model: str | Path) -> Path | None:
    """The committed EAGLE drafter trained for the model folder `model` (the toy or the built
    default model), or None: another model, or that drafter not there."""
    folder = Path(model).resolve()
    for target, drafter in ((BUNDLED_TARGET, BUNDLED_DRAFTER), (DEFAULT_TARGET, DEFAULT_DRAFTER)):
        if folder == target.resolve() and (drafter / "config.json").is_file():
            return drafter
    return None
