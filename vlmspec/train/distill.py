"""`vlmspec train`: online-logit distillation of an EAGLE-style draft head against a frozen target.

Every batch runs the target (the teacher) on the fly for its features F [B, T, H] and logits; the
head reads pairs (F_t, x_{t+1}) at answer positions (labels != -100) and is trained with

    loss = w_ce * CE(lm_head(h_t), softmax(teacher_logits_{t+1}))  +  w_feat * SmoothL1(h_t, F_{t+1})

(SpecVLM's, defaults 0.1 / 1.0; EAGLE-3, `--arch eagle3`: the CE alone), unrolled `ttt_steps` times,
step j reading its own predicted features of step j-1 (training-time test, approximated). With
`acceptance_head` (SpecDec++) a small head learns whether each top-k child is the teacher's next
token (weighted BCE), its stop threshold chosen on validation prompts (`choose_stop_threshold`).
Under torchrun (DistributedDataParallel) process r trains the r-th share of each step's batch and
losses are means over the whole batch (`distill_losses.shard_mean`), as one process would with it.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from vlmspec.policy.cost import COST_PROMPT, measure_cost
from vlmspec.data.heldout import heldout
from vlmspec.draft.base import TreeConfig
from vlmspec.draft.eagle import EagleConfig, EagleDrafter, EagleHead, build_head, draft_vocabulary
from vlmspec.engine import SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.target import Target
from vlmspec.train.common import clipped_step, save_checkpoint_dir
from vlmspec.train.data import DataError, encode_conversations
from vlmspec.train.distill_config import TEXT_STYLES, DistillConfig
from vlmspec.train.distill_data import AnswerCache, answer_token_counts, conversations, magpie_for
from vlmspec.train.distill_eval import STOP_GRID, accepted_length, choose_stop_threshold, inference_copy
from vlmspec.train.distill_losses import (
    DistillStep,
    RowBatch,
    acceptance_loss,
    distill_losses,
    gated_losses,
    mixed_precision,
    plain_rows,
    soft_ce,
    teacher,
    visual_rows,
)
from vlmspec.train.features import FeatureCache, collate, is_feature_cache
from vlmspec.train.loop import CKPT, Hooks, Stage, new_state, saved_state, train_loop, write_summary
from vlmspec.vision_compress import VisualConfig

__all__ = ["STOP_GRID", "TEXT_STYLES", "AnswerCache", "DistillConfig", "DistillStep", "RowBatch", "acceptance_loss",
           "accepted_length", "answer_token_counts", "choose_stop_threshold", "conversations", "distill_losses",
           "gated_losses", "inference_copy", "init_distributed", "plain_rows", "soft_ce", "teacher", "train_drafter",
           "visual_rows", "warm_start"]


def init_distributed(device: torch.device) -> tuple[int, int, bool]:
    """(rank, world size, whether this call set the process group up), from torchrun's environment
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): gloo on the CPU, NCCL on CUDA. (0, 1, False)
    in a plain single-process run."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, False
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), True


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


def warm_start(head: EagleHead, target: Target, folder: str | Path) -> None:
    """Copy a trained drafter's weights into `head` (fp32 master weights); DataError unless the
    two have the same shape, trimmed vocabulary size, visual variant and acceptance head."""
    init = EagleDrafter.load(folder, target).head  # checked against the target, loaded strictly
    want, have = head.config, init.config
    diff = [f"{name}: {getattr(have, name)!r} (--init-from) != {getattr(want, name)!r} (this run)"
            for name in ("arch", "feature_layers", "draft_vocab_size", "acceptance_head", "visual")  # the shape follows the target, checked on load
            if getattr(have, name) != getattr(want, name)]
    if diff:
        raise DataError(f"--init-from {folder}: a drafter of another kind ({'; '.join(diff)}); "
                        "train with the same --arch / --feature-layers / --draft-vocab / --visual / --acceptance-head as it was")
    head.load_state_dict(init.head_state_dict(), strict=True)  # same config, so the same keys



def new_head(target: Target, cfg: DistillConfig) -> EagleHead:
    """A fresh float32 head for `target`, of the config's kind (EAGLE-1 or EAGLE-3, trimmed vocabulary,
    acceptance head, visual variant)."""
    ecfg = EagleConfig.from_target(target, cfg.arch, cfg.feature_layers)
    ecfg.draft_vocab_size = cfg.draft_vocab
    ecfg.acceptance_head = cfg.acceptance_head
    vis = VisualConfig.from_dict(cfg.visual).sized_for(target.image_tokens)  # the resampler's queries cover one image
    if not vis.is_plain:
        ecfg.extra["visual"] = vis.to_dict()
    head = build_head(ecfg, target.input_embeddings(), target.output_embeddings(), target.attention)
    return head.to(device=target.device, dtype=torch.float32)


