"""`vlmspec train`'s data: the batches of conversations (ToyWorld or a LLaVA-style JSONL, plus the
target's own text-only pairs), each process's share under torchrun, the target's own answers
(ViSpec, cached) and the answer-token counts a trimmed draft vocabulary is chosen from."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch

from vlmspec.data import toyworld
from vlmspec.data.heldout import Conversation
from vlmspec.draft.base import PlainDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.target import Target
from vlmspec.text import generate_text
from vlmspec.train.data import DataError, encode_conversations, load_jsonl, toyworld_stream
from vlmspec.train.distill_config import DistillConfig
from vlmspec.train.magpie import INSTRUCTION_OPENERS, MagpieConfig, Pair, as_conversation, cached_pairs


def answer_token_counts(target: Target, batches: Iterator[list[Conversation]], n: int, regen: Any = None) -> torch.Tensor:
    """[V] how often each token appears in the answers of the first `n` conversations of `batches`
    (the target's own answers when `regen` is given), as the training labels mark them."""
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    seen = 0
    for convs in batches:
        if seen >= n:
            break
        convs = convs[: n - seen]
        if regen is not None:
            convs = [regen(c) for c in convs]
        labels = encode_conversations(target.processor, convs)["labels"]
        counts += torch.bincount(labels[labels != -100], minlength=target.vocab_size)[: target.vocab_size]
        seen += len(convs)
    return counts


def conversations(data: str, cfg: DistillConfig, rank: int, start_step: int, text_pairs: list[Pair] = (),
                  world: int = 1) -> Iterator[list[Conversation]]:
    """Batches of conversations, process `rank`'s share of each step's batch: the step's whole
    batch has world x cfg.batch_size conversations (what one process with that batch size would
    get) and rank r takes its contiguous r-th share, so N processes train on exactly one process's
    samples. A pure function of (data, seed, world, rank, step, text_pairs) for exact resume. With
    `text_pairs`, the last `text_per_batch` of each whole batch are those pairs, in turn."""
    whole = replace(cfg, batch_size=cfg.batch_size * world)
    m = whole.text_per_batch if text_pairs else 0
    step = start_step
    b = cfg.batch_size
    for batch in _data_batches(data, whole, start_step):
        first = step * m
        batch = batch[: len(batch) - m] + [as_conversation(text_pairs[(first + j) % len(text_pairs)]) for j in range(m)]
        yield batch[rank * b : (rank + 1) * b]
        step += 1


def _data_batches(data: str, cfg: DistillConfig, start_step: int) -> Iterator[list[Conversation]]:
    """The whole batches of `cfg.batch_size` from `start_step` on."""
    if data == "toyworld":
        generator = toyworld()
        first = generator.SPLITS["train"][0] + 5 * 10**8 + cfg.seed * 10**7 + start_step * cfg.batch_size
        ramp = cfg.curriculum_steps * cfg.batch_size

        def share(i: int) -> float:
            return 1.0 if ramp == 0 else min(1.0, (start_step * cfg.batch_size + i) / ramp)

        stream = toyworld_stream(first, share, generator.ANSWER_STYLES[cfg.answer_style])
        while True:
            yield [next(stream) for _ in range(cfg.batch_size)]
    convs, problems = load_jsonl(data)
    if problems:
        print(f"train: skipped {len(problems)} bad lines in {data}; first: {problems[0]}")
    g = torch.Generator().manual_seed(cfg.seed * 1000)
    step = 0
    while True:
        order = torch.randperm(len(convs), generator=g).tolist()
        for i in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            if step >= start_step:
                yield [convs[k] for k in order[i : i + cfg.batch_size]]
            step += 1
class AnswerCache:
    """The target's own greedy answers, keyed by (prompt, image bytes), appended to a JSONL file so
    a later run (or a resume) reuses them instead of generating again."""

    def __init__(self, path: Path, target: Target, max_new_tokens: int) -> None:
        self.path, self.target, self.max_new_tokens = path, target, max_new_tokens
        self.answers: dict[str, str] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                self.answers[rec["key"]] = rec["answer"]
        self.generated = 0

    @staticmethod
    def key(c: Conversation) -> str:
        h = hashlib.sha1(c.prompt.encode())
        for im in c.images:
            h.update(f"{im.size}{im.mode}".encode())
            h.update(im.tobytes())
        return h.hexdigest()

    def __call__(self, c: Conversation) -> Conversation:
        k = self.key(c)
        if k not in self.answers:
            engine = SpecEngine(self.target, PlainDrafter())
            inputs = encode_prompt(self.target, c.prompt, c.images)
            text = generate_text(engine, inputs, GenerationConfig(max_new_tokens=self.max_new_tokens)).text
            self.answers[k] = text
            self.generated += 1
            with self.path.open("a") as f:
                f.write(json.dumps({"key": k, "answer": text}) + "\n")
        return replace(c, answer=self.answers[k])



def magpie_for(target: Target, out: Path, cfg: DistillConfig, progress: bool) -> list[Pair]:
    """The target's own text-only pairs (cached in out/magpie.json), or [] when cfg asks for none."""
    if cfg.text_pairs == 0:
        return []
    tokenizer = target.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("--text-pairs needs a target whose tokenizer has a chat template (Magpie samples its user turn)")
    rounds = max(MagpieConfig.max_rounds, 3 * math.ceil(cfg.text_pairs / MagpieConfig.batch))  # room for unusable rounds
    openers = INSTRUCTION_OPENERS if cfg.text_style == "varied" else ()
    mcfg = MagpieConfig(n=cfg.text_pairs, seed=cfg.seed, answer_tokens=cfg.text_answer_tokens, max_rounds=rounds, openers=openers)
    pairs = cached_pairs(out / "magpie.json", target.model, tokenizer, mcfg, progress)
    if not pairs:
        raise DataError(f"the target wrote no usable Magpie instruction in {mcfg.max_rounds} rounds; train without --text-pairs")
    return pairs

