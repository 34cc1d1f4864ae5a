"""The target's KV cache: built from the model's config, with length, crop, and commit of an accepted path.

After a tree-verify forward the cache holds [committed prefix (P) | N tree entries]. Only the
entries of the accepted path (root first) may stay, in path order, right after the prefix.
`commit` gathers them: the accepted nodes are generally not a contiguous run of the tree, so
a crop would keep the wrong entries. Only when they are the tree's first entries (a plain step,
a chain's head) is a crop the same thing, and then it crops.

Layer kinds (from the config's `layer_types`, as transformers reads them):
- full, sliding-window and chunked attention keep every entry (a `DynamicLayer`): a sliding or
  chunked layer's window is applied by the attention mask (`Target.tree_masks`, over `vlmspec.tree.tree_attention_mask`), not by dropping
  entries, so a rejected branch can always be rolled back;
- layers that hold no KV (`dummy`: MLP-only layers, consumers of a shared KV) are skipped;
- every other kind (convolution or recurrent state, compressed or indexed attention) keeps transformers'
  own cache layer, so plain decoding works, but its state cannot be rolled back: `rollback_blockers`
  names them, and the engine refuses speculative drafters for such a model (`check_rollback`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, DummyLayer, DynamicLayer, get_layer_types_and_kwargs

from vlmspec.errors import ConfigError
from vlmspec.transfer import to_device

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
            "Use --drafter none (plain decoding through the same engine, exact) with this model.")


class KVCache:
    """An HF cache over the decoder's layers (see the module docstring for the layer kinds)."""

    def __init__(self, hf_cache: DynamicCache | None = None, kinds: list[str] | None = None) -> None:
        self.hf = hf_cache if hf_cache is not None else DynamicCache()
        self.kinds = kinds or []  # [] : every layer full attention (a cache built without a config)
        # the layer that says how long the cache is: the first one holding KV entries
        self._length_layer = next((i for i, k in enumerate(self.kinds) if k in ATTENTION_KINDS), 0)

    @classmethod
    def for_model(cls, config: Any) -> "KVCache":
        """A cache with one layer per decoder layer of `config`, of the kind the module docstring gives."""
        kinds, kwargs = layer_kinds(config)
        if not kinds:
            return cls()
        layers = []
        for kind, kw in zip(kinds, kwargs):
            if kind in ATTENTION_KINDS:
                layers.append(DynamicLayer())
            elif kind in NO_KV_KINDS:
                layers.append(DummyLayer())
            elif kind in DYNAMIC_LAYER_TYPE_MAPPING:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
            else:
                raise ConfigError(f"the model's decoder has layers of kind {kind!r}, which transformers {_tf_version()} has no cache for")
        hf = DynamicCache()
        hf.layers = layers
        return cls(hf, kinds)

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
        for layer in self._kv_layers():
            if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
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


def _tf_version() -> str:
    import transformers

    return transformers.__version__
