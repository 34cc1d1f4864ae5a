"""`vlmspec train`: online-logit distillation of an EAGLE-style draft head against a frozen target.

No stored hidden-state corpus: every batch runs the target (the teacher) on the fly for its
features F [B, T, H] and logits. The head reads pairs (F_t, x_{t+1}) and is trained with

    loss = w_ce * CE(lm_head(h_t), softmax(teacher_logits_{t+1}))  +  w_feat * SmoothL1(h_t, F_{t+1})

(SpecVLM's online-logit distillation, defaults 0.1 / 1.0), plus training-time test: the head is
unrolled `ttt_steps` times, step j reading its OWN predictions of step j-1 as features, so it
learns to draft from what it will really see at depth j. (An approximation of EAGLE-3's TTT:
within step j the head attends causally over that step's sequence of predicted features.)

With `acceptance_head` (SpecDec++) a small head learns beside it, on the head's detached outputs,
whether each of the top-k draft children at every unrolled position is the teacher's next token
(the greedy acceptance given that the path so far was accepted): weighted binary cross-entropy,
`accept_rej_weight` on the rejected class as in the paper. Its stop threshold is then chosen on
validation prompts (`choose_stop_threshold`).

Only answer positions are trained (labels != -100). Data: ToyWorld (with a text-only-first
curriculum) or a LLaVA-style JSONL. Checkpoints are safetensors with exact resume; under
torchrun each rank draws its own data and the head's gradients are averaged (all-reduce).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from vlmspec.data import toyworld
from vlmspec.data.heldout import Conversation, heldout
from vlmspec.draft.base import NoDrafter, TreeConfig
from vlmspec.draft.eagle import EagleConfig, EagleDrafter, EagleHead, draft_entropy, draft_vocabulary
from vlmspec.control import CostModel, FixedPolicy
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.cost import COST_PROMPT, measure_cost
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams
from vlmspec.stats import SpecStats
from vlmspec.target import Target
from vlmspec.target.model import last_hidden
from vlmspec.text import generate_text
from vlmspec.train.common import clipped_step, save_checkpoint_dir, warmup_cosine
from vlmspec.train.magpie import INSTRUCTION_OPENERS, MagpieConfig, Pair, as_conversation, cached_pairs
from vlmspec.train.data import DataError, encode_conversations, load_jsonl, toyworld_stream
from vlmspec.vision_compress import VisualConfig
from vlmspec.vision_compress.capture import capture, image_token_id, last_layer_attention


TEXT_STYLES = ("plain", "varied")  # DistillConfig.text_style


@dataclass
class DistillConfig:
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
    seed: int = 0
    eval_every: int = 200
    eval_n: int = 12
    ckpt_every: int = 100
    minutes: float | None = None
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
    # contexts the drafter learns on are the ones the target writes (toyworld.ANSWER_STYLES)
    answer_style: str = "short"
    # continued training: start from this drafter folder's weights (same head shape, trimmed
    # vocabulary size, visual variant and acceptance head); the draft vocabulary is recounted on
    # this run's data. "" = a fresh head
    init_from: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.text_share <= 1.0 or self.text_pairs < 0:
            raise ValueError(f"text_pairs must be >= 0 and text_share in [0, 1], got {self.text_pairs}, {self.text_share}")
        if self.text_style not in TEXT_STYLES:
            raise ValueError(f"text_style must be one of {TEXT_STYLES}, got {self.text_style!r}")
        if self.answer_style not in toyworld.ANSWER_STYLES:
            raise ValueError(f"answer_style must be one of {sorted(toyworld.ANSWER_STYLES)}, got {self.answer_style!r}")

    @property
    def text_per_batch(self) -> int:
        """Magpie pairs in each batch (0 without pairs)."""
        return round(self.text_share * self.batch_size) if self.text_pairs else 0


# ------------------------------------------------------------------------------------ losses
def soft_ce(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """[..., V] x [..., V] -> [...]: cross-entropy against the teacher's distribution."""
    return -(teacher_logits.float().softmax(-1) * draft_logits.float().log_softmax(-1)).sum(-1)


