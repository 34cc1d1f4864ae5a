"""Pieces the trainers share: the learning-rate schedule, the clipped optimizer step and atomic checkpoint folders."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def warmup_cosine(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to min_ratio * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def clipped_step(optimizer: torch.optim.Optimizer, params, max_norm: float) -> None:
    """Clip the gradients of `params` to `max_norm` (global L2), step, and drop the gradients."""
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def save_checkpoint_dir(
    folder: Path, weights: dict[str, torch.Tensor], weights_name: str, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Write weights (safetensors), optimizer state and trainer state to `folder` atomically:
    a crash mid-save leaves the previous checkpoint intact."""
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / weights_name))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state))
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    if old.exists():
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
