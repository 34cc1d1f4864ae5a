"""The held-out ToyWorld prompt sets, defined once.

Each set is a block of seeds of a split that training never draws from (training reads the train
split; these blocks sit in val / test), and each consumer has its own block, so no two
measurements share prompts by accident. The seeds are the ones the committed reports were made
with.

    heldout("bench", 12)                         # `vlmspec bench`: mixed tasks, test split
    heldout("drafter-eval", 8, per_task=True)    # `eval-drafter`, the ablate recipe (test; split="val": selection)
    heldout("distill-eval", 16, seed=0)          # the trainer's periodic evaluation (val split)
    heldout("target-eval", 600, per_task=True, tasks=SCORED)   # `python -m recipes eval-target` (test split)
    adversarial("photo_unknown", 5)              # the adaptive recipe: prompts no drafter is ready for
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from PIL import Image

from vlmspec.assets import SAMPLE_IMAGES
from vlmspec.data import toyworld
from vlmspec.inputs import load_image_file

if TYPE_CHECKING:
    from toyworld import AnswerStyle, Sample


@dataclass
class Conversation:
    """A prompt with its images and a reference answer (what training and evaluation read)."""

    prompt: str
    answer: str
    images: list[Image.Image] = field(default_factory=list)
    task: str = ""
    sample: Sample | None = None  # the ToyWorld item it came from (for scoring)
    # later (prompt, answer) turns of the same dialogue, text only (the images stay in context)
    followups: list[tuple[str, str]] = field(default_factory=list)
    # the last answer was cut short (a length limit): training supervises no end of turn after it
    open_end: bool = False

    @classmethod
    def from_sample(cls, s: Sample) -> "Conversation":
        return cls(s.prompt, s.answer, [s.image] if s.image is not None else [], s.task, s)


def toyworld_conversation(seed: int, task: str | None = None, style: AnswerStyle | None = None) -> Conversation:
    """ToyWorld item `seed` (its `task`, answered in `style`: the generator's SHORT by default)."""
    generator = toyworld()
    return Conversation.from_sample(generator.make_sample(seed, task, style or generator.SHORT))


# name -> (default split, first seed's offset into the split, seed stride per `seed` argument)
SETS: dict[str, tuple[str, int, int]] = {
    "bench": ("test", 700_000, 0),
    "drafter-eval": ("test", 800_000, 0),
    "distill-eval": ("val", 500_000, 10_000),
    "target-eval": ("test", 0, 100_000),
    "smoke": ("test", 950_000, 1),
    "sft-eval": ("val", 0, 0),  # train-target's held-out answer loss  # the bundled model's smoke tests (tests/test_bundled.py)
}


def heldout(name: str, n: int, *, split: str | None = None, per_task: bool = False,
            tasks: tuple[str, ...] | None = None, seed: int = 0) -> list[Conversation]:
    """`n` prompts of the named set (mixed tasks), or with per_task=True `n` prompts of each task
    in `tasks` (every ToyWorld task by default; interleaved: task order within each round)."""
    if name not in SETS:
        raise ValueError(f"unknown held-out set {name!r}: expected one of {sorted(SETS)}")
    default_split, offset, stride = SETS[name]
    generator = toyworld()
    tasks = generator.TASKS if tasks is None else tasks
    lo = generator.SPLITS[split or default_split][0] + offset + seed * stride
    if not per_task:
        return [toyworld_conversation(lo + i) for i in range(n)]
    return [toyworld_conversation(lo + i * len(tasks) + j, t) for i in range(n) for j, t in enumerate(tasks)]


# Held-out text-only instructions (no image): how far an aligned target's text behaviour moved from
# its language model's (`python -m recipes eval-target --text-reference`). Written for this purpose, general
# chat requests of the kind an instruct model is tuned on; none appears in any training data here.
TEXT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for sleeping better.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Name three planets of the solar system.",
    "How do I boil an egg?",
    "Write a short thank-you note to a teacher.",
    "What does a computer's CPU do?",
    "Suggest a name for a small coffee shop.",
    "Summarise the story of Cinderella in one sentence.",
    "What are the primary colours?",
    "List four animals that live in the ocean.",
    "Why do we have seasons on Earth?",
    "Give an example of a healthy breakfast.",
)


