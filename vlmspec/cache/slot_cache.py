"""The target's KV cache for a batch of requests: one preallocated buffer per layer, a slot per request.

    keys, values of layer l: [slots, kv_heads, capacity, head_dim]     (allocated at the first write)

A request owns a slot while it runs; its committed length lives with the request (`TargetState.seq_len`). A
forward writes its rows' (`rows`) new entries at each row's own offset (`starts`); a rejected draft is dropped
by not advancing the length, an accepted path that is not a contiguous run is gathered within its row
(`commit`); nothing is re-padded or realigned. It is an HF `Cache` the unmodified models accept: `update`
returns the rows' keys and values up to the furthest end, `get_seq_length` / `get_mask_sizes` are the furthest
row's (one row: a `DynamicLayer`'s); shorter rows are cut by the caller's 4D mask; a ragged step's entries come
laid end to end (`begin(..., counts)`). Layer kinds follow `vlmspec.cache.kv_cache`: full, sliding and chunked
attention keep every entry (windows are masks), `dummy` holds nothing; any other kind keeps transformers' own
layer, which cannot be rolled back: such a cache has one slot, plain decoding only.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, CacheLayerMixin, DummyLayer, DynamicLayer

from vlmspec.errors import ConfigError
from vlmspec.cache.kv_cache import ATTENTION_KINDS, NO_KV_KINDS, blocker_message, layer_kinds, rollback_blockers


def cross_attention_layers(config: Any) -> set[int]:
    """Decoder layers that attend to the image's states (Mllama), which a request's prefill stores in
    the cache once and later steps read as they are."""
    if config is None:
        return set()
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", 0) or 0
    return {i for i in getattr(text, "cross_attention_layers", None) or [] if i < layers}


def single_slot_reason(config: Any) -> str:
    """'' when requests of any lengths can share this model's cache, else why it holds one request."""
    kinds, _ = layer_kinds(config) if config is not None else ([], [])
    blockers = rollback_blockers(kinds)
    if blockers:
        return blocker_message("the model", blockers).split(" Use --drafter plain")[0]
    if cross_attention_layers(config):
        return ("its cross-attention layers keep each request's image states in the cache, and the model decides for the "
                "whole batch whether they are there")
    return ""


class _Step:
    """Where one forward writes: shared by every slot layer of a cache (set by `SlotCache.begin`)."""

    def __init__(self) -> None:
        self.rows: list[int] = [0]
        self.starts: list[int] = [0]
        self.counts: list[int] | None = None  # a ragged step: row b's entries, laid end to end (`RaggedRows`)
        self.rows_t: torch.Tensor | None = None  # [B] long on the buffers' device
        self.starts_t: torch.Tensor | None = None  # [B] long
        self.block: slice | None = slice(0, 1)  # rows as a slice when they are consecutive (reads are views)
        self._flat: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}  # `flat_index` of this step, by shape

    def set(self, rows: list[int], starts: list[int], counts: list[int] | None = None) -> None:
        assert len(rows) == len(starts) and rows, (rows, starts)
        assert counts is None or (len(counts) == len(rows) and min(counts) >= 1), counts
        self.rows, self.starts, self.counts = list(rows), list(starts), None if counts is None else list(counts)
        self.rows_t = self.starts_t = None
        self._flat.clear()
        lo = rows[0]
        self.block = slice(lo, lo + len(rows)) if rows == list(range(lo, lo + len(rows))) else None

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rows_t is None or self.rows_t.device != device:
            both = torch.tensor([self.rows, self.starts], dtype=torch.long).to(device, non_blocking=True)
            self.rows_t, self.starts_t = both[0], both[1]
        assert self.starts_t is not None
        return self.rows_t, self.starts_t

    def flat_index(self, heads: int, capacity: int, q: int, device: torch.device) -> torch.Tensor:
        """Where the step's new entries go in a buffer [slots, heads, capacity, D] seen as [-1, D]:
        [B * heads * q] long, in the order of the entries [B, heads, q, D]. Built once per step and
        shape, shared by every layer."""
        key = (heads, capacity, q, device)
        if key not in self._flat:
            rows, starts = self.tensors(device)
            head = torch.arange(heads, device=device)[None, :, None]
            pos = starts[:, None, None] + torch.arange(q, device=device)[None, None, :]
            self._flat[key] = ((rows[:, None, None] * heads + head) * capacity + pos).reshape(-1)
        return self._flat[key]

    def ragged_index(self, heads: int, capacity: int, device: torch.device) -> torch.Tensor:
        """`flat_index` of a ragged step, whose entries come laid end to end ([1, heads, T, D], row b's
        `counts[b]` after row b - 1's): [heads * T] long, in their order."""
        assert self.counts is not None
        key = (heads, capacity, -1, device)
        if key not in self._flat:
            slot = [r for r, c in zip(self.rows, self.counts) for _ in range(c)]
            pos = [s + j for s, c in zip(self.starts, self.counts) for j in range(c)]
            both = torch.tensor([slot, pos], dtype=torch.long).to(device, non_blocking=True)  # [2, T]
            head = torch.arange(heads, device=device)[:, None]
            self._flat[key] = ((both[0][None] * heads + head) * capacity + both[1][None]).reshape(-1)
        return self._flat[key]


