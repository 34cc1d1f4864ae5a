"""Tiny, fully offline processors for Hugging Face image-text-to-text families.

``build_processor(family, config)`` returns the family's own ``ProcessorMixin`` subclass (e.g.
``Gemma3Processor``, ``Qwen2VLProcessor``) wired to

* a small byte-level BPE tokenizer trained in process (`testing.tiny.trained_bpe`)
  (:data:`BPE_VOCAB` entries) plus every special token the processor needs, appended on top;
* the family's own image processor (and video processor where the processor requires one), built
  from its class defaults and shrunk so that a small image (e.g. 48x48 or 64x64 RGB) becomes a
  handful of vision patches;
* a generic ``<|im_start|>role ... <|im_end|>`` chat template whose image parts emit the family's
  image placeholder text (read from the processor, e.g. ``processor.image_token``; a small table
  :data:`_IMAGE_PLACEHOLDER` covers the families whose template text differs from it).

``config`` is the (already shrunk) model config of that family. It is updated in place so that the
model built from it accepts the processor's outputs:

* every ``*_token_id`` / ``*_token_index`` whose token the tokenizer knows is set to the
  tokenizer's id (``image_token_id`` to the id of the token that is repeated once per image feature);
* ``bos`` / ``eos`` / ``pad`` ids of the text config are set to the tokenizer's;
* the vision geometry (``image_size``, tokens per image, grid pinpoints, ...) is shrunk together
  with the processor's so that the number of image placeholder tokens the processor emits equals the
  number of image features the model produces.

Contract for a built processor ``p`` (``n`` images, ``T`` prompt tokens after expansion):

* ``p.apply_chat_template(messages, add_generation_prompt=True)`` -> ``str`` with one placeholder
  per ``{"type": "image"}`` part;
* ``p(text=[prompt], images=[img], return_tensors="pt")`` -> ``BatchFeature`` with ``input_ids``
  ``(1, T)``, ``attention_mask`` ``(1, T)`` and the family's pixel inputs (``pixel_values`` of a
  family-specific shape plus e.g. ``image_grid_thw`` / ``image_sizes`` / ``pixel_attention_mask``);
  ``model.generate(**inputs)`` runs with the model built from the updated ``config``;
* ``len(p.tokenizer) <= config.get_text_config().vocab_size``.

Families that cannot be built raise :class:`NotBuildable` with a one-line reason. Everything is
deterministic (no randomness beyond the fixed BPE training) and takes well under a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import re
import types
from collections import Counter
from collections.abc import Iterator

import numpy as np
from PIL import Image
from transformers import ProcessorMixin
from transformers.models.auto import image_processing_auto, processing_auto

from testing.families import NotBuildable
from testing.tiny_geometry import _EXTRA_VOCAB, _GEOMETRY, _default_geometry, _size_items, _vision
from testing.tiny_tokens import _TURN_TOKENS, BPE_VOCAB, _chat_template, _processor_tokens, build_tokenizer

try:  # not every transformers build ships video processors
    from transformers.models.auto import video_processing_auto
except ImportError:  # pragma: no cover - depends on the installed transformers
    video_processing_auto = None

__all__ = ["NotBuildable", "build_processor", "build_tokenizer", "tiny_test_image", "BPE_VOCAB"]


_CONFIG_TOKEN_ATTR = re.compile(r"^_?(\w+?)_token_(?:id|index)$")


# --------------------------------------------------------------------------------------
# Family tables (kept small; everything else is discovered from the processor classes)
# --------------------------------------------------------------------------------------
# Families that are not decoder-only chat models (or not image+text at all).
_NOT_CHAT = {
    "blip": "encoder-decoder captioner (no chat placeholder)",
    "florence2": "encoder-decoder (BART) task-prompt model",
    "pix2struct": "encoder-decoder (image is the encoder input)",
    "udop": "encoder-decoder document model (needs OCR boxes)",
    "t5gemma2": "encoder-decoder",
    "vision-encoder-decoder": "encoder-decoder without a processor",
    "git": "image-prefix captioner without an image placeholder token",
    "kosmos-2": "grounding model with its own processor layout (no processor in the auto mapping)",
    "kosmos-2.5": "OCR model with its own processor layout (no processor in the auto mapping)",
    "evolla": "protein-text model, no images",
    "pi0": "robotics action model, no generate()",
    "idefics": "perceiver-resampler model with its own processor layout",
}

# Families whose vision tower does not shrink (text prompts only).
_NO_TINY_VISION = {
    "gemma3n": "its MobileNetV5 vision tower (timm) keeps its full width (2,048) and takes ~40 s per image on a CPU",
}

# Families whose processor / image processor is registered under another family (or not at all).
_PROCESSOR_ALIASES = {
    "fast_vlm": ("LlavaProcessor", "CLIPImageProcessor"),
    "glm4v_moe": ("Glm4vProcessor", "Glm4vImageProcessor"),
    "glm_ocr": ("Glm4vProcessor", "Glm4vImageProcessor"),
    "glmga": ("Glm46VProcessor", "GlmgaImageProcessor"),
    "qwen3_vl_moe": ("Qwen3VLProcessor", "Qwen2VLImageProcessor"),
    "cosmos3_omni": ("Qwen3VLProcessor", "Qwen2VLImageProcessor"),
}


# Template text for one image part, where it differs from ``processor.image_token``.
_IMAGE_PLACEHOLDER = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl_moe": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_5_moe": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen4_exp": "<|vision_start|><|image_pad|><|vision_end|>",
    "glm4v": "<|begin_of_image|><|image|><|end_of_image|>",
    "glm4v_moe": "<|begin_of_image|><|image|><|end_of_image|>",
    "glm_ocr": "<|begin_of_image|><|image|><|end_of_image|>",
    "glm46v": "<|begin_of_image|><|image|><|end_of_image|>",
    "glmga": "<|begin_of_image|><|image|><|end_of_image|>",
    "glm5_next": "<|begin_of_image|><|image|><|end_of_image|>",
    "fuyu": "",  # FuyuProcessor puts the image in front of the prompt itself
}

# Config token attributes whose token string is not ``<processor|tokenizer>.<base>_token``: the
# literal token string (used only when the tokenizer has it).
_CONFIG_TOKEN_SOURCES = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_start_token_id": "<|begin_of_image|>",
    "image_end_token_id": "<|end_of_image|>",
    "video_start_token_id": "<|begin_of_video|>",
    "video_end_token_id": "<|end_of_video|>",
}


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def tiny_test_image(size: int = 48, seed: int = 0) -> Image.Image:
    """Deterministic random RGB image, ``size`` x ``size``."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)).convert("RGB")


