"""`python -m recipes train-target`: how the toy target (assets/toyworld-vlm) was made: the
LLaVA-architecture target trained from scratch on ToyWorld.

Stage 0 pre-trains the vision tower and projector on scene labels (`vision_pretrain`); then
next-token SFT on the answers only (prompt and image positions are masked), AdamW with linear
warm-up and cosine decay (`vlmspec.train.loop`), batches bucketed by length, safetensors
checkpoints with exact resume (model, optimizer, step; the data order is a pure function of the
step), a loss curve PNG. The model card (assets/toyworld-vlm/README.md) has the commands.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from itertools import count
from typing import Any, Iterator

import torch
from safetensors.torch import load_file

import toyworld
from vlmspec.data.heldout import heldout
from vlmspec.data.heldout import Conversation
from recipes.train.toy_processor import build_processor, corpus_for_tokenizer, llava_config_kwargs, train_tokenizer
from vlmspec.train.common import clipped_step, save_checkpoint_dir
from vlmspec.train.loop import CKPT, Hooks, Stage, TrainConfig, new_state, train_loop, write_summary
from vlmspec.train.data import encode_conversations
from recipes.train.vision_pretrain import SceneLabels, SceneProbe, image_tokens, pretrain_batch, scene_labels


@dataclass
class TargetArch:
    """Sizes of the bundled target: a CLIP-style vision tower, an MLP projector, a Llama decoder."""

    # 32 px patches on 96 px images: 9 image tokens, one per cell of ToyWorld's 3x3 grid, so an
    # object is whole inside one token (with 12 px patches the small model did not learn to read
    # the image within our CPU budget: held-out scores stayed at the noise-image level)
    patch_size: int = 32
    vision_hidden: int = 128
    vision_layers: int = 4
    vision_heads: int = 4
    # the bundled v4's decoder: 8 layers (a one-layer drafter is then 1/8 of it) at width 160, a
    # step half as costly as at 256 / 704 (v2), which is what fits the recipe in 90 CPU minutes
    hidden: int = 160
    layers: int = 8
    heads: int = 5
    kv_heads: int = 5
    intermediate: int = 448
    max_positions: int = 1024
    tokenizer_vocab: int = 3000
    tokenizer_corpus: int = 20000


def saved_sizes(folder: str | Path) -> dict[str, int]:
    """The decoder sizes of an exported model folder, as TargetArch fields (hidden, intermediate,
    heads, kv_heads); {} when the folder has no config.json."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        return {}
    text = json.loads(config.read_text()).get("text_config", {})
    names = (("hidden", "hidden_size"), ("intermediate", "intermediate_size"), ("heads", "num_attention_heads"),
             ("kv_heads", "num_key_value_heads"))
    return {k: text[hf] for k, hf in names if hf in text}


@dataclass
class SFTConfig(TrainConfig):
    steps: int = 3000
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    bucket: int = 4  # samples for `bucket` batches are drawn together and sorted by length
    ckpt_every: int = 100
    eval_every: int = 100
    eval_samples: int = 64
    # "sample": every sample weighs the same (short grounded answers are not drowned by long
    # descriptions, whose tokens are mostly phrasing); "token": the usual mean over all tokens
    loss_norm: str = "sample"
    # the CLIP tower's residual stream runs away at the decoder's learning rate (measured: std 1.3
    # at init -> 37 after 300 steps, almost all of it a constant offset, so the image content
    # drowns after the projector's LayerNorm and the tower's gradient falls to ~1e-4); a small
    # rate keeps it near its well-conditioned start while the projector and decoder learn
    vision_lr_mult: float = 0.3
    # stage 0 (vision_pretrain.py): the vision tower + projector learn to encode
    # each cell's object, the sign's word and the chart's bars before the decoder sees them
    vision_steps: int = 1500
    vision_batch_size: int = 64
    vision_lr: float = 1e-3
    # weight of the same probe loss during SFT (image samples only), so the tokens stay readable
    aux_weight: float = 0.2
    # task -> weight of the training mix; None = ToyWorld's default mix (toyworld.TASK_MIX). A
    # later stage can shift the mix, e.g. to the short grounded questions (count, attribute)
    task_mix: dict[str, float] | None = None
    arch: TargetArch = field(default_factory=TargetArch)


