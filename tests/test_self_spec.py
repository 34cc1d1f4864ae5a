"""Self-speculation (#21 item 3): the target's first E layers draft; DEL's choice of E."""
import pytest
import torch

from conftest import tiny_target
from vlmspec.draft import load_drafter
from vlmspec.draft.base import PlainDrafter, TreeConfig
from vlmspec.draft.self_spec import SelfSpecConfig, SelfSpecDrafter, best_exit, default_exits, expected_tokens_per_second
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.errors import DrafterLoadError
from vlmspec.inputs import encode_prompt
from vlmspec.target.early_exit import ExitView
from testing.tiny import tiny_image
from vlmspec.tree import DraftTree


def _prefill(target, text="once upon a time", images=()):
    inputs = encode_prompt(target, text, [tiny_image(s) for s in images])
    state, out = target.prefill(inputs)
    return inputs, state, int(out.logits[0].argmax())


@pytest.mark.parametrize("arch", ["llava", "idefics3"])
def test_the_exit_view_through_every_layer_is_the_target_itself(arch):
    """The naive oracle of the layer loop: exiting after the last layer gives the target's own logits."""
    target = tiny_target(arch)
    view = ExitView(target)
    _, state, root = _prefill(target, images=[0])
    cache = view.shallow_cache(state.entries(view.num_layers), view.num_layers)
    w, b = view.head_weights()
    hidden = view.run(root, state.seq_len, cache, view.num_layers)  # [H]
    ref = target.forward_tree(state, DraftTree.root_only(root)).logits[0]
    torch.testing.assert_close(torch.nn.functional.linear(hidden, w, b).float(), ref, atol=1e-4, rtol=1e-4)
    rows = torch.tensor([5, 1, 9])  # a trimmed vocabulary: those rows of the same head
    wk, bk = view.head_weights(rows)
    torch.testing.assert_close(torch.nn.functional.linear(hidden, wk, bk).float(), ref[rows], atol=1e-4, rtol=1e-4)


def test_drafting_leaves_the_targets_cache_alone_and_builds_a_chain_with_leaf_siblings():
    target = tiny_target("llava")
    drafter = SelfSpecDrafter(target, TreeConfig(depth=4, top_k=3, total_tokens=9), SelfSpecConfig(exit_layer=1))
    inputs, state, root = _prefill(target)
    n_layers = ExitView(target).num_layers
    before = [(k.clone(), v.clone()) for k, v in state.entries(n_layers)]
    from vlmspec.draft.base import PromptContext

    session = drafter.start(PromptContext(inputs["input_ids"][0], torch.zeros(1), inputs, kv=state.entries))
    tree = session.propose(root, 4)
    for (k, v), (k2, v2) in zip(before, state.entries(n_layers)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    # 3 levels of (chain node + 2 leaves) = 9 nodes: the budget stops the 4th level
    assert tree.size == 10 and int(tree.depth.max()) == 3
    kids = tree.children()
    chain = [i for i in range(1, tree.size) if kids[i]]
    assert [len(kids[i]) for i in [0, *chain]] == [3, 3, 3]  # every chain node has top_k children, leaves have none
    assert session.propose(root, 0).size == 1  # depth 0: the root alone


def test_dels_choice_of_exit_on_constructed_histories():
    # a never measured exit is tried first, the shallowest first
    assert best_exit({4: 0.9, 8: 0.9}, {4: 0.001, 8: 0.0}, depth=3, num_layers=30) == 8
    # equal acceptance: the shallow exit is cheaper
    assert best_exit({4: 0.6, 8: 0.6}, {4: 0.002, 8: 0.004}, depth=3, num_layers=30) == 4
    # the shallow exit's acceptance collapsed: the deeper one pays
    assert best_exit({4: 0.05, 8: 0.8}, {4: 0.002, 8: 0.004}, depth=3, num_layers=30) == 8
    # expected tokens per second: more acceptance is better, more seconds per level worse
    f = expected_tokens_per_second
    assert f(0.8, 0.002, 4, 3, 30) > f(0.4, 0.002, 4, 3, 30) and f(0.8, 0.002, 4, 3, 30) > f(0.8, 0.004, 4, 3, 30)
    assert default_exits(30) == (5, 8, 10, 15) and default_exits(2) == (1,)


@pytest.mark.parametrize("arch", ["llava", "idefics3"])
@pytest.mark.parametrize("images", [(), (0,), (1, 2)])
def test_greedy_parity_fixed_and_dynamic_exit(arch, images):
    target = tiny_target(arch)
    inputs = encode_prompt(target, "describe the image in detail" if images else "once upon a time", [tiny_image(s) for s in images])
    cfg = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    plain = SpecEngine(target, PlainDrafter()).generate(inputs, cfg).token_ids
    tree = TreeConfig(depth=4, top_k=2, total_tokens=8)
    for spec in ("self", "self:1"):
        got = SpecEngine(target, load_drafter(spec, target, tree)).generate(inputs, cfg)
        assert got.token_ids == plain, f"{arch}/{spec} diverged"
        assert got.num_drafted > 0


def test_a_target_it_cannot_run_and_a_bad_exit_are_refused_clearly():
    with pytest.raises(DrafterLoadError, match="M-RoPE"):
        load_drafter("self", tiny_target("qwen2_5_vl"))
    with pytest.raises(DrafterLoadError, match=r"exit layer must be in \[1, 1\]"):
        load_drafter("self:5", tiny_target("llava"))
    with pytest.raises(DrafterLoadError, match="self:E"):
        load_drafter("self:x", tiny_target("llava"))
    with pytest.raises(DrafterLoadError, match="draft vocabulary must be in"):
        load_drafter("self:1:999999", tiny_target("llava"))


def test_a_trimmed_draft_vocabulary_drafts_only_its_ids_and_keeps_parity():
    target = tiny_target("llava")
    inputs = encode_prompt(target, "once upon a time", [])
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    plain = SpecEngine(target, PlainDrafter()).generate(inputs, cfg).token_ids
    drafter = load_drafter("self:auto:40", target, TreeConfig(depth=3, top_k=2, total_tokens=6))
    assert drafter.rows is not None and drafter.head[0].shape[0] == 40
    seen = []
    engine = SpecEngine(target, drafter)
    gen = engine.stream(inputs, cfg)
    real = drafter.start

    def spy(prompt, tree=None):
        session = real(prompt, tree)
        propose = session.propose
        session.propose = lambda root, d: seen.append(t := propose(root, d)) or t
        return session

    drafter.start = spy
    assert [tok for ev in gen for tok in ev.token_ids] == plain
    drafted = torch.cat([t.tokens[1:] for t in seen])
    assert drafted.numel() > 0 and int(drafted.max()) < 40  # only ids of the draft vocabulary are proposed
