"""Tests for the offline tiny VLM builders in ``testing.tiny`` (CPU, a few seconds total)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import transformers

try:
    import vlmspec  # noqa: F401
except ImportError:  # plain `pytest` from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testing.tiny import ARCHS, build_tiny, tiny_image  # noqa: E402

MAX_NEW = 8

MODEL_CLASSES = {
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
}
PROCESSOR_CLASSES = {
    "llava": "LlavaProcessor",
    "llava_next": "LlavaNextProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "idefics3": "Idefics3Processor",
}
# Expected processor output keys (besides input_ids / attention_mask) when images are given.
IMAGE_KEYS = {
    "llava": {"pixel_values"},
    "llava_next": {"pixel_values", "image_sizes"},
    "qwen2_5_vl": {"pixel_values", "image_grid_thw", "mm_token_type_ids"},
    "idefics3": {"pixel_values", "pixel_attention_mask"},
}
# Number of image-placeholder tokens for one 48x48 image.
TOKENS_PER_IMAGE = {"llava": 16, "llava_next": 24, "qwen2_5_vl": 9, "idefics3": 20}


@functools.lru_cache(maxsize=None)
def _tiny(arch: str):
    return build_tiny(arch)


def _messages(n_images: int, text: str = "describe"):
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def _inputs(processor, n_images: int, images=None):
    text = processor.apply_chat_template(_messages(n_images), add_generation_prompt=True)
    assert isinstance(text, str)
    if images is None:
        images = [tiny_image(10 + i) for i in range(n_images)] or None
    return processor(text=[text], images=images, return_tensors="pt")


def _greedy_reference(model, inputs, n: int) -> list[int]:
    """Greedy decoding by full recomputation (no KV cache): the lossless reference."""
    ids = inputs["input_ids"]
    fixed = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    out = []
    with torch.no_grad():
        for _ in range(n):
            extra = {}
            if "mm_token_type_ids" in inputs:
                mm = inputs["mm_token_type_ids"]
                extra["mm_token_type_ids"] = torch.cat([mm, mm.new_zeros(mm.shape[0], ids.shape[1] - mm.shape[1])], 1)
            logits = model(
                input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **fixed, **extra
            ).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(nxt))
            ids = torch.cat([ids, nxt], dim=1)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_build_properties(arch):
    model, processor = _tiny(arch)
    assert type(model).__name__ == MODEL_CLASSES[arch]
    assert type(processor).__name__ == PROCESSOR_CLASSES[arch]
    assert not model.training
    assert model.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"

    tok = processor.tokenizer
    text_cfg = model.config.get_text_config()
    assert text_cfg.vocab_size % 2 == 1
    assert text_cfg.vocab_size >= len(tok)
    assert model.get_output_embeddings().weight.shape[0] == text_cfg.vocab_size
    assert text_cfg.num_hidden_layers == 2
    assert text_cfg.hidden_size == 64
    assert text_cfg.num_attention_heads == 4
    assert text_cfg.num_key_value_heads == 2
    assert text_cfg.max_position_embeddings >= 2048
    assert text_cfg.eos_token_id == tok.eos_token_id is not None
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id is not None

    # special-token ids agree between tokenizer, processor and config
    assert model.config.image_token_id == processor.image_token_id
    assert tok.convert_ids_to_tokens(model.config.image_token_id) == processor.image_token
    assert len(tok.encode(processor.image_token, add_special_tokens=False)) == 1
    if arch == "qwen2_5_vl":
        for field, token in [
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
        ]:
            assert getattr(model.config, field) == tok.convert_tokens_to_ids(token)
        rope = text_cfg.rope_parameters
        head_dim = text_cfg.hidden_size // text_cfg.num_attention_heads
        assert sum(rope["mrope_section"]) == head_dim // 2
    if arch == "idefics3":
        for token in ("<fake_token_around_image>", "<global-img>", "<end_of_utterance>", "<row_1_col_1>"):
            assert len(tok.encode(token, add_special_tokens=False)) == 1
    if arch in ("llava", "llava_next"):
        assert model.config.image_token_index == tok.convert_tokens_to_ids("<image>")


@pytest.mark.parametrize("arch", ARCHS)
def test_deterministic(arch):
    m1, p1 = _tiny(arch)
    m2, p2 = build_tiny(arch, seed=0)
    m3, _ = build_tiny(arch, seed=1)
    sd1, sd2, sd3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert sd1.keys() == sd2.keys()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert any(not torch.equal(sd1[k], sd3[k]) for k in sd1)
    assert p1.tokenizer.get_vocab() == p2.tokenizer.get_vocab()
    assert tiny_image(3).tobytes() == tiny_image(3).tobytes()
    assert tiny_image(3).tobytes() != tiny_image(4).tobytes()
    assert tiny_image(3).size == (48, 48) and tiny_image(3).mode == "RGB"


@pytest.mark.parametrize("n_images", [1, 2, 0], ids=["one_image", "two_images", "text_only"])
@pytest.mark.parametrize("arch", ARCHS)
def test_generate(arch, n_images):
    model, processor = _tiny(arch)
    inputs = _inputs(processor, n_images)
    ids = inputs["input_ids"]
    assert ids.shape[0] == 1 and ids.dtype == torch.long
    assert inputs["attention_mask"].shape == ids.shape

    n_img_tokens = int((ids == model.config.image_token_id).sum())
    assert n_img_tokens == n_images * TOKENS_PER_IMAGE[arch]
    if n_images:
        assert IMAGE_KEYS[arch] <= set(inputs.keys())
    else:
        assert "pixel_values" not in inputs

    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    assert out.shape == (1, ids.shape[1] + MAX_NEW)
    assert torch.equal(out[:, : ids.shape[1]], ids)
    new = out[0, ids.shape[1] :].tolist()
    assert all(0 <= t < model.config.get_text_config().vocab_size for t in new)
    # KV-cached generate == greedy by full recomputation (checks positions / M-RoPE / image merge)
    assert new == _greedy_reference(model, inputs, MAX_NEW)


@pytest.mark.parametrize("arch", ARCHS)
def test_non_square_image(arch):
    model, processor = _tiny(arch)
    img = tiny_image(7, size=64, height=40)
    assert img.size == (64, 40)
    inputs = _inputs(processor, 1, images=[img])
    n_img_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert 0 < n_img_tokens <= 80
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    assert out[0, -4:].tolist() == _greedy_reference(model, inputs, 4)


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_tokenize(arch):
    _, processor = _tiny(arch)
    msgs = _messages(1)
    msgs[0]["content"][0]["image"] = tiny_image(10)
    got = processor.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    ref = _inputs(processor, 1)
    assert set(got.keys()) == set(ref.keys())
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_roundtrip(arch, tmp_path):
    model, processor = _tiny(arch)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)

    model2 = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path, local_files_only=True)
    processor2 = transformers.AutoProcessor.from_pretrained(tmp_path, local_files_only=True)
    model2.eval()
    assert type(model2) is type(model)
    assert type(processor2) is type(processor)
    assert model2.dtype == torch.float32
    assert model2.config.image_token_id == model.config.image_token_id
    assert model2.generation_config.eos_token_id == model.generation_config.eos_token_id
    assert processor2.tokenizer.get_vocab() == processor.tokenizer.get_vocab()

    sd1, sd2 = model.state_dict(), model2.state_dict()
    assert sd1.keys() == sd2.keys()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)

    for n_images in (2, 0):
        text1 = processor.apply_chat_template(_messages(n_images), add_generation_prompt=True)
        text2 = processor2.apply_chat_template(_messages(n_images), add_generation_prompt=True)
        assert text1 == text2
        inputs1 = _inputs(processor, n_images)
        inputs2 = _inputs(processor2, n_images)
        assert inputs1.keys() == inputs2.keys()
        for k in inputs1:
            assert torch.equal(inputs1[k], inputs2[k]), k
        with torch.no_grad():
            logits1 = model(**inputs1).logits
            logits2 = model2(**inputs2).logits
        assert logits1.shape == (1, inputs1["input_ids"].shape[1], model.config.get_text_config().vocab_size)
        assert torch.isfinite(logits1).all()
        assert torch.equal(logits1, logits2)
