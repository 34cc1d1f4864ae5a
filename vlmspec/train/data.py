"""Training data: conversations from ToyWorld or a LLaVA-style JSONL, encoded with the target's
own processor and chat template; labels cover the answer (and its end-of-turn token) only.

`Conversation` and `toyworld_conversation` live in `vlmspec.data.heldout` (re-exported here);
JSONL images load through `vlmspec.inputs.load_image_file`, with the limits every image gets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from vlmspec.data import corpus
from vlmspec.data.heldout import Conversation, toyworld_conversation
from vlmspec.errors import VlmspecError
from vlmspec.inputs import load_image_file, user_turn

if TYPE_CHECKING:
    from toyworld import AnswerStyle


class DataError(VlmspecError, ValueError):
    """A training file that cannot be used; the message names the file and line."""


def messages(prompt: str, n_images: int, answer: str | None = None,
             followups: list[tuple[str, str]] = ()) -> list[dict[str, Any]]:
    """The user turn (`vlmspec.inputs.user_turn`: images first, then the text), and the answer
    as the assistant turn when given; then each follow-up (prompt, answer) as a text-only pair."""
    msgs = user_turn(prompt, n_images)
    if answer is not None:
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    for q, a in followups:
        msgs += user_turn(q, 0)
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
    return msgs


def _answer_spans(processor: Any, c: Conversation) -> tuple[str, list[tuple[str, str]]]:
    """The full text of a conversation and, per assistant turn, (text before the answer, text up to
    the end of the answer's turn). Each must extend the one before: the chat template guarantees it."""
    turns = [(c.prompt, c.answer)] + list(c.followups)
    spans = []
    for i, (q, _) in enumerate(turns):
        history = messages(c.prompt, len(c.images)) if i == 0 else messages(c.prompt, len(c.images), c.answer, turns[1:i]) + user_turn(q, 0)
        before = processor.apply_chat_template(history, add_generation_prompt=True)
        through = processor.apply_chat_template(messages(c.prompt, len(c.images), c.answer, turns[1:i + 1]))
        if not through.startswith(before):  # templates that re-render the user turn: append the answer ourselves
            assert i == 0, "multi-turn training needs a chat template whose turns extend each other"
            through = before + c.answer + (processor.tokenizer.eos_token or "")
        spans.append((before, through))
    return spans[-1][1], spans


def encode_conversations(processor: Any, convs: list[Conversation]) -> dict[str, torch.Tensor]:
    """-> input_ids / attention_mask [B, T] (right-padded), pixel tensors, labels [B, T] (-100 outside answers).

    Each answer's span is found by encoding the dialogue up to its generation prompt and up to the
    end of its turn: the full text must extend both, which the chat template guarantees. Follow-up
    turns (`Conversation.followups`) are supervised the same way. A conversation marked `open_end`
    (its last answer cut by a length limit) has that answer supervised without the end of turn.
    """
    tok = processor.tokenizer
    fulls, images, spans = [], [], []
    for c in convs:
        full, s = _answer_spans(processor, c)
        fulls.append(full)
        spans.append(s)
        images.extend(c.images)
    saved_side = tok.padding_side
    tok.padding_side = "right"
    try:
        enc = processor(text=fulls, images=images or None, return_tensors="pt", padding=True)

        def n_tokens(texts: list[str], conv_images: list[list]) -> list[int]:
            flat = [im for ims in conv_images for im in ims]
            return processor(text=texts, images=flat or None, return_tensors="pt", padding=True)["attention_mask"].sum(1).tolist()

        labels = torch.full_like(enc["input_ids"], -100)
        lengths = enc["attention_mask"].sum(1).tolist()  # a dialogue's last turn ends where its text does
        most = max(len(s) for s in spans)
        for t in range(most):
            rows = [i for i, s in enumerate(spans) if len(s) > t]
            ims = [convs[i].images for i in rows]
            lo = n_tokens([spans[i][t][0] for i in rows], ims)
            inner = [i for i in rows if len(spans[i]) > t + 1]
            ends = dict(zip(inner, n_tokens([spans[i][t][1] for i in inner], [convs[i].images for i in inner]))) if inner else {}
            cut = [i for i in rows if len(spans[i]) == t + 1 and convs[i].open_end]  # no end of turn after a cut answer
            if cut:
                last = [(convs[i].followups[-1][1] if convs[i].followups else convs[i].answer) for i in cut]
                ends.update(zip(cut, n_tokens([spans[i][t][0] + a for i, a in zip(cut, last)], [convs[i].images for i in cut])))
            for i, a in zip(rows, lo):
                b = ends.get(i, lengths[i])
                labels[i, a:b] = enc["input_ids"][i, a:b]
    finally:
        tok.padding_side = saved_side
    labels[enc["attention_mask"] == 0] = -100
    out = dict(enc)
    out["labels"] = labels
    return out


def toyworld_stream(
    first_seed: int, multimodal_share: Callable[[int], float] = lambda i: 1.0, style: AnswerStyle | None = None
) -> Iterator[Conversation]:
    """Train-split conversations from `first_seed` on, answers phrased in `style`; sample i is
    text-only with probability 1 - multimodal_share(i) (the text-first curriculum), decided by the
    seed alone."""
    i = 0
    while True:
        seed = first_seed + i
        share = multimodal_share(i)
        if share >= 1.0:
            yield toyworld_conversation(seed, None, style)
        else:
            draw = (seed * 2654435761 % 2**32) / 2**32  # a fixed per-seed coin
            yield toyworld_conversation(seed, "text_only" if draw >= share else None, style)
        i += 1


def load_jsonl(path: str | Path, skip_bad: bool = True) -> tuple[list[Conversation], list[str]]:
    """LLaVA-style JSONL: {"images": [paths relative to the file], "conversations": [{"from": "human",
    "value": "<image>\\n..."}, {"from": "gpt", "value": "..."}, more human / gpt pairs: follow-up turns],
    "open_end": the last answer was cut (optional)}. Returns (conversations, problems); a bad line is
    skipped and reported (file:line: why), or raises DataError when skip_bad=False.

    `path` may also be a corpus folder of `vlmspec data` (manifest.json + shards): every shard is
    checked against the manifest first, and a corrupt one raises DataError naming its path."""
    path = Path(path)
    if path.is_dir() and (path / corpus.MANIFEST).is_file():
        return _load_corpus(path, skip_bad)
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


def _load_corpus(folder: Path, skip_bad: bool) -> tuple[list[Conversation], list[str]]:
    """Every checked shard of a `vlmspec data` corpus folder, in order."""
    try:
        shards = corpus.checked_shards(folder)
    except corpus.CorpusError as exc:
        raise DataError(str(exc)) from None
    convs: list[Conversation] = []
    problems: list[str] = []
    for shard in shards:
        c, p = load_jsonl(shard, skip_bad)
        convs += c
        problems += p
    return convs, problems


def _pairs(turns: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(user turn, answer) pairs in order: each human turn with the gpt turn after it."""
    pairs, question = [], None
    for t in turns:
        if t["from"] in ("human", "user"):
            question = t["value"]
        elif t["from"] in ("gpt", "assistant") and question is not None:
            pairs.append((question, t["value"]))
            question = None
    return pairs


def _parse_record(rec: dict[str, Any], root: Path) -> Conversation:
    turns = rec["conversations"]
    if not isinstance(turns, list) or len(turns) < 2:
        raise ValueError("'conversations' needs a human turn and a gpt turn")
    pairs = _pairs(turns)
    if not pairs:
        raise ValueError("'conversations' needs a human turn and a gpt turn after it")
    if any(not isinstance(q, str) or not isinstance(a, str) or not a.strip() for q, a in pairs):
        raise ValueError("empty or non-text turn")
    (human, answer), followups = pairs[0], pairs[1:]
    images = []
    for rel in rec.get("images") or ([rec["image"]] if rec.get("image") else []):
        images.append(load_image_file(root / rel))
    if human.count("<image>") not in (0, len(images)):
        raise ValueError(f"{human.count('<image>')} <image> tags for {len(images)} images")
    prompt = human.replace("<image>\n", "").replace("<image>", "").strip()
    return Conversation(prompt, answer, images, rec.get("task", ""), followups=followups, open_end=bool(rec.get("open_end", False)))


__all__ = ["Conversation", "DataError", "encode_conversations", "load_jsonl", "messages", "toyworld_conversation", "toyworld_stream"]