def trim_vocabulary(head: EagleHead, target: Target, data: str, cfg: DistillConfig, text_pairs: list, regen: Any,
                    counts: torch.Tensor | None = None) -> dict[str, Any]:
    """Set a trimmed head's draft vocabulary from the answers of the first `cfg.draft_vocab_samples`
    training samples (of the whole batches: every process picks the same), or from `counts` [V]
    (a feature cache's); returns its record."""
    if counts is None:
        counts = answer_token_counts(target, conversations(data, cfg, 0, 0, text_pairs), cfg.draft_vocab_samples, regen)
    d2t = draft_vocabulary(counts, cfg.draft_vocab, always=tuple(sorted(target.eos_token_ids)))
    head.set_draft_vocab(d2t.to(head.d2t.device))
    ranked = counts.sort(descending=True).values.cumsum(0) / counts.sum().clamp(min=1)  # [V] coverage of the top K
    return {"size": cfg.draft_vocab, "coverage": float(counts[d2t].sum() / counts.sum().clamp(min=1)),
            "samples": cfg.draft_vocab_samples, "answer_tokens": int(counts.sum()),
            "coverage_by_k": {k: float(ranked[k - 1]) for k in (256, 1024, 2048, 4096, 8192, 16384) if k <= len(ranked)}}


def text_pairs_for(target: Target, out: Path, cfg: DistillConfig, progress: bool, rank: int, world: int) -> list:
    """`magpie_for`'s pairs; under torchrun process 0 writes them (cached in out/magpie.json) and the others read them."""
    if world > 1 and rank != 0:
        dist.barrier()
    pairs = magpie_for(target, out, cfg, progress and rank == 0)
    if world > 1 and rank == 0:
        dist.barrier()
    return pairs


def teacher_batch(target: Target, convs: list, cached: bool, regen: Any, visual: bool, layers: tuple[int, ...] | None) -> tuple:
    """One step's (batch, features, logits, captured): from a feature cache's samples (`cached`: no
    target forward), or the target's forward over the conversations (their answers regenerated first
    with `regen`; Magpie pairs already carry the target's own)."""
    if cached:
        batch = collate(convs, target.vocab_size, target.dtype, target.device)
        return batch, batch["feats"], batch["logits"], {}
    if regen is not None:
        convs = [c if c.task == "magpie" else regen(c) for c in convs]
    batch = {k: v.to(target.device) if isinstance(v, torch.Tensor) else v for k, v in encode_conversations(target.processor, convs).items()}
    return (batch, *teacher(target, batch, visual=visual, layers=layers))


def offline_cache(data: str, cfg: DistillConfig, world: int) -> FeatureCache | None:
    """The feature cache `data` names (its shards checked), None for online data; DataError for what
    a cache cannot train: a visual head, regenerated answers, Magpie pairs, several processes."""
    if not is_feature_cache(data):
        return None
    refused = [what for what, on in (("--visual variants", bool(cfg.visual)), ("--regenerate", cfg.regenerate),
                                     ("--text-pairs", cfg.text_pairs > 0), ("torchrun", world > 1)) if on]
    if refused:
        raise DataError(f"{data} is a feature cache (offline: plain EAGLE-1 / EAGLE-3 heads in one process, on the answers it "
                        f"was built from); {', '.join(refused)} train online: pass the corpus as --data instead")
    return FeatureCache(data)