# The adversarial sets of `python -m recipes adaptive` (issue #21): prompts where a drafter has little
# to go on. Questions about the sample photographs that nothing in them answers; strings of random
# vocabulary tokens; general text instructions (TEXT_PROMPTS: no drafter here was trained on them).
PHOTO_QUESTIONS = (
    "What is the serial number printed on the underside of the main object?",
    "What was the photographer's grandmother's maiden name?",
    "How much did everything in this picture cost in 1987, in yen?",
    "Read out the licence plate of the car parked just outside the frame.",
    "Which song was playing on the radio when this was taken?",
)
ADVERSARIAL = ("photo_unknown", "random_tokens", "unseen_text")

# Held-out follow-up turns: later user turns worded apart from the data engine's
# (`vlmspec.data.prompts.FOLLOWUPS`), asked after a held-out instruction and the target's own answer.
FOLLOWUP_QUESTIONS = (
    "Could you rephrase that for a beginner?",
    "Tell me more about the part you find most interesting.",
    "What would be a good first step?",
    "Please add one detail you skipped.",
    "Could you condense that into two sentences?",
    "Which of those matters most, and why?",
)
DESCRIBE_PHOTO = "Tell me what this photograph shows."  # the described-photographs task of `eval_set("photo")`

# `eval_set`'s names: what a drafter is measured on, none of it trained on (`vlmspec eval-drafter --sets`)
EVAL_SETS = ("toyworld", "text", "photo", "followup")


def adversarial(kind: str, n: int, tokenizer=None, seed: int = 0, words: int = 24) -> list[Conversation]:
    """`n` prompts of one adversarial kind. photo_unknown: the sample photographs (assets/images,
    ToyWorld renders left out) in turn with PHOTO_QUESTIONS; random_tokens: `words` vocabulary
    tokens drawn uniformly (needs `tokenizer`; special tokens left out), decoded; unseen_text:
    TEXT_PROMPTS in turn."""
    if kind == "photo_unknown":
        photos = sorted(p for p in SAMPLE_IMAGES.glob("*.jpg"))
        assert photos, f"no sample photographs in {SAMPLE_IMAGES}"
        return [Conversation(PHOTO_QUESTIONS[i % len(PHOTO_QUESTIONS)], "", [load_image_file(photos[i % len(photos)])], kind) for i in range(n)]
    if kind == "random_tokens":
        if tokenizer is None:
            raise ValueError("random_tokens prompts need the target's tokenizer")
        special = set(tokenizer.all_special_ids)
        ids = [i for i in range(len(tokenizer)) if i not in special]
        rng = random.Random(seed)
        return [Conversation(tokenizer.decode(rng.choices(ids, k=words)), "", [], kind) for _ in range(n)]
    if kind == "unseen_text":
        return [Conversation(TEXT_PROMPTS[(seed + i) % len(TEXT_PROMPTS)], "", [], kind) for i in range(n)]
    raise ValueError(f"unknown adversarial set {kind!r}: expected one of {ADVERSARIAL}")


def eval_set(name: str, n: int) -> list[Conversation]:
    """A held-out evaluation set (`EVAL_SETS`), n prompts of each of its tasks. toyworld: the
    drafter-eval block of the test split; text: TEXT_PROMPTS ("unseen_text"); photo: the sample
    photographs, which no corpus draws from, asked what nothing in them answers ("photo_unknown")
    and to describe them ("photo_describe"); followup: a held-out instruction, the target's own
    answer (written at evaluation: the empty answers), then FOLLOWUP_QUESTIONS."""
    if name == "toyworld":
        return heldout("drafter-eval", n, per_task=True)
    if name == "text":
        return adversarial("unseen_text", n)
    if name == "photo":
        unknown = adversarial("photo_unknown", n)
        return unknown + [Conversation(DESCRIBE_PHOTO, "", c.images, "photo_describe") for c in unknown]
    if name == "followup":
        return [Conversation(TEXT_PROMPTS[(i + 7) % len(TEXT_PROMPTS)], "", [], "followup",
                             followups=[(FOLLOWUP_QUESTIONS[i % len(FOLLOWUP_QUESTIONS)], "")]) for i in range(n)]
    raise ValueError(f"unknown evaluation set {name!r}: expected one of {EVAL_SETS}")
