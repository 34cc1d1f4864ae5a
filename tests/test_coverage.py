"""Every image-text-to-text family: lossless or refused with vlmspec's own message, never silently wrong.

Tier 1: the windowed tree masks against transformers' own mask functions; the cache's layer kinds.
Tier 2: the coverage matrix over tiny random builds of every family (testing.coverage), its
negative control (one full-causal mask for every layer: the sliding-window families are caught), the
refusals, and the generated docs in step with the matrix.
"""

import functools
from pathlib import Path

import pytest
import torch
from transformers.masking_utils import chunked_overlay, sliding_window_overlay

from vlmspec.draft.base import PlainDrafter, TreeConfig
from vlmspec.draft.ngram import NgramDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.errors import ConfigError, InputError, TargetLoadError
from vlmspec.inputs import model_inputs, render_chat
from vlmspec.target import Target
from testing import coverage
from testing.families import build_family, tiny_config
from vlmspec.runtime.transfer import to_device
from vlmspec.tree import DraftTree, ancestor_mask, tree_attention_mask, windowed_tree_mask

ROOT = Path(__file__).resolve().parents[1]
# families whose tree forwards were silently wrong with one full-causal mask for every layer
WINDOWED = ("gemma3", "aya_vision", "cohere2_vision", "idefics2")


# ------------------------------------------------------------------ tier 1: masks and cache kinds
@pytest.mark.parametrize("kind,overlay", [("sliding_attention", sliding_window_overlay), ("chunked_attention", None)])
def test_windowed_chain_mask_equals_transformers_own(kind, overlay):
    """A chain's nodes stand at consecutive indices: its windowed mask is transformers' one-step mask, row by row."""
    prefix, n, window = 13, 6, 4
    chain = torch.arange(-1, n - 1)
    got = windowed_tree_mask(ancestor_mask(chain), prefix, torch.arange(n), kind, window)
    fn = sliding_window_overlay(window) if kind == "sliding_attention" else chunked_overlay(window, torch.zeros(1, dtype=torch.long))
    for i in range(n):
        q = prefix + i
        want = [kv <= q and bool(fn(0, 0, q, kv)) for kv in range(prefix + n)]
        assert got[i].tolist() == want, (kind, i)


def test_windowed_tree_mask_uses_depth_not_index():
    # root, two children (depth 1), a grandchild of the second (depth 2, index 3)
    parents = torch.tensor([-1, 0, 0, 2])
    depth = torch.tensor([0, 1, 1, 2])
    got = windowed_tree_mask(ancestor_mask(parents), 10, depth, "sliding_attention", 3)
    # node 3 stands at 12: it sees prefix 10, 11 (q - k < 3), not 9, and its ancestors 0, 2 but not sibling 1
    assert got[3].tolist() == [False] * 10 + [True, False, True, True]
    full = windowed_tree_mask(ancestor_mask(parents), 10, depth, "full_attention", None)
    assert full[3].tolist() == [True] * 10 + [True, False, True, True]
    # negative control: index-based positions (12 -> 13 for node 3) would cut the root out of its window
    assert windowed_tree_mask(ancestor_mask(parents), 10, torch.arange(4), "sliding_attention", 3)[3, 10].item() is False


# ------------------------------------------------------------------ tier 2: the matrix
@functools.lru_cache(maxsize=None)
def _matrix() -> tuple:
    from testing.tiny import tiny_image
    from testing.tiny_processors import build_processor

    return tuple(coverage.run_matrix(None, build_processor, tiny_image(0), workers=2))


