"""The bundled ToyWorld VLM: loads through the HF auto classes offline, reads images, and the
engine reproduces HF generate on it token for token."""
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmspec import assets
import toyworld
from vlmspec.draft import NgramDrafter, PlainDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.target import Target
from vlmspec.target import load_target
from vlmspec.inputs import encode_prompt
from vlmspec.data.heldout import heldout
from vlmspec.text import generate_text

pytestmark = pytest.mark.skipif(assets.bundled_target() is None, reason="no bundled model in assets/")


@pytest.fixture(scope="module")
def target():
    return load_target(assets.BUNDLED_TARGET)


def test_loads_with_hf_auto_classes_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForImageTextToText.from_pretrained(assets.BUNDLED_TARGET)
    processor = AutoProcessor.from_pretrained(assets.BUNDLED_TARGET)
    assert model.config.text_config.num_hidden_layers >= 8
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_index


def _held_out(task, n, offset=0):
    return [c.sample for c in heldout("smoke", n, per_task=True, tasks=(task,), seed=offset)]


def test_answers_counting_questions(target):
    engine = SpecEngine(target, NgramDrafter())
    right = 0
    for s in _held_out("count", 10):
        text = generate_text(engine, encode_prompt(target, s.prompt, [s.image]), GenerationConfig(max_new_tokens=24)).text
        right += toyworld.score(s, text)["counting"]
    assert right >= 7, f"{right}/10 held-out counting questions right"


def test_engine_equals_hf_generate(target):
    for s in _held_out("describe", 2, offset=100):
        inputs = encode_prompt(target, s.prompt, [s.image])
        ref = target.model.generate(**inputs, max_new_tokens=80, do_sample=False)[0, inputs["input_ids"].shape[1] :].tolist()
        for drafter in (PlainDrafter(), NgramDrafter()):
            got = SpecEngine(target, drafter).generate(inputs, GenerationConfig(max_new_tokens=80)).token_ids
            assert got == ref, drafter.name
    assert torch.is_grad_enabled()  # the engine does not leave grad mode switched off