@dataclass
class RowBatch:
    """The head's step-1 rows for a batch (see vision_compress.adaptor). Shapes [B, T] / [B, T, H]."""

    tokens: torch.Tensor  # token that follows each row's feature
    feats: torch.Tensor
    positions: torch.Tensor
    keep: torch.Tensor  # bool
    direct: torch.Tensor | None  # bool, None = no decoupled rows
    fuse: torch.Tensor | None  # bool, None = no global feature
    fixed: torch.Tensor  # bool: image-content rows (keep their input in every unroll step)
    global_feat: torch.Tensor | None  # [B, H]
    gate_logits: torch.Tensor | None = None  # [B, C] the gate's logits (gate variants)
    gate_fracs: torch.Tensor | None = None  # [B, C] fraction of each sample's image tokens each choice keeps


def plain_rows(input_ids: torch.Tensor, feats: torch.Tensor, pad_id: int = 0) -> RowBatch:
    """The plain head's rows: (F_t, x_{t+1}) at position t."""
    B, T, _ = feats.shape
    toks = torch.cat([input_ids[:, 1:], input_ids.new_full((B, 1), pad_id)], 1)
    pos = torch.arange(T, device=feats.device).expand(B, T)
    none = torch.zeros(B, T, dtype=torch.bool, device=feats.device)
    return RowBatch(toks, feats, pos, ~none, None, None, none, None)


def visual_rows(head: EagleHead, input_ids: torch.Tensor, feats: torch.Tensor, captured: dict[str, torch.Tensor],
                force: str | None = None) -> RowBatch:
    """Rows of a VLM-aware head, sample by sample through its VisualAdaptor; `force` makes a
    gate use that choice for every sample (gated_losses)."""
    from vlmspec.draft.eagle import question_embedding

    B, T, H = feats.shape
    image_mask, embeds, attention, prompt_len = captured["image_mask"], captured["inputs_embeds"], captured["attention"], captured["prompt_len"]
    out: list = []
    for b in range(B):
        ids = torch.cat([input_ids[b], input_ids.new_zeros(1)])
        q = question_embedding(head, input_ids[b, : int(prompt_len[b])], image_mask[b, : int(prompt_len[b])])
        out.append(head.visual.prompt_rows(ids, feats[b], image_mask[b], embeds[b, image_mask[b]], attention[b], q, force))
    st = lambda name: torch.stack([getattr(r, name) for r in out])  # noqa: E731
    has_global = head.visual.cfg.global_feature
    glob = torch.stack([r.global_feat if r.global_feat is not None else feats.new_zeros(H) for r in out]) if has_global else None
    gated = head.visual.gate is not None
    fracs = [head.visual.kept_fractions(max(1, int(image_mask[b].sum()))) for b in range(B)] if gated else None
    return RowBatch(
        st("tokens"), st("feats"), st("positions"), st("keep"),
        st("direct") if head.visual.cfg.decouple else None,
        st("fuse") if has_global else None,
        st("fixed"), glob,
        torch.stack([r.gate_logits if r.gate_logits is not None else feats.new_zeros(len(head.visual.names)) for r in out]) if gated else None,
        torch.stack(fracs).to(feats.device) if gated else None,
    )