def test_a_differing_token_is_a_near_tie_only_within_the_logit_bound():
    """`coverage.compare`: equal tokens pass; a token that parts where the reference's margin is within
    `MAX_LOGIT_GAP` is a near-tie, noted with its margin; the negative control: a larger margin fails."""
    ref = [5, 6, 7, 8]
    assert coverage.compare(ref, ref, "x", lambda k, other: 1.0) == ""
    note = coverage.compare([5, 6, 9, 1], ref, "x", lambda k, other: 6e-8 if (k, other) == (2, 9) else 1.0)
    assert "token 2" in note and "6.0e-08" in note
    with pytest.raises(coverage._Failed, match="token 2 differs"):
        coverage.compare([5, 6, 9, 1], ref, "x", lambda k, other: 1e-2)
    with pytest.raises(coverage._Failed, match="3 tokens"):
        coverage.compare(ref[:3], ref, "x", lambda k, other: 0.0)


def test_every_family_lossless_or_refused():
    rows = _matrix()
    failed = [f"{r.family}: {r.detail}" for r in rows if r.status == "FAILED"]
    assert not failed, "\n".join(failed)
    near_ties = [f"{r.family}: {note}" for r in rows for note in r.near_ties]
    print("\n".join(["near-ties (CPU-dependent):", *near_ties]) if near_ties else "no near-tie divergence on this CPU")
    assert len(near_ties) <= 3, near_ties  # rounding flips a rare exact tie; many would be a fault the allowance hides
    by_status = {r.family: r.status for r in rows}
    for family in ("llava", "qwen2_5_vl", "idefics3", "gemma3", "gemma4", "aya_vision", "mllama", "smolvlm", "paligemma"):
        assert by_status[family] == "lossless", family
    assert by_status["lfm2_vl"] == by_status["minicpmv4_7"] == "plain only"
    # image prompts ran wherever a tiny processor builds, among them the sliding-window families
    assert {"gemma3", "aya_vision", "qwen2_5_vl"} <= {r.family for r in rows if "image" in r.prompts}
    assert all(r.max_gap is not None and r.max_gap <= coverage.MAX_LOGIT_GAP for r in rows if r.status == "lossless")
    # a refusal is vlmspec's own sentence, saying what to do
    for r in rows:
        if r.status in ("plain only", "refused"):
            assert r.detail and not r.detail.startswith("raw"), r


def test_docs_are_generated_from_the_matrix():
    rows = list(_matrix())
    page = (ROOT / "docs" / "families.md").read_text()
    readme = (ROOT / "README.md").read_text()
    fix = "python -m testing.coverage --write"
    assert coverage.replace_block(page, coverage.table(rows)) == page, f"docs/families.md is stale: run {fix}"
    assert coverage.replace_block(readme, coverage.summary(rows)) == readme, f"the README's family list is stale: run {fix}"


def _one_full_mask(self, state, tree):
    """The old tree mask: one full-causal ancestor mask for every layer (the negative control)."""
    return to_device(tree_attention_mask(tree.ancestor_mask(), state.seq_len, self.dtype), self.device)


def test_negative_control_without_per_layer_masks(monkeypatch):
    monkeypatch.setattr(Target, "tree_masks", _one_full_mask)
    rows = coverage.run_matrix(list(WINDOWED))
    assert [r.status for r in rows] == ["FAILED"] * len(WINDOWED), [(r.family, r.status, r.detail) for r in rows]
    assert all("differs" in r.detail or "logit gap" in r.detail for r in rows)


# ------------------------------------------------------------------ refusals, each with a control
def test_conv_state_refuses_drafters_but_decodes_plain():
    target = Target(build_family("lfm2_vl"), None, name="lfm2-tiny")
    with pytest.raises(ConfigError, match=r"'conv' at layer 0.*--drafter plain"):
        SpecEngine(target, NgramDrafter(TreeConfig(depth=3, top_k=2, total_tokens=6)))
    inputs = coverage.text_prompt()
    got = SpecEngine(target, PlainDrafter()).generate(inputs, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids
    assert got == coverage.hf_greedy(target.model, inputs, 12)


def test_own_position_ids_refuse_drafters():
    target = Target(build_family("kosmos-2.5"), None, name="kosmos")
    with pytest.raises(ConfigError, match="computes its own position ids or masks"):
        SpecEngine(target, NgramDrafter())
    control = Target(build_family("llava"), None, name="llava")
    SpecEngine(control, NgramDrafter())  # positions agree: accepted


def test_model_that_needs_an_image_says_so():
    target = Target(build_family("kosmos-2"), None, name="kosmos-2")
    with pytest.raises(InputError, match="cannot run this prompt"):
        SpecEngine(target, PlainDrafter()).generate(coverage.text_prompt(), GenerationConfig(max_new_tokens=2))


class _Tok:
    def __init__(self, template):
        self.chat_template = template

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert tokenize is False and add_generation_prompt
        return "from the tokenizer"


class _Proc:
    chat_template = None

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, *a, **k):
        raise AssertionError("the processor has no template: its apply_chat_template must not be called")


