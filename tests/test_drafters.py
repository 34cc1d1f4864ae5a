"""Drafters on their own: n-gram proposals, EAGLE head save/load and target checks."""
import json

import pytest
import torch

from conftest import tiny_target
from vlmspec.draft import load_drafter
from vlmspec.draft.base import DraftSession, Drafter, NoDrafter, PromptContext, TreeConfig
from vlmspec.draft.eagle import DrafterLoadError, EagleDrafter
from vlmspec.draft.ngram import NgramConfig, NgramDrafter
from vlmspec.prompts import encode_prompt


def _ctx(ids, hidden=8):
    ids = torch.tensor(ids)
    return PromptContext(ids, torch.zeros(len(ids), hidden))


def test_protocol_conformance():
    target = tiny_target("llava")
    for d in (NoDrafter(), NgramDrafter(), EagleDrafter.random_init(target)):
        assert isinstance(d, Drafter)
        assert isinstance(d.start(_ctx([1, 2, 3], target.hidden_size)), DraftSession)


def test_ngram_proposes_continuation_of_latest_match():
    d = NgramDrafter(TreeConfig(depth=3, top_k=1, total_tokens=8))
    s = d.start(_ctx([5, 6, 7, 8, 9, 1, 2, 5, 6]))
    tree = s.propose(7, max_depth=3)  # "... 5 6 | 7" matches "5 6 7" -> 8 9 1
    assert tree.tokens.tolist() == [7, 8, 9, 1] and tree.parents.tolist() == [-1, 0, 1, 2]
    assert s.propose(7, max_depth=1).tokens.tolist() == [7, 8]
    assert s.propose(7, max_depth=0).tokens.tolist() == [7]


def test_ngram_branches_and_budget():
    # "1 2" was followed by 3 and (more recently) by 4: two branches, most recent first
    d = NgramDrafter(TreeConfig(depth=2, top_k=2, total_tokens=3), NgramConfig(max_ngram=2))
    s = d.start(_ctx([1, 2, 3, 0, 1, 2, 4, 9, 1]))
    tree = s.propose(2, max_depth=2)
    assert tree.tokens.tolist()[:3] == [2, 4, 9] and tree.size - 1 <= 3
    assert 3 in tree.tokens.tolist()[1:] and int(tree.depth.max()) <= 2
    s.commit(torch.tensor([2, 4]), torch.zeros(2, 8))
    assert s.history[-2:] == [2, 4]


def test_ngram_no_match_is_root_only():
    s = NgramDrafter().start(_ctx([1, 2, 3]))
    assert s.propose(9, max_depth=4).size == 1


def test_eagle_tree_shape_follows_config():
    target = tiny_target("llava")
    cfg = TreeConfig(depth=4, top_k=3, total_tokens=10)
    d = EagleDrafter.random_init(target, cfg)
    inputs = encode_prompt(target, "hello there")
    _, out = target.prefill(inputs)
    s = d.start(PromptContext(inputs["input_ids"][0], out.features))
    tree = s.propose(5, max_depth=10)
    assert tree.size == 1 + cfg.total_tokens and int(tree.depth.max()) <= cfg.depth
    assert tree.tokens[0] == 5
    # siblings are distinct tokens
    for kids in tree.children():
        toks = [int(tree.tokens[c]) for c in kids]
        assert len(toks) == len(set(toks))
    assert s.cache.seq_len == inputs["input_ids"].shape[1]  # tree entries were dropped again


def test_eagle_save_load_roundtrip(tmp_path):
    target = tiny_target("llava")
    d = EagleDrafter.random_init(target, seed=3)
    d.save(tmp_path / "drafter")
    assert sorted(p.name for p in (tmp_path / "drafter").iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_drafter(str(tmp_path / "drafter"), target)
    for (k1, v1), (k2, v2) in zip(d.head.state_dict().items(), loaded.head.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    # the shared embedding/LM head are the target's own modules, not copies
    assert loaded.head.embed is target.input_embeddings() and loaded.head.lm_head is target.output_embeddings()


@pytest.mark.parametrize(
    "field,value,word",
    [("hidden_size", 96, "hidden_size"), ("vocab_size", 1003, "vocab_size"), ("rope_theta", 1234.0, "rope_theta"), ("max_position_embeddings", 512, "max_position")],
)
def test_eagle_for_another_target_is_refused(tmp_path, field, value, word):
    target = tiny_target("llava")
    EagleDrafter.random_init(target).save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterLoadError, match=word):
        EagleDrafter.load(tmp_path, target)


def test_eagle_bad_checkpoints_are_refused(tmp_path):
    target = tiny_target("llava")
    with pytest.raises(DrafterLoadError, match="config.json"):
        EagleDrafter.load(tmp_path, target)
    EagleDrafter.random_init(target).save(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    state.pop(next(iter(state)))
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterLoadError, match="missing"):
        EagleDrafter.load(tmp_path, target)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DrafterLoadError, match="not a valid"):
        EagleDrafter.load(tmp_path, target)
