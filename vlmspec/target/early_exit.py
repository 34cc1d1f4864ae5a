"""The target's first E decoder layers with its own final norm and LM head: the draft model of
self-speculation (Kangaroo, DEL), over the unmodified Hugging Face modules.

    view = ExitView(target)                                  # ConfigError when the decoder is not a plain stack
    cache = view.shallow_cache(state.entries(E), E)          # the target's committed KV of layers < E, copied
    hidden = view.run(token, position, cache, exit_layer)    # [H], after the final norm
    w, b = view.head_weights(rows)                           # the LM head, or its `rows` (a trimmed vocabulary)
    logits = linear(hidden, w, b)                            # [V] (or [K])

Layers < E compute exactly what they compute inside the full target, so their KV entries for the committed tokens are
already in the target's cache: a draft step appends its own entries to a copy (the target's cache is never written).
The stack runs as the decoder's own forward runs it, for decoders built as ``embed_tokens / layers / norm / rotary_emb``
with one rotary embedding for every layer (Llama, Mistral, Qwen2, SmolLM2); others are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from vlmspec.errors import ConfigError
from vlmspec.cache.kv_cache import cache_kwarg
from vlmspec.target.model import Target

_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


def decoder_of(model: torch.nn.Module) -> Any:
    """The text decoder stack of an HF VLM (``model.model.language_model`` in transformers 5)."""
    base = getattr(model, "model", model)
    dec = getattr(base, "language_model", None)
    if dec is None and hasattr(model, "get_decoder"):
        dec = model.get_decoder()
    return dec


class ExitView:
    def __init__(self, target: Target) -> None:
        if target.uses_mrope:
            raise ConfigError("self-speculation does not support M-RoPE targets (Qwen2-VL family) yet: use --drafter ngram or an EAGLE drafter")
        dec = decoder_of(target.model)
        missing = [p for p in _PARTS if dec is None or not hasattr(dec, p)]
        if missing:
            raise ConfigError(f"self-speculation needs a decoder with {', '.join(_PARTS)}; {type(dec).__name__} lacks "
                              f"{', '.join(missing)}: use --drafter ngram or an EAGLE drafter")
        layer_types = getattr(target.text_config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ConfigError("self-speculation supports full-attention decoders only (this one has sliding-window layers)")
        self.target = target
        self.decoder = dec
        self.num_layers = len(dec.layers)
        self.head = target.output_embeddings()  # the LM head: [V, H] weight

    def check_exit(self, exit_layer: int) -> None:
        if not 1 <= exit_layer < self.num_layers:
            raise ConfigError(f"exit layer must be in [1, {self.num_layers - 1}] (the target has {self.num_layers} layers), got {exit_layer}")

    @staticmethod
    def shallow_cache(entries: list[tuple[torch.Tensor, torch.Tensor]], exit_layer: int) -> DynamicCache:
        """A new cache holding copies of a request's committed entries for layers < exit_layer (what
        the draft steps append to; the target's own tensors are left as they are).
        entries: per layer (keys, values) [1, kv_heads, L, head_dim], e.g. `TargetState.entries`."""
        out = DynamicCache()
        for i, (keys, values) in enumerate(entries[:exit_layer]):
            out.update(keys, values, i)  # the update concatenates: a copy (tested)
        return out

    @torch.no_grad()
    def run(self, token: int, position: int, cache: DynamicCache, exit_layer: int) -> torch.Tensor:
        """One token at `position`, attending to everything in `cache`, through layers < exit_layer
        -> its hidden state after the final norm, [H]. Appends its entries to `cache`."""
        dec, dev = self.decoder, self.target.device
        ids = torch.tensor([[token]], device=dev)  # [1, 1]
        pos = torch.tensor([[position]], device=dev)
        h = dec.embed_tokens(ids)  # [1, 1, H]
        rope = dec.rotary_emb(h, position_ids=pos)
        for layer in dec.layers[:exit_layer]:  # one query over a cache: no mask needed
            h = layer(h, attention_mask=None, position_ids=pos, **cache_kwarg(layer, cache), use_cache=True, position_embeddings=rope)
        return dec.norm(h)[0, 0]

    def head_weights(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's weight [V, H] and bias, or their `rows` ([K] target ids: a trimmed vocabulary, copied once)."""
        w, b = self.head.weight, getattr(self.head, "bias", None)
        if rows is None:
            return w, b
        rows = rows.to(w.device)
        return w[rows].contiguous(), None if b is None else b[rows]


__all__ = ["ExitView", "decoder_of"]