def build_model(processor: Any, arch: TargetArch, seed: int = 0) -> torch.nn.Module:
    """A VipLlava model: LLaVA-1.5's architecture (CLIP-style vision tower, MLP projector, Llama
    decoder) whose projector starts with a LayerNorm. Trained from scratch, a plain LLaVA
    projector lets the vision stream's scale run away (measured: projected image embeddings at
    std ~80 against text embeddings at ~0.03) and the gradient into the vision tower vanishes;
    the LayerNorm keeps the image embeddings' scale in the projector's hands."""
    from transformers import CLIPVisionConfig, LlamaConfig, VipLlavaConfig, VipLlavaForConditionalGeneration

    kw = llava_config_kwargs(processor)
    vcfg = kw.pop("vision_config")
    vcfg.pop("model_type", None)
    kw.pop("vision_feature_select_strategy", None)  # VipLlava always drops the CLS position
    vision = CLIPVisionConfig(
        **vcfg,
        hidden_size=arch.vision_hidden,
        intermediate_size=4 * arch.vision_hidden,
        num_hidden_layers=arch.vision_layers,
        num_attention_heads=arch.vision_heads,
        projection_dim=arch.vision_hidden,
    )
    text = LlamaConfig(
        **kw.pop("text_config"),
        hidden_size=arch.hidden,
        intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        max_position_embeddings=arch.max_positions,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config = VipLlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-1, **kw)
    torch.manual_seed(seed)
    model = VipLlavaForConditionalGeneration(config)
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = text.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id
    model.generation_config.bos_token_id = text.bos_token_id
    return model


def warm_start(model: torch.nn.Module, folder: Path) -> int:
    """Start from every weight of an exported model folder (`out/model` of an earlier run, or
    the bundled model), read through HF's own loader (which maps saved key names); the
    architecture must match exactly. Returns the number of tensors."""
    from transformers import AutoModelForImageTextToText

    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"--init-from: no model.safetensors in {folder}")
    state = {k: v.float() for k, v in AutoModelForImageTextToText.from_pretrained(folder).state_dict().items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"--init-from {folder}: weights do not match this architecture: {str(exc)[:300]}") from None
    return len(state)


# ---------------------------------------------------------------------------------------- data
def encode_batch(samples: list[toyworld.Sample], processor: Any) -> dict[str, torch.Tensor]:
    """ToyWorld samples -> padded tensors with labels on the answers only."""
    convs = [Conversation.from_sample(s) for s in samples]
    return encode_conversations(processor, convs)


def batch_seeds(step: int, cfg: SFTConfig) -> tuple[list[int], int]:
    """The train-split seeds of batch `step`: a pure function of the step (exact resume)."""
    chunk, part = divmod(step, cfg.bucket)
    first = toyworld.SPLITS["train"][0] + cfg.seed * 10**7 + chunk * cfg.bucket * cfg.batch_size
    return list(range(first, first + cfg.bucket * cfg.batch_size)), part


def parse_task_mix(text: str) -> dict[str, float]:
    """'count=0.3,attribute=0.3,describe=0.2' -> {task: weight}; every task must be a ToyWorld task."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, weight = part.partition("=")
        if not sep or name.strip() not in toyworld.TASKS:
            raise ValueError(f"task mix: {part!r} is not TASK=WEIGHT with TASK one of {', '.join(toyworld.TASKS)}")
        try:
            mix[name.strip()] = float(weight)
        except ValueError:
            raise ValueError(f"task mix: weight of {name.strip()!r} is not a number: {weight!r}") from None
        if not mix[name.strip()] >= 0:
            raise ValueError(f"task mix: weight of {name.strip()!r} must be >= 0")
    if not mix or sum(mix.values()) <= 0:
        raise ValueError("task mix: give at least one task with a positive weight, e.g. count=1,attribute=1")
    return mix


def sample_for(seed: int, cfg: SFTConfig, style: toyworld.AnswerStyle = toyworld.SHORT) -> toyworld.Sample:
    """The training sample of `seed` under the run's task mix (a pure function of the seed)."""
    if cfg.task_mix is None:
        return toyworld.make_sample(seed, style=style)
    task = random.Random(seed ^ 0x5EED).choices(list(cfg.task_mix), weights=list(cfg.task_mix.values()))[0]
    return toyworld.make_sample(seed, task, style)


