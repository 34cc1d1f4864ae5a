"""`python -m recipes eval-target`: does the target read the image? Held-out ToyWorld scores, and the same
scores with every image replaced by noise (a model that reads the image must fall far below).

    python -m recipes eval-target [--model DIR] [--n 600] [--seed 0] [--json]
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
from PIL import Image

import toyworld
from vlmspec.data.heldout import heldout
from vlmspec.draft import NgramDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.target import Target
from vlmspec.text import generate_text

# task -> (metric key, max new tokens); counts have room for the lists a model may write before
# the number (`toyworld.SCAN`: up to six objects, then up to four picked out, about 10 tokens each)
SCORED = {
    "count": ("counting", 160),
    "attribute": ("attribute", 24),
    "read_text": ("text_reading", 24),
    "describe": ("description_coverage", 256),
    "spatial": ("spatial", 32),
    "read_chart": ("chart_reading", 24),
}
REQUIRED = ("counting", "attribute", "text_reading", "description_coverage")


def noise_like(image: Image.Image, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(image.height, image.width, 3), dtype=np.uint8)
    return Image.fromarray(arr, "RGB")


def evaluate(target: Target, n: int = 600, seed: int = 0, progress: bool = True, answers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Mean scores by metric, real and noise images; `answers`, when given, receives every item
    (task, image kind, prompt, answer, reference, scores) in order."""
    from tqdm import tqdm

    engine = SpecEngine(target, NgramDrafter())
    # n test-split items balanced over the scored tasks (`vlmspec.data.heldout`'s "target-eval" set)
    samples = [c.sample for c in heldout("target-eval", max(1, n // len(SCORED)), per_task=True, tasks=tuple(SCORED), seed=seed)]
    scores: dict[str, dict[str, list[float]]] = {"real": defaultdict(list), "noise": defaultdict(list)}
    examples: list[dict[str, str]] = []
    for s in tqdm(samples, desc="eval-target", disable=not progress, dynamic_ncols=True):
        key, max_new = SCORED[s.task]
        for kind, image in (("real", s.image), ("noise", noise_like(s.image, s.seed))):
            inputs = encode_prompt(target, s.prompt, [image])
            text = generate_text(engine, inputs, GenerationConfig(max_new_tokens=max_new)).text
            scored = toyworld.score(s, text)
            for k, v in scored.items():
                scores[kind][k].append(v)
            if answers is not None:
                answers.append({"task": s.task, "image": kind, "prompt": s.prompt, "answer": text, "reference": s.answer, "scores": scored})
            if kind == "real" and len(examples) < len(SCORED) and all(e["task"] != s.task for e in examples):
                examples.append({"task": s.task, "prompt": s.prompt, "answer": text, "reference": s.answer})
    mean = {kind: {k: float(np.mean(v)) for k, v in d.items()} for kind, d in scores.items()}
    out: dict[str, Any] = dict(mean["real"])
    out["noise_image"] = mean["noise"]
    out["n"] = len(samples)
    out["per_task"] = {k: len(v) for k, v in scores["real"].items()}
    out["examples"] = examples
    return out


def text_agreement(target: Target, reference: Target, max_new_tokens: int = 32, progress: bool = True) -> dict[str, Any]:
    """Greedy answers to the held-out text-only instructions (`heldout.TEXT_PROMPTS`) from `target`
    against `reference` (e.g. the untrained assembly, whose language model is SmolLM2-Instruct's):
    the share of identical answers and the mean length of the common prefix in tokens."""
    from tqdm import tqdm

    from vlmspec.data.heldout import TEXT_PROMPTS

    config = GenerationConfig(max_new_tokens=max_new_tokens)
    engines = SpecEngine(target, NgramDrafter()), SpecEngine(reference, NgramDrafter())
    same, prefix, examples = 0, [], []
    for prompt in tqdm(TEXT_PROMPTS, desc="text-only", disable=not progress, dynamic_ncols=True):
        ids = [e.generate(encode_prompt(e.target, prompt, []), config).token_ids for e in engines]
        common = next((i for i, (a, b) in enumerate(zip(*ids)) if a != b), min(map(len, ids)))
        same += ids[0] == ids[1]
        prefix.append(common)
        if len(examples) < 3:
            examples.append({"prompt": prompt, "answer": target.processor.tokenizer.decode(ids[0], skip_special_tokens=True),
                             "reference": reference.processor.tokenizer.decode(ids[1], skip_special_tokens=True)})
    return {"prompts": len(TEXT_PROMPTS), "max_new_tokens": max_new_tokens, "identical": same / len(TEXT_PROMPTS),
            "mean_common_prefix_tokens": float(np.mean(prefix)), "examples": examples}


def format_table(result: dict[str, Any]) -> str:
    rows = ["| metric | real image | noise image | items |", "|---|---:|---:|---:|"]
    for key, _ in SCORED.values():
        rows.append(f"| {key} | {result[key]:.3f} | {result['noise_image'][key]:.3f} | {result['per_task'][key]} |")
    if "text_only" in result:
        t = result["text_only"]
        rows.append(f"\ntext-only against the reference: {t['identical']:.2f} of {t['prompts']} greedy answers identical "
                    f"({t['max_new_tokens']} tokens), mean common prefix {t['mean_common_prefix_tokens']:.1f} tokens")
    return "\n".join(rows)


__all__ = ["evaluate", "format_table", "noise_like", "REQUIRED", "text_agreement"]