class _FakeTarget:
    name, device, dtype = "fake", torch.device("cpu"), torch.float32

    def __init__(self, processor):
        self.processor = processor


def test_chat_template_from_wherever_it_is():
    assert render_chat(_FakeTarget(_Proc(_Tok("{{ x }}"))), [{"role": "user", "content": "hi"}]) == "from the tokenizer"
    with pytest.raises(TargetLoadError, match="chat_template.jinja"):
        render_chat(_FakeTarget(_Proc(_Tok(None))), [{"role": "user", "content": "hi"}])


def test_model_inputs_drop_labels_and_cast_pixels():
    raw = {"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 4, dtype=torch.long),
           "pixel_values": torch.ones(1, 3, 8, 8, dtype=torch.bfloat16)}
    out = model_inputs(_FakeTarget(None), raw)
    assert set(out) == {"input_ids", "pixel_values"}
    assert out["pixel_values"].dtype == torch.float32 and out["input_ids"].dtype == torch.long
    assert "labels" in raw  # the processor's own output is left as it was


def test_tree_masks_per_kind_on_a_mixed_model():
    target = Target(build_family("gemma3"), None, name="gemma3")
    state, _ = target.prefill(coverage.text_prompt())
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]))
    masks = target.tree_masks(state, tree)
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert masks["full_attention"].shape == masks["sliding_attention"].shape == (1, 1, 3, state.seq_len + 3)
    assert bool((masks["sliding_attention"] < masks["full_attention"]).any())  # the window cuts the prefix
    single = Target(build_family("llava"), None, name="llava")
    s2, _ = single.prefill(coverage.text_prompt())
    assert isinstance(single.tree_masks(s2, tree), torch.Tensor)  # one kind: one tensor


def _paligemma2():
    """PaliGemma over a Gemma 2 decoder (sliding and full layers): its wrapper builds one mask per kind
    itself, and takes neither a dict of masks nor one mask for both (the real PaliGemma 2)."""
    from transformers import CONFIG_MAPPING, PaliGemmaForConditionalGeneration

    from testing.families import remap_special_ids, shrink

    config = tiny_config("paligemma")
    config.text_config = shrink(CONFIG_MAPPING["gemma2"](), "gemma2")
    remap_special_ids(config)
    torch.manual_seed(0)
    return PaliGemmaForConditionalGeneration(config).eval()


def test_masks_a_wrapper_does_not_take_refuse_drafters():
    target = Target(_paligemma2(), None, name="paligemma2-tiny")
    assert {"sliding_attention", "full_attention"} <= set(target.layer_kinds)
    with pytest.raises(ConfigError, match="does not take a tree's per-layer masks.*--drafter plain"):
        SpecEngine(target, NgramDrafter())
    inputs = coverage.text_prompt()  # plain decoding lets the wrapper build its own masks: exact
    got = SpecEngine(target, PlainDrafter()).generate(inputs, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids
    assert got == coverage.hf_greedy(target.model, inputs, 12)
    control = Target(build_family("paligemma"), None, name="paligemma")  # Gemma 1: one kind, one mask tensor
    SpecEngine(control, NgramDrafter())