# --------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------
def _resolve_class(name: str) -> type:
    import transformers

    try:
        return getattr(transformers, name)
    except AttributeError as exc:
        raise NotBuildable(f"transformers has no class {name}") from exc


def _processor_class(family: str) -> type:
    if family in _PROCESSOR_ALIASES:
        return _resolve_class(_PROCESSOR_ALIASES[family][0])
    name = processing_auto.PROCESSOR_MAPPING_NAMES.get(family)
    if not name:
        raise NotBuildable("no processor class registered for this family")
    return _resolve_class(name)


def _image_processor_class(family: str) -> type:
    if family in _PROCESSOR_ALIASES:
        return _resolve_class(_PROCESSOR_ALIASES[family][1])
    names = image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES.get(family)
    if not names:
        raise NotBuildable("no image processor class registered for this family")
    if isinstance(names, str):
        return _resolve_class(names)
    if isinstance(names, dict):
        name = names.get("torchvision") or names.get("pil") or next(iter(names.values()))
    else:  # (slow, fast) tuple in older layouts
        name = next(n for n in reversed(tuple(names)) if n)
    return _resolve_class(name)


def _video_processor_class(family: str, processor_cls: type) -> type:
    names = None
    if video_processing_auto is not None:
        names = video_processing_auto.VIDEO_PROCESSOR_MAPPING_NAMES.get(family)
    if isinstance(names, dict):
        names = names.get("torchvision") or next(iter(names.values()))
    if not names:  # borrow from the processor's own module family (e.g. Qwen3VL for qwen3_vl_moe)
        module = processor_cls.__module__.rsplit(".", 1)[0]
        stem = processor_cls.__name__.removesuffix("Processor")
        candidate = f"{stem}VideoProcessor"
        mod = importlib.import_module(module)
        if hasattr(mod, candidate):
            return getattr(mod, candidate)
        raise NotBuildable(f"no video processor for {processor_cls.__name__}")
    return _resolve_class(names)


@contextlib.contextmanager
def _family_patches(family: str) -> Iterator[None]:
    """Temporary module patches some processor constructors need to fit a 1k vocabulary."""
    if family == "paligemma":  # PaliGemmaProcessor adds 1,152 <loc>/<seg> tokens on init
        module = importlib.import_module("transformers.models.paligemma.processing_paligemma")
        saved = module.EXTRA_TOKENS
        module.EXTRA_TOKENS = []
        try:
            yield
        finally:
            module.EXTRA_TOKENS = saved
    elif family == "smolvlm":  # SmolVLMProcessor insists on `num2words`, which only video prompts use
        module = importlib.import_module("transformers.models.smolvlm.processing_smolvlm")
        saved = module.num2words
        module.num2words = saved or str
        try:
            yield
        finally:
            module.num2words = saved
    else:
        yield


