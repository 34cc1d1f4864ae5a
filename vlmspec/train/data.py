"""Training data: conversations from ToyWorld or a LLaVA-style JSONL, encoded with the target's
own processor and chat template; labels cover the answer (and its end-of-turn token) only.

`Conversation` and `toyworld_conversation` live in `vlmspec.data.heldout` (re-exported here);
JSONL images load through `vlmspec.images.load_image_file`, with the limits every image gets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from vlmspec.data.heldout import Conversation, toyworld_conversation
from vlmspec.errors import VlmspecError
from vlmspec.images import load_image_file
from vlmspec.prompts import user_turn


class DataError(VlmspecError, ValueError):
    """A training file that cannot be used; the message names the file and line."""


def messages(prompt: str, n_images: int, answer: str | None = None) -> list[dict[str, Any]]:
    """The user turn (`vlmspec.prompts.user_turn`: images first, then the text), and the answer
    as the assistant turn when given."""
    msgs = user_turn(prompt, n_images)
    if answer is not None:
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return msgs


def encode_conversations(processor: Any, convs: list[Conversation]) -> dict[str, torch.Tensor]:
    """-> input_ids / attention_mask [B, T] (right-padded), pixel tensors, labels [B, T] (-100 outside answers).

    The answer span is found by encoding the prompt with the generation prompt on its own: the
    full text must start with it, which the chat template guarantees.
    """
    tok = processor.tokenizer
    prompts, fulls, images = [], [], []
    for c in convs:
        prompt = processor.apply_chat_template(messages(c.prompt, len(c.images)), add_generation_prompt=True)
        full = processor.apply_chat_template(messages(c.prompt, len(c.images), c.answer))
        if not full.startswith(prompt):  # templates that re-render the user turn: append the answer ourselves
            full = prompt + c.answer + (tok.eos_token or "")
        prompts.append(prompt)
        fulls.append(full)
        images.extend(c.images)
    saved_side = tok.padding_side
    tok.padding_side = "right"
    try:
        enc = processor(text=fulls, images=images or None, return_tensors="pt", padding=True)
        prompt_lens = processor(text=prompts, images=images or None, return_tensors="pt", padding=True)["attention_mask"].sum(1)
    finally:
        tok.padding_side = saved_side
    labels = enc["input_ids"].clone()
    for row, n in enumerate(prompt_lens.tolist()):
        labels[row, :n] = -100
    labels[enc["attention_mask"] == 0] = -100
    out = dict(enc)
    out["labels"] = labels
    return out


def toyworld_stream(
    first_seed: int, multimodal_share: Callable[[int], float] = lambda i: 1.0
) -> Iterator[Conversation]:
    """Train-split conversations from `first_seed` on; sample i is text-only with probability
    1 - multimodal_share(i) (the text-first curriculum), decided by the seed alone."""
    i = 0
    while True:
        seed = first_seed + i
        share = multimodal_share(i)
        if share >= 1.0:
            yield toyworld_conversation(seed)
        else:
            draw = (seed * 2654435761 % 2**32) / 2**32  # a fixed per-seed coin
            yield toyworld_conversation(seed, "text_only" if draw >= share else None)
        i += 1


def load_jsonl(path: str | Path, skip_bad: bool = True) -> tuple[list[Conversation], list[str]]:
    """LLaVA-style JSONL: {"images": [paths relative to the file], "conversations": [{"from": "human",
    "value": "<image>\\n..."}, {"from": "gpt", "value": "..."}]}. Returns (conversations, problems);
    a bad line is skipped and reported (file:line: why), or raises DataError when skip_bad=False."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    convs: list[Conversation] = []
    problems: list[str] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                convs.append(_parse_record(json.loads(line), path.parent))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, OSError) as exc:  # InputError is a ValueError
                msg = f"{path}:{lineno}: {exc.__class__.__name__}: {exc}"
                if not skip_bad:
                    raise DataError(msg) from None
                problems.append(msg)
    if not convs:
        raise DataError(f"{path}: no usable conversation ({len(problems)} bad lines; first: {problems[:1]})")
    return convs, problems


def _parse_record(rec: dict[str, Any], root: Path) -> Conversation:
    turns = rec["conversations"]
    if not isinstance(turns, list) or len(turns) < 2:
        raise ValueError("'conversations' needs a human turn and a gpt turn")
    human = next(t["value"] for t in turns if t["from"] in ("human", "user"))
    answer = next(t["value"] for t in turns if t["from"] in ("gpt", "assistant"))
    if not isinstance(human, str) or not isinstance(answer, str) or not answer.strip():
        raise ValueError("empty or non-text turn")
    images = []
    for rel in rec.get("images") or ([rec["image"]] if rec.get("image") else []):
        images.append(load_image_file(root / rel))
    if human.count("<image>") not in (0, len(images)):
        raise ValueError(f"{human.count('<image>')} <image> tags for {len(images)} images")
    prompt = human.replace("<image>\n", "").replace("<image>", "").strip()
    return Conversation(prompt, answer, images, rec.get("task", ""))


__all__ = ["Conversation", "DataError", "encode_conversations", "load_jsonl", "messages", "toyworld_conversation", "toyworld_stream"]
