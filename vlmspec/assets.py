"""Where the models live.

- The real target (SmolLM2-135M-Instruct + EfficientNet-Lite0 in `fast_vlm`) is *built* on this
  machine by `vlmspec build-target` (`make setup` runs it) into $VLMSPEC_MODELS (default: the
  repository's models/ folder) from two pip packages: `smolvlm-base`, the untrained assembly (the
  parity tests run on it), and `smolvlm-toyworld`, with assets/smolvlm-toyworld/'s trained parts: the
  default model (where it is not built, the default falls back to the toy).
- The toy (`toyworld-vlm`, 4 M parameters, `--model toy`) and its EAGLE drafter are committed in
  assets/ (or $VLMSPEC_ASSETS); tests use them as a fast model.
- Each shipped EAGLE drafter sits next to its model (`shipped_drafter`): assets/toyworld-vlm-drafter,
  assets/smolvlm-toyworld-drafter (#20). A drafter records its target by name (`model_name`: 'toy',
  these models' names, another folder's name with its path, or a hub id); `recorded_model` turns
  the record back into a --model on this machine.
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


def _known() -> dict[str, Path]:
    return {TOY_NAME: BUNDLED_TARGET, DEFAULT_TARGET_NAME: DEFAULT_TARGET, BASE_TARGET.name: BASE_TARGET}


KNOWN_MODELS = tuple(_known())  # the models a drafter's record names without a path: found here by name


def model_name(model: str | Path) -> str:
    """The name a drafter records for its target: 'toy' (the toy's folder), the default model's or
    the untrained assembly's name (their folders), another folder's name, or the hub id as given."""
    path = Path(model)
    if not path.is_dir():
        return str(model)
    folder = os.path.realpath(path)  # (never raises: a folder behind a symlink loop is just not one of them)
    return next((name for name, known in _known().items() if folder == os.path.realpath(known)), Path(folder).name)


def recorded_model(name: str, path: str = "") -> str | None:
    """The --model a drafter's record (`model_name`, and the folder's path where it was another
    folder) stands for on this machine: 'toy', a known model's folder when it is built, the recorded
    folder where it still is, or the hub id; None when that model is not here."""
    if name == TOY_NAME:
        return TOY_NAME
    if name in KNOWN_MODELS:
        folder = _known()[name]
        return str(folder) if (folder / "config.json").is_file() else None
    if path:
        return path if Path(path).is_dir() else None
    return name  # recorded without a folder: a hub id