def _float32_image_processor(image_processor) -> None:
    """Llama 4's image processor normalizes in bfloat16; the tiny models are float32."""
    for base in type(image_processor).__mro__[1:]:
        if "rescale_and_normalize" in vars(base):
            method = vars(base)["rescale_and_normalize"]
            image_processor.rescale_and_normalize = types.MethodType(method, image_processor)
            return


# Per-family tweaks of the built image processor (after geometry): family -> fn(image_processor).
_IMAGE_PROCESSOR_FIXUPS = {"llama4": _float32_image_processor}
# Per-family settings of the built processor that its constructor does not take: family -> {attribute: value}.
_PROCESSOR_SETTINGS = {
    "got_ocr2": {"num_image_tokens": 16},  # a call-time default (class attribute) in GOT-OCR 2
    "cosmos3_edge": {"return_mm_token_type_ids": True},  # its model requires them; the processor's default is off
}


def _kwargs_from_config(processor_cls: type, config, taken: dict) -> dict:
    """Processor constructor arguments that the model config also carries under the same name."""
    params = inspect.signature(processor_cls.__init__).parameters
    attributes = set(processor_cls.get_attributes())
    out = {}
    sources = [config, _vision(config)]
    for name in params:
        if name in attributes or name in taken or name in ("self", "chat_template", "args", "kwargs"):
            continue
        if name.endswith("_token"):
            continue
        for source in sources:
            value = getattr(source, name, None) if source is not None else None
            if value is not None and not callable(value):
                out[name] = value
                break
    return out


def _sub_processor(attr: str, family: str, processor_cls: type, config, image_processor):
    if attr == "image_processor":
        return image_processor
    if attr == "video_processor":
        video_processor = _video_processor_class(family, processor_cls)()
        _shrink_pixels(video_processor, config)
        return video_processor
    if attr == "feature_extractor":
        from transformers.models.auto import feature_extraction_auto

        name = feature_extraction_auto.FEATURE_EXTRACTOR_MAPPING_NAMES.get(family)
        if not name:
            raise NotBuildable("processor needs a feature extractor and none is registered")
        return _resolve_class(name)()
    raise NotBuildable(f"processor needs a {attr!r}, which has no offline builder")


# image-processor attribute <- vision-config attribute, copied when both exist
_PROCESSOR_FROM_VISION = {
    "patch_size": "patch_size",
    "merge_size": "spatial_merge_size",
    "temporal_patch_size": "temporal_patch_size",
}


def _sync_from_vision(processor, config) -> None:
    """Give an image/video processor the vision tower's patch / merge sizes."""
    vc = _vision(config)
    if vc is None:
        return
    for attr, source in _PROCESSOR_FROM_VISION.items():
        value = getattr(vc, source, None)
        if isinstance(getattr(processor, attr, None), int) and isinstance(value, int):
            setattr(processor, attr, value)


def _shrink_pixels(processor, config) -> None:
    """Cap ``min_pixels``/``max_pixels``-style processors (Qwen-VL family) at a few merged patches."""
    _sync_from_vision(processor, config)
    patch = getattr(processor, "patch_size", None)
    merge = getattr(processor, "merge_size", None) or 1
    if not isinstance(patch, int):
        return
    factor = patch * merge
    size = getattr(processor, "size", None)
    items = _size_items(size)
    if "shortest_edge" in items and "longest_edge" in items and items["longest_edge"] > 4096:  # pixel counts
        items.update(shortest_edge=factor * factor, longest_edge=(4 * factor) ** 2)
        processor.size = type(size)(**items) if dataclasses.is_dataclass(size) else items
    for attr, value in (("min_pixels", factor * factor), ("max_pixels", (4 * factor) ** 2)):
        if getattr(processor, attr, None) is not None:
            setattr(processor, attr, value)


def _special_ids(tokenizer) -> set[int]:
    skip = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    skip |= set(tokenizer.convert_tokens_to_ids(_TURN_TOKENS))
    return {i for i in tokenizer.all_special_ids if i not in skip}


def _image_feature_token_id(processor, image_size: int) -> int:
    """Id of the token the processor repeats once per image feature (the model's ``image_token_id``)."""
    prompt = processor.apply_chat_template(_probe_messages(), add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[tiny_test_image(image_size)], return_tensors="pt")
    specials = _special_ids(processor.tokenizer)
    counts = Counter(int(i) for i in inputs["input_ids"].reshape(-1).tolist() if int(i) in specials)
    if not counts:
        raise NotBuildable("processed image prompt contains no special image token")
    return counts.most_common(1)[0][0]