def distill_losses(
    head: EagleHead,
    rows: RowBatch,  # the head's step-1 rows
    feats: torch.Tensor,  # [B, T, H] teacher features (last hidden state)
    teacher_logits: torch.Tensor,  # [B, T, V]
    labels: torch.Tensor,  # [B, T], -100 = not trained
    cfg: DistillConfig,
    row_weights: torch.Tensor | None = None,  # [B] weight of each sample's rows (gated_losses); None = 1
) -> tuple[torch.Tensor, dict[str, float]]:
    """The unrolled distillation loss. Step j (1-based), row t stands at slot t+j-1: it reads
    (the step-(j-1) prediction of F_{t+j-1} [the teacher's F_t at step 1], token x_{t+j}) and
    predicts F_{t+j} and the teacher's next-token distribution there. Image-content rows keep
    their input in every step; dropped (compressed-away) rows are hidden from every query."""
    B, T, _ = feats.shape
    total = feats.new_zeros(())
    stats: dict[str, float] = {}
    prev = rows.feats  # step 1 reads the teacher's own features (or image content)
    causal = torch.ones(T, T, dtype=torch.bool, device=feats.device).tril()
    for j in range(1, cfg.ttt_steps + 1):
        n = T - j
        if n <= 1:
            break
        sl = slice(j - 1, j - 1 + n)
        inp = torch.where(rows.fixed[:, sl, None], rows.feats[:, sl], prev[:, :n])  # [B, n, H]
        keep = rows.keep[:, sl]
        mask = None
        if not bool(keep.all()):
            allowed = (causal[:n, :n] & keep[:, None, :]) | torch.eye(n, dtype=torch.bool, device=feats.device)
            mask = torch.zeros(B, 1, n, n, dtype=inp.dtype, device=feats.device).masked_fill(~allowed[:, None], torch.finfo(inp.dtype).min)
        h = head(
            rows.tokens[:, sl], inp, rows.positions[:, sl], mask, None,
            None if rows.direct is None else rows.direct[:, sl],
            None if rows.fuse is None else rows.fuse[:, sl],
            rows.global_feat,
        )  # [B, n, H]
        target_f = feats[:, j : j + n]  # F_{t+j}
        target_l = teacher_logits[:, j : j + n]  # p(x_{t+j+1} | ...)
        lmask = torch.zeros(B, n, dtype=torch.bool, device=feats.device)
        lmask[:, :-1] = labels[:, j + 1 : j + n] != -100  # the next token is an answer token
        lmask &= keep & ~rows.fixed[:, sl]
        if not lmask.any():
            break
        w = 1.0 if row_weights is None else row_weights[:, None].expand(B, n)[lmask]
        ce = (soft_ce(head.logits(h[lmask]), head.draft_view(target_l[lmask])) * w).mean()
        fl = (F.smooth_l1_loss(h[lmask].float(), target_f[lmask].float(), reduction="none").mean(-1) * w).mean()
        total = total + (cfg.w_ce * ce + cfg.w_feat * fl) / cfg.ttt_steps
        with torch.no_grad():
            acc = (head.target_ids(head.logits(h[lmask]).argmax(-1)) == target_l[lmask].argmax(-1)).float().mean()
        stats.update({f"ce{j}": float(ce.detach()), f"feat{j}": float(fl.detach()), f"acc{j}": float(acc)})
        if head.accept is not None:
            bce, calib = acceptance_loss(head, h[lmask].detach(), target_l[lmask], cfg)
            total = total + cfg.w_accept * bce / cfg.ttt_steps
            stats.update({f"accept_bce{j}": float(bce.detach()), f"accept_rate{j}": calib})
        prev = h
    return total, stats


