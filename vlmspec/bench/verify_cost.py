"""Verify cost: ms per target forward over a tree of N nodes vs a one-token decode step.

    vlmspec bench verify-cost [--model DIR | --shape bundled|llava-7b] [--prefix 256] [--sizes 1,2,4,8,16,32,64]

Random weights are fine for costs (the arithmetic does not depend on the values). Trees are
chains (the mask pattern does not change the cost of the dense path). The ratio
tree forward / one-token forward is what sizes the draft tree per device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from vlmspec.target import Target
from vlmspec.tree import DraftTree
from vlmspec.target import load_target

SHAPES: dict[str, dict[str, int]] = {
    # the bundled target's text decoder (issue #3)
    "bundled": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, vocab_size=3001),
    # LLaVA-1.5-7B's language model (Vicuna-7B)
    "llava-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32064),
}


def synthetic_target(shape: str, device: str, dtype: torch.dtype, layers: int | None = None) -> Target:
    """A LLaVA-architecture model with the text decoder of `shape` and random weights."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = dict(SHAPES[shape])
    if layers:
        text["num_hidden_layers"] = layers
    vision = CLIPVisionConfig(image_size=32, patch_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    cfg = LlavaConfig(vision_config=vision, text_config=LlamaConfig(max_position_embeddings=8192, **text), image_token_index=0)
    with torch.device(device):
        model = LlavaForConditionalGeneration(cfg).to(dtype)
    model.config._attn_implementation = "sdpa"
    return Target(model, processor=None, name=f"synthetic-{shape}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_tree_forward(target: Target, prefix: int, n: int, repeats: int, warmup: int) -> float:
    """Median ms of one forward_tree over a chain of n nodes on a prefix of `prefix` tokens."""
    ids = torch.randint(1, target.vocab_size, (1, prefix), device=target.device)
    state, _ = target.prefill({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    tree = DraftTree.chain(1, [2] * (n - 1))
    times = []
    for i in range(warmup + repeats):
        _sync(target.device)
        t0 = time.perf_counter()
        target.forward_tree(state, tree)
        _sync(target.device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        state.cache.crop(prefix)  # drop the tree entries again
    return statistics.median(times)


def run(target: Target, prefix: int, sizes: list[int], repeats: int, warmup: int) -> list[dict[str, Any]]:
    rows = []
    base = None
    for n in sizes:
        ms = time_tree_forward(target, prefix, n, repeats, warmup)
        base = ms if base is None else base
        rows.append({"tree_tokens": n, "ms": ms, "ratio_vs_first": ms / base})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vlmspec bench verify-cost", description=__doc__.split("\n")[1])
    p.add_argument("--model", help="a model folder (default: a synthetic --shape with random weights)")
    p.add_argument("--shape", default="bundled", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="override the synthetic shape's layer count")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", dest="json_path")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    sizes = [int(s) for s in a.sizes.split(",")]
    torch.manual_seed(0)
    target = load_target(a.model, device=a.device, dtype=dtype) if a.model else synthetic_target(a.shape, a.device, dtype, a.layers)
    with torch.no_grad():
        rows = run(target, a.prefix, sizes, a.repeats, a.warmup)
    env = {"device": a.device, "dtype": str(dtype), "threads": torch.get_num_threads(), "torch": torch.__version__, "target": target.name, "prefix": a.prefix}
    print(f"verify cost on {target.name} ({a.device}, {dtype}, {env['threads']} threads), prefix {a.prefix}")
    print("| tree tokens | ms / forward | x one-token step |\n|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tree_tokens']} | {r['ms']:.2f} | {r['ratio_vs_first']:.2f} |")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=2)
    return 0
