#!/usr/bin/env python
"""Verify a folder written by assemble.py, fully offline.

  python check.py DIR [--skip-timing] [--timing-only] [--json results.json]

(a) AutoModelForImageTextToText + AutoProcessor load DIR (HF_HUB_OFFLINE=1, sockets blocked)
(b) text-only greedy generate == SmolLM2 loaded directly from the GGUF (3 prompts x 32 new tokens)
(c) an image prompt runs (384 px -> 144 <image> tokens; also 768 px -> 576 via a size override)
(d) EfficientNet-Lite0 classification sanity check (.pth mapped onto timm; and the tower saved in DIR)
(e) CPU timings with torch.set_num_threads(2): decode step, prefill w/ 144 image tokens, generate tok/s
"""
import argparse
import glob
import json
import os
import socket
import statistics
import sys
import time

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


# Hard guarantee that nothing is fetched: any attempt to open a network connection raises.
class _NoNet(RuntimeError):
    pass


def _blocked(*a, **k):
    raise _NoNet(f"network access attempted: {a[1:] if len(a) > 1 else a}")


socket.socket.connect = _blocked
socket.socket.connect_ex = _blocked
socket.create_connection = _blocked

import torch  # noqa: E402

torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from assemble import (  # noqa: E402
    IMAGENET_MEAN, IMAGENET_STD, LM_DIST, LM_FILE, TIMM_ARCH, VIS_DIST, VIS_FILE, locate, lukemelas_to_timm,
)

IMAGES = "/work/main/assets/images"
PROMPTS = [
    "Tell me about the history of Paris.",
    "Write a short poem about the sea.",
    "Explain in simple words what a CPU does.",
]
RESULTS = {}


def log(*a):
    print(*a, flush=True)