def gated_losses(
    head: EagleHead,
    input_ids: torch.Tensor,  # [B, T]
    feats: torch.Tensor,  # [B, T, H] teacher features
    captured: dict[str, torch.Tensor],  # teacher(visual=True)
    teacher_logits: torch.Tensor,  # [B, T, V]
    labels: torch.Tensor,  # [B, T]
    cfg: DistillConfig,
    gate_cost: float,
    tau: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A gate's training loss (Gumbel-softmax relaxation of the per-input choice). Every choice c
    gives its rows and its distillation loss; y = gumbel_softmax(gate logits) [B, C] weighs
    sample b's rows under choice c by y[b, c]. The gate's gradient moves its mass toward the
    choices with the lower loss for that question, and every compressor keeps learning in
    proportion to how often it would be picked. + gate_cost x the expected kept fraction."""
    total = feats.new_zeros(())
    stats: dict[str, float] = {}
    y = probs = fracs = None
    for c, name in enumerate(head.visual.names):
        rows = visual_rows(head, input_ids, feats, captured, force=name)
        assert rows.gate_logits is not None and rows.gate_fracs is not None
        if y is None:
            y = F.gumbel_softmax(rows.gate_logits, tau=tau, hard=False)  # [B, C]
            probs, fracs = rows.gate_logits.softmax(-1), rows.gate_fracs
        loss_c, st = distill_losses(head, rows, feats, teacher_logits, labels, cfg, row_weights=y[:, c])
        total = total + loss_c
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + v / len(head.visual.names)
    assert probs is not None and fracs is not None
    kept = (probs * fracs).sum(-1).mean()
    if gate_cost > 0:
        total = total + gate_cost * kept
    stats["gate_kept"] = float(kept.detach())
    stats["gate_entropy"] = float(-(probs * probs.clamp_min(1e-9).log()).sum(-1).mean().detach())
    return total, stats


@torch.no_grad()
def teacher(target: Target, batch: dict[str, torch.Tensor], visual: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Frozen target forward: (features [B, T, H], logits [B, T, V], captured). With visual=True,
    captured holds image_mask [B, T], inputs_embeds [B, T, H], prompt_len [B] and attention
    [B, T] (last layer, from each sample's last prompt token)."""
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    # (M-RoPE targets compute their 3-axis positions from mm_token_type_ids inside this forward)
    with capture(target.model) if visual else nullcontext() as cap:
        out = target.model(**kwargs, output_hidden_states=True, return_dict=True)
    captured: dict[str, torch.Tensor] = {}
    if visual:
        ids = batch["input_ids"]
        answer = batch["labels"] != -100
        prompt_len = torch.where(answer.any(1), answer.float().argmax(1), torch.full_like(ids[:, 0], ids.shape[1]))
        captured = {
            "image_mask": ids == image_token_id(target.model),
            "inputs_embeds": cap.inputs_embeds,
            "prompt_len": prompt_len,
            "attention": last_layer_attention(target.model, cap, (prompt_len - 1).clamp(min=0)),
        }
    return last_hidden(out.hidden_states), out.logits, captured


# ------------------------------------------------------------------------------------ data
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


def conversations(data: str, cfg: DistillConfig, rank: int, start_step: int, text_pairs: list[Pair] = ()) -> Iterator[list[Conversation]]:
    """Batches of conversations; a pure function of (data, seed, rank, step, text_pairs) for exact
    resume. With `text_pairs`, the last `cfg.text_per_batch` of each batch are those pairs, in turn."""
    m = cfg.text_per_batch if text_pairs else 0
    step = start_step
    for batch in _data_batches(data, cfg, rank, start_step):
        first = (step * max(world_size(), 1) + rank) * m
        yield batch[: len(batch) - m] + [as_conversation(text_pairs[(first + j) % len(text_pairs)]) for j in range(m)]
        step += 1


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _data_batches(data: str, cfg: DistillConfig, rank: int, start_step: int) -> Iterator[list[Conversation]]:
    if data == "toyworld":
        first = toyworld.SPLITS["train"][0] + 5 * 10**8 + cfg.seed * 10**7 + rank * 10**6 + start_step * cfg.batch_size
        ramp = cfg.curriculum_steps * cfg.batch_size

        def share(i: int) -> float:
            return 1.0 if ramp == 0 else min(1.0, (start_step * cfg.batch_size + i) / ramp)

        stream = toyworld_stream(first, share, toyworld.ANSWER_STYLES[cfg.answer_style])
        while True:
            yield [next(stream) for _ in range(cfg.batch_size)]
    convs, problems = load_jsonl(data)
    if problems:
        print(f"train: skipped {len(problems)} bad lines in {data}; first: {problems[0]}")
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
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
            engine = SpecEngine(self.target, NoDrafter())
            inputs = encode_prompt(self.target, c.prompt, c.images)
            text = generate_text(engine, inputs, GenerationConfig(max_new_tokens=self.max_new_tokens)).text
            self.answers[k] = text
            self.generated += 1
            with self.path.open("a") as f:
                f.write(json.dumps({"key": k, "answer": text}) + "\n")
        return replace(c, answer=self.answers[k])


# ------------------------------------------------------------------------------------ eval
@torch.no_grad()
def accepted_length(
    target: Target,
    drafter: Any,
    prompts: list[Conversation],
    temperature: float = 0.0,
    max_new_tokens: int = 96,
) -> dict[str, float]:
    """Mean accepted length (bonus included, `SpecStats.mean_accepted_length`) per task and
    overall ("all"), over the given prompts: each generation's stats added up per task."""
    engine = SpecEngine(target, drafter)
    per: dict[str, SpecStats] = {}
    total = SpecStats()
    for i, c in enumerate(prompts):
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=temperature), seed=i)
        r = engine.generate(encode_prompt(target, c.prompt, c.images), cfg)
        task = per.setdefault(c.task, SpecStats())
        task += r.stats
        total += r.stats
    out = {task: stats.mean_accepted_length for task, stats in per.items()}
    out["all"] = total.mean_accepted_length
    return out


