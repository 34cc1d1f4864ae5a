"""Host -> device copies that do not make the host wait (pinned memory, non-blocking on CUDA)."""

from __future__ import annotations

import torch


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor onto `device`; on CUDA through pinned memory without a host sync."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)
