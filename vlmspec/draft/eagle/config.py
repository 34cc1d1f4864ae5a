"""The drafter's config and its files: `EagleConfig` (a `PretrainedConfig`, registered with
`AutoConfig` as model_type "vlmspec_eagle"), reading config.json in either format (the Hugging Face
one, or the first format, {"drafter": "eagle", ...}, converted in memory), resolving a folder or a
hub id to a local folder, the target a drafter records it was trained for (`trained_for`), and the
checks against a target."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import field, fields
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, LlamaConfig, PretrainedConfig

from vlmspec import assets
from vlmspec.errors import DrafterLoadError
from vlmspec.draft.base import TreeConfig
from vlmspec.target import Target
from vlmspec.vision_compress import VisualConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_TYPE = "vlmspec_eagle"
LEGACY_KEY = "drafter"  # the first format's marker: {"drafter": "eagle", <EagleConfig fields>}
ARCHS = ("eagle1", "eagle3")  # EagleConfig.arch


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's (and vLLM's, and `speculators`') default low / middle / high layers of a target with
    `num_layers` decoder layers: [2, n // 2, n - 3]. Layer id i is the hidden state decoder layer i
    reads (HF `hidden_states[i]`; 0 is the embedding output), as vLLM collects its auxiliary hidden
    states. A target too shallow for three distinct ids there (n < 7, the tiny test models) gets
    [0, n // 2, n - 1] without repeats ([0, 1] for two layers)."""
    assert num_layers >= 1, num_layers
    ids = [2, num_layers // 2, num_layers - 3]
    if ids[0] < ids[1] < ids[2] < num_layers:
        return ids
    return sorted({0, num_layers // 2, num_layers - 1})


def target_depth(target: Target) -> int:
    """The target language model's decoder layers."""
    return int(getattr(target.text_config, "num_hidden_layers"))

logger = logging.getLogger("vlmspec.draft")


# ------------------------------------------------------------------------- the target a drafter was trained for
def target_fields(target: Target) -> dict[str, Any]:
    """The fields of a target's config a head depends on: its family, the width and vocabulary it
    reads and writes, the layers it can read, where positions end, and an image's tokens."""
    tc = target.text_config
    try:
        layers = getattr(tc, "num_hidden_layers", None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError (per-layer configs)
        layers = None
    return {"model_type": str(getattr(target.model.config, "model_type", "")), "hidden_size": int(tc.hidden_size),
            "vocab_size": int(tc.vocab_size), "num_hidden_layers": layers, "max_position_embeddings": target.max_positions,
            "rope_theta": _rope_theta(tc), "image_tokens": target.image_tokens}


def fields_digest(fields: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def target_record(target: Target) -> dict[str, Any]:
    """What a head's config records of the target it is made for (`EagleConfig.trained_for`): the
    name `--model` takes ('toy', the default model's name, a folder's name or the hub id:
    `assets.model_name`), the folder's absolute path where it is another folder (a hint for this
    machine), the digest of its `target_fields`, and the fields (so that a mismatch says which)."""
    fields = target_fields(target)
    name = assets.model_name(target.name)
    folder = Path(target.name)
    path = str(folder.resolve()) if folder.is_dir() and name not in assets.KNOWN_MODELS else ""
    return {"model": name, "path": path, "digest": fields_digest(fields), "fields": fields}


def recorded_target(folder: Path) -> dict[str, Any] | None:
    """The target a drafter folder's config.json names, read without loading anything: vlmspec's
    `trained_for`, or a speculators drafter's verifier; None for a drafter written before drafters
    recorded their target, or a config.json that is not one (loading it says what is wrong)."""
    try:
        raw = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    record = raw.get("trained_for") if raw.get("model_type") == MODEL_TYPE else None
    if isinstance(record, dict) and isinstance(record.get("model"), str) and record["model"]:
        return record
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") if "speculators_model_type" in raw else None
    if isinstance(verifier, str) and verifier:
        local = Path(verifier).is_dir()
        return {"model": assets.model_name(verifier), "path": str(Path(verifier).resolve()) if local else ""}
    return None


def _rope_theta(text_config: Any) -> float:
    rp = getattr(text_config, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(text_config, "rope_theta", None))
    return float(theta) if theta is not None else 10000.0


class EagleConfig(PretrainedConfig):
    """The head's shape, the target it was trained for, and its variant settings (`extra`).

    A `PretrainedConfig`: `save_pretrained(dir)` writes config.json, `from_pretrained(dir or hub id)`
    reads it, and `AutoConfig` knows model_type "vlmspec_eagle".
    """

    model_type = MODEL_TYPE

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    target_model_type: str = ""
    draft_vocab_size: int = 0  # K > 0: the head predicts over K target tokens only (`d2t` in the weights); 0: all
    acceptance_head: bool = False  # SpecDec++: an acceptance-prediction head in the weights (`accept.*`)
    stop_threshold: float = 0.0  # stop deepening when no path's predicted acceptance reaches it (0: never; chosen on validation)
    extra: dict[str, Any] = field(default_factory=dict)  # variant settings: {"visual": VisualConfig dict}
    # measured best tree per device type, {"cpu": [depth, top_k, total_tokens]} (`python -m recipes trees`;
    # the card says how); a device without an entry gets `TreeConfig.for_device`
    tree_defaults: dict[str, list[int]] = field(default_factory=dict)
    # "eagle1": fc over [embedding, the target's last hidden state], the target's LM head (`EagleHead`);
    # "eagle3": the hidden states of the target's `feature_layers` fused by fc, embedding and fused state
    # normed apart into the decoder layer, a final norm and its own LM head (`Eagle3Head`)
    arch: str = "eagle1"
    feature_layers: list[int] = field(default_factory=list)  # eagle3: the target layers it reads (ids as `default_feature_layers`)
    norm_before_residual: bool = False  # eagle3: the residual of its layer is the normed fused state (else the fused state)
    # the target it was made for (`target_record`): {"model", "path", "digest", "fields"}; {} in drafters
    # written before drafters recorded it. The CLI's default --model with this drafter; a target of another digest is refused
    trained_for: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self, **kwargs: Any) -> None:
        for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.rope_theta, self.rms_norm_eps = float(self.rope_theta), float(self.rms_norm_eps)
        k = self.draft_vocab_size
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be an integer in 0..vocab_size ({self.vocab_size}), got {k!r}")
        self.stop_threshold = float(self.stop_threshold)
        if not isinstance(self.acceptance_head, bool) or not 0.0 <= self.stop_threshold < 1.0:
            raise ValueError(f"acceptance_head must be a bool and stop_threshold in [0, 1), got {self.acceptance_head!r}, {self.stop_threshold!r}")
        if self.stop_threshold > 0 and not self.acceptance_head:
            raise ValueError("stop_threshold needs acceptance_head (the stop rule reads its predictions)")
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a JSON object, got {self.extra!r}")
        if not isinstance(self.trained_for, dict):
            raise ValueError(f"trained_for must be a JSON object, got {self.trained_for!r}")
        if not isinstance(self.tree_defaults, dict):
            raise ValueError(f"tree_defaults must be a JSON object, got {self.tree_defaults!r}")
        for device, shape in self.tree_defaults.items():
            ok = isinstance(shape, (list, tuple)) and len(shape) == 3 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape)
            if device not in ("cpu", "cuda") or not ok:
                raise ValueError(f"tree_defaults maps 'cpu' / 'cuda' to [depth, top_k, total_tokens] (positive integers), got {device!r}: {shape!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        self.feature_layers = list(self.feature_layers)
        if self.arch == "eagle3":
            # (two or more: the head tells the target's features [mH] from its own outputs [H] by their width, as vLLM does)
            if len(self.feature_layers) < 2 or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.feature_layers):
                raise ValueError(f"an eagle3 head reads two or more target layers (feature_layers, ids >= 0), got {self.feature_layers!r}")
            if self.extra.get("visual"):
                raise ValueError("the VLM-aware variants (extra.visual) are EAGLE-1 heads: train eagle3 with --visual none")
        elif self.feature_layers or self.norm_before_residual:
            raise ValueError("feature_layers and norm_before_residual are eagle3 settings (arch is eagle1)")
        super().__post_init__(**kwargs)

    @property
    def feature_width(self) -> int:
        """The width of the target features the head reads: H (eagle1: the last hidden state) or
        len(feature_layers) x H (eagle3: the chosen layers' hidden states, concatenated)."""
        return self.hidden_size * max(1, len(self.feature_layers))

    @property
    def visual(self) -> VisualConfig:
        return VisualConfig.from_dict(self.extra.get("visual"))

    def default_tree(self, device: str | torch.device) -> TreeConfig | None:
        """The tree measured best for this drafter on `device`'s type; None when none was recorded."""
        shape = self.tree_defaults.get(torch.device(device).type)
        return None if shape is None else TreeConfig(*shape)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The head's own settings (what the first, plain-JSON format held)."""
        own = {f.name for f in fields(PretrainedConfig)}
        return tuple(f.name for f in fields(cls) if f.name not in own)

    @classmethod
    def from_legacy_dict(cls, raw: dict[str, Any]) -> "EagleConfig":
        """The first format: {"drafter": "eagle", <the fields above>}."""
        raw = dict(raw)
        kind = raw.pop(LEGACY_KEY, None)
        unknown = sorted(set(raw) - set(cls.field_names()))
        if kind != "eagle" or unknown:
            raise ValueError(f"drafter kind {kind!r}, unknown keys {unknown[:5]}")
        return cls(**raw)

    @classmethod
    def from_target(cls, target: Target, arch: str = "eagle1", layers: tuple[int, ...] = ()) -> "EagleConfig":
        """A head of `arch` sized for `target` (eagle3: reading `layers`, () = EAGLE-3's defaults, `default_feature_layers`)."""
        tc = target.text_config

        def attr(name: str) -> Any:
            """The text config's field; where its layers differ in it (Gemma 4's per-layer configs,
            Gemma 3n's per-layer lists), the first layer's."""
            try:
                value = getattr(tc, name, None)
            except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
                value = getattr(tc.per_layer_config[0], name, None)
            return value[0] if isinstance(value, (list, tuple)) else value

        heads = int(attr("num_attention_heads"))
        ffn = attr("intermediate_size") or attr("moe_intermediate_size")  # MoE decoders: the expert's
        return cls(
            hidden_size=int(tc.hidden_size),
            vocab_size=int(tc.vocab_size),
            num_attention_heads=heads,
            num_key_value_heads=int(attr("num_key_value_heads") or heads),
            head_dim=int(attr("head_dim") or tc.hidden_size // heads),
            intermediate_size=int(ffn or 4 * tc.hidden_size),
            max_position_embeddings=target.max_positions,
            rope_theta=_rope_theta(tc),
            rms_norm_eps=float(attr("rms_norm_eps") or 1e-6),
            target_model_type=str(getattr(target.model.config, "model_type", "")),
            arch=arch,
            feature_layers=(list(layers) or default_feature_layers(target_depth(target))) if arch == "eagle3" else [],
            trained_for=target_record(target),
        )

    def llama_config(self, attn_implementation: str = "sdpa") -> LlamaConfig:
        cfg = LlamaConfig(
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            num_hidden_layers=1,
        )
        cfg._attn_implementation = attn_implementation
        return cfg

    def check_against(self, target: Target) -> None:
        """Refuse a head trained for another target (a silent mismatch destroys acceptance)."""
        want = EagleConfig.from_target(target)
        problems = [
            f"{name}: drafter {getattr(self, name)} != target {getattr(want, name)}"
            for name in ("hidden_size", "vocab_size", "max_position_embeddings", "rope_theta")
            if getattr(self, name) != getattr(want, name)
        ]
        depth = target_depth(target)
        beyond = [i for i in self.feature_layers if i >= depth]
        if beyond:
            problems.append(f"feature_layers: drafter reads layers {beyond}, beyond this target's {depth} layers (ids 0..{depth - 1})")
        vis = self.visual
        if vis.sized_for(target.image_tokens) != vis:  # its resampler has fewer queries than one image needs
            problems.append(f"its resampler reads images of up to {vis.max_queries * vis.ratio:g} tokens at {vis.ratio:g}x "
                            f"and this target's take {target.image_tokens}")
        record, given = self.trained_for, want.trained_for
        if record.get("digest") and record["digest"] != given["digest"]:  # fields the checks above do not read, too
            problems += [f"{k}: drafter's target {v!r} != target {given['fields'].get(k)!r}" for k, v in sorted(record.get("fields", {}).items())
                         if v != given["fields"].get(k) and k not in ("hidden_size", "vocab_size", "max_position_embeddings", "rope_theta")]
            problems = problems or [f"config digest: drafter's target {record['digest']} != target {given['digest']}"]
        if problems and record.get("model"):
            raise DrafterLoadError(
                f"this drafter was trained for a different target: for {record['model']}, and the model given is {given['model']} ("
                + "; ".join(problems) + f"). Leave --model out (a drafter's own target is the default) or pass --model {record['model']}, "
                f"or train a drafter for {given['model']} with `vlmspec train`."
            )
        if problems:
            raise DrafterLoadError(
                "this drafter was trained for a different target (" + "; ".join(problems) + "). "
                "Train one for this target with `vlmspec train`, or pass the matching --model."
            )


AutoConfig.register(MODEL_TYPE, EagleConfig, exist_ok=True)  # AutoConfig.from_pretrained(drafter) works too


def _read_config(folder: Path) -> EagleConfig:
    """config.json in the Hugging Face format, or the first format (converted in memory, with a warning)."""
    path = folder / CONFIG_NAME
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        if raw.get("model_type") == MODEL_TYPE:
            return EagleConfig.from_pretrained(str(folder), local_files_only=True)
        if LEGACY_KEY not in raw:
            raise ValueError(f'neither model_type "{MODEL_TYPE}" nor "{LEGACY_KEY}": "eagle"')
        config = EagleConfig.from_legacy_dict(raw)
    except (OSError, ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise DrafterLoadError(f"{path}: not a valid EAGLE drafter config ({exc})") from exc
    logger.warning("%s is in the first drafter format (\"drafter\": \"eagle\"); converted in memory. "
                   "Re-save it as a Hugging Face artefact with `vlmspec.draft.eagle.EagleDrafter.save`.", path)
    return config


def looks_like_hub_id(spec: str) -> bool:
    """"org/name" with the hub's characters (a drafter repo always has an owner)."""
    parts = spec.split("/")
    ok = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
    return len(parts) == 2 and all(p and set(p) <= ok and not p.startswith(".") for p in parts)


def _checkpoint_folder(spec: str) -> Path:
    """A local folder for `spec`: the folder itself, or a hub id's snapshot in the local HF cache."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if not looks_like_hub_id(spec):
        raise DrafterLoadError(f"drafter {spec!r} is neither a drafter folder nor a hub id (org/name)")
    from huggingface_hub import snapshot_download

    from vlmspec.target import hub_reachable

    offline = not hub_reachable()
    try:
        local = snapshot_download(spec, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, "README.md"], local_files_only=offline)
    except (OSError, ValueError) as exc:  # hub errors are OSErrors (HTTP, not cached), id errors ValueErrors
        if offline:
            raise DrafterLoadError(f"drafter {spec!r} looks like a hub id, but the hub is unreachable from here (or "
                                   "HF_HUB_OFFLINE is set) and it is not in the local cache: pass a drafter folder, "
                                   f"or fetch it where the hub answers (`hf download {spec}`)") from None
        raise DrafterLoadError(f"cannot fetch drafter {spec!r} from the hub: {str(exc).splitlines()[0]}") from exc
    return Path(local)
