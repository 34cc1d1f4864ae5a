"""KV caches over Hugging Face's cache layers: the decoder's layer kinds (`layer_kinds`), which of
them a rejected draft cannot be rolled back out of (`rollback_blockers`), the forward's cache keyword
(`cache_kwarg`), and `KVCache`, a `DynamicCache` with its length and a crop (the EAGLE head's own
cache; the target's batch lives in `vlmspec.cache.slot_cache.SlotCache`, which commits accepted paths).

Full, sliding and chunked attention keep every entry (windows are applied by the mask, so a
rejected branch can be rolled back); layers without KV are skipped; every other kind (convolution,
recurrent state) keeps transformers' own layer: plain decoding works, and
`Target.check_speculative` refuses drafters for such a model.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

from vlmspec.errors import ConfigError

ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
NO_KV_KINDS = ("dummy",)


def cache_kwarg(module: torch.nn.Module, cache: DynamicCache | None) -> dict[str, Any]:
    """`{keyword: cache}` for a call of `module`: transformers 5 renamed forward's `past_key_values`
    to `cache` (the old name warns, and goes in 5.40); a model that predates the rename takes the old one."""
    return {_cache_keyword(type(module).forward): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(forward: Callable[..., Any]) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def layer_kinds(config: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """The decoder's cache layer kinds ('full_attention', 'sliding_attention', 'conv', ...) and each
    layer's cache arguments, read the way transformers reads them. A config without layer kinds
    (older text-only decoders) gives ([], [])."""
    decoder = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(decoder, "num_hidden_layers", None) is None:
        return [], []
    kinds, kwargs = get_layer_types_and_kwargs(decoder)
    return list(kinds), list(kwargs)


def rollback_blockers(kinds: list[str]) -> dict[str, list[int]]:
    """{kind: [layer index, ...]} for the layers whose state a rejected draft could not be taken out of."""
    out: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        if kind not in ATTENTION_KINDS and kind not in NO_KV_KINDS:
            out.setdefault(kind, []).append(i)
    return out


def blocker_message(name: str, blockers: dict[str, list[int]]) -> str:
    """What a user reads when a speculative drafter is asked for with a model that cannot roll back."""
    kinds = "; ".join(f"'{kind}' at layer{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}" for kind, idx in blockers.items())
    return (f"{name} has decoder layers whose state is not a list of KV entries ({kinds}): a rejected draft "
            "could not be taken back out of that state, so speculative decoding would not be lossless. "
            "Use --drafter plain (plain decoding through the same engine, exact) with this model.")


class KVCache:
    """An HF cache over the decoder's layers (see the module docstring for the layer kinds)."""

    def __init__(self, hf_cache: DynamicCache | None = None, kinds: list[str] | None = None) -> None:
        self.hf = hf_cache if hf_cache is not None else DynamicCache()
        self.kinds = kinds or []  # [] : every layer full attention (a cache built without a config)
        # the layer that says how long the cache is: the first one holding KV entries
        self._length_layer = next((i for i, k in enumerate(self.kinds) if k in ATTENTION_KINDS), 0)

    @property
    def seq_len(self) -> int:
        return self.hf.get_seq_length(self._length_layer)

    def _kv_layers(self) -> list[DynamicLayer]:
        """The layers that hold KV entries; refuses a cache with state that cannot be cut back."""
        blockers = rollback_blockers(self.kinds)
        if blockers:
            raise ConfigError(blocker_message("the model", blockers))
        return [layer for i, layer in enumerate(self.hf.layers) if not self.kinds or self.kinds[i] in ATTENTION_KINDS]

    def crop(self, length: int) -> None:
        """Keep the first `length` entries of every layer."""
        assert 0 <= length <= self.seq_len, (length, self.seq_len)
        if length == self.seq_len:
            return
        for layer in self._kv_layers():
            if layer.is_initialized and layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
