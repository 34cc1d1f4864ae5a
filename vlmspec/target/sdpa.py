"""The SDPA backends the engine's forwards run under (the target's and the drafter's).

On CUDA they run without cuDNN's SDPA. cuDNN plans each shape it has not met before it runs it,
and decoding brings a new key length to nearly every call: each row's cache grows every step,
prompts differ. On a lent H200 (torch 2.11, cuDNN 9.19) a masked call of 32 queries over about
5,000 keys took 68-1,661 ms at a key length it had not met and 0.12 ms at one it had; with cuDNN
left out torch ran it in about 0.5 ms at any length. Batched drafting of 8 rows (toy model, bf16)
went from 403-513 ms per step to 24-27 ms (docs/batching.md, "On a GPU"). Elsewhere torch's own
choice stands.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# every SDPA backend but cuDNN's, in torch's order: the backends the engine's CUDA forwards may take
DECODING_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def decoding_sdpa(device: torch.device) -> contextlib.AbstractContextManager:
    """The context the engine runs its forwards in: on CUDA, SDPA without cuDNN's backend (see the
    module docstring); elsewhere a context that changes nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(DECODING_SDPA_BACKENDS))


__all__ = ["DECODING_SDPA_BACKENDS", "decoding_sdpa"]
