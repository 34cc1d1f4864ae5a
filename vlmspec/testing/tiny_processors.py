"""Tiny, fully offline processors for Hugging Face image-text-to-text families.

``build_processor(family, config)`` returns the family's own ``ProcessorMixin`` subclass (e.g.
``Gemma3Processor``, ``Qwen2VLProcessor``) wired to

* a small byte-level BPE tokenizer trained in process (`vlmspec.testing.tiny.trained_bpe`)
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
import functools
import importlib
import inspect
import re
import types
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from PIL import Image
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast, ProcessorMixin
from transformers.models.auto import image_processing_auto, processing_auto

from vlmspec.testing.families import NotBuildable
from vlmspec.testing.tiny import trained_bpe

try:  # not every transformers build ships video processors
    from transformers.models.auto import video_processing_auto
except ImportError:  # pragma: no cover - depends on the installed transformers
    video_processing_auto = None

__all__ = ["NotBuildable", "build_processor", "build_tokenizer", "tiny_test_image", "BPE_VOCAB"]

BPE_VOCAB = 640  # byte alphabet (256) + merges; special tokens go on top
MAX_LEN = 4096

# Standard chat-template tokens every tiny tokenizer has (bos/eos/pad + turn markers).
_BASE_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
_TURN_TOKENS = ["<|im_start|>", "<|im_end|>"]

# Names matched by ``tokenizer.<name>`` that are standard tokenizer attributes, not added tokens.
_STANDARD_TOKEN_ATTRS = {"bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"}

_SPECIAL_LITERAL = re.compile(r"""["'](<[^<>\s"'(){}\\]{1,48}>|\[[A-Z_]{2,24}\])["']""")
# ``vocab["|SPEAKER|"]``: a token the processor looks up in the tokenizer's vocabulary by its literal
_VOCAB_LOOKUP = re.compile(r"""vocab\[\s*["']([^"'\s]{1,48})["']\s*\]""")
_TOKENIZER_ATTR = re.compile(r"tokenizer\.(\w+_token)\b")
# ``hasattr(tokenizer, "x_token")`` / ``getattr(tokenizer, "x_token", default)``: optional, the processor has a default.
_TOKENIZER_OPTIONAL = re.compile(r"""(?:hasattr|getattr)\(\s*(?:self\.)?tokenizer\s*,\s*["'](\w+_token)["']""")
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

# Real strings of tokens that processors read from ``tokenizer.<name>`` (they come from the
# checkpoint's tokenizer config, so they cannot be discovered from code). Unlisted names fall back
# to ``<|name|>`` with the ``_token`` suffix dropped, which is equally valid for a random model.
_TOKENIZER_TOKEN_VALUES = {
    "gemma": {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
        "boa_token": "<start_of_audio>",
        "eoa_token": "<end_of_audio>",
        "audio_token": "<audio_soft_token>",
    },
    "cohere2_vision": {
        "boi_token": "<|START_OF_IMG|>",
        "eoi_token": "<|END_OF_IMG|>",
        "image_token": "<|IMG_PATCH|>",
        "img_line_break_token": "<|IMG_LINE_BREAK|>",
    },
    "internvl": {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    },
    "janus": {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"},
    "chameleon": {"image_token": "<image>", "boi_token": "<racm3:break>", "eoi_token": "<eoss>"},
    "emu3": {
        "image_token": "<image>",
        "boi_token": "<|image start|>",
        "eoi_token": "<|image end|>",
        "image_wrapper_token": "<|image token|>",
        "eof_token": "<|extra_201|>",
    },
    "mllama": {"image_token": "<|image|>"},
    "lighton_ocr": {
        "image_token": "<|image_pad|>",
        "image_break_token": "<|vision_pad|>",
        "image_end_token": "<|vision_end|>",
    },
    "paddleocr_vl": {"image_token": "<|IMAGE_PLACEHOLDER|>"},
    "perception_lm": {"image_token": "<|image|>", "video_token": "<|video|>"},
}
_TOKEN_VALUE_GROUPS = {
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "gemma4": "gemma",
    "gemma4_unified": "gemma",
    "diffusion_gemma": "gemma",
    "shieldgemma2": "gemma",
    "t5gemma2": "gemma",
    "qianfan_ocr": "internvl",
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
@functools.lru_cache(maxsize=1)
def _trained_bpe_json() -> str:
    return trained_bpe(BPE_VOCAB).to_str()


def _chat_template(image_placeholder: str) -> str:
    """ChatML-style template; each ``{"type": "image"}`` part renders ``image_placeholder``."""
    image = image_placeholder.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for item in message['content'] %}"
        "{% if item['type'] == 'image' %}{{ '" + image + "' }}"
        "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


def build_tokenizer(named: dict[str, str], extra: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (:data:`BPE_VOCAB`) + specials: ``named`` become ``tokenizer.<name>`` attributes.

    ``named`` maps attribute names (``"bos_token"``, ``"image_token"``, ``"boi_token"``...) to token
    strings; ``extra`` are further special tokens without a name. Raises :class:`NotBuildable` when
    the tokenizer would not fit in ``vocab_size``.
    """
    tok = Tokenizer.from_str(_trained_bpe_json())
    ordered = list(dict.fromkeys([*named.values(), *_TURN_TOKENS, *extra]))
    if tok.get_vocab_size() + len(ordered) > vocab_size:
        raise NotBuildable(f"{tok.get_vocab_size()} BPE + {len(ordered)} special tokens > vocab_size {vocab_size}")
    tok.add_special_tokens(ordered)
    standard = {k: v for k, v in named.items() if k in _STANDARD_TOKEN_ATTRS}
    custom = {k: v for k, v in named.items() if k not in _STANDARD_TOKEN_ATTRS}
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=None,
        extra_special_tokens=custom,
        model_max_length=MAX_LEN,
        padding_side="left",
        **standard,
    )
    leftover = [t for t in ordered if t not in custom.values() and t not in standard.values()]
    if leftover:
        hf_tok.add_special_tokens({"additional_special_tokens": leftover}, replace_extra_special_tokens=False)
    return hf_tok


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


def _processor_tokens(processor_cls: type, family: str) -> tuple[dict[str, str], list[str]]:
    """Special tokens the processor needs: (``tokenizer.<name>`` attributes, other literals)."""
    source = inspect.getsource(inspect.getmodule(processor_cls))
    init_defaults = {
        k: p.default
        for k, p in inspect.signature(processor_cls.__init__).parameters.items()
        if isinstance(p.default, str)
    }
    values = _TOKENIZER_TOKEN_VALUES.get(_TOKEN_VALUE_GROUPS.get(family, family), {})
    named: dict[str, str] = dict(_BASE_SPECIALS)
    optional = set(_TOKENIZER_OPTIONAL.findall(source))
    for name in sorted(set(_TOKENIZER_ATTR.findall(source)) | (optional & set(values))):
        if name in _STANDARD_TOKEN_ATTRS or (name in optional and name not in values) or name.startswith("add_"):
            continue
        named[name] = values.get(name) or init_defaults.get(name) or f"<|{name.removesuffix('_token')}|>"
    extra = [v for k, v in init_defaults.items() if k.endswith("_token") and v.startswith(("<", "["))]
    extra += _SPECIAL_LITERAL.findall(source)
    extra += _VOCAB_LOOKUP.findall(source)
    extra += [v for v in values.values() if v not in named.values()]
    return named, list(dict.fromkeys(t for t in extra if t not in named.values()))


# --------------------------------------------------------------------------------------
# Geometry helpers
# --------------------------------------------------------------------------------------
def _size_items(size) -> dict:
    """The set (non-``None``) entries of a size dict or ``SizeDict``."""
    if size is None:
        return {}
    if hasattr(size, "keys"):
        return {k: size[k] for k in size.keys() if size[k] is not None}
    if dataclasses.is_dataclass(size):
        return {f.name: getattr(size, f.name) for f in dataclasses.fields(size) if getattr(size, f.name) is not None}
    return {}


def _set_size(image_processor, height: int, width: int | None = None, attrs=("size", "crop_size")) -> None:
    """Set the size-like attributes of ``image_processor`` to ``height`` x ``width``, keeping their keys."""
    width = height if width is None else width
    for attr in attrs:
        size = getattr(image_processor, attr, None)
        items = _size_items(size)
        if not items:
            continue
        new = dict(items)
        for key in items:
            if key in ("height", "max_height"):
                new[key] = height
            elif key in ("width", "max_width"):
                new[key] = width
            elif key == "longest_edge":
                new[key] = max(height, width)
            elif key == "shortest_edge":
                new[key] = min(height, width)
        setattr(image_processor, attr, type(size)(**new) if dataclasses.is_dataclass(size) else new)


def _vision(config):
    return getattr(config, "vision_config", None)


def _int(value) -> int:
    return int(value[0]) if isinstance(value, (list, tuple)) else int(value)


def _shrink_square_tower(config, patches_per_side: int) -> int:
    """Set ``vision_config.image_size`` to ``patches_per_side`` patches; return the image size."""
    vc = _vision(config)
    patch = _int(vc.patch_size)
    size = patch * patches_per_side
    vc.image_size = [size, size] if isinstance(vc.image_size, (list, tuple)) else size
    return size


# Each hook shrinks the vision geometry: it may edit ``config`` and the image processor and returns
# extra keyword arguments for the processor constructor. Signature: (config, image_processor) -> dict.
_Hook = Callable[[Any, Any], dict]
_GEOMETRY: dict[str, _Hook] = {}


def _geometry(*families: str) -> Callable[[_Hook], _Hook]:
    def register(fn: _Hook) -> _Hook:
        for fam in families:
            _GEOMETRY[fam] = fn
        return fn

    return register


def _default_geometry(config, image_processor) -> dict:
    """Square tower of 4x4 patches; processor sized to it."""
    vc = _vision(config)
    if vc is not None and isinstance(getattr(vc, "patch_size", None), (int, list, tuple)) and hasattr(vc, "image_size"):
        size = _shrink_square_tower(config, 4)
        _set_size(image_processor, size)
    return {}


@_geometry("llava", "vipllava", "video_llava")
def _llava_geometry(config, image_processor) -> dict:
    size = _shrink_square_tower(config, 4)
    _set_size(image_processor, size)
    if hasattr(config, "image_seq_length"):
        config.image_seq_length = 16
    return _llava_kwargs(config)


@_geometry("gemma3", "shieldgemma2")
def _gemma3_geometry(config, image_processor) -> dict:
    size = _shrink_square_tower(config, 4)  # 4x4 patches pooled to 2x2 = 4 tokens
    config.mm_tokens_per_image = 4
    _set_size(image_processor, size)
    return {"image_seq_length": config.mm_tokens_per_image}


@_geometry("gemma4", "gemma4_unified", "diffusion_gemma")
def _gemma4_geometry(config, image_processor) -> dict:
    """Patches are pooled by pooling_kernel_size^2 into soft tokens; 70 is the smallest budget the image
    processor accepts (630 patches)."""
    if hasattr(image_processor, "max_soft_tokens"):
        image_processor.max_soft_tokens = 70
    return {"image_seq_length": 70}


@_geometry("paligemma")
def _paligemma_geometry(config, image_processor) -> dict:
    size = _shrink_square_tower(config, 4)
    _set_size(image_processor, size)
    image_processor.image_seq_length = 16
    config.text_config.num_image_tokens = 16
    return {}


def _has_cls(config) -> bool:
    """CLIP-style towers prepend a CLS embedding (counted by ``num_additional_image_tokens``)."""
    return getattr(_vision(config), "model_type", "") in ("clip_vision_model", "clip")


def _llava_kwargs(config) -> dict:
    return {
        "patch_size": _int(_vision(config).patch_size),
        "vision_feature_select_strategy": getattr(config, "vision_feature_select_strategy", "default"),
        "num_additional_image_tokens": 1 if _has_cls(config) else 0,
    }


@_geometry("llava_next", "llava_next_video", "granite4_vision")
def _llava_next_geometry(config, image_processor) -> dict:
    size = _shrink_square_tower(config, 4)
    pinpoints = [[size, 2 * size], [2 * size, size], [2 * size, 2 * size]]
    config.image_grid_pinpoints = pinpoints
    image_processor.image_grid_pinpoints = pinpoints
    _set_size(image_processor, size)
    if hasattr(config, "image_seq_length"):
        config.image_seq_length = 16
    return _llava_kwargs(config)


@_geometry("llava_onevision")
def _llava_onevision_geometry(config, image_processor) -> dict:
    size = _shrink_square_tower(config, 4)
    pinpoints = [[size, 2 * size], [2 * size, size], [2 * size, 2 * size]]
    config.image_grid_pinpoints = pinpoints
    image_processor.image_grid_pinpoints = pinpoints
    _set_size(image_processor, size)
    return {"num_image_tokens": 16, "vision_feature_select_strategy": config.vision_feature_select_strategy}


@_geometry("aya_vision")
def _aya_geometry(config, image_processor) -> dict:
    size = _shrink_square_tower(config, 4)  # 4x4 patches, pixel-shuffled by downsample_factor 2 -> 2x2 tokens
    _set_size(image_processor, size)
    image_processor.max_patches = 2
    # the processor multiplies patch_size by downsample_factor itself
    patch = _int(_vision(config).patch_size)
    return {"img_size": size, "patch_size": patch, "downsample_factor": config.downsample_factor}


@_geometry("cohere2_vision")
def _cohere2_vision_geometry(config, image_processor) -> dict:
    size = _shrink_square_tower(config, 4)
    _set_size(image_processor, size)
    image_processor.max_patches = 2
    image_processor.patch_size = 4 // config.downsample_factor  # processor: tokens per tile side
    return {}


@_geometry("internvl", "qianfan_ocr")
def _internvl_geometry(config, image_processor) -> dict:
    size = _shrink_square_tower(config, 4)
    _set_size(image_processor, size)
    image_processor.max_patches = 2
    config.image_seq_length = int(16 * config.downsample_ratio**2)
    return {"image_seq_length": config.image_seq_length}


@_geometry("idefics3", "smolvlm", "granite_docling")
def _idefics3_geometry(config, image_processor) -> dict:
    size = _shrink_square_tower(config, 4)
    seq = 16 // config.scale_factor**2
    _set_size(image_processor, 2 * size)  # longest edge: a 2x2 grid of tiles + the global image
    image_processor.max_image_size = {"longest_edge": size}
    return {"image_seq_len": seq}


@_geometry("fuyu")
def _fuyu_geometry(config, image_processor) -> dict:
    """Fuyu has no vision tower: images are padded to ``size`` and cut into ``patch_size`` patches."""
    _set_size(image_processor, 2 * config.patch_size)  # 2x2 patches (+ a newline token per row)
    return {}


@_geometry("janus", "deepseek_vl")
def _janus_geometry(config, image_processor) -> dict:
    size = _shrink_square_tower(config, 4)
    _set_size(image_processor, size)
    if hasattr(_vision(config), "num_image_tokens"):
        _vision(config).num_image_tokens = 16
    return {"num_image_tokens": 16}


@_geometry("deepseek_vl_hybrid")
def _deepseek_vl_hybrid_geometry(config, image_processor) -> dict:
    """A 4x4-patch low-res tower plus a SAM high-res tower on 4x larger images (its features are resized
    to the low-res grid): 16 image tokens."""
    _janus_geometry(config, image_processor)
    size = _int(_vision(config).image_size)
    high = config.high_res_vision_config
    high.image_size, high.window_size = 4 * size, 4
    _set_size(image_processor, 4 * size, attrs=("high_res_size",))
    return {"num_image_tokens": 16}


@_geometry("got_ocr2")
def _got_ocr2_geometry(config, image_processor) -> dict:
    """SAM tower of 16x16 patches (windows of 4), then two stride-2 convolutions: 4x4 = 16 image tokens."""
    size = _shrink_square_tower(config, 16)
    _vision(config).window_size = 4
    _set_size(image_processor, size)
    return {}


@_geometry("aria")
def _aria_geometry(config, image_processor) -> dict:
    """The processor's call defaults pin images to 980px squares: 70px patches make that 14x14, and the
    projector's cross-attention maps those 196 patches to 4 queries."""
    size = image_processor.max_image_size
    _vision(config).patch_size, _vision(config).image_size = size // 14, size
    config.projector_patch_to_query_dict = {14 * 14: 4}
    config.max_value_projector_patch_to_query_dict = 4
    return {"size_conversion": {size: 4}}


@_geometry("fast_vlm")
def _fast_vlm_geometry(config, image_processor) -> dict:
    """FastViT (timm) downsamples by 64 and has no image_size: 128px images -> 2x2 tokens."""
    _set_size(image_processor, 128)
    config.image_seq_length = 4
    return {"patch_size": 64, "vision_feature_select_strategy": "full", "num_additional_image_tokens": 0}


@_geometry("ovis2")
def _ovis2_geometry(config, image_processor) -> dict:
    size = _shrink_square_tower(config, 4)
    _set_size(image_processor, size)
    return {"image_seq_length": 16 // getattr(_vision(config), "hidden_stride", 1) ** 2}


def _chameleon_image_token_names(n: int) -> list[str]:
    """Chameleon's BPE names of VQ codes: ``IMGIMG`` + code digits as letters A-J + ``Z``."""
    return ["IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(i)) + "Z" for i in range(n)]


_CHAMELEON_CODES = 32  # VQ codebook entries (each needs a token in the 1k vocabulary)

_EMU3_CODES = 32  # Emu3's VQ codes, each a ``<|visual token NNNNNN|>`` token of the tokenizer

# Extra (non-special) tokens a family's tokenizer must contain: family -> list of token strings.
_EXTRA_VOCAB = {
    "chameleon": _chameleon_image_token_names(_CHAMELEON_CODES),
    "emu3": ["<|extra_200|>"] + [f"<|visual token {i:06d}|>" for i in range(_EMU3_CODES)],  # end of row + codes
}


@_geometry("chameleon")
def _chameleon_geometry(config, image_processor) -> dict:
    """VQ-GAN tokenizer shrunk to 32px images, 8x downsampling -> 4x4 = 16 image tokens."""
    vq = config.vq_config
    vq.resolution, vq.channel_multiplier, vq.num_res_blocks = 32, [1, 2, 2, 2], 1
    vq.base_channels, vq.latent_channels, vq.embed_dim = 32, 32, 32  # GroupNorm uses 32 groups
    vq.num_embeddings = _CHAMELEON_CODES
    _set_size(image_processor, vq.resolution)
    return {"image_seq_length": 16}


@_geometry("emu3")
def _emu3_geometry(config, image_processor) -> dict:
    """VQ-VAE tokenizer downsampling by 8: 32px images -> 4x4 codes (+ an end-of-row token per row)."""
    config.vq_config.codebook_size = _EMU3_CODES
    side = 4 * image_processor.spatial_factor
    image_processor.min_pixels = image_processor.max_pixels = side * side
    image_processor.size = {"min_pixels": side * side, "max_pixels": side * side}
    return {}


# --------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------
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
