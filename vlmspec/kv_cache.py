"""A small adapter over Hugging Face's DynamicCache: length, crop, and commit of an accepted path.

After a tree-verify forward the cache holds [committed prefix (P) | N tree entries]. Only the
entries of the accepted path (root first) may stay, in path order, right after the prefix.
`commit` gathers them: the accepted nodes are generally not a contiguous run of the tree, so
a crop would keep the wrong entries. Only when they are the tree's first entries (a plain step,
a chain's head) is a crop the same thing, and then it crops.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from vlmspec.transfer import to_device


def cache_kwarg(module: torch.nn.Module, cache: DynamicCache | None) -> dict[str, Any]:
    """`{keyword: cache}` for a call of `module`: transformers 5 renamed forward's `past_key_values`
    to `cache` (the old name warns, and goes in 5.40); a model that predates the rename takes the old one."""
    return {_cache_keyword(type(module).forward): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(forward: Callable[..., Any]) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class KVCache:
    def __init__(self, hf_cache: DynamicCache | None = None) -> None:
        self.hf = hf_cache if hf_cache is not None else DynamicCache()

    @property
    def seq_len(self) -> int:
        return self.hf.get_seq_length()

    def _layers(self) -> list[DynamicLayer]:
        layers = self.hf.layers
        for i, layer in enumerate(layers):
            if type(layer) is not DynamicLayer and not isinstance(layer, DynamicSlidingWindowLayer):
                raise TypeError(f"KV commit supports full-attention dynamic cache layers; layer {i} is {type(layer).__name__}")
            if isinstance(layer, DynamicSlidingWindowLayer):
                raise TypeError(f"layer {i} uses a sliding window, which tree verification does not support yet")
        return layers

    def crop(self, length: int) -> None:
        """Keep the first `length` entries of every layer."""
        assert 0 <= length <= self.seq_len, (length, self.seq_len)
        for layer in self._layers():
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    def commit(self, prefix_len: int, keep: torch.Tensor) -> None:
        """Keep prefix entries [0, prefix_len) plus tree entries prefix_len + keep, in that order.

        keep: [k] long, indices into the tree entries (root = 0), e.g. the accepted path.
        After the call seq_len == prefix_len + k.
        """
        assert keep.ndim == 1
        n_tree = self.seq_len - prefix_len
        assert n_tree >= 0 and (keep.numel() == 0 or int(keep.max()) < n_tree), (prefix_len, self.seq_len, keep)
        k = keep.numel()
        if keep.tolist() == list(range(k)):  # the first k tree entries (a plain step, a chain's head): already in place
            self.crop(prefix_len + k)
            return
        rows = keep + prefix_len
        on_device: dict[torch.device, torch.Tensor] = {}  # one copy per device, not per layer
        for layer in self._layers():
            if not layer.is_initialized or layer.keys.numel() == 0:
                continue
            dev = layer.keys.device
            if dev not in on_device:
                on_device[dev] = to_device(rows, dev)
            idx = on_device[dev]
            # gather first (a copy), then write: sources may overlap the destination rows
            keys = layer.keys.index_select(-2, idx)
            values = layer.values.index_select(-2, idx)
            layer.keys[..., prefix_len : prefix_len + k, :] = keys
            layer.values[..., prefix_len : prefix_len + k, :] = values
            layer.keys = layer.keys[..., : prefix_len + k, :]
            layer.values = layer.values[..., : prefix_len + k, :]