def load_folder(d):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    t = time.time()
    model, info = AutoModelForImageTextToText.from_pretrained(d, dtype="auto", output_loading_info=True)
    model.eval()
    processor = AutoProcessor.from_pretrained(d)
    dt = time.time() - t
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} | ({"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
    log(f"(a) loaded {type(model).__name__} dtype={model.dtype} + {type(processor).__name__}"
        f"/{type(processor.image_processor).__name__}/{type(processor.tokenizer).__name__} in {dt:.1f}s; "
        f"loading_info problems: {bad or 'none'}")
    assert type(model).__name__ == "FastVlmForConditionalGeneration"
    assert type(processor).__name__ == "LlavaProcessor"
    assert not bad, bad
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    RESULTS["a"] = {"load_s": round(dt, 1), "dtype": str(model.dtype), "ok": True}
    return model, processor


def check_text(model, processor):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, gguf = locate(LM_DIST, LM_FILE)
    gd, gn = os.path.dirname(gguf), os.path.basename(gguf)
    t = time.time()
    ref_tok = AutoTokenizer.from_pretrained(gd, gguf_file=gn)
    # load straight in the folder's dtype: `.to(torch.bfloat16)` after loading would also cast the RoPE
    # inv_freq buffer to bf16 (from_pretrained keeps it fp32) and shift logits by up to ~1.8
    ref = AutoModelForCausalLM.from_pretrained(gd, gguf_file=gn, dtype=model.dtype).eval()
    log(f"(b) reference SmolLM2 from GGUF loaded in {time.time() - t:.1f}s (dtype {ref.dtype})")
    img_id = model.config.image_token_id
    out = []
    for p in PROMPTS:
        ref_ids = ref_tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
        conv = [{"role": "user", "content": [{"type": "text", "text": p}]}]
        inp = processor.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True,
                                            return_tensors="pt")
        assert torch.equal(ref_ids, inp["input_ids"]), "prompt token ids differ"
        n = ref_ids.shape[1]
        with torch.no_grad():
            g_ref = ref.generate(ref_ids, attention_mask=torch.ones_like(ref_ids), max_new_tokens=32, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            g_vlm = model.generate(**inp, max_new_tokens=32, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True)
        a, b = g_ref.sequences[0, n:].tolist(), g_vlm.sequences[0, n:].tolist()
        # logits comparison on the shared vocab + how far the <image> logit (== 0) is below the argmax
        max_diff = max(float((sr[0] - sv[0, :sr.shape[-1]]).abs().max()) for sr, sv in zip(g_ref.scores, g_vlm.scores))
        margin = min(float(sv[0].max() - sv[0, img_id]) for sv in g_vlm.scores)
        same = a == b
        out.append({"prompt": p, "n_new": len(b), "identical": same, "max_logit_diff": max_diff,
                    "min_margin_argmax_minus_image_logit": round(margin, 2),
                    "text": processor.tokenizer.decode(b, skip_special_tokens=True)})
        log(f"    {'SAME' if same else 'DIFF'} {len(a)}/{len(b)} tokens, max|dlogit|={max_diff:.2e}, "
            f"image-logit margin>={margin:.1f}: {out[-1]['text']!r}")
    RESULTS["b"] = out
    assert all(o["identical"] for o in out), "text-only greedy output differs from SmolLM2"
    del ref


def check_image(model, processor):
    from PIL import Image

    img = Image.open(os.path.join(IMAGES, "cat.jpg")).convert("RGB")
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this image?"}]}]
    prompt = processor.apply_chat_template(conv, add_generation_prompt=True)
    res = {}
    for size in (None, 768):
        kw = {} if size is None else {"size": {"height": size, "width": size}, "crop_size": {"height": size, "width": size}}
        inp = processor(images=img, text=prompt, return_tensors="pt", **kw)
        n_img = int((inp["input_ids"] == model.config.image_token_id).sum())
        t = time.time()
        with torch.no_grad():
            g = model.generate(**inp, max_new_tokens=16 if size else 32, do_sample=False)
        txt = processor.decode(g[0, inp["input_ids"].shape[1]:], skip_special_tokens=True)
        key = f"{tuple(inp['pixel_values'].shape[-2:])}"
        res[key] = {"image_tokens": n_img, "prompt_len": inp["input_ids"].shape[1], "s": round(time.time() - t, 1), "text": txt}
        log(f"(c) pixel_values {tuple(inp['pixel_values'].shape)} -> {n_img} <image> tokens, prompt {inp['input_ids'].shape[1]} "
            f"tokens, generate {time.time() - t:.1f}s: {txt!r}")
        assert n_img == (inp["pixel_values"].shape[-1] // 32) ** 2
    log("    prompt text:", repr(prompt))
    RESULTS["c"] = res


def check_classify(model):
    import timm
    from PIL import Image
    from timm.data import ImageNetInfo, create_transform, resolve_data_config

    _, pth = locate(VIS_DIST, VIS_FILE)
    src = torch.load(pth, map_location="cpu", weights_only=True)
    ref = timm.create_model(TIMM_ARCH, pretrained=False).eval()
    ref.load_state_dict(lukemelas_to_timm(src, ref.state_dict()))
    cfg = resolve_data_config({"mean": tuple(IMAGENET_MEAN), "std": tuple(IMAGENET_STD)}, model=ref)
    tf = create_transform(**cfg)
    info = ImageNetInfo()
    tower = model.model.vision_tower
    W, B = ref.classifier.weight, ref.classifier.bias
    res = {}
    for name in ("cat.jpg", "coffee.jpg", "grace_hopper.jpg", "astronaut.jpg", "rocket.jpg"):
        x = tf(Image.open(os.path.join(IMAGES, name)).convert("RGB")).unsqueeze(0)
        with torch.no_grad():
            p = ref(x).softmax(-1)[0]
            feat = tower(x.to(model.dtype), return_dict=True).last_hidden_state.float()  # [1,1280,7,7] at 224
            p2 = (feat.mean((2, 3)) @ W.T + B).softmax(-1)[0]
            fdiff = float((feat - ref.forward_features(x)).abs().max())
        top = [(info.index_to_description(int(i)), round(float(v), 3)) for v, i in zip(*p.topk(3))]
        res[name] = {"timm_top3": top, "folder_tower_top1": info.index_to_description(int(p2.argmax())),
                     "folder_vs_timm_feature_maxdiff": fdiff}
        log(f"(d) {name:18s} timm+pth: {top}  | folder tower top1: {res[name]['folder_tower_top1']!r} "
            f"(feature max|diff| {fdiff:.2e})")
    assert res["cat.jpg"]["timm_top3"][0][0].startswith("tabby")
    assert res["coffee.jpg"]["timm_top3"][0][0] == "espresso"
    assert res["cat.jpg"]["folder_tower_top1"].startswith("tabby") and res["coffee.jpg"]["folder_tower_top1"] == "espresso"
    RESULTS["d"] = res


def timings(model, processor, threads=2, reps=20):
    from PIL import Image
    from transformers import DynamicCache

    torch.set_num_threads(threads)
    img = Image.open(os.path.join(IMAGES, "cat.jpg")).convert("RGB")
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image in detail."}]}]
    prompt = processor.apply_chat_template(conv, add_generation_prompt=True)
    inp = processor(images=img, text=prompt, return_tensors="pt")
    L = inp["input_ids"].shape[1]
    n_img = int((inp["input_ids"] == model.config.image_token_id).sum())

    def med(fn, n):
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts), min(ts)

    with torch.inference_mode():
        pv = inp["pixel_values"]  # the timm wrapper casts to its own dtype
        # vision tower + projector alone
        model.model.get_image_features(pixel_values=pv)  # warm-up
        vis_med, _ = med(lambda: model.model.get_image_features(pixel_values=pv), 3)
        # prefill: vision + projector + LM over L tokens (144 of them image tokens)
        def prefill():
            return model(**inp, use_cache=True, past_key_values=DynamicCache(config=model.config.text_config),
                         logits_to_keep=1)
        prefill()  # warm-up
        pre_med, pre_min = med(prefill, 3)
        # one-token decode step on top of the prefilled cache (cache cropped back each time)
        out = prefill()
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        am = torch.ones(1, L + 1, dtype=torch.long)

        def step():
            model(input_ids=nxt, attention_mask=am, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.crop(-1)  # v5: positive max_length is rejected; drop the token just added
        step()
        dec_med, dec_min = med(step, reps)
        # HF generate, exactly 64 new tokens
        gen_kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False)
        model.generate(**inp, max_new_tokens=4, do_sample=False)  # warm-up
        t = time.perf_counter()
        g = model.generate(**inp, **gen_kw)
        gen_s = time.perf_counter() - t
        assert g.shape[1] - L == 64
    r = {"threads": threads, "dtype": str(model.dtype),
         "vision_dtype": str(model.model.vision_tower.dtype), "prompt_tokens": L, "image_tokens": n_img,
         "vision+projector_ms": round(vis_med * 1e3, 1),
         "prefill_ms_median": round(pre_med * 1e3, 1), "prefill_ms_min": round(pre_min * 1e3, 1),
         "decode_step_ms_median": round(dec_med * 1e3, 2), "decode_step_ms_min": round(dec_min * 1e3, 2),
         "generate64_s": round(gen_s, 2), "generate64_tok_per_s": round(64 / gen_s, 2),
         "generate64_tok_per_s_excl_prefill": round(64 / max(gen_s - pre_med, 1e-9), 2)}
    log(f"(e) {json.dumps(r)}")
    RESULTS.setdefault("e", []).append(r)
    torch.set_num_threads(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--timing-only", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--threads", default="2", help="comma list of thread counts for the timing part, e.g. 2,1")
    ap.add_argument("--vision-fp32", action="store_true",
                    help="after loading, keep vision tower + projector in fp32 (bf16 convs are very slow on AVX2 CPUs)")
    args = ap.parse_args()
    model, processor = load_folder(args.dir)
    if args.vision_fp32:
        model.model.vision_tower.float()
        model.model.multi_modal_projector.float()
    if not args.timing_only:
        check_text(model, processor)
        check_image(model, processor)
        check_classify(model)
    if not args.skip_timing:
        for th in args.threads.split(","):
            timings(model, processor, threads=int(th))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=2)
    log("ALL CHECKS PASSED")


if __name__ == "__main__":
    main()