def batches(start_step: int, cfg: SFTConfig, processor: Any) -> Iterator[tuple[int, dict[str, torch.Tensor], list[dict]]]:
    """Yields (step, encoded batch, scene metas of the batch's images in order)."""
    step = start_step
    while True:
        seeds, part = batch_seeds(step, cfg)
        samples = [sample_for(s, cfg) for s in seeds]
        lengths = [len(s.prompt) + len(s.answer) + (1000 if s.image is not None else 0) for s in samples]
        order = sorted(range(len(samples)), key=lambda i: (lengths[i], i))
        while part < cfg.bucket:
            chosen = [samples[i] for i in order[part * cfg.batch_size : (part + 1) * cfg.batch_size]]
            yield step, encode_batch(chosen, processor), [s.meta["scene"] for s in chosen if s.image is not None]
            step += 1
            part += 1


def sft_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], norm: str) -> torch.Tensor:
    """Next-token cross-entropy on the answer tokens, averaged per token or per sample."""
    if norm == "token":
        return model(**batch).loss
    return answer_loss(model, batch)


def answer_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy on the answer tokens, averaged per sample; the LM head runs on the
    answer positions only (not on the image and prompt positions: with a 49k vocabulary it dominates)."""
    labels = batch["labels"][:, 1:]  # [B, T-1]
    hidden = model.model(**{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state[:, :-1]  # [B, T-1, D]
    mask = labels != -100
    tok = torch.nn.functional.cross_entropy(model.lm_head(hidden[mask]).float(), labels[mask], reduction="none")  # [N]
    per_sample = torch.zeros(labels.shape[0], dtype=tok.dtype).index_add(0, mask.nonzero()[:, 0], tok)
    return (per_sample / mask.sum(1).clamp(min=1)).mean()


# ---------------------------------------------------------------------------------------- checkpoints

def save_checkpoint(out: Path, model: torch.nn.Module, probe: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    weights = {**model.state_dict(), **{"probe." + k: v for k, v in probe.state_dict().items()}}
    save_checkpoint_dir(out / CKPT, weights, "model.safetensors", opt, state)


def load_checkpoint(out: Path, model: torch.nn.Module, probe: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    d = out / CKPT
    state = load_file(str(d / "model.safetensors"))
    probe_state = {k[len("probe.") :]: state.pop(k) for k in list(state) if k.startswith("probe.")}
    try:
        model.load_state_dict(state, strict=True)
        probe.load_state_dict(probe_state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{d}: checkpoint does not match the model: {str(exc)[:300]}") from None
    opt.load_state_dict(torch.load(d / "optimizer.pt", weights_only=True))
    return json.loads((d / "trainer_state.json").read_text())


# ---------------------------------------------------------------------------------------- loop
def _processor(out: Path, arch: TargetArch, resume: bool) -> Any:
    from transformers import AutoProcessor

    pdir = out / "processor"
    if pdir.is_dir():  # resume, or the processor of the --init-from model
        return AutoProcessor.from_pretrained(pdir)
    tok = train_tokenizer(corpus_for_tokenizer(arch.tokenizer_corpus), vocab_size=arch.tokenizer_vocab)
    processor = build_processor(tok, patch_size=arch.patch_size)
    processor.save_pretrained(pdir)
    return AutoProcessor.from_pretrained(pdir)


@torch.no_grad()
def eval_loss(model: torch.nn.Module, processor: Any, cfg: SFTConfig) -> dict[str, float]:
    """Held-out answer loss, and on the image samples the loss with real images vs with the
    images of other samples: `image_gap` > 0 measures how much the model reads the image."""
    model.eval()
    samples = [c.sample for c in heldout("sft-eval", cfg.eval_samples)]
    sums = {"all": [0.0, 0], "real": [0.0, 0], "shuffled": [0.0, 0]}
    for i in range(0, len(samples), cfg.batch_size):
        b = encode_batch(samples[i : i + cfg.batch_size], processor)
        n = int((b["labels"][:, 1:] != -100).sum())
        sums["all"][0] += float(model(**b).loss) * n
        sums["all"][1] += n
        with_image = [s for s in samples[i : i + cfg.batch_size] if s.image is not None]
        if len(with_image) > 1:
            b = encode_batch(with_image, processor)
            n = int((b["labels"][:, 1:] != -100).sum())
            sums["real"][0] += float(model(**b).loss) * n
            sums["shuffled"][0] += float(model(**{**b, "pixel_values": b["pixel_values"].roll(1, 0)}).loss) * n
            sums["real"][1] += n
            sums["shuffled"][1] += n
    model.train()
    mean = {k: t / max(1, c) for k, (t, c) in sums.items()}
    return {"val_loss": mean["all"], "image_gap": mean["shuffled"] - mean["real"]}


def plot_curve(history: list[dict[str, float]], path: Path) -> None:
    """Stage 0's probe loss and accuracy (left, when there was a stage 0); SFT's train and held-out
    loss with the real-vs-shuffled image gap (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vis = [h for h in history if "probe_loss" in h]
    fig, axes = plt.subplots(1, 2 if vis else 1, figsize=(12 if vis else 7, 4), squeeze=False)
    if vis:
        ax = axes[0, 0]
        ax.plot([h["vision_step"] for h in vis], [h["probe_loss"] for h in vis], lw=0.8, label="probe loss")
        ax.set_yscale("log")
        ax.set_xlabel("stage-0 step")
        ax.set_ylabel("cross-entropy")
        ax.set_title("stage 0: scene probes on the image tokens")
        acc_ax = ax.twinx()
        names = {"acc_obj": "obj", "acc_word": "word", "acc_bar_value": "bar_value", "acc_cell": "cell", "acc_w_row": "row word", "acc_w_col": "column word"}
        for key, name in names.items():
            pts = [(h["vision_step"], h[key]) for h in vis if key in h]
            if pts:
                acc_ax.plot(*zip(*pts), lw=0.6, alpha=0.7, label=name + " acc")
        acc_ax.set_ylim(0, 1)
        acc_ax.set_ylabel("probe accuracy")
        ax.legend(loc="center left")
        acc_ax.legend(loc="center right")
        ax.grid(alpha=0.3)
    ax = axes[0, -1]
    steps = [h["step"] for h in history if "loss" in h]
    ax.plot(steps, [h["loss"] for h in history if "loss" in h], lw=0.8, alpha=0.6, label="train loss (answers)")
    ev = [h for h in history if "val_loss" in h]
    if ev:
        ax.plot([h["step"] for h in ev], [h["val_loss"] for h in ev], "o-", label="held-out loss")
        gaps = [h for h in ev if "image_gap" in h]
        if gaps:
            ax.plot([h["step"] for h in gaps], [max(h["image_gap"], 1e-4) for h in gaps], "s--",
                    label="image gap (shuffled - real images)")
    ax.set_xlabel("SFT step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def param_groups(model: torch.nn.Module, probe: torch.nn.Module, cfg: SFTConfig) -> list[dict[str, Any]]:
    """AdamW groups: (vision tower | projector + probe | decoder) x (decayed | not)."""
    groups: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    named = [(n, p) for n, p in model.named_parameters()] + [("probe." + n, p) for n, p in probe.named_parameters()]
    for n, p in named:
        part = "vision" if n.startswith("model.vision_tower.") else "stage0" if n.startswith(("model.multi_modal_projector.", "probe.")) else "lm"
        groups.setdefault((part, p.ndim >= 2), []).append(p)
    return [
        {"params": ps, "weight_decay": cfg.weight_decay if decay else 0.0, "part": part}
        for (part, decay), ps in sorted(groups.items())
    ]


def pretrain_vision(model, probe, opt, processor, cfg: SFTConfig, state: dict[str, Any], out: Path, progress: bool) -> None:
    """Stage 0: the probe loss only, through the shared loop; the decoder's groups get no gradient
    (rate 0). Resumable by `state["vision_step"]`."""
    if state["vision_step"] >= cfg.vision_steps:
        return
    params = list(model.parameters()) + list(probe.parameters())

    def step(_: int, batch: tuple[torch.Tensor, SceneLabels]) -> dict[str, float]:
        loss, acc = probe(image_tokens(model, batch[0]), batch[1])
        loss.backward()
        clipped_step(opt, params, cfg.grad_clip)
        return {"probe_loss": float(loss.detach()), **{f"acc_{k}": v for k, v in acc.items()}}

    stage = Stage("stage 0 (vision)", cfg.vision_steps, min(cfg.warmup, cfg.vision_steps // 10), cfg.min_lr_ratio, cfg.ckpt_every,
                  counter="vision_step", peak=lambda g: cfg.vision_lr if g["part"] in ("vision", "stage0") else 0.0)
    batches = (pretrain_batch(s, cfg.vision_batch_size, cfg.seed, processor) for s in count(state["vision_step"]))
    hooks = Hooks(step=step, save=lambda: save_checkpoint(out, model, probe, opt, state),
                  postfix=lambda r: {"loss": f"{r['probe_loss']:.3f}", "obj": f"{r.get('acc_obj', float('nan')):.2f}"})
    train_loop(stage, state, batches, opt, hooks, progress)


def setup(out: Path, cfg: SFTConfig, resume: bool, init_from: str | Path | None) -> tuple[SFTConfig, Any, torch.nn.Module, SceneProbe, torch.optim.Optimizer, dict[str, Any]]:
    """(config, processor, model, probe, optimizer, trainer state): resumed from out/checkpoint,
    started from `init_from`'s weights and processor, or fresh."""
    state = new_state(vision_step=0)
    if resume:
        saved = json.loads((out / CKPT / "trainer_state.json").read_text())
        cfg = SFTConfig(**{**saved["config"], "arch": TargetArch(**saved["config"]["arch"]), "steps": cfg.steps, "minutes": cfg.minutes})
    torch.manual_seed(cfg.seed)
    if init_from is not None and not resume:
        shutil.rmtree(out / "processor", ignore_errors=True)
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(init_from).save_pretrained(out / "processor")
    processor = _processor(out, cfg.arch, resume)
    model = build_model(processor, cfg.arch, cfg.seed)
    probe = SceneProbe(model.config.text_config.hidden_size)
    opt = torch.optim.AdamW(param_groups(model, probe, cfg), lr=cfg.lr, betas=(0.9, 0.98))
    if resume:
        state = {"vision_step": cfg.vision_steps, **load_checkpoint(out, model, probe, opt)}
    elif init_from is not None:
        n = warm_start(model, Path(init_from))
        print(f"train-target: starting from {init_from} ({n} tensors)")
        state["init_from"] = str(init_from)
    state["config"] = asdict(cfg)
    return cfg, processor, model, probe, opt, state


def train(
    out: str | Path,
    cfg: SFTConfig,
    resume: bool = False,
    progress: bool = True,
    init_from: str | Path | None = None,
    stop_at: int | None = None,
) -> Path:
    """Train (or resume) into `out`; returns the exported model folder `out/model`.
    init_from: an exported model folder (weights + processor) this run starts from, e.g. a later
    stage with another task mix; set cfg.vision_steps = 0 to skip stage 0 then.
    stop_at: end this run after that SFT step (checkpointed; `resume` continues it)."""
    wall0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if resume and not (out / CKPT).is_dir():
        raise FileNotFoundError(f"--resume: no checkpoint in {out / CKPT}")
    cfg, processor, model, probe, opt, state = setup(out, cfg, resume, init_from)
    model.train()
    pretrain_vision(model, probe, opt, processor, cfg, state, out, progress)

    def step(_: int, item: tuple[int, dict[str, torch.Tensor], list[dict]]) -> dict[str, float]:
        _, batch, scenes = item
        loss = sft_loss(model, batch, cfg.loss_norm)
        total = loss
        if cfg.aux_weight > 0 and scenes:
            total = loss + cfg.aux_weight * probe(image_tokens(model, batch["pixel_values"]), scene_labels(scenes))[0]
        total.backward()
        clipped_step(opt, model.parameters(), cfg.grad_clip)
        return {"loss": float(loss.detach())}

    def save() -> None:
        save_checkpoint(out, model, probe, opt, state)
        plot_curve(state["history"], out / "loss.png")

    mult = {"vision": cfg.vision_lr_mult, "stage0": 1.0, "lm": 1.0}
    stage = Stage.of(cfg, "train-target", peak=lambda g: cfg.lr * mult[g["part"]])
    hooks = Hooks(step=step, save=save, evaluate=lambda _: eval_loss(model, processor, cfg), postfix=lambda r: {"loss": f"{r['loss']:.3f}"})
    stopped = train_loop(stage, state, batches(state["step"], cfg, processor), opt, hooks, progress, stop_at)
    save()
    export = out / "model"
    model.save_pretrained(export)
    processor.save_pretrained(export)
    write_summary(out, state, stopped, wall0)
    print(f"train-target: step {state['step']}/{cfg.steps} ({stopped}), {state['elapsed_s'] / 60:.1f} min total; model in {export}")
    return export
