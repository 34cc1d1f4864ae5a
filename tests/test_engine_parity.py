"""Tier 2: greedy parity with HF generate on tiny real architectures, for every drafter."""
import pytest
import torch

from conftest import tiny_target
from drafters import OracleDrafter
from vlmspec.draft.base import PlainDrafter, TreeConfig
from vlmspec.draft.eagle import EagleDrafter
from vlmspec.draft.ngram import NgramDrafter
from vlmspec.draft.self_spec import SelfSpecDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.sampling import SamplingParams
from testing.tiny import tiny_image
from vlmspec.inputs import encode_prompt
from vlmspec.text import decode, generate_text, stream_text

NEW = 64
PROMPTS = {
    "one_image": ("describe the image in detail", [0]),
    "two_images": ("compare the first image with the second image", [1, 2]),
    "text_only": ("once upon a time, in a quiet village", []),
}


def _inputs(target, kind):
    text, seeds = PROMPTS[kind]
    return encode_prompt(target, text, [tiny_image(s) for s in seeds])


def _hf_greedy(target, inputs):
    out = target.model.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _drafters(target, ref):
    tree = TreeConfig(depth=5, top_k=3, total_tokens=12)
    drafters = {
        "none": PlainDrafter(),
        "ngram": NgramDrafter(tree),
        "eagle_random": EagleDrafter.random_init(target, tree, seed=1),
        "eagle3_random": EagleDrafter.random_init(target, tree, seed=1, arch="eagle3"),
        "oracle": OracleDrafter(ref, depth=tree.depth, vocab=target.vocab_size),
    }
    if not target.uses_mrope:  # self-speculation refuses M-RoPE targets (tests/test_self_spec.py)
        drafters["self"] = SelfSpecDrafter(target, tree)
    return drafters


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_parity_all_drafters(arch, kind):
    target = tiny_target(arch)
    inputs = _inputs(target, kind)
    ref = _hf_greedy(target, inputs)
    assert len(ref) == NEW
    config = GenerationConfig(max_new_tokens=NEW, ignore_eos=True)
    for name, drafter in _drafters(target, ref).items():
        result = SpecEngine(target, drafter).generate(inputs, config)
        assert result.token_ids == ref, f"{arch}/{kind}/{name} diverged from HF generate"
        assert result.finish_reason == "length"
        if name == "oracle":
            # self-draft accepts (almost) everything: tau >= 0.9 * (depth + 1)
            assert result.mean_accepted_length >= 0.9 * (5 + 1), result.mean_accepted_length
        if name == "none":
            assert result.mean_accepted_length == 1.0 and result.num_target_forwards == NEW


def test_llava_next_parity():
    target = tiny_target("llava_next")
    inputs = _inputs(target, "two_images")
    ref = _hf_greedy(target, inputs)
    for name, drafter in _drafters(target, ref).items():
        result = SpecEngine(target, drafter).generate(inputs, GenerationConfig(max_new_tokens=NEW, ignore_eos=True))
        assert result.token_ids == ref, name


def test_sampling_is_seeded_and_varies():
    target = tiny_target("qwen2_5_vl")
    inputs = _inputs(target, "one_image")
    engine = SpecEngine(target, NgramDrafter(TreeConfig(depth=3, top_k=2, total_tokens=6)))

    def run(seed):
        cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True, seed=seed, sampling=SamplingParams(1.0, top_p=0.9))
        return engine.generate(inputs, cfg).token_ids

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_stops_on_eos_and_stop_string():
    target = tiny_target("llava")
    inputs = _inputs(target, "one_image")
    ref = _hf_greedy(target, inputs)
    engine = SpecEngine(target, PlainDrafter())
    # pretend the 10th greedy token is EOS: generation must end right after it
    eos_tok = ref[9]
    first = ref.index(eos_tok)
    saved = target.eos_token_ids
    target.eos_token_ids = {eos_tok}
    try:
        result = engine.generate(inputs, GenerationConfig(max_new_tokens=NEW))
    finally:
        target.eos_token_ids = saved
    assert result.token_ids == ref[: first + 1] and result.finish_reason == "stop"
    # a stop string taken from the greedy text: the text ends right before it
    full = decode(target.tokenizer, ref)
    stop = full[20:26]
    result = generate_text(engine, inputs, GenerationConfig(max_new_tokens=NEW, ignore_eos=True), stop=(stop,))
    assert result.finish_reason == "stop" and result.text == full[: full.find(stop)]


def test_max_tokens_respected_with_deep_trees():
    target = tiny_target("llava")
    inputs = _inputs(target, "one_image")
    ref = _hf_greedy(target, inputs)
    for n in (1, 2, 7):
        drafter = OracleDrafter(ref, depth=5, vocab=target.vocab_size)
        result = SpecEngine(target, drafter).generate(inputs, GenerationConfig(max_new_tokens=n, ignore_eos=True))
        assert result.token_ids == ref[:n]


def test_prompt_beyond_context_is_refused():
    from vlmspec.target import ContextLengthError

    target = tiny_target("llava")
    inputs = _inputs(target, "text_only")
    long = {"input_ids": torch.ones(1, target.max_positions + 5, dtype=torch.long)}
    long["attention_mask"] = torch.ones_like(long["input_ids"])
    with pytest.raises(ContextLengthError, match="context"):
        SpecEngine(target, PlainDrafter()).generate(long, GenerationConfig(max_new_tokens=4))
    assert inputs  # the normal prompt is unaffected


def test_streamed_text_concatenates_to_the_final_text():
    target = tiny_target("llava")
    inputs = _inputs(target, "one_image")
    ref_text = decode(target.tokenizer, _hf_greedy(target, inputs))
    for stop in ((), (ref_text[30:34],)):
        gen = stream_text(SpecEngine(target, NgramDrafter()), inputs, GenerationConfig(max_new_tokens=NEW, ignore_eos=True), stop=stop)
        streamed = "".join(event.text for event in gen)
        assert streamed == gen.completion.text
        assert gen.completion.text == (ref_text if not stop else ref_text[: ref_text.find(stop[0])])
