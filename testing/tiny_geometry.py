"""Per-family image geometry for the tiny processors (`testing.tiny_processors`).

Each hook shrinks a family's vision config and image processor together, so that a small image
becomes a handful of vision patches and the number of image placeholder tokens the processor emits
equals the number of image features the model produces. `_GEOMETRY[family](config, image_processor)`
returns the processor keyword arguments that follow from it; `_default_geometry` serves the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


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
