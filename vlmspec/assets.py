"""Where the bundled model and drafter live (the repository's assets/ folder, or $VLMSPEC_ASSETS)."""

from __future__ import annotations

import os
from pathlib import Path

ASSETS = Path(os.environ.get("VLMSPEC_ASSETS", Path(__file__).resolve().parents[1] / "assets"))
BUNDLED_TARGET = ASSETS / "toyworld-vlm"
BUNDLED_DRAFTER = ASSETS / "toyworld-vlm-drafter"
SAMPLE_IMAGES = ASSETS / "images"


def bundled_target() -> Path | None:
    """The bundled target folder, or None when it is not there (e.g. before it was trained)."""
    return BUNDLED_TARGET if (BUNDLED_TARGET / "config.json").is_file() else None


def bundled_drafter() -> Path | None:
    return BUNDLED_DRAFTER if (BUNDLED_DRAFTER / "config.json").is_file() else None
