"""What VLM-aware drafters read from the target's forward, captured with hooks (no forked
modelling file):

* the projected image embeddings: the language model's `inputs_embeds` at image positions;
* the target's own attention to each prompt position: the last decoder layer's softmax
  attention from a query position (the last prompt token), averaged over heads; recomputed
  from that layer's input with the layer's own q/k projections and rotary embedding (which
  also covers M-RoPE, whose 3 axes are folded into cos/sin before the attention module).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


def image_token_id(model: torch.nn.Module) -> int:
    cfg = model.config
    for name in ("image_token_id", "image_token_index"):
        value = getattr(cfg, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(model).__name__}: its config names no image token id")


@dataclass
class Captured:
    inputs_embeds: torch.Tensor | None = None  # [B, L, H] what the decoder read
    attn_input: torch.Tensor | None = None  # [B, L, H] the last layer's (normed) attention input
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@contextmanager
def capture(model: torch.nn.Module, attention: bool = True) -> Iterator[Captured]:
    """Hooks on the decoder (its inputs_embeds) and on its last layer's attention module."""
    decoder = model.get_decoder()
    out = Captured()

    def on_decoder(_mod, args, kwargs):
        emb = kwargs.get("inputs_embeds")
        if emb is not None:
            out.inputs_embeds = emb.detach()

    def on_attention(_mod, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        out.attn_input = hs.detach()
        out.cos_sin = kwargs.get("position_embeddings")

    handles = [decoder.register_forward_pre_hook(on_decoder, with_kwargs=True)]
    if attention:
        handles.append(decoder.layers[-1].self_attn.register_forward_pre_hook(on_attention, with_kwargs=True))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def last_layer_attention(model: torch.nn.Module, cap: Captured, query_index: torch.Tensor) -> torch.Tensor:
    """[B] query positions -> [B, L] head-averaged attention of each query over keys 0..query."""
    attn = model.get_decoder().layers[-1].self_attn
    hs, (cos, sin) = cap.attn_input, cap.cos_sin
    assert hs is not None and cos is not None, "run the forward inside capture(model) first"
    B, L, _ = hs.shape
    cos, sin = cos.expand(B, *cos.shape[1:]), sin.expand(B, *sin.shape[1:])  # shared positions: batch dim 1
    d = attn.head_dim
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    k = attn.k_proj(hs).view(B, L, -1, d).transpose(1, 2)  # [B, kvh, L, d]
    rows = torch.arange(B, device=hs.device)
    q = attn.q_proj(hs[rows, query_index])[:, None].view(B, 1, -1, d).transpose(1, 2)  # [B, h, 1, d]
    cq, sq = cos[rows, query_index][:, None], sin[rows, query_index][:, None]
    q, _ = rotate(q, q, cq, sq)
    k, _ = rotate(k, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)).float()[:, :, 0] * attn.scaling  # [B, h, L]
    future = torch.arange(L, device=hs.device)[None] > query_index[:, None]
    scores = scores.masked_fill(future[:, None], float("-inf"))
    return scores.softmax(-1).mean(1)
