"""Text-only instructions and answers from the instruct model itself (Magpie), for want of an
offline instruction dataset.

Given only its template's opening of a user turn (``<|im_start|>user\\n`` after the default system
prompt) an aligned chat model writes a plausible instruction: sampled (T=1, nucleus 0.95) they are
the prompts, its greedy answers the targets. With `openers` each sampled turn starts with one of
them (`INSTRUCTION_OPENERS`, cycled over the slots; alone a small model repeats itself). The data engine
uses `ENGINE_OPENERS`, `TOPIC_LEADS` (`magpie_start`) and `usable_instruction` (docs/data.md). Kept:
an instruction ended within `prompt_tokens`, of at least 3 words, not held out
(`heldout.TEXT_PROMPTS`), not a repeat, with its answer's first `answer_tokens` tokens and whether
it ended there (`Conversation.open_end`); a pure function of the model and config (seeded per batch).

    pairs = magpie_pairs(model, tokenizer, MagpieConfig(n=96))   # [(instruction, answer, ended), ...]
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vlmspec.data.heldout import TEXT_PROMPTS, Conversation
from vlmspec.data.prompts import is_heldout, prompt_key

_MARK = "\x00MAGPIE\x00"

# first words of the kinds of request a chat model is sent: what `openers` starts user turns with
INSTRUCTION_OPENERS = (
    "Write", "Explain", "List", "Give", "What", "How", "Why", "Name", "Describe", "Summarize",
    "Translate", "Suggest", "Tell me", "Compare", "Define", "Who", "When", "Which", "Create",
    "Calculate", "Can you", "Rewrite", "Classify", "Generate", "Provide", "Recommend", "Is",
    "Help me", "Make", "Convert", "Correct", "Plan",
)
# the data engine's wider spread (`vlmspec data`): INSTRUCTION_OPENERS (kept as they are: `vlmspec train
# --text-style varied` caches its pairs by them) and these
MORE_OPENERS = (
    "Could you", "I need", "I want to", "Please", "Imagine", "Pretend you are", "Draft", "Outline", "Brainstorm",
    "Analyze", "Evaluate", "Predict", "Estimate", "Solve", "Prove", "Simplify", "Paraphrase", "Shorten", "Expand",
    "Edit", "Proofread", "Format", "Sort", "Rank", "Organize", "Schedule", "Design", "Invent", "Compose", "Sketch",
    "Teach me", "Quiz me", "Show me", "Walk me through", "Break down", "Distinguish", "Contrast", "Identify",
    "Find", "Choose", "Where", "Do you know", "What if", "Should I", "Is it true that", "What's the difference",
    "In what ways", "How many", "How much", "How long", "I'm trying to", "My friend says", "I have a question:",
    "Act as", "Role-play", "Argue", "Debate", "Critique", "Review", "Fix", "Debug", "Optimize", "Write a function",
    "Write a letter", "Write a poem", "Write a story", "Write an email", "Give me ideas", "Give me a list",
    "Tell me a fact", "Tell me a joke", "Recommend a book", "Suggest a recipe", "Describe how", "Explain why",
)
ENGINE_OPENERS = INSTRUCTION_OPENERS + MORE_OPENERS
# how a topic leads into a user turn ("{topic}" filled in); a lead ending in ", " lowercases the opener after it
TOPIC_LEADS = (
    "About {topic}: ", "Regarding {topic}, ", "On the subject of {topic}, ", "I'm curious about {topic}. ",
    "Question about {topic}: ", "I've been reading about {topic}. ", "For a project on {topic}, ", "Thinking about {topic}, ",
)


@dataclass(frozen=True)
class MagpieConfig:
    n: int = 96  # pairs wanted
    seed: int = 0
    prompt_tokens: int = 48
    answer_tokens: int = 64
    batch: int = 16
    temperature: float = 1.0
    top_p: float = 0.95
    max_rounds: int = 12  # give up after this many prompt batches
    openers: tuple[str, ...] = ()  # user turns start with these, cycled over the batch slots (() = Magpie's open turn)


def magpie_start(rng: random.Random, topics: tuple[str, ...], topic_share: float = 0.5) -> tuple[str, str, str | None]:
    """(the start of a sampled user turn, its opener, its topic or None): an opener of ENGINE_OPENERS,
    led in by a topic (TOPIC_LEADS) with probability `topic_share`; the model writes the rest."""
    opener = rng.choice(ENGINE_OPENERS)
    if not topics or rng.random() >= topic_share:
        return opener, opener, None
    topic = rng.choice(topics)
    lead = rng.choice(TOPIC_LEADS).format(topic=topic)
    first = opener if not lead.endswith(", ") or opener.startswith("I ") or opener.startswith("I'") else opener[0].lower() + opener[1:]
    return lead + first, opener, topic


def user_turn_opening(tokenizer: Any) -> str:
    """The chat template's text up to where a user's first message begins."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    assert _MARK in text, "the chat template dropped the user's message"
    return text[: text.index(_MARK)]


