"""Tiny random builds of every image-text-to-text family transformers ships, for the coverage matrix.

``tiny_family(family)`` takes the family's own default config (``CONFIG_MAPPING[family]()``), shrinks
it in place (`shrink`: hidden 64, two decoder layers that keep one layer of every kind the family
has, four heads, a 1,024-token vocabulary with the special-token ids moved into its top, sliding
windows and attention chunks of 8 so that a 20-token prompt already runs past them) and builds the
model from it with random weights, fp32, on the CPU. Nothing is downloaded.

The shrink is generic; what it keeps consistent: multi-head and multi-query attention stay so; widths
copied from a tower under another name (a projector's in/out dims) shrink with it; multi-head latent
attention dims are divided by one factor (`_shrink_mla`); heterogeneous configs (`per_layer_config`)
keep one layer per kind of override, the overrides scaled with their globals; layers named by index
(SAM's ``global_attn_indexes``) and vision-feature taps follow the kept layers; VQ image tokenizers get
32 base channels; discrete codes that live in the text vocabulary get a small codebook below the
special-token zone; a text-only default (no ``vision_config``) gets its family's default tower.

What a build cannot do here is said with `NotBuildable` (the reason is the matrix's row), never
hidden: a family whose default config does not build, or that is not a decoder the engine can
drive (encoder-decoder families).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

VOCAB = 1024  # tiny vocabulary; special-token ids are moved into [VOCAB - 64, VOCAB)
SPECIAL_ZONE = 64
CODE_ZONE, CODEBOOK = 768, 64  # discrete image / audio codes that live in the text vocabulary: [768, 768 + 64k)
WINDOW = 8  # sliding windows and attention chunks: a 20-token prompt is already past them

# integer config fields set to a tiny value wherever they appear (text, vision, audio sub-configs)
SIZES = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_heads": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "projection_dim": 64,
    "vision_output_dim": 64, "out_hidden_size": 64, "text_hidden_size": 64, "embed_dim": 64, "d_model": 64,
    "hidden_size_per_layer_input": 16, "index_n_heads": 4, "mm_embed_dim": 64, "output_proj_dims": 64,
    "linear_num_heads": 4, "linear_head_dim": 16, "mlp_dim": 128,
}
WIDTHS = ("hidden_size", "text_hidden_size", "out_hidden_size", "embed_dim", "d_model", "projection_dim", "vision_output_dim")
DEPTHS = ("depth", "num_layers")  # vision towers' layer counts
# multi-head latent attention dimensions, divided by one factor (`_shrink_mla`) that brings the rotary
# part to MLA_ROPE_DIM (or v_head_dim to twice that)
MLA_DIMS = ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim", "v_head_dim", "kv_lora_rank",
            "q_lora_rank", "index_head_dim")
MLA_ROPE_DIM = 8
# families whose modelling code splits M-RoPE by sections their default config leaves out
# (proportions: their real checkpoints' [16, 24, 24])
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "glm4v", "glm46v", "glm4v_moe", "glm_ocr", "glmga", "paddleocr_vl")
MROPE_PROPORTIONS = (2, 3, 3)
# the decoder layers a tiny build keeps, where the default config has fewer kinds than the real models
LAYER_KINDS = {"lfm2_vl": ("conv", "full_attention")}


class NotBuildable(Exception):
    """A family this machine cannot build a tiny model of (the message says why)."""


def families() -> list[str]:
    """Every image-text-to-text family (config model_type) of the installed transformers, sorted."""
    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _kept_layers(layer_types: list[str] | None, n: int, overrides: dict[int, dict[str, Any]] | None = None) -> list[int]:
    """Indices of the decoder layers to keep: the first of each kind (at least two layers). A layer's kind
    is its layer type and, in a heterogeneous config, which attributes its per-layer overrides set."""
    overrides = overrides or {}
    if (layer_types is None or len(layer_types) != n) and not overrides:
        return list(range(min(2, n)))
    types = layer_types if layer_types is not None and len(layer_types) == n else [None] * n
    first: dict[Any, int] = {}
    for i, kind in enumerate(types):
        first.setdefault((kind, frozenset(overrides.get(i, {}))), i)
    keep = sorted(first.values())
    if len(keep) < 2 and n >= 2:
        keep = sorted({*keep, next(i for i in range(n) if i not in keep)})
    return keep


def _shrink_mrope(config: Any, family: str) -> None:
    """M-RoPE sections summing to the rotary half-dimension (head_dim x partial_rotary_factor / 2);
    families whose models read sections the default config leaves out get them set (their modelling
    code has its own full-size default)."""
    for field in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, field, None)
        if not isinstance(rope, dict):
            continue
        section = rope.get("mrope_section")
        if not isinstance(section, list):
            if family not in MROPE_FAMILIES or field != "rope_parameters":
                continue
            section = list(MROPE_PROPORTIONS)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        half = int(head_dim * rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)) // 2
        new = [max(1, round(x * half / sum(section))) for x in section]
        new[-1] += half - sum(new)
        rope["mrope_section"] = new


def _fit_vision_taps(config: Any) -> None:
    """Vision towers whose projector width depends on their own layer taps (Mllama: hidden x (1 + taps);
    Llama 4: the pixel-shuffle MLP maps hidden / ratio^2 to the projector)."""
    if isinstance(getattr(config, "intermediate_layers_indices", None), list) and isinstance(getattr(config, "vision_output_dim", None), int):
        config.intermediate_layers_indices = list(range(config.num_hidden_layers))
        config.vision_output_dim = config.hidden_size * (1 + len(config.intermediate_layers_indices))
        if isinstance(getattr(config, "num_global_layers", None), int):
            config.num_global_layers = 2
    if isinstance(getattr(config, "pixel_shuffle_ratio", None), float) and isinstance(getattr(config, "projector_input_dim", None), int):
        config.intermediate_size = int(config.hidden_size / config.pixel_shuffle_ratio**2)
        config.projector_input_dim = config.projector_output_dim = config.vision_output_dim = config.hidden_size


def _ints(config: Any) -> dict[str, int]:
    return {k: v for k, v in vars(config).items() if isinstance(v, int) and not isinstance(v, bool)}


def _shrink_mla(config: Any, before: dict[str, int]) -> None:
    """Multi-head latent attention (DeepSeek-V3 style: a kv_lora_rank): every head and rank dimension is
    divided by one factor, so that the relations between them (head_dim == qk_rope_head_dim,
    qk_head_dim == nope + rope, a partial rotary factor, the indexer's head) still hold."""
    if not isinstance(before.get("kv_lora_rank"), int):
        return
    factors = [before.get("qk_rope_head_dim", 0) / MLA_ROPE_DIM, before.get("v_head_dim", 0) / (2 * MLA_ROPE_DIM)]
    factor = max(1.0, min((f for f in factors if f > 0), default=1.0))
    for key in MLA_DIMS:
        if isinstance(before.get(key), int) and before[key] > 0:
            setattr(config, key, max(1, round(before[key] / factor)))


def _shrink_conv_autoencoder(config: Any) -> None:
    """VQ / VAE image tokenizers (base_channels x channel_multiplier conv stages): 32 base channels (their
    GroupNorms use 32 groups), multipliers capped at 2 with the same number of stages (so the same
    downsampling), one residual block per stage."""
    config.base_channels = 32
    config.channel_multiplier = type(config.channel_multiplier)(min(2, m) for m in config.channel_multiplier)
    if isinstance(getattr(config, "num_res_blocks", None), int):
        config.num_res_blocks = 1
    if isinstance(getattr(config, "latent_channels", None), int) and config.latent_channels > 32:
        config.latent_channels = 32


def _fit_codebooks(config: Any) -> None:
    """Discrete image / audio codes embedded in the text vocabulary at ``<modality>_token_offset`` (Apertus
    1.5): each modality's codebook shrinks to CODEBOOK codes, laid out one after another from CODE_ZONE,
    below the special-token zone."""
    start = CODE_ZONE
    for _, key in sorted((v, k) for k, v in vars(config).items() if k.endswith("_token_offset") and isinstance(v, int)):
        modality = key.removesuffix("_token_offset")
        sub = getattr(config, "vision_config" if modality == "image" else f"{modality}_config", None)
        if isinstance(getattr(sub, "codebook_size", None), int):
            sub.codebook_size = CODEBOOK
            setattr(config, key, start)
            start += CODEBOOK


def _fit_feature_layers(config: Any) -> None:
    """Vision-feature taps (``vision_feature_layer``: an index or a list of them into the tower's hidden
    states) clamped into the shrunk tower's range, as many taps as before (the projector's width counts them)."""
    depth = getattr(getattr(config, "vision_config", None), "num_hidden_layers", None)
    if not isinstance(depth, int):
        return

    def clamp(i: int) -> int:
        return max(i, -(depth + 1)) if i < 0 else min(i, depth)

    for cfg in [config] + [getattr(config, name, None) for name in getattr(config, "sub_configs", {})]:
        value = getattr(cfg, "vision_feature_layer", None) if cfg is not None else None
        if isinstance(value, int) and not isinstance(value, bool):
            cfg.vision_feature_layer = clamp(value)
        elif isinstance(value, (list, tuple)) and all(isinstance(i, int) for i in value):
            cfg.vision_feature_layer = type(value)(clamp(i) for i in value)


def _scaled_override(value: Any, old: Any, new: Any) -> Any:
    """A per-layer override of an attribute the shrink changed (global old -> new): the same ratio to the
    new global, kept within [new / 2, 2 * new] (so an expert count stays >= experts per token)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (value, old, new)) or old == new or old <= 0:
        return value
    return min(2 * new, max(-(-new // 2), round(new * value / old)))


def _widths(config: Any) -> set[int]:
    """The hidden widths (original) of `config` and its sub-configs: a field of another name that holds one of
    them (a projector's input or output width) is shrunk with them."""
    out = {v for k, v in _ints(config).items() if k in WIDTHS and v >= 256}
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out |= _widths(sub)
    return out


def shrink(config: Any, family: str = "", widths: set[int] | None = None) -> Any:
    """Shrink `config` and its sub-configs in place (see the module docstring); returns it.

    A heterogeneous config (transformers' `per_layer_config`: layers overriding e.g. head_dim or the head
    count) is shrunk as a homogeneous one; the kept layers then get their overrides back, scaled like
    their global values (`_scaled_override`), so the tiny build stays heterogeneous."""
    if getattr(config, "model_type", None) == "timm_wrapper":  # a timm tower keeps its real feature width
        return config
    widths = _widths(config) if widths is None else widths
    spec = config.__dict__.pop("_heterogeneity_spec", None)
    overrides = dict(spec.per_layer_overrides) if spec is not None else {}
    before = _ints(config)
    n = getattr(config, "num_hidden_layers", None)
    if family in LAYER_KINDS and isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = list(LAYER_KINDS[family]) + config.layer_types[len(LAYER_KINDS[family]):]
        n = config.num_hidden_layers = len(config.layer_types)
    for key, value in SIZES.items():
        current = getattr(config, key, None)
        if isinstance(current, int) and not isinstance(current, bool):
            setattr(config, key, value)
    if "head_dim" in vars(config) and config.head_dim is None and isinstance(getattr(config, "num_attention_heads", None), int):
        config.head_dim = SIZES["head_dim"]  # what hidden // heads gives; some modelling code reads it unguarded
    for key, value in before.items():
        if key in SIZES or value < 256:
            continue
        if key.endswith("intermediate_size"):  # shared_experts_intermediate_size, ... (not spelled as in SIZES)
            setattr(config, key, SIZES["moe_intermediate_size"] if "expert" in key or "moe" in key else SIZES["intermediate_size"])
        elif value in widths and (key.endswith("_dim") or "hidden_size" in key):  # a width copied from a tower
            setattr(config, key, SIZES["hidden_size"])
    heads, kv_heads = before.get("num_attention_heads"), before.get("num_key_value_heads")
    if isinstance(kv_heads, int) and kv_heads in (1, heads):  # multi-query and multi-head attention stay so
        config.num_key_value_heads = 1 if kv_heads == 1 else config.num_attention_heads
    for key, value in before.items():  # per-layer-input embeddings (Gemma 3n, Gemma 4) and the like
        if key.startswith("vocab_size") and value > VOCAB:
            setattr(config, key, VOCAB)
    _shrink_mla(config, before)
    if isinstance(before.get("base_channels"), int) and isinstance(getattr(config, "channel_multiplier", None), (list, tuple)):
        _shrink_conv_autoencoder(config)
    if isinstance(getattr(config, "num_kv_shared_layers", None), int):  # layers reading an earlier layer's cache
        config.num_kv_shared_layers = 0  # (Gemma 3n): two kept layers leave no earlier layer of their kind to share
    if isinstance(getattr(config, "sliding_window", None), int):
        config.sliding_window = WINDOW
    if isinstance(getattr(config, "attention_chunk_size", None), int):
        config.attention_chunk_size = WINDOW
    if isinstance(n, int):
        marked = {k: v for k, v in vars(config).items() if k.endswith(("_indexes", "_indices")) and not k.startswith("intermediate")
                  and isinstance(v, (list, tuple)) and v and all(isinstance(i, int) and 0 <= i < n for i in v)}
        kinds = getattr(config, "layer_types", None)
        if kinds is None and marked:  # layers named by index (SAM's global_attn_indexes) are a kind of their own
            kinds = [tuple(k for k, v in marked.items() if i in v) for i in range(n)]
        keep = _kept_layers(kinds, n, overrides)
        for key, value in marked.items():
            setattr(config, key, type(value)(j for j, i in enumerate(keep) if i in value))
        for key, value in list(vars(config).items()):  # every per-layer list keeps the same layers
            if isinstance(value, (list, tuple)) and len(value) == n and key != "architectures":
                setattr(config, key, type(value)(value[i] for i in keep))
        config.num_hidden_layers = len(keep)
        if overrides:
            after = _ints(config)
            config.per_layer_config = {
                j: {k: _scaled_override(v, before.get(k), after.get(k)) for k, v in overrides[i].items()}
                for j, i in enumerate(keep) if i in overrides
            }
    for key in DEPTHS:
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, 2)
    _shrink_mrope(config, family)
    _fit_vision_taps(config)
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            shrink(sub, family, widths)
    if isinstance(getattr(config, "vocab_size", None), int) and config.vocab_size > VOCAB:
        config.vocab_size = VOCAB
    _fit_codebooks(config)
    _fit_feature_layers(config)
    return config


def remap_special_ids(config: Any, moved: dict[int, int] | None = None) -> dict[int, int]:
    """Move every special-token id (fields named *_token_id, *_token_index, *_token_ids) that would fall
    outside the tiny vocabulary into its top zone, the same old id to the same new one across
    sub-configs. Returns {old id: new id}."""
    moved = {} if moved is None else moved

    def new_id(old: int) -> int:
        if old < VOCAB - SPECIAL_ZONE:
            return old
        if old not in moved:
            moved[old] = VOCAB - 1 - len(moved)
            assert len(moved) <= SPECIAL_ZONE
        return moved[old]

    for key, value in list(vars(config).items()):
        if not key.endswith(("token_id", "token_index", "token_ids")):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(config, key, new_id(value))
        elif isinstance(value, list) and all(isinstance(v, int) for v in value):
            setattr(config, key, [new_id(v) for v in value])
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            remap_special_ids(sub, moved)
    return moved


def tiny_config(family: str) -> Any:
    """The family's default config, shrunk, special ids inside the vocabulary (NotBuildable if it has none)."""
    if family not in CONFIG_MAPPING:
        raise NotBuildable(f"transformers has no config class for {family!r}")
    try:
        config = CONFIG_MAPPING[family]()
        if getattr(config, "vision_config", False) is None and "vision_config" in getattr(config, "sub_configs", {}):
            config.vision_config = config.sub_configs["vision_config"]()  # a text-only default (Gemma 4): add the tower
        shrink(config, family)
        remap_special_ids(config)
    except Exception as exc:  # noqa: BLE001  (a family's own config code raises any type; the row records it)
        raise NotBuildable(f"its default config does not shrink: {type(exc).__name__}: {first_line(exc)}") from exc
    if getattr(config, "is_encoder_decoder", False):
        raise NotBuildable("encoder-decoder (not a decoder-only chat model)")
    return config


def build_family(family: str, config: Any | None = None, seed: int = 0) -> torch.nn.Module:
    """A random-weight model of `family` (fp32, eval, SDPA where the family has it, else eager)."""
    config = copy.deepcopy(config) if config is not None else tiny_config(family)
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float32)
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(seed)
            try:
                model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
            except ValueError as exc:
                if "sdpa" not in str(exc).lower() and "scaled_dot_product" not in str(exc).lower():
                    raise
                model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="eager")
    except Exception as exc:  # noqa: BLE001  (as above: the family's modelling code, not vlmspec)
        raise NotBuildable(f"the shrunk config does not build: {type(exc).__name__}: {first_line(exc)}") from exc
    finally:
        torch.set_default_dtype(prev)
    if not hasattr(model, "generate"):
        raise NotBuildable(f"{type(model).__name__} has no generate (not a text generator)")
    return model.eval()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:160]


__all__ = ["NotBuildable", "VOCAB", "WINDOW", "build_family", "families", "first_line", "remap_special_ids", "shrink", "tiny_config"]
