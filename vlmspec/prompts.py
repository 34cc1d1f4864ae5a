"""The one prompt encoder: chat messages (and their images) -> the target's model inputs.

Every message keeps its role; a message's content is a list of parts in order, ``{"type": "text",
"text": ...}`` or ``{"type": "image"}`` (one per image, handed to the processor in the order they
appear). The conversation goes through the target's own chat template with
``add_generation_prompt=True``, then through its processor.

    encode_prompt(target, "Describe the image.", [image])   # one user turn: images first, then the text
    encode_messages(target, messages, images)               # a whole conversation (the server)
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from vlmspec.errors import TargetLoadError


def user_turn(prompt: str, n_images: int = 0) -> list[dict[str, Any]]:
    """One user message: `n_images` image placeholders, then the text."""
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    content.append({"type": "text", "text": prompt})
    return [{"role": "user", "content": content}]


def encode_messages(target: Any, messages: list[dict[str, Any]], images: list[Image.Image] | None = None) -> dict[str, Any]:
    """Chat-template messages + their images (in order) -> the processor's tensors on the target's
    device: input_ids [1, L], attention_mask [1, L], pixel tensors, grids, ..."""
    processor, images = target.processor, list(images or [])
    tokenizer = getattr(processor, "tokenizer", processor)
    if getattr(processor, "chat_template", None) is None and getattr(tokenizer, "chat_template", None) is None:
        raise TargetLoadError(f"{target.name}: the processor has no chat template; cannot build a prompt")
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = [im.convert("RGB") for im in images]
    inputs = processor(**kwargs)
    return {k: v.to(target.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def encode_prompt(target: Any, prompt: str, images: list[Image.Image] | None = None) -> dict[str, Any]:
    """A single user turn (its images first, then the text) -> model inputs."""
    images = list(images or [])
    return encode_messages(target, user_turn(prompt, len(images)), images)
