"""Verify cost: ms per target forward over a tree of N nodes vs a one-token decode step.

    vlmspec bench verify-cost [--model DIR | --shape bundled|llava-7b] [--prefix 256] [--sizes 1,2,4,8,16,32,64]
                              [--draft-vocab 2048,4096,8192] [--rows 1,1,1,1,1,1,5,5]

Random weights are fine for costs (the arithmetic does not depend on the values). Trees are
chains (the mask pattern does not change the cost of the dense path). The ratio
tree forward / one-token forward is what sizes the draft tree per device; with --draft-vocab, the
LM head cut to K rows (what a trimmed EAGLE head calls once per level) is timed too. With --rows,
one batched forward over rows of those tree sizes, padded to the largest and laid end to end (a
target whose attention takes that: `--model DIR` on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlmspec import factory
from vlmspec.errors import ConfigError
from vlmspec.factory import EngineSpec
from vlmspec.target import Target
from vlmspec.target.timing import time_lm_head_rows, time_ragged_forward, time_tree_forward

SHAPES: dict[str, dict[str, int]] = {
    # the bundled target's text decoder (v4, assets/toyworld-vlm)
    "bundled": dict(hidden_size=160, intermediate_size=448, num_hidden_layers=8, num_attention_heads=5, num_key_value_heads=5, vocab_size=1015),
    # the wider v2 target's decoder (the shape `--shape bundled` had before v4)
    "bundled-v2": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, vocab_size=3001),
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


def run(target: Target, prefix: int, sizes: list[int], repeats: int, warmup: int) -> list[dict[str, Any]]:
    rows = []
    base = None
    for n in sizes:
        ms = time_tree_forward(target, prefix, n, repeats, warmup)
        base = ms if base is None else base
        rows.append({"tree_tokens": n, "ms": ms, "ratio_vs_first": ms / base})
    return rows


@dataclass(frozen=True)
class VerifyCostOptions:
    model: str | None = None  # a model folder or hub id; None = a synthetic `shape` with random weights
    shape: str = "bundled"
    layers: int | None = None  # override the synthetic shape's layer count
    device: str | None = None  # None: CUDA when available (vlmspec.factory)
    dtype: str = "auto"
    prefix: int = 256
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    repeats: int = 10
    warmup: int = 3
    draft_vocab: tuple[int, ...] = ()  # also time the LM head cut to these K rows (a trimmed drafter's head)
    head_rows: tuple[int, ...] = (1, 4)  # hidden states per head call: a level's frontier
    rows: tuple[int, ...] = ()  # tree sizes of a batch's rows: its forward padded and laid end to end


def measure(opts: VerifyCostOptions) -> dict[str, Any]:
    """`vlmspec bench verify-cost`: -> {"env": {...}, "rows": run(...)}."""
    device = factory.resolve_device(opts.device)
    dtype = factory.resolve_dtype(opts.dtype, device)
    torch.manual_seed(0)
    if opts.model:
        target = factory.load(EngineSpec(model=opts.model, device=device, dtype=opts.dtype))
    else:
        target = synthetic_target(opts.shape, device, dtype, opts.layers)
    with torch.no_grad():
        rows = run(target, opts.prefix, list(opts.sizes), opts.repeats, opts.warmup)
    step = next((r["ms"] for r in rows if r["tree_tokens"] == 1), None)
    head = []
    for k in sorted({min(k, target.vocab_size) for k in opts.draft_vocab}):
        for n in opts.head_rows:
            ms = time_lm_head_rows(target, k, n, 5 * opts.repeats, opts.warmup)
            head.append({"draft_vocab": k, "rows": n, "ms": ms, "x_step": ms / step if step else None})
    ragged = {}
    if opts.rows:
        if not target.verifies_ragged:
            raise ConfigError(f"{target.name} does not lay rows end to end (attention {target.attention!r}, {target.dtype}): "
                              "--rows needs --model DIR --dtype bfloat16 on a CPU, where 'auto' attention takes them")
        ragged = {"sizes": list(opts.rows), **time_ragged_forward(target, opts.prefix, list(opts.rows), opts.repeats, opts.warmup)}
    env = {"device": device, "dtype": str(dtype), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "target": target.name, "prefix": opts.prefix}
    return {"env": env, "rows": rows, "lm_head": head, "ragged": ragged}


def format_table(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"verify cost on {env['target']} ({env['device']}, {env['dtype']}, {env['threads']} threads), prefix {env['prefix']}",
             "| tree tokens | ms / forward | x one-token step |", "|---:|---:|---:|"]
    lines += [f"| {r['tree_tokens']} | {r['ms']:.2f} | {r['ratio_vs_first']:.2f} |" for r in report["rows"]]
    if report.get("lm_head"):
        lines += ["", "LM head cut to a draft vocabulary of K tokens (one call; x one-token step)",
                  "| K | rows | ms / call | x one-token step |", "|---:|---:|---:|---:|"]
        lines += [f"| {h['draft_vocab']} | {h['rows']} | {h['ms']:.2f} | " + (f"{h['x_step']:.3f} |" if h["x_step"] else "- |")
                  for h in report["lm_head"]]
    if report.get("ragged"):
        r = report["ragged"]
        lines += ["", f"one forward over {len(r['sizes'])} rows of {','.join(map(str, r['sizes']))} nodes: padded "
                  f"{r['padded']:.2f} ms, laid end to end {r['laid end to end']:.2f} ms"]
    return "\n".join(lines)
