"""Tier 1: KV commit keeps exactly the accepted path's entries (a gather, not a crop)."""
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from vlmspec.kv_cache import KVCache, cache_kwarg


def _filled_cache(n_layers=2, length=10):
    cache = DynamicCache()
    for layer in range(n_layers):
        # entry t of layer l holds the value 100*l + t everywhere, so rows are identifiable
        vals = (100 * layer + torch.arange(length, dtype=torch.float32)).view(1, 1, length, 1).expand(1, 2, length, 4)
        cache.update(vals.clone(), -vals.clone(), layer)
    return KVCache(cache)


def _rows(kv, layer):
    return kv.hf.layers[layer].keys[0, 0, :, 0].tolist(), kv.hf.layers[layer].values[0, 1, :, 0].tolist()


def test_commit_gathers_non_contiguous_path():
    kv = _filled_cache(length=10)  # prefix 4 + tree of 6 entries
    kv.commit(prefix_len=4, keep=torch.tensor([0, 2, 5]))
    assert kv.seq_len == 7
    for layer in range(2):
        keys, values = _rows(kv, layer)
        assert keys == [100 * layer + t for t in [0, 1, 2, 3, 4, 6, 9]]
        assert values == [-(100 * layer + t) for t in [0, 1, 2, 3, 4, 6, 9]]


def test_commit_root_only_and_whole_chain():
    kv = _filled_cache(length=8)
    kv.commit(prefix_len=5, keep=torch.tensor([0]))
    assert _rows(kv, 0)[0] == [0, 1, 2, 3, 4, 5]
    kv = _filled_cache(length=8)
    kv.commit(prefix_len=5, keep=torch.tensor([0, 1, 2]))
    assert _rows(kv, 1)[0] == [100, 101, 102, 103, 104, 105, 106, 107]


def test_commit_out_of_order_sources_overlapping_destination():
    # keep entries whose sources overlap the rows they are written to
    kv = _filled_cache(length=6)
    kv.commit(prefix_len=0, keep=torch.tensor([1, 0, 3]))
    assert _rows(kv, 0)[0] == [1, 0, 3]


def test_commit_then_append_continues():
    kv = _filled_cache(n_layers=1, length=6)
    kv.commit(prefix_len=2, keep=torch.tensor([0, 3]))
    new = torch.full((1, 2, 1, 4), 50.0)
    kv.hf.update(new, new, 0)
    assert _rows(kv, 0)[0] == [0, 1, 2, 5, 50]
    kv.crop(3)
    assert kv.seq_len == 3


class _Ops(TorchDispatchMode):
    """Records every op dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("keep, gathers", [([0], False), ([0, 1, 2], False), ([0, 2, 5], True), ([1], True)])
def test_a_path_that_is_the_tree_s_first_entries_is_cropped_not_copied(keep, gathers):
    kv = _filled_cache(length=10)
    with _Ops() as seen:
        kv.commit(prefix_len=4, keep=torch.tensor(keep))
    assert (torch.ops.aten.index_select.default in seen.ops) == gathers  # the plain step (keep [0]) moves nothing
    want = [100 + t for t in [0, 1, 2, 3] + [4 + j for j in keep]]
    assert kv.seq_len == 4 + len(keep) and _rows(kv, 1)[0] == want


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
    from vlmspec.testing.tiny import tiny_image
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