def _generate(model: Any, tokenizer: Any, texts: list[str], max_new_tokens: int, sample: bool, cfg: MagpieConfig) -> list[tuple[str, bool]]:
    """Left-padded batched generation -> (new text, ended with the end-of-turn token) per input;
    the text as decoded (a cut one without a trailing partial character), callers strip it."""
    eos = tokenizer.eos_token_id  # SmolLM2's is its end of turn, <|im_end|>
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    kwargs = dict(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=0) if sample else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos, **kwargs)
    new = out[:, enc["input_ids"].shape[1] :]  # [B, <= max_new_tokens]
    result = []
    for row in new.tolist():
        ended = eos in row
        ids = row[: row.index(eos)] if ended else row
        text = tokenizer.decode(ids, skip_special_tokens=True)
        result.append((text if ended else text.rstrip("\ufffd"), ended))
    return result


def _key(prompt: str) -> str:
    """An instruction up to case and spacing (what counts as a repeat)."""
    return " ".join(prompt.lower().split())


def _usable(prompt: str, seen: set[str]) -> bool:
    return len(prompt.split()) >= 3 and "<|" not in prompt and _key(prompt) not in seen


def usable_instruction(prompt: str, seen: set[str]) -> bool:
    """The data engine's filter of a sampled user turn: of at least 3 words, no template token, not a
    held-out prompt (`vlmspec.data.prompts.is_heldout`), not in `seen` (keys of `prompt_key`)."""
    return len(prompt.split()) >= 3 and "<|" not in prompt and not is_heldout(prompt) and prompt_key(prompt) not in seen


Pair = tuple[str, str, bool]  # (instruction, greedy answer, the answer ended within answer_tokens)


def magpie_pairs(model: Any, tokenizer: Any, cfg: MagpieConfig = MagpieConfig(), progress: bool = True) -> list[Pair]:
    """Up to `cfg.n` (instruction, greedy answer, ended) written by `model` (an HF causal or
    image-text model; text only). Fewer when `cfg.max_rounds` batches do not yield enough."""
    from tqdm import tqdm

    opening = user_turn_opening(tokenizer)
    seen = {_key(p) for p in TEXT_PROMPTS}
    pairs: list[Pair] = []
    bar = tqdm(total=cfg.n, desc="magpie pairs", disable=not progress, dynamic_ncols=True)
    for rnd in range(cfg.max_rounds):
        if len(pairs) >= cfg.n:
            break
        torch.manual_seed(cfg.seed * 1000 + rnd)
        starts = [cfg.openers[(rnd * cfg.batch + i) % len(cfg.openers)] if cfg.openers else "" for i in range(cfg.batch)]
        prompts = []
        for start, (text, ended) in zip(starts, _generate(model, tokenizer, [opening + s for s in starts], cfg.prompt_tokens, True, cfg)):
            text = (start + text).strip()
            if ended and _usable(text, seen):
                seen.add(_key(text))
                prompts.append(text)
        if not prompts:
            continue
        asks = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in prompts]
        for p, (answer, ended) in zip(prompts, _generate(model, tokenizer, asks, cfg.answer_tokens, False, cfg)):
            answer = answer.strip() if ended else answer.lstrip()  # a cut answer keeps its last space
            if answer.strip() and len(pairs) < cfg.n:
                pairs.append((p, answer, ended))
                bar.update(1)
    bar.close()
    return pairs


def _as_json(cfg: MagpieConfig) -> dict[str, Any]:
    """The config as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(asdict(cfg)))


def cached_pairs(path: Path, model: Any, tokenizer: Any, cfg: MagpieConfig, progress: bool = True) -> list[Pair]:
    """`magpie_pairs`, kept in `path` (JSON with its config) so a resumed run reads the same pairs."""
    if path.is_file():
        saved = json.loads(path.read_text())
        saved_cfg = {**_as_json(MagpieConfig()), **(saved.get("config") or {})}  # fields added since take their defaults
        if saved_cfg == _as_json(cfg):
            return [tuple(p) for p in saved["pairs"]]
    pairs = magpie_pairs(model, tokenizer, cfg, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": asdict(cfg), "pairs": pairs}, indent=1))
    return pairs


def as_conversation(pair: Pair) -> Conversation:
    """A pair as a text-only training conversation (a cut answer trains without an end of turn)."""
    prompt, answer, ended = pair
    return Conversation(prompt, answer, task="magpie", open_end=not ended)


__all__ = ["ENGINE_OPENERS", "INSTRUCTION_OPENERS", "MORE_OPENERS", "TOPIC_LEADS", "magpie_start", "MagpieConfig", "Pair", "as_conversation", "cached_pairs", "magpie_pairs", "usable_instruction", "user_turn_opening"]
