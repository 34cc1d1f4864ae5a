"""Loading a target: an unmodified `AutoModelForImageTextToText` + `AutoProcessor` from a folder or a hub id."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from vlmspec.errors import TargetLoadError
from vlmspec.target.attention import set_attention
from vlmspec.target.model import Target
from vlmspec.target.packing import pack_exact_linears


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick look at whether the HF hub answers, so an offline machine fails in seconds, not minutes."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def looks_like_path(src: str) -> bool:
    """A string meant as a local folder rather than a hub id ("org/name")."""
    return src.startswith((".", "/", "~")) or src.count("/") > 1


def load_target(
    path_or_id: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    attention: str = "auto",
    packed_weights: bool = True,
) -> Target:
    """Load a VLM with AutoModelForImageTextToText + AutoProcessor from a folder or a hub id.
    `attention`: see `vlmspec.target.attention.set_attention`. `packed_weights`: on a CPU, linear
    layers multiply the few rows of decode steps over weights packed once for oneDNN, where that
    gives F.linear's numbers to the bit (`vlmspec.target.packing`: bf16)."""
    try:
        from transformers import AutoModelForImageTextToText, AutoProcessor
    except ImportError as exc:  # pragma: no cover - transformers is a core dependency
        raise TargetLoadError(f"transformers is not importable ({exc}): pip install 'transformers>=5,<6'") from None

    src = str(path_or_id)
    is_dir = Path(src).is_dir()
    if not is_dir and looks_like_path(src):
        raise TargetLoadError(f"model folder not found: {src}")
    kwargs: dict[str, Any] = {"attn_implementation": "sdpa"}  # the language model's is set below
    if dtype is not None:
        kwargs["dtype"] = dtype
    # a hub id: use the local HF cache when it has the files, the hub only when it answers
    offline = not is_dir and not hub_reachable()
    if offline:
        kwargs["local_files_only"] = True
    try:
        processor = AutoProcessor.from_pretrained(src, local_files_only=offline)
        model = AutoModelForImageTextToText.from_pretrained(src, **kwargs)
    except ImportError as exc:  # an optional dependency of this architecture (timm, gguf, ...)
        raise TargetLoadError(f"cannot load {src!r}: a package it needs is missing ({str(exc).splitlines()[0]}); "
                              "install it with pip (make setup installs the project's extras)") from None
    except (OSError, ValueError, KeyError) as exc:
        if is_dir:
            raise TargetLoadError(f"cannot load a vision-language model from folder {src!r}: {exc}") from exc
        hint = " (the hub is unreachable from here and it is not in the local cache: pass a local folder)" if offline else ""
        raise TargetLoadError(f"cannot load a vision-language model from hub id {src!r}{hint}: {str(exc).splitlines()[0]}") from exc
    model = model.to(device)
    set_attention(model, attention)
    if packed_weights and torch.device(device).type == "cpu":
        pack_exact_linears(model)
    return Target(model, processor, name=src)