class SlotLayer(CacheLayerMixin):
    """One attention layer's slots: keys / values [slots, kv_heads, capacity, head_dim]."""

    is_sliding = False  # every entry is kept: windows are the masks' business
    is_croppable = False

    def __init__(self, slots: int, capacity: int, step: _Step) -> None:
        super().__init__()
        self.slots, self.capacity, self.step = slots, capacity, step
        self.growable = True  # False: the pool is fixed (`SlotCache.fix`)
        self.buf_k: torch.Tensor | None = None
        self.buf_v: torch.Tensor | None = None
        self.is_initialized = True  # nothing for transformers to set up lazily: `update` allocates

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    # what transformers' own layers expose: the entries of this step's rows before the step's writes
    # (a model may look at them, e.g. to see whether a layer holds anything yet)
    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor:
        return torch.empty(0) if self.buf_k is None else self._read(max(self.step.starts))[0]

    @keys.setter
    def keys(self, value: Any) -> None:
        assert value is None, "a slot layer's entries are written by update()"

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor:
        return torch.empty(0) if self.buf_v is None else self._read(max(self.step.starts))[1]

    @values.setter
    def values(self, value: Any) -> None:
        assert value is None, "a slot layer's entries are written by update()"

    def reserve(self, n: int) -> None:
        """At least `n` entries per slot: the size of the first allocation, or a grown buffer."""
        if self.buf_k is None:
            self.capacity = max(self.capacity, n)
        elif n > self.buf_k.shape[2]:
            self._grow(n)

    def _grow(self, end: int) -> None:
        assert self.buf_k is not None and self.buf_v is not None
        assert self.growable, f"a fixed pool ({self.capacity} entries per slot) never grows: {end} asked for (its owner admits what fits)"
        pad = (0, 0, 0, max(end, 2 * self.buf_k.shape[2]) - self.buf_k.shape[2])
        self.buf_k = torch.nn.functional.pad(self.buf_k, pad)
        self.buf_v = torch.nn.functional.pad(self.buf_v, pad)
        self.capacity = self.buf_k.shape[2]

    def _ensure(self, k: torch.Tensor, v: torch.Tensor, end: int) -> None:
        """Allocate (zeros: stale entries stay finite, so masked ones weigh exactly 0) or grow to `end`.
        Keys and values may differ in head size (latent attention: MLA)."""
        if self.buf_k is None:
            self.capacity = max(self.capacity, end)
            self.buf_k = torch.zeros(self.slots, k.shape[1], self.capacity, k.shape[3], dtype=k.dtype, device=k.device)
            self.buf_v = torch.zeros(self.slots, v.shape[1], self.capacity, v.shape[3], dtype=v.dtype, device=v.device)
        elif end > self.buf_k.shape[2]:
            self._grow(end)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states [B, kv_heads, q, head_dim] of the step's rows -> the rows' keys and
        values [B, kv_heads, max(starts) + q, head_dim] (a view when the rows are consecutive). A
        ragged step's come laid end to end, [1, kv_heads, sum(counts), head_dim]: q = max(counts)."""
        step = self.step
        ragged = step.counts is not None
        b, _, q, _ = key_states.shape
        if ragged:
            assert step.counts is not None and b == 1 and q == sum(step.counts), (key_states.shape, step.counts)
            q = max(step.counts)
        else:
            assert b == len(step.rows), (b, step.rows)
        end = max(step.starts) + q
        self._ensure(key_states, value_states, end)
        assert self.buf_k is not None and self.buf_v is not None
        if b == 1 and not ragged:  # one row: a plain slice write
            r, s = step.rows[0], step.starts[0]
            self.buf_k[r, :, s : s + q] = key_states[0]
            self.buf_v[r, :, s : s + q] = value_states[0]
        else:  # every entry to its row and offset: one copy of whole D-wide entries per tensor
            for buf, new in ((self.buf_k, key_states), (self.buf_v, value_states)):
                heads, capacity = buf.shape[1], buf.shape[2]
                index = step.ragged_index(heads, capacity, buf.device) if ragged else step.flat_index(heads, capacity, q, buf.device)
                buf.view(-1, buf.shape[3]).index_copy_(0, index, new.reshape(-1, buf.shape[3]))
        return self._read(end)

    def _read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.buf_k is not None and self.buf_v is not None
        if self.step.block is not None:
            return self.buf_k[self.step.block, :, :end], self.buf_v[self.step.block, :, :end]
        rows, _ = self.step.tensors(self.buf_k.device)
        return self.buf_k[rows, :, :end], self.buf_v[rows, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        counts = self.step.counts
        return max(self.step.starts) + (query_length if counts is None else max(counts)), 0

    def get_seq_length(self) -> int:
        return max(self.step.starts)

    def get_max_length(self) -> int:
        return -1  # grows on demand (the batch's owner bounds it): never a static cache to transformers

    def gather(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """For each row b: entries src[b] move to dst[b] (rows [R], src / dst [R, K] long)."""
        if self.buf_k is None:
            return
        for buf in (self.buf_k, self.buf_v):
            assert buf is not None
            moved = buf[rows[:, None], :, src]  # [R, K, H, D], a copy: sources may overlap the destinations
            buf[rows[:, None], :, dst] = moved

    def entries(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's first `length` entries, [1, kv_heads, length, head_dim] views."""
        assert self.buf_k is not None and self.buf_v is not None
        return self.buf_k[slot : slot + 1, :, :length], self.buf_v[slot : slot + 1, :, :length]

    def nbytes(self) -> int:
        return 0 if self.buf_k is None else 2 * self.buf_k.numel() * self.buf_k.element_size()


class SlotCache(DynamicCache):
    """A transformers cache of slot layers (see the module docstring).

    slots: how many requests it can hold at once; capacity: entries per slot allocated at the first
    write (it grows when a write needs more; a batch's owner refuses requests that would not fit
    its bound before they join).
    """

    def __init__(self, config: Any = None, slots: int = 1, capacity: int = 256) -> None:
        super().__init__()
        kinds, kwargs = layer_kinds(config) if config is not None else ([], [])
        self.kinds = kinds
        self.slots = slots
        self._step = _Step()
        reason = single_slot_reason(config)
        if reason and slots > 1:
            raise ConfigError(f"{reason}: such a model decodes one request at a time (a cache of one slot)")
        self._cross = cross_attention_layers(config)
        layers: list[Any] = []
        for i, (kind, kw) in enumerate(zip(kinds, kwargs)):
            if i in self._cross:  # the image's states, stored once by the prefill: transformers' own layer
                layers.append(DynamicLayer())
            elif kind in ATTENTION_KINDS:
                layers.append(SlotLayer(slots, capacity, self._step))
            elif kind in NO_KV_KINDS:
                layers.append(DummyLayer())
            elif kind in DYNAMIC_LAYER_TYPE_MAPPING:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
            else:
                raise ConfigError(f"the model's decoder has layers of kind {kind!r}, which this transformers has no cache for")
        self._kw = kwargs
        self.rollback_blockers = rollback_blockers(kinds)  # read on every commit: computed once
        self.layers = layers
        self._fixed = bool(layers)  # a config gave the layers; without one, slot layers are added as the model writes
        self._pool: int | None = None  # entries per slot of a fixed pool (`fix`); None: slots grow as written


    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.layers) <= layer_idx:  # a cache built without a config: every layer full attention
            assert not self._fixed, (layer_idx, len(self.layers))
            layer = SlotLayer(self.slots, self._pool or 0, self._step)
            layer.growable = self._pool is None
            self.layers.append(layer)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def begin(self, rows: list[int], starts: list[int], counts: list[int] | None = None) -> None:
        """The next forward covers slots `rows` (its batch rows, in order), each writing from `starts[b]`;
        with `counts`, row b writes counts[b] entries and the forward's come laid end to end (a ragged
        step, `vlmspec.target.attention.RaggedRows`)."""
        assert all(0 <= r < self.slots for r in rows), (rows, self.slots)
        self._step.set(rows, starts, counts)

    def reserve(self, n: int) -> None:
        """At least `n` entries per slot in every layer (allocated at the first write, or grown now)."""
        for layer in self._slot_layers():
            layer.reserve(n)

    def fix(self, capacity: int) -> None:
        """`capacity` entries per slot, allocated at the first write and never grown (a service's pool,
        sized at start-up: its owner admits only requests that fit)."""
        for layer in self._slot_layers():
            assert layer.buf_k is None, "fix the pool before anything is written"
            layer.capacity, layer.growable = capacity, False
        self._pool = capacity

    def reset_slot(self, slot: int) -> None:
        """A new request takes `slot`: transformers' own layers (non-attention state, cross-attention
        image states) start from nothing."""
        for i, kind in enumerate(self.kinds):
            if i in self._cross:
                self.layers[i] = DynamicLayer()
            elif kind not in ATTENTION_KINDS and kind not in NO_KV_KINDS:
                self.layers[i] = DYNAMIC_LAYER_TYPE_MAPPING[kind](**self._kw[i])

    def _slot_layers(self) -> list[SlotLayer]:
        return [layer for layer in self.layers if isinstance(layer, SlotLayer)]

    def commit(self, rows: list[int], starts: list[int], keep: list[list[int]]) -> None:
        """Row `rows[b]` keeps its entries starts[b] + keep[b] (e.g. an accepted path, root first), in that
        order, right after its committed prefix starts[b]. Rows whose kept entries are already the first
        ones after the prefix (a plain step, a chain's head) move nothing."""
        if self.rollback_blockers:  # one slot, plain steps only: nothing to move, nothing that could be
            assert all(k == list(range(len(k))) for k in keep), "a model with non-attention state keeps every entry"
            return
        moving = [b for b, k in enumerate(keep) if k != list(range(len(k)))]
        if not moving:
            return
        width = max(len(keep[b]) for b in moving)
        # pad by repeating the last entry: the extra writes land past the row's new end (stale, masked)
        src = [[starts[b] + j for j in keep[b]] + [starts[b] + keep[b][-1]] * (width - len(keep[b])) for b in moving]
        dst = [[starts[b] + j for j in range(width)] for b in moving]
        host = torch.tensor([[rows[b] for b in moving], *zip(*src), *zip(*dst)], dtype=torch.long)  # [1 + 2 * width, R]
        on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # one copy per device, not per layer
        for layer in self._slot_layers():
            if layer.buf_k is None:
                continue
            dev = layer.buf_k.device
            if dev not in on_device:
                idx = host.to(dev, non_blocking=True)
                on_device[dev] = (idx[0], idx[1 : 1 + width].T, idx[1 + width :].T)  # rows [R], src / dst [R, width]
            layer.gather(*on_device[dev])

    def entries(self, slot: int, length: int, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first `length` entries of `slot` in layers < num_layers ([1, kv_heads, length, head_dim] views)."""
        out = []
        for layer in self.layers[:num_layers]:
            assert isinstance(layer, SlotLayer), "entries() reads attention layers only"
            out.append(layer.entries(slot, length))
        return out

    @property
    def copyable(self) -> bool:
        """Whether a slot's whole state is its slot layers' entries (`save` / `load` move all of it): no
        cross-attention image states, no state of transformers' own layers."""
        return bool(self.layers) and all(isinstance(layer, (SlotLayer, DummyLayer)) for layer in self.layers)

    def save(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Copies of `slot`'s first `length` entries, per layer ([kv_heads, length, head_dim] keys and
        values; None for a layer that holds nothing). Only for a `copyable` cache."""
        assert self.copyable, "a cache with state outside its slot layers cannot be saved"
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for layer in self.layers:
            if isinstance(layer, SlotLayer) and layer.buf_k is not None:
                k, v = layer.entries(slot, length)
                out.append((k[0].clone(), v[0].clone()))
            else:
                out.append(None)
        return out

    def load(self, slot: int, saved: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write what `save` returned into `slot`'s first entries (the slot's later entries are stale:
        the request's length says where it ends)."""
        assert self.copyable and len(saved) == len(self.layers), (len(saved), len(self.layers))
        for layer, kv in zip(self.layers, saved):
            if kv is None:
                continue
            k, v = kv
            layer._ensure(k[None], v[None], k.shape[1])
            layer.buf_k[slot, :, : k.shape[1]] = k
            layer.buf_v[slot, :, : v.shape[1]] = v

    def nbytes(self) -> int:
        """Bytes the slot buffers hold now."""
        return sum(layer.nbytes() for layer in self._slot_layers())


__all__ = ["SlotCache", "SlotLayer"]
