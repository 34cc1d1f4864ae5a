"""The held-out ToyWorld prompt sets, defined once.

Each set is a block of seeds of a split that training never draws from (training reads the train
split; these blocks sit in val / test), and each consumer has its own block, so no two
measurements share prompts by accident. The seeds are the ones the committed reports were made
with.

    heldout("bench", 12)                         # `vlmspec bench`: mixed tasks, test split
    heldout("drafter-eval", 8, per_task=True)    # `eval-drafter`, `bench ablate` (test; split="val": selection)
    heldout("distill-eval", 16, seed=0)          # the trainer's periodic evaluation (val split)
    heldout("target-eval", 600, per_task=True, tasks=SCORED)   # `eval-target` (test split)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

from vlmspec.data import toyworld


@dataclass
class Conversation:
    """A prompt with its images and a reference answer (what training and evaluation read)."""

    prompt: str
    answer: str
    images: list[Image.Image] = field(default_factory=list)
    task: str = ""
    sample: toyworld.Sample | None = None  # the ToyWorld item it came from (for scoring)
    # later (prompt, answer) turns of the same dialogue, text only (the images stay in context)
    followups: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def from_sample(cls, s: toyworld.Sample) -> "Conversation":
        return cls(s.prompt, s.answer, [s.image] if s.image is not None else [], s.task, s)


def toyworld_conversation(seed: int, task: str | None = None) -> Conversation:
    return Conversation.from_sample(toyworld.make_sample(seed, task))


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
            tasks: tuple[str, ...] = toyworld.TASKS, seed: int = 0) -> list[Conversation]:
    """`n` prompts of the named set (mixed tasks), or with per_task=True `n` prompts of each task
    in `tasks` (interleaved: task order within each round)."""
    if name not in SETS:
        raise ValueError(f"unknown held-out set {name!r}: expected one of {sorted(SETS)}")
    default_split, offset, stride = SETS[name]
    lo = toyworld.SPLITS[split or default_split][0] + offset + seed * stride
    if not per_task:
        return [toyworld_conversation(lo + i) for i in range(n)]
    return [toyworld_conversation(lo + i * len(tasks) + j, t) for i in range(n) for j, t in enumerate(tasks)]


# Held-out text-only instructions (no image): how far an aligned target's text behaviour moved from
# its language model's (`vlmspec eval-target --text-reference`). Written for this purpose, general
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
