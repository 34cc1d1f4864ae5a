"""`vlmspec train`'s configuration: what a drafter's training run is (`vlmspec.train.distill`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmspec.data import ANSWER_STYLES
from vlmspec.train.loop import TrainConfig

TEXT_STYLES = ("plain", "varied")  # DistillConfig.text_style


@dataclass
class DistillConfig(TrainConfig):
    """A drafter's training run (the shared fields are `TrainConfig`'s; under torchrun
    `batch_size` is each process's share of the step's batch)."""

    steps: int = 1000
    batch_size: int = 8
    lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    w_ce: float = 0.1
    w_feat: float = 1.0
    ttt_steps: int = 2  # 1 = no training-time test
    curriculum_steps: int = 0  # text-only share ramps from 1 to 0 over these steps (ToyWorld); 0 = off
    eval_every: int = 200
    eval_n: int = 12  # held-out prompts of each evaluation (mean accepted length); 0 = no evaluation
    ckpt_every: int = 100
    # VLM-aware head variant (vision_compress.VisualConfig as a dict); {} = the plain EAGLE head
    visual: dict[str, Any] = field(default_factory=dict)
    # ViSpec: train on the target's own (greedy) answers instead of the dataset's, cached on disk
    regenerate: bool = False
    regen_max_tokens: int = 256
    # a trimmed draft vocabulary: the head predicts the K tokens the target writes most often in the
    # first `draft_vocab_samples` training answers (VocabTrim / EAGLE-3's d2t); 0 = the whole vocabulary
    draft_vocab: int = 0
    draft_vocab_samples: int = 256
    # SpecDec++: an acceptance-prediction head trained alongside (its inputs detached), its stop
    # threshold chosen on validation prompts after training
    acceptance_head: bool = False
    accept_top_k: int = 4  # children per position it learns about (the tree's top_k)
    w_accept: float = 0.1
    accept_rej_weight: float = 1.0  # weight of the rejected class in the BCE (the paper's w_rej / w_acc)
    # text-only prompts for a target with a chat template (Magpie): `text_pairs` instructions and
    # greedy answers the target writes itself, cached in OUT/magpie.json, `text_share` of each batch
    text_pairs: int = 0
    text_share: float = 0.25
    text_answer_tokens: int = 96
    text_style: str = "plain"  # plain: Magpie's open user turn; varied: turns started with magpie.INSTRUCTION_OPENERS
    # ToyWorld's answers phrased as the target was aligned (train-align --answer-style), so the
    # contexts the drafter learns on are the ones the target writes (vlmspec.data.ANSWER_STYLES)
    answer_style: str = "short"
    # continued training: start from this drafter folder's weights (same head shape, trimmed
    # vocabulary size, visual variant and acceptance head); the draft vocabulary is recounted on
    # this run's data. "" = a fresh head
    init_from: str = ""
    # the head: "eagle1" (EagleHead) or "eagle3" (Eagle3Head: three target layers, its own LM head)
    arch: str = "eagle1"
    # eagle3: the target layers whose hidden states the head reads (HF hidden_states ids); () = EAGLE-3's defaults
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in ("eagle1", "eagle3"):
            raise ValueError(f"arch must be eagle1 or eagle3, got {self.arch!r}")
        self.feature_layers = tuple(self.feature_layers)
        if self.feature_layers and self.arch != "eagle3":
            raise ValueError("feature_layers choose an eagle3 head's layers: train arch eagle3, or leave them out")
        if self.arch == "eagle3" and self.visual:
            raise ValueError("the VLM-aware variants (visual) are EAGLE-1 heads: train eagle3 without one")
        if not 0.0 <= self.text_share <= 1.0 or self.text_pairs < 0:
            raise ValueError(f"text_pairs must be >= 0 and text_share in [0, 1], got {self.text_pairs}, {self.text_share}")
        if self.text_style not in TEXT_STYLES:
            raise ValueError(f"text_style must be one of {TEXT_STYLES}, got {self.text_style!r}")
        if self.acceptance_head and self.eval_n < 1:
            raise ValueError("the acceptance head's stop threshold is chosen on the held-out prompts: eval_n must be >= 1")
        if self.answer_style not in ANSWER_STYLES:
            raise ValueError(f"answer_style must be one of {sorted(ANSWER_STYLES)}, got {self.answer_style!r}")

    @property
    def text_per_batch(self) -> int:
        """Magpie pairs in each batch (0 without pairs)."""
        return round(self.text_share * self.batch_size) if self.text_pairs else 0

