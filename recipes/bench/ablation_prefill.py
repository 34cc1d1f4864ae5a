"""The ablation's timing of a drafter's read of the prompt: on the test prompts, and at a real
VLM's scale (576 image tokens, LLaVA-1.5's) round-robin over every variant, with its FLOPs counted
(`python -m recipes ablate`; see `ablation`)."""

from __future__ import annotations

import math
import time
from statistics import median_high
from typing import Any

import torch

from vlmspec.data.heldout import Conversation
from vlmspec.draft.base import PromptContext
from vlmspec.inputs import encode_prompt
from vlmspec.target import Target


@torch.no_grad()
def drafter_prefill_ms(target: Target, drafter: Any, prompts: list[Conversation]) -> float:
    """Mean ms of the drafter's read of the prompt (start + the rows' forward, no tree), after
    the target's prefill; image prompts only."""
    times = []
    for c in prompts:
        if not c.images:
            continue
        inputs = encode_prompt(target, c.prompt, c.images)
        _, out = target.prefill(inputs, visual=drafter.needs_visual)
        ctx = PromptContext(inputs["input_ids"][0], out.features, inputs, out.image_mask, out.image_embeds, out.attention)
        root = int(out.logits.argmax())
        t0 = time.perf_counter()
        drafter.start(ctx).read(root)
        times.append(time.perf_counter() - t0)
    return 1000 * sum(times) / max(1, len(times))


def _over_capacity(drafter: Any, n_image: int) -> str | None:
    """The compressor of `drafter` that cannot take `n_image` tokens (a resampler has a fixed
    number of queries, e.g. 64 < 576 / 4), or None."""
    visual = getattr(getattr(drafter, "head", None), "visual", None)
    if visual is None or visual.cfg.sized_for(n_image) == visual.cfg:
        return None
    return "resampler"  # the one compressor with a capacity (VisualConfig.sized_for)


def scale_prompt(target: Target, n_image: int = 576, n_text: int = 48) -> tuple[PromptContext, int]:
    """A prompt the size of a real VLM's (LLaVA-1.5: 576 image tokens): `n_text` text tokens
    around one image of `n_image` tokens, with random target features, image embeddings and
    attention of the target's width; -> (context, root token). The bundled target has only 9
    image tokens, too few for the image rows to dominate; a drafter's read of the prompt depends
    on the shapes only, so this measures what compression saves at real scale."""
    from vlmspec.vision_compress.capture import image_token_id

    g = torch.Generator().manual_seed(0)
    H = target.model.config.get_text_config().hidden_size
    V = int(target.model.config.get_text_config().vocab_size)
    img = image_token_id(target.model)
    text = torch.randint(0, V, (n_text,), generator=g)
    text[text == img] = 0
    head_len = n_text // 4
    ids = torch.cat([text[:head_len], torch.full((n_image,), img), text[head_len:]])
    L = ids.shape[0]
    dev, dt = target.device, target.dtype
    ctx = PromptContext(
        ids.to(dev), torch.randn(L, H, generator=g).to(dev, dt), {}, (ids == img).to(dev),
        torch.randn(n_image, H, generator=g).to(dev, dt), torch.rand(L, generator=g).softmax(0).to(dev),
    )
    return ctx, int(text[0])


def _read_s(drafter: Any, ctx: PromptContext, root: int) -> float:
    """Seconds of one read of the prompt rows by the drafter (no tree)."""
    t0 = time.perf_counter()
    drafter.start(ctx).read(root)
    return time.perf_counter() - t0


def read_flops(drafter: Any, ctx: PromptContext, root: int) -> int:
    """Floating-point operations of one read of the prompt rows (`_read_s`'s work), counted by
    torch's FlopCounterMode: matrix products, plus two kinds of op the counter leaves out on CPU:
    attention (aten._scaled_dot_product_flash_attention_for_cpu), counted as QK^T and PV of every
    query against every key (the read passes a dense mask, not a causal flag), and the drafter's
    products over packed weights (mkldnn._linear_pointwise: 2 x rows x in x out)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def packed_linear(x_shape, *args, out_shape=None, **kwargs) -> int:  # x [..., K] -> out [..., N]
        return 2 * math.prod(x_shape) * out_shape[-1]

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa}
    if torch.backends.mkldnn.is_available():
        mapping[torch.ops.mkldnn._linear_pointwise] = packed_linear
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        drafter.start(ctx).read(root)
    return int(counter.get_total_flops())


@torch.no_grad()
def prefill_at_scale(target: Target, drafters: dict[str, Any], rounds: int = 21, baseline: str = "plain",
                     n_image: int = 576, n_text: int = 48, blocks: int = 1, pause_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Each drafter's read of `scale_prompt`, timed round-robin: every round times every drafter
    once (order reversed on odd rounds), so a slow spell of the machine hits all of them alike.
    `blocks` blocks of `rounds` rounds, `pause_s` apart, spread the rounds over time: on a shared
    machine the ratio of one short block moves with what the neighbours do (3.1x to 4.4x for the
    same two drafters, blocks seconds apart), so the result pools every round of every block.
    -> {name: {"ms": median ms over all rounds, "vs_baseline": median over all rounds of baseline
    time / this time, "vs_baseline_blocks": that median per block, "gflop": the read's GFLOP
    (`read_flops`)}}; all None for a drafter that cannot read that many image tokens (a
    resampler's fixed query count), the ratios None without a measurable `baseline`."""
    ctx, root = scale_prompt(target, n_image, n_text)
    able = {k: d for k, d in drafters.items() if _over_capacity(d, n_image) is None}
    for d in able.values():
        _read_s(d, ctx, root)  # warm-up
    times: dict[str, list[list[float]]] = {k: [] for k in able}  # [block][round]
    for blk in range(blocks):
        if blk:
            time.sleep(pause_s)
        for k in able:
            times[k].append([])
        for r in range(rounds):
            for k in (list(able) if r % 2 == 0 else list(able)[::-1]):
                times[k][-1].append(_read_s(able[k], ctx, root))

    def ratios(k: str, blk: int) -> list[float]:
        return [b / t for b, t in zip(times[baseline][blk], times[k][blk])]

    measured = baseline in able
    out: dict[str, dict[str, Any]] = {}
    for k in drafters:
        if k not in able:
            out[k] = {"ms": None, "vs_baseline": None, "vs_baseline_blocks": None, "gflop": None}
            continue
        out[k] = {
            "ms": 1000 * median_high([t for blk in times[k] for t in blk]),
            "vs_baseline": median_high([x for blk in range(blocks) for x in ratios(k, blk)]) if measured else None,
            "vs_baseline_blocks": [median_high(ratios(k, blk)) for blk in range(blocks)] if measured else None,
            "gflop": read_flops(able[k], ctx, root) / 1e9,
        }
    return out


__all__ = ["drafter_prefill_ms", "prefill_at_scale", "read_flops", "scale_prompt"]
