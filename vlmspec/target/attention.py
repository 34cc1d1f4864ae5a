"""Which attention implementation the target's language model runs its forwards with.

On CPU 'auto' is SDPA that reads grouped key / value heads in place (`GQA_SDPA`). transformers'
own SDPA path, given a mask and more than one query, copies every key / value head once per
query head it serves (`repeat_kv`) before calling SDPA: that is every tree forward and every
batched step, over the whole cache, in every layer. torch's SDPA takes the grouped heads as
they are (`enable_gqa=True`) with the same numbers bit for bit on CPU (tests/test_attention.py);
on the default model a batched step of 8 rows drafting 3 levels spends about 6 ms of its
100 ms on those copies (`python -m vlmspec.target.attention` times the kernels).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from transformers.integrations import sdpa_attention

from vlmspec.errors import TargetLoadError

ATTENTION_MODES = ("auto", "triton", "sdpa", "eager")
GQA_SDPA = "vlmspec_sdpa_gqa"  # the registered name of `gqa_sdpa_forward`
_UNSUPPORTED = ("position_bias", "softcap", "s_aux", "sinks")  # extras only transformers' own functions apply


def set_attention(model: torch.nn.Module, mode: str = "auto") -> str:
    """Pick the language model's attention: 'auto' (the Triton tree kernel on CUDA when Triton is
    importable, SDPA over grouped heads on CPU, else SDPA), 'triton', 'sdpa' (transformers' own)
    or 'eager'. The vision tower keeps its own. Returns the implementation's name."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {mode!r}")
    from vlmspec.kernels import tree_attention  # imports triton: only when an attention is chosen

    device = next(model.parameters()).device
    use_kernel = mode == "triton" or (mode == "auto" and device.type == "cuda" and tree_attention.kernel_available())
    if mode == "triton" and not tree_attention.kernel_available():
        raise TargetLoadError("attention 'triton' needs CUDA and Triton (or TRITON_INTERPRET=1); use 'sdpa'")
    if use_kernel:
        impl = tree_attention.register()
    elif mode == "auto" and device.type == "cpu":
        impl = register_gqa_sdpa()
    else:
        impl = "eager" if mode == "eager" else "sdpa"
    has_text = "text_config" in getattr(model.config, "sub_configs", {})
    model.set_attn_implementation({"text_config": impl} if has_text else impl)
    return impl


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, Lq, D]
    key: torch.Tensor,  # [B, Hkv, Lk, D], Hq a multiple of Hkv
    value: torch.Tensor,  # [B, Hkv, Lk, Dv]
    attention_mask: torch.Tensor | None,  # [B or 1, 1 or Hq, Lq, Lk], additive or bool
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # [B, Lq, Hq, Dv]
    """transformers' SDPA attention function, except that a masked call on grouped heads reads the
    key / value heads in place instead of copying them per query head. Calls that differ in more
    than that (no mask: transformers passes `is_causal` or packs a lone query itself; no grouping;
    a gradient; position biases, soft caps, sinks) go to transformers' own function unchanged."""
    grouped = key.shape[1] != query.shape[1]
    extras = any(kwargs.get(name) is not None for name in _UNSUPPORTED) or kwargs.get("output_attentions", False)
    if attention_mask is None or not grouped or extras or query.device.type != "cpu" or (torch.is_grad_enabled() and query.requires_grad):
        return sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register_gqa_sdpa() -> str:
    """Register `gqa_sdpa_forward` (with SDPA's mask builder) for `set_attn_implementation`; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, gqa_sdpa_forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    return GQA_SDPA


def main() -> None:
    """Times one layer's attention, transformers' SDPA path against `gqa_sdpa_forward`, at the
    default model's heads (9 query, 3 key / value, 64 wide) and a batched step's shapes."""
    from types import SimpleNamespace

    from vlmspec.target.timing import median_ms

    sdpa_attention_forward = sdpa_attention.sdpa_attention_forward

    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    for dtype in (torch.bfloat16, torch.float32):
        print(f"{dtype}, {torch.get_num_threads()} threads: median us per layer, transformers' SDPA vs grouped heads read in place")
        for rows, n, cached in ((1, 16, 200), (8, 2, 210), (8, 4, 210), (16, 3, 220)):
            q = torch.randn(rows, 9, n, 64).to(dtype)
            k, v = torch.randn(rows, 3, cached + n, 64).to(dtype), torch.randn(rows, 3, cached + n, 64).to(dtype)
            mask = torch.zeros(rows, 1, n, cached + n, dtype=dtype)
            mask[..., cached:] = torch.finfo(dtype).min * (1 - torch.eye(n, dtype=dtype))
            with torch.no_grad():
                same = torch.equal(sdpa_attention_forward(module, q, k, v, mask)[0], gqa_sdpa_forward(module, q, k, v, mask)[0])
                old = 1e3 * median_ms(q.device, lambda: sdpa_attention_forward(module, q, k, v, mask), repeats=200, warmup=10)
                new = 1e3 * median_ms(q.device, lambda: gqa_sdpa_forward(module, q, k, v, mask), repeats=200, warmup=10)
            print(f"  {rows:2d} rows x {n:2d} queries over {cached + n} entries: {old:7.1f} vs {new:7.1f}  (equal: {same})")


if __name__ == "__main__":
    main()
