"""Tier 1: a commit keeps exactly each row's accepted path's entries (a gather, not a crop); the
cache's layers follow the decoder's layer kinds; the forward's cache keyword."""
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from vlmspec.cache.kv_cache import cache_kwarg, rollback_blockers
from vlmspec.cache.slot_cache import SlotCache
from testing.families import tiny_config


def _filled_cache(n_layers=2, length=10):
    """Two slots of a `SlotCache` with `length` entries each: entry t of layer l, slot r holds
    100*l + t (+ 1000 in slot 1) in its keys and minus that in its values, so rows are identifiable."""
    cache = SlotCache(None, slots=2, capacity=16)
    cache.begin([0, 1], [0, 0])
    for layer in range(n_layers):
        vals = (100 * layer + torch.arange(length, dtype=torch.float32)).view(1, 1, length, 1).expand(2, 2, length, 4).clone()
        vals[1] += 1000
        cache.update(vals.clone(), -vals.clone(), layer)
    return cache


def _rows(cache, layer, length, slot=0):
    keys, values = cache.entries(slot, length, layer + 1)[layer]
    return keys[0, 0, :, 0].tolist(), values[0, 1, :, 0].tolist()


def test_commit_gathers_non_contiguous_path_and_leaves_the_other_slot():
    cache = _filled_cache(length=10)  # prefix 4 + tree of 6 entries
    cache.commit([0], [4], [[0, 2, 5]])
    for layer in range(2):
        keys, values = _rows(cache, layer, 7)
        assert keys == [100 * layer + t for t in [0, 1, 2, 3, 4, 6, 9]]
        assert values == [-(100 * layer + t) for t in [0, 1, 2, 3, 4, 6, 9]]
        assert _rows(cache, layer, 10, slot=1)[0] == [1000 + 100 * layer + t for t in range(10)]  # untouched


def test_commit_of_two_rows_each_keeps_its_own_path():
    cache = _filled_cache(length=8)
    cache.commit([0, 1], [5, 3], [[0], [0, 2, 4]])
    assert _rows(cache, 0, 6)[0] == [0, 1, 2, 3, 4, 5]
    assert _rows(cache, 1, 6, slot=1)[0] == [1100, 1101, 1102, 1103, 1105, 1107]


def test_commit_out_of_order_sources_overlapping_destination():
    cache = _filled_cache(length=6)  # kept entries whose sources overlap the rows they are written to
    cache.commit([0], [0], [[1, 0, 3]])
    assert _rows(cache, 0, 3)[0] == [1, 0, 3]


class _Ops(TorchDispatchMode):
    """Records every op dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("keep, moves", [([0], False), ([0, 1, 2], False), ([0, 2, 5], True), ([1], True)])
def test_a_path_that_is_the_tree_s_first_entries_moves_nothing(keep, moves):
    cache = _filled_cache(length=10)
    before = [t.clone() for t in cache.entries(0, 10, 2)[1]]
    with _Ops() as seen:
        cache.commit([0], [4], [keep])
    assert bool(seen.ops) == moves  # the plain step (keep [0]) and a chain's head run no op at all
    want = [100 + t for t in [0, 1, 2, 3] + [4 + j for j in keep]]
    assert _rows(cache, 1, 4 + len(keep))[0] == want
    if not moves:
        assert torch.equal(cache.entries(0, 10, 2)[1][0], before[0])


def test_cache_kinds_from_config():
    """Each decoder layer's cache follows its kind: a slot layer for attention of any window (the mask
    applies the window), transformers' own layer for state that cannot be rolled back."""
    lfm = SlotCache(tiny_config("lfm2_vl"), slots=1, capacity=8)
    assert lfm.kinds[:2] == ["conv", "full_attention"]
    assert type(lfm.layers[0]).__name__ == "LinearAttentionLayer" and type(lfm.layers[1]).__name__ == "SlotLayer"
    assert rollback_blockers(lfm.kinds) == {"conv": [0]}
    sliding = SlotCache(tiny_config("gemma3"), slots=2, capacity=8)
    assert "sliding_attention" in sliding.kinds
    assert {type(layer).__name__ for layer in sliding.layers} == {"SlotLayer"}


def test_cache_keyword_follows_the_forward_signature():
    class Renamed(torch.nn.Module):
        def forward(self, x, cache=None):
            return x

    class Before(torch.nn.Module):
        def forward(self, x, past_key_values=None, **kwargs):
            return x

    c = DynamicCache()
    assert cache_kwarg(Renamed(), c) == {"cache": c}
    assert cache_kwarg(Before(), c) == {"past_key_values": c}


def _cache_warnings(call):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in seen if "past_key_values" in str(w.message)]


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "idefics3"])
def test_target_forwards_pass_the_cache_without_the_deprecated_keyword(arch):
    from conftest import tiny_target
    from vlmspec.inputs import encode_prompt
    from testing.tiny import tiny_image
    from vlmspec.tree import DraftTree

    target = tiny_target(arch)
    inputs = encode_prompt(target, "what is this?", [tiny_image(1)])

    def prefill_and_verify():
        state, out = target.prefill(inputs)
        target.forward_tree(state, DraftTree.chain(int(out.logits.argmax()), [5, 7]))

    assert _cache_warnings(prefill_and_verify) == []
    if "cache" in cache_kwarg(target.model, None):
        # negative control: the old keyword does warn on this transformers, so the check above can fail
        ids = inputs["input_ids"]
        assert _cache_warnings(lambda: target.model(input_ids=ids[:, :1], past_key_values=DynamicCache(), use_cache=True))