STOP_GRID = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def choose_stop_threshold(target: Target, drafter: EagleDrafter, prompts: list[Conversation], cost: CostModel,
                          grid: tuple[float, ...] = STOP_GRID, max_new_tokens: int = 96) -> tuple[float, list[dict[str, float]]]:
    """SpecDec++'s threshold, chosen on validation prompts: greedy generations at the drafter's
    full depth under each threshold of `grid`, scored by modelled goodput = emitted tokens /
    the `cost` model's seconds for the levels each step grew (counted, so the choice does not ride
    on this machine's timing noise). Returns (best threshold, one row per threshold); ties go to
    the lower threshold."""
    rows = []
    for thr in grid:
        engine = SpecEngine(target, EagleDrafter(drafter.head, drafter.tree, thr))
        total = SpecStats()
        for i, c in enumerate(prompts):
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, seed=i, policy=FixedPolicy())
            total += engine.generate(encode_prompt(target, c.prompt, c.images), cfg).stats
        levels = sum(total.reached_per_pos)
        reached = [total.num_drafts, *total.reached_per_pos, 0]  # [d]: steps that grew at least d levels
        seconds = sum((reached[d] - reached[d + 1]) * cost.seconds(d) for d in range(len(reached) - 1))  # steps of exactly d levels
        rows.append({"threshold": thr, "tau": total.mean_accepted_length, "levels_per_step": levels / max(total.num_drafts, 1),
                     "drafted_per_accepted": total.num_draft_tokens / max(total.num_accepted_tokens, 1),
                     "modelled_tokens_per_s": total.num_emitted_tokens / seconds})
    best = max(rows, key=lambda r: (r["modelled_tokens_per_s"], -r["threshold"]))
    return best["threshold"], rows


# ------------------------------------------------------------------------------------ loop
CKPT = "checkpoint"


def _lr(step: int, cfg: DistillConfig) -> float:
    return warmup_cosine(step, cfg.steps, cfg.lr, cfg.warmup, 0.1)


