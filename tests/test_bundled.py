"""The bundled ToyWorld VLM: loads through the HF auto classes offline, reads images, and the
engine reproduces HF generate on it token for token."""
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmspec import assets
from vlmspec.data import toyworld
from vlmspec.draft import NgramDrafter, NoDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.target import Target

pytestmark = pytest.mark.skipif(assets.bundled_target() is None, reason="no bundled model in assets/")


@pytest.fixture(scope="module")
def target():
    return Target.load(assets.BUNDLED_TARGET)


def test_loads_with_hf_auto_classes_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForImageTextToText.from_pretrained(assets.BUNDLED_TARGET)
    processor = AutoProcessor.from_pretrained(assets.BUNDLED_TARGET)
    assert model.config.text_config.num_hidden_layers >= 8
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_index


def _held_out(task, n, offset=0):
    lo = toyworld.SPLITS["test"][0] + 950_000 + offset
    return [toyworld.make_sample(lo + i, task) for i in range(n)]


def test_answers_counting_questions(target):
    engine = SpecEngine(target, NgramDrafter())
    right = 0
    for s in _held_out("count", 10):
        text = engine.generate(target.encode(s.prompt, [s.image]), GenerationConfig(max_new_tokens=24)).text
        right += toyworld.score(s, text)["counting"]
    assert right >= 7, f"{right}/10 held-out counting questions right"


def test_engine_equals_hf_generate(target):
    for s in _held_out("describe", 2, offset=100):
        inputs = target.encode(s.prompt, [s.image])
        ref = target.model.generate(**inputs, max_new_tokens=80, do_sample=False)[0, inputs["input_ids"].shape[1] :].tolist()
        for drafter in (NoDrafter(), NgramDrafter()):
            got = SpecEngine(target, drafter).generate(inputs, GenerationConfig(max_new_tokens=80)).token_ids
            assert got == ref, drafter.name
    assert torch.is_grad_enabled()  # the engine does not leave grad mode switched off