def setup(target: Target, out: Path, cfg: DistillConfig, resume: bool) -> tuple[EagleHead, torch.optim.Optimizer, dict[str, Any]]:
    """The head, its optimizer and the trainer state: fresh (or from `cfg.init_from`), or resumed from out/checkpoint."""
    for p in target.model.parameters():
        p.requires_grad_(False)
    target.model.eval()
    torch.manual_seed(cfg.seed)
    head = new_head(target, cfg)
    if cfg.init_from and not resume:
        warm_start(head, target, cfg.init_from)
    opt = torch.optim.AdamW(list(head.parameters()), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    state = new_state()
    if resume:
        state = saved_state(out)
        head.load_state_dict(load_file(str(out / CKPT / "head.safetensors")), strict=True)
        opt.load_state_dict(torch.load(out / CKPT / "optimizer.pt", weights_only=True))
    state["config"] = asdict(cfg)
    return head, opt, state


def choose_stop(target: Target, head: EagleHead, tree: TreeConfig | None, prompts: list, progress: bool) -> dict[str, Any]:
    """SpecDec++: set the head's stop threshold, chosen on the validation prompts; returns its record."""
    unstopped = EagleDrafter(inference_copy(head, target), tree, 0.0)
    cost = measure_cost(SpecEngine(target, unstopped), encode_prompt(target, COST_PROMPT))
    head.config.stop_threshold, rows = choose_stop_threshold(target, unstopped, prompts, cost)
    if progress:
        print(f"stop threshold {head.config.stop_threshold} (of {[r['threshold'] for r in rows]}, modelled goodput on {len(prompts)} validation prompts)")
    return {"chosen": head.config.stop_threshold, "cost": asdict(cost), "grid": rows}


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
    """Train (or resume) an EAGLE head for `target`; saves the drafter folder `out/drafter` (process
    0 under torchrun). stop_at: end this run after that step (the schedule still spans cfg.steps; resume later)."""
    wall0 = time.perf_counter()  # this run's wall time: the Magpie pairs, evals and threshold choice included
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rank, world, owns_group = init_distributed(target.device)
    main = rank == 0
    cache = offline_cache(data, cfg, world)  # None: the online path (a target forward per step)
    head, opt, state = setup(target, out, cfg, resume)
    regen = AnswerCache(out / f"answers_rank{rank}.jsonl", target, cfg.regen_max_tokens) if cfg.regenerate else None
    text_pairs = text_pairs_for(target, out, cfg, progress, rank, world) if cache is None else []
    if text_pairs:
        state["magpie_pairs"] = len(text_pairs)
    # (an EAGLE-3 head continued with --init-from keeps its vocabulary: its own LM head was trained on it)
    if head.trimmed and not resume and not (cfg.init_from and not head.predicts_features):
        counts = cache.answer_counts(cfg.draft_vocab_samples, target.vocab_size) if cache is not None else None
        state["draft_vocab"] = trim_vocabulary(head, target, data, replace(cfg, batch_size=cfg.batch_size * world), text_pairs, regen, counts)
    loss_fn: torch.nn.Module = DistillStep(head, cfg, VisualConfig.from_dict(cfg.visual).gate_cost)
    if world > 1:  # starts every process from process 0's weights, averages the gradients in backward
        loss_fn = torch.nn.parallel.DistributedDataParallel(loss_fn, find_unused_parameters=True)  # (a visual head's parts idle on text-only batches)
    held_out = heldout("distill-eval", cfg.eval_n)
    drafter = EagleDrafter(head, tree)
    if cache is not None and cache.layers != drafter.feature_layers:
        raise DataError(f"{data}: its features are of layers {cache.layers or 'last hidden state'}, this head reads "
                        f"{drafter.feature_layers or 'the last hidden state'}: build the cache with this run's --arch / --feature-layers")
    tau = {"text": "-"}

    def step(_: int, convs: list) -> dict[str, float]:
        batch, feats, logits, captured = teacher_batch(target, convs, cache is not None, regen, head.visual is not None, drafter.feature_layers)
        head.train()
        with mixed_precision(target):
            loss, stats = loss_fn(batch["input_ids"], feats.float(), logits, batch["labels"], captured)
        loss.backward()
        if head.accept is not None:  # its own norm: the acceptance head never changes the drafter's own updates
            torch.nn.utils.clip_grad_norm_(head.accept.parameters(), cfg.grad_clip)
        clipped_step(opt, [p for n, p in head.named_parameters() if not n.startswith("accept.")], cfg.grad_clip)
        head.eval()
        return {"loss": float(loss.detach()), **stats}

    def evaluate(_: int) -> dict[str, float] | None:
        if not main:
            return None
        found = accepted_length(target, EagleDrafter(inference_copy(head, target), tree), held_out)["all"]
        tau["text"] = f"{found:.2f}"
        return {"tau": found}

    def save() -> None:
        _save(out, head, opt, state)
        _plot(state["history"], out / "train_curve.png")

    hooks = Hooks(step=step, save=save, evaluate=evaluate if cfg.eval_n > 0 else None,
                  postfix=lambda r: {"loss": f"{r['loss']:.3f}", "acc1": f"{r.get('acc1', 0):.2f}", "tau": tau["text"]})
    batches = conversations(data, cfg, rank, state["step"], text_pairs, world) if cache is None else \
        cache.batches(cfg.batch_size, cfg.seed, state["step"])
    stopped = train_loop(Stage.of(cfg, "train"), state, batches, opt, hooks, progress, stop_at, main)
    if main:
        if head.accept is not None:
            state["stop_threshold"] = choose_stop(target, head, tree, held_out, progress)
        save()
        head.to(target.dtype)
        drafter.save(out / "drafter")
        write_summary(out, state, stopped, wall0, processes=world)
    if owns_group:
        dist.destroy_process_group()
    return drafter
