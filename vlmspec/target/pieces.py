"""Where a prompt may be cut into pieces for chunked prefill (`vlmspec.engine.prefill`).

The first piece holds every image (a piece never splits an image's or a video's tokens); later
pieces are text, run as a chain through the tree forward. A prompt is cut only where that gives the
logits of one whole prefill: the target passes a one-time check (`prompt_pieces_problem`) and the
prompt's only per-token inputs are its ids, an all-ones attention mask and a marker of its media
tokens (`mm_token_type_ids`, Qwen-VL's M-RoPE: all in the first piece); `token_type_ids` and the
like can change how a prompt attends to itself (PaliGemma's bidirectional prefix), so such a
prompt comes in whole.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmspec.tree import DraftTree

MEDIA_TOKEN_KEYS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
CUTTABLE = {"input_ids", "attention_mask", "mm_token_type_ids"}  # per-token inputs a prompt may be cut across


def per_token_keys(inputs: dict[str, torch.Tensor]) -> list[str]:
    """The processor outputs laid out like the prompt's ids ([1, L]): the ones a piece is cut from."""
    shape = inputs["input_ids"].shape
    return [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.shape == shape]


def prompt_head(inputs: dict[str, torch.Tensor], end: int) -> dict[str, torch.Tensor]:
    """The prompt's first `end` tokens with all of its other inputs (images, grids): the first piece."""
    if end == int(inputs["input_ids"].shape[1]):
        return inputs
    keys = per_token_keys(inputs)
    return {k: (v[:, :end] if k in keys else v) for k, v in inputs.items()}


def media_end(target: Any, ids: torch.Tensor) -> int:  # target: a `vlmspec.target.Target` (as below)
    """One past the prompt's last image or video token (0: it has none). ids: [L]."""
    cfg = target.model.config
    media = [int(v) for k in MEDIA_TOKEN_KEYS if isinstance(v := getattr(cfg, k, None), int)]
    if not media:
        return 0
    where = torch.isin(ids, torch.tensor(media, device=ids.device)).nonzero()
    return int(where.max()) + 1 if where.numel() else 0


def first_piece(target: Any, inputs: dict[str, torch.Tensor], chunk: int | None) -> int:
    """How many of the prompt's tokens its first piece holds: all of them unless `chunk` is set, the
    prompt is longer and may be cut here; else `chunk`, or up to its last image when that is later."""
    length = int(inputs["input_ids"].shape[1])
    if chunk is None or length <= chunk:
        return length
    if set(per_token_keys(inputs)) - CUTTABLE or not bool(inputs.get("attention_mask", torch.ones(1)).all()):
        return length
    if target.prompt_pieces_problem():
        return length
    end = min(length, max(chunk, media_end(target, inputs["input_ids"][0])))
    marks = inputs.get("mm_token_type_ids")
    return length if marks is not None and bool(marks[0, end:].any()) else end


@torch.no_grad()
def probe_prompt_pieces(target: Any) -> str:
    """'' when a prompt prefilled in two pieces (the second as a chain) gives the logits of the same
    prompt prefilled whole, else why not (within bf16 rounding; a model that counts positions its
    own way, or masks a prompt otherwise than causally, is far outside)."""
    problem = target._explicit_inputs_problem()
    if problem:
        return problem
    ids = torch.tensor([[1, 2, 3, 4, 5]], device=target.device)
    whole = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    try:
        _, out = target.prefill(whole)
        state, _ = target.prefill(prompt_head(whole, 2))
        pieces = target.forward_tree(state, DraftTree.chain(3, [4, 5])).logits[-1:]
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError) as exc:
        return f"a prompt prefilled in pieces does not run ({type(exc).__name__}: {str(exc)[:120]})"
    tol = (1e-3 if target.dtype == torch.float32 else 5e-2) * max(1.0, float(out.logits.abs().max()))
    if float((pieces - out.logits).abs().max()) <= tol:
        return ""
    return "a prompt prefilled in pieces gives other logits than the whole prompt"