def _probe_messages() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe the image"}]}]


def _sub_configs(config) -> list:
    out = [config]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out.append(sub)
    return out


def _sync_config(config, processor, image_token_id: int) -> None:
    """Point the config's special-token ids at the tokenizer's."""
    tokenizer = processor.tokenizer
    for cfg in _sub_configs(config):
        names = [k for k in vars(cfg) if _CONFIG_TOKEN_ATTR.match(k) and not k.startswith("_")]
        for name in names:
            base = _CONFIG_TOKEN_ATTR.match(name).group(1)
            if base == "image":
                setattr(cfg, name, image_token_id)
                continue
            token = _CONFIG_TOKEN_SOURCES.get(name)
            if token is None:
                token = getattr(processor, f"{base}_token", None) or getattr(tokenizer, f"{base}_token", None)
            if isinstance(token, str) and token in tokenizer.get_vocab():
                setattr(cfg, name, tokenizer.convert_tokens_to_ids(token))
    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        for base in ("bos", "eos", "pad"):
            setattr(cfg, f"{base}_token_id", getattr(tokenizer, f"{base}_token_id"))
    if hasattr(config, "vocabulary_map"):  # Chameleon / Emu3 map VQ codes to BPE ids through it
        config.vocabulary_map = dict(tokenizer.get_vocab())
    for name in ("image_token_id", "image_token_index"):
        if hasattr(config, name):
            setattr(config, name, image_token_id)


def build_processor(family: str, config, *, image_size: int = 48) -> ProcessorMixin:
    """A tiny offline processor for ``family`` whose outputs the tiny model built from ``config`` accepts.

    ``config`` (the family's shrunk model config) is updated in place: special-token ids, vision
    geometry (see the module docstring). ``image_size`` is the side of the probe image used to find
    the image-feature token; any small image works with the built processor.
    Raises :class:`NotBuildable` when the family has no tiny offline processor, including when the
    family's own processor code fails on the tiny parts (its exception, type and first line, is the reason).
    """
    try:
        return _build_processor(family, config, image_size)
    except NotBuildable:
        raise
    except Exception as exc:  # noqa: BLE001  (the family's own processor code raises any type; the reason records it)
        text = str(exc).strip()
        first = (text.splitlines()[0] if text else "")[:160]
        raise NotBuildable(f"its processor does not build offline: {type(exc).__name__}: {first}") from exc


def _build_processor(family: str, config, image_size: int) -> ProcessorMixin:
    if family in _NOT_CHAT:
        raise NotBuildable(_NOT_CHAT[family])
    if family in _NO_TINY_VISION:
        raise NotBuildable(_NO_TINY_VISION[family])
    processor_cls = _processor_class(family)
    named, extra = _processor_tokens(processor_cls, family)
    vocab_size = config.get_text_config().vocab_size
    tokenizer = build_tokenizer(named, extra + _EXTRA_VOCAB.get(family, []), vocab_size)
    image_processor = _image_processor_class(family)()
    _shrink_pixels(image_processor, config)
    kwargs = _GEOMETRY.get(family, _default_geometry)(config, image_processor)
    if family in _IMAGE_PROCESSOR_FIXUPS:
        _IMAGE_PROCESSOR_FIXUPS[family](image_processor)
    kwargs.update(_kwargs_from_config(processor_cls, config, kwargs))
    subs = {}
    for attr in processor_cls.get_attributes():
        if attr == "tokenizer":
            subs[attr] = tokenizer
        else:
            subs[attr] = _sub_processor(attr, family, processor_cls, config, image_processor)
    with _family_patches(family):
        processor = processor_cls(**subs, **kwargs)
    for name, value in _PROCESSOR_SETTINGS.get(family, {}).items():
        setattr(processor, name, value)
    if len(processor.tokenizer) > vocab_size:
        raise NotBuildable(f"processor grew the tokenizer to {len(processor.tokenizer)} > vocab_size {vocab_size}")
    placeholder = _IMAGE_PLACEHOLDER.get(family)
    for attr in ("image_placeholder_token", "image_token"):
        placeholder = placeholder if placeholder is not None else getattr(processor, attr, None)
    if not isinstance(placeholder, str):
        raise NotBuildable(f"{processor_cls.__name__} exposes no image placeholder token")
    processor.chat_template = _chat_template(placeholder)
    processor.tokenizer.chat_template = processor.chat_template
    _sync_config(config, processor, _image_feature_token_id(processor, image_size))
    return processor