def _save(out: Path, head: EagleHead, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    save_checkpoint_dir(out / CKPT, head.head_state_dict(), "head.safetensors", opt, state)


def _plot(history: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    tr = [h for h in history if "loss" in h]
    a.plot([h["step"] for h in tr], [h["loss"] for h in tr], lw=0.8)
    a.set_xlabel("step")
    a.set_ylabel("distillation loss")
    a.set_yscale("log")
    a.grid(alpha=0.3)
    ev = [h for h in history if "tau" in h]
    if ev:
        b.plot([h["step"] for h in ev], [h["tau"] for h in ev], "o-")
    b.set_xlabel("step")
    b.set_ylabel("mean accepted length (T=0, held out)")
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def acceptance_loss(head: EagleHead, hidden: torch.Tensor, teacher_logits: torch.Tensor, cfg: DistillConfig) -> tuple[torch.Tensor, float]:
    """SpecDec++'s loss. hidden [N, H] (detached head outputs), teacher_logits [N, V] -> (weighted
    BCE of the acceptance head on whether each of the top-k draft children is the teacher's argmax,
    the fraction of children that are). The head's own weights get no gradient from it."""
    with torch.no_grad():
        logp = torch.log_softmax(head.logits(hidden), -1)  # [N, V']
        top = logp.topk(min(cfg.accept_top_k, logp.shape[-1]), dim=-1)  # [N, k]
        accepted = (head.target_ids(top.indices) == teacher_logits.argmax(-1, keepdim=True)).float()  # [N, k]
        weight = torch.where(accepted > 0, 1.0, cfg.accept_rej_weight)
    logits = head.accept(hidden, top.values, draft_entropy(logp))  # [N, k]
    return F.binary_cross_entropy_with_logits(logits, accepted, weight=weight), float(accepted.mean())


def mixed_precision(target: Target):
    """The head keeps float32 weights; with a bf16 / fp16 target it computes in the target's dtype
    (autocast), as it will at inference."""
    if target.dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(target.device.type, dtype=target.dtype)
    return nullcontext()


def inference_copy(head: EagleHead, target: Target) -> EagleHead:
    """`head` as inference runs it: itself for a float32 target, else a copy in the target's dtype
    (evaluation during training must not round the float32 weights it trains)."""
    if target.dtype == torch.float32:
        return head
    twin = EagleHead(head.config, target.input_embeddings(), target.output_embeddings(), target.attention)
    twin.load_state_dict(head.state_dict(), strict=True)
    return twin.to(device=target.device, dtype=target.dtype).eval()


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


def warm_start(head: EagleHead, target: Target, folder: str | Path) -> None:
    """Copy a trained drafter's weights into `head` (fp32 master weights); DataError unless the
    two have the same shape, trimmed vocabulary size, visual variant and acceptance head."""
    init = EagleDrafter.load(folder, target).head  # checked against the target, loaded strictly
    want, have = head.config, init.config
    diff = [f"{name}: {getattr(have, name)!r} (--init-from) != {getattr(want, name)!r} (this run)"
            for name in ("draft_vocab_size", "acceptance_head", "visual")  # the shape follows the target, checked on load
            if getattr(have, name) != getattr(want, name)]
    if diff:
        raise DataError(f"--init-from {folder}: a drafter of another kind ({'; '.join(diff)}); "
                        "train with the same --draft-vocab / --visual / --acceptance-head as it was")
    head.load_state_dict(init.head_state_dict(), strict=True)  # same config, so the same keys


def train_drafter(
    target: Target,
    data: str,
    out: str | Path,
    cfg: DistillConfig,
    resume: bool = False,
    tree: TreeConfig | None = None,
    progress: bool = True,
    stop_at: int | None = None,
) -> EagleDrafter:
    """Train (or resume) an EAGLE head for `target`; saves the drafter folder `out/drafter`.
    stop_at: end this run after that step (the schedule still spans cfg.steps; resume later)."""
    from tqdm import tqdm

    wall0 = time.perf_counter()  # this run's wall time: the Magpie pairs, evals and threshold choice included
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    world = world_size()
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if target.device.type == "cuda" else "gloo")
    for p in target.model.parameters():
        p.requires_grad_(False)
    target.model.eval()
    torch.manual_seed(cfg.seed)
    ecfg = EagleConfig.from_target(target)
    ecfg.draft_vocab_size = cfg.draft_vocab
    ecfg.acceptance_head = cfg.acceptance_head
    vis = VisualConfig.from_dict(cfg.visual).sized_for(target.image_tokens)  # the resampler's queries cover one image
    if not vis.is_plain:
        ecfg.extra["visual"] = vis.to_dict()
    head = EagleHead(ecfg, target.input_embeddings(), target.output_embeddings(), target.attention)
    head.to(device=target.device, dtype=torch.float32)
    if cfg.init_from and not resume:
        warm_start(head, target, cfg.init_from)
    if world > 1:  # every rank starts from rank 0's weights; gradients are averaged below
        for p in head.parameters():
            torch.distributed.broadcast(p.data, 0)
    state: dict[str, Any] = {"step": 0, "history": [], "elapsed_s": 0.0}
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    if resume:
        ck = out / CKPT
        if not ck.is_dir():
            raise FileNotFoundError(f"--resume: no checkpoint in {ck}")
        head.load_state_dict(load_file(str(ck / "head.safetensors")), strict=True)
        opt.load_state_dict(torch.load(ck / "optimizer.pt", weights_only=True))
        state = json.loads((ck / "trainer_state.json").read_text())
    state["config"] = asdict(cfg)
    regen = AnswerCache(out / f"answers_rank{rank}.jsonl", target, cfg.regen_max_tokens) if cfg.regenerate else None
    text_pairs = magpie_for(target, out, cfg, progress and rank == 0)
    if text_pairs:
        state["magpie_pairs"] = len(text_pairs)
    if head.trimmed and not resume:
        counts = answer_token_counts(target, conversations(data, cfg, rank, 0, text_pairs), cfg.draft_vocab_samples, regen)
        d2t = draft_vocabulary(counts, cfg.draft_vocab, always=tuple(sorted(target.eos_token_ids)))
        head.set_draft_vocab(d2t.to(head.d2t.device))
        ranked = counts.sort(descending=True).values.cumsum(0) / counts.sum().clamp(min=1)  # [V] coverage of the top K
        state["draft_vocab"] = {"size": cfg.draft_vocab, "coverage": float(counts[d2t].sum() / counts.sum().clamp(min=1)),
                                "samples": cfg.draft_vocab_samples, "answer_tokens": int(counts.sum()),
                                "coverage_by_k": {k: float(ranked[k - 1]) for k in (256, 1024, 2048, 4096, 8192, 16384) if k <= len(ranked)}}
    drafter = EagleDrafter(head, tree)
    held_out = heldout("distill-eval", cfg.eval_n)
    bar = tqdm(total=cfg.steps, initial=state["step"], disable=not progress or rank != 0, desc="train", dynamic_ncols=True)
    t0, elapsed0 = time.perf_counter(), state["elapsed_s"]
    tau_text = "-"
    for convs in conversations(data, cfg, rank, state["step"], text_pairs):
        step = state["step"]
        if step >= cfg.steps or (stop_at is not None and step >= stop_at):
            break
        if regen is not None:  # Magpie pairs already carry the target's own answers
            convs = [c if c.task == "magpie" else regen(c) for c in convs]
        batch = {k: v.to(target.device) if isinstance(v, torch.Tensor) else v for k, v in encode_conversations(target.processor, convs).items()}
        feats, logits, captured = teacher(target, batch, visual=head.visual is not None)
        head.train()
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg)
        feats = feats.float()
        with mixed_precision(target):
            if head.visual is None:
                loss, stats = distill_losses(head, plain_rows(batch["input_ids"], feats), feats, logits, batch["labels"], cfg)
            else:
                captured["inputs_embeds"] = captured["inputs_embeds"].float()
                if head.visual.gate is not None:
                    loss, stats = gated_losses(head, batch["input_ids"], feats, captured, logits, batch["labels"], cfg, vis.gate_cost)
                else:
                    rows = visual_rows(head, batch["input_ids"], feats, captured)
                    loss, stats = distill_losses(head, rows, feats, logits, batch["labels"], cfg)
        loss.backward()
        if world > 1:  # data parallel: average the head's gradients over the ranks
            for p in head.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= world
        if head.accept is not None:  # its own norm: the acceptance head never changes the drafter's own updates
            torch.nn.utils.clip_grad_norm_(head.accept.parameters(), cfg.grad_clip)
        clipped_step(opt, [p for n, p in head.named_parameters() if not n.startswith("accept.")], cfg.grad_clip)
        head.eval()
        state["step"] = step + 1
        state["elapsed_s"] = elapsed0 + time.perf_counter() - t0
        state["history"].append({"step": step, "loss": float(loss.detach()), **stats})
        if rank == 0 and (state["step"] % cfg.eval_every == 0 or state["step"] == cfg.steps):
            tau = accepted_length(target, EagleDrafter(inference_copy(head, target), tree), held_out)["all"]
            state["history"].append({"step": step, "tau": tau})
            tau_text = f"{tau:.2f}"
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc1=f"{stats.get('acc1', 0):.2f}", tau=tau_text)
        out_of_time = cfg.minutes is not None and (time.perf_counter() - t0) > cfg.minutes * 60
        if rank == 0 and (state["step"] % cfg.ckpt_every == 0 or state["step"] == cfg.steps or out_of_time):
            _save(out, head, opt, state)
            _plot(state["history"], out / "train_curve.png")
        if out_of_time:
            break
    bar.close()
    if rank == 0:
        if head.accept is not None:  # SpecDec++: the stop threshold, chosen on the validation prompts
            unstopped = EagleDrafter(inference_copy(head, target), tree, 0.0)
            cost = measure_cost(SpecEngine(target, unstopped), encode_prompt(target, COST_PROMPT))
            head.config.stop_threshold, rows = choose_stop_threshold(target, unstopped, held_out, cost)
            state["stop_threshold"] = {"chosen": head.config.stop_threshold, "cost": asdict(cost), "grid": rows}
            if progress:
                print(f"stop threshold {head.config.stop_threshold} (of {[r['threshold'] for r in rows]}, modelled goodput on {len(held_out)} validation prompts)")
        _save(out, head, opt, state)
        _plot(state["history"], out / "train_curve.png")
        head.to(target.dtype)
        drafter.save(out / "drafter")
        (out / "train_summary.json").write_text(json.dumps({"step": state["step"], "elapsed_s": state["elapsed_s"],
                                                                "run_wall_s": time.perf_counter() - wall0, "config": state["config"]}, indent=2))
    return drafter
