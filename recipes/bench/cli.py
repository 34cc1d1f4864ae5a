"""The `python -m vlmspec.recipes` commands of this folder."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add this folder's commands to the recipes' command line."""
