"""Prefills of prompts seen before: the slot's entries, the last token's logits and the features,
kept once and written into the next request's slot instead of running the target again.

    cache = PromptCache(max_bytes=256 << 20)          # one per engine; least recently used out first
    state, out = cache.prefill(target, inputs, visual, slots, slot, layers)   # Target.prefill's result

A prompt is the same when every tensor of its inputs is (ids, masks, pixels: a digest of their
bytes) and so are what the drafter asks of its prefill (`visual`, `layers`). A prefill runs alone as
batch 1, so its entries and outputs are those of any other run of the same prompt: a hit gives the
request what its own prefill would have. Only caches whose whole state is their slot layers
(`SlotCache.copyable`) are served; the others run the prefill every time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from vlmspec.cache.slot_cache import SlotCache
from vlmspec.target import ForwardOut, TargetState


def prompt_key(inputs: dict[str, Any], visual: bool, layers: tuple[int, ...] | None) -> bytes:
    """A digest of every input tensor's name, dtype, shape and bytes, with `visual` and `layers`."""
    h = hashlib.blake2b(repr((visual, layers)).encode(), digest_size=20)
    for name in sorted(inputs):
        value = inputs[name]
        if isinstance(value, torch.Tensor):
            h.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
            flat = value.detach().reshape(-1).contiguous().cpu()
            h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        else:
            h.update(f"{name}={value!r}".encode())
    return h.digest()


def _clone(out: ForwardOut) -> ForwardOut:
    return dataclasses.replace(out, **{f.name: getattr(out, f.name).clone() for f in dataclasses.fields(out)
                                       if isinstance(getattr(out, f.name), torch.Tensor)})


def _nbytes(saved: list[tuple[torch.Tensor, torch.Tensor] | None], out: ForwardOut) -> int:
    tensors = [t for kv in saved if kv is not None for t in kv]
    tensors += [getattr(out, f.name) for f in dataclasses.fields(out) if isinstance(getattr(out, f.name), torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class _Entry:
    saved: list[tuple[torch.Tensor, torch.Tensor] | None]  # per layer: [kv_heads, length, head_dim] keys, values
    length: int
    rope_delta: int
    out: ForwardOut
    nbytes: int


class PromptCache:
    """At most `max_bytes` of saved prefills, least recently used evicted first; `hits` / `misses`
    count the prefills served and run (counters)."""

    def __init__(self, max_bytes: int) -> None:
        assert max_bytes > 0, max_bytes
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()  # one engine may serve several batches' threads

    def __len__(self) -> int:
        return len(self._entries)

    def prefill(self, target: Any, inputs: dict[str, torch.Tensor], visual: bool, cache: SlotCache, slot: int,
                layers: tuple[int, ...] | None) -> tuple[TargetState, ForwardOut]:
        """`target.prefill(inputs, visual, cache, slot, layers)`, from the saved entry when there is one."""
        if not cache.copyable:
            return target.prefill(inputs, visual=visual, cache=cache, slot=slot, layers=layers)
        key = prompt_key(inputs, visual, layers)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and len(entry.saved) != len(cache.layers):  # a cache of another layout: run it
                entry = None
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
        if entry is not None:
            cache.reset_slot(slot)
            cache.load(slot, entry.saved)
            return TargetState(cache=cache, seq_len=entry.length, rope_delta=entry.rope_delta, slot=slot), _clone(entry.out)
        state, out = target.prefill(inputs, visual=visual, cache=cache, slot=slot, layers=layers)
        saved = cache.save(slot, state.seq_len)
        entry = _Entry(saved, state.seq_len, state.rope_delta, _clone(out), 0)
        entry.nbytes = _nbytes(saved, entry.out)
        with self._lock:
            self.misses += 1
            if entry.nbytes <= self.max_bytes and key not in self._entries:
                self._entries[key] = entry
                self.bytes += entry.nbytes
                while self.bytes > self.max_bytes:
                    _, old = self._entries.popitem(last=False)
                    self.bytes -= old.nbytes
        return state, out
