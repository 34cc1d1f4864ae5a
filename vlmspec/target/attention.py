"""Which attention implementation the target's language model runs its forwards with."""

from __future__ import annotations

import torch

from vlmspec.errors import TargetLoadError

ATTENTION_MODES = ("auto", "triton", "sdpa", "eager")


def set_attention(model: torch.nn.Module, mode: str = "auto") -> str:
    """Pick the language model's attention: 'auto' (the Triton tree kernel on CUDA when Triton is
    importable, else SDPA), 'triton', 'sdpa' or 'eager'. The vision tower keeps its own.
    Returns the implementation's name."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {mode!r}")
    from vlmspec.kernels import tree_attention  # imports triton: only when an attention is chosen

    device = next(model.parameters()).device
    use_kernel = mode == "triton" or (mode == "auto" and device.type == "cuda" and tree_attention.kernel_available())
    if mode == "triton" and not tree_attention.kernel_available():
        raise TargetLoadError("attention 'triton' needs CUDA and Triton (or TRITON_INTERPRET=1); use 'sdpa'")
    impl = tree_attention.register() if use_kernel else ("eager" if mode == "eager" else "sdpa")
    has_text = "text_config" in getattr(model.config, "sub_configs", {})
    model.set_attn_implementation({"text_config": impl} if has_text else impl)
    return impl
