"""`python -m recipes train-align`: how the default target's trained parts were made. The
assembled real target (EfficientNet-Lite0 + SmolLM2-135M in `fast_vlm`, `vlmspec build-target
--no-trained`) is aligned on ToyWorld, LLaVA stage-1 style plus low-rank adapters on the language model.

  stage 0  the projector and the vision tower's last `tower_tail` block stages (with its 1x1
           head) learn alone, through probes on the projector's tokens: linear scene probes on the
           tokens pooled to ToyWorld's 3x3 cells (each cell's object and size, the sign's word, the
           chart's bars) and the word probe (`vision_pretrain.WordProbe`), which asks every token
           for its row and column and every cell for its colour, shape, size and sign word against
           the language model's own frozen word embeddings. No language-model forward. Then the
           projector's output is rescaled to the RMS of the text embeddings, and the tower's tail
           is frozen again.
  SFT      the projector and LoRA pairs on every projection of the 30 decoder layers: answer-only
           next-token cross-entropy, averaged per sample, on dialogues of several questions about
           each image (`followups`), plus `aux_weight` x the probes' loss, plus `text_per_step`
           text-only pairs per batch the base model wrote itself before training (Magpie,
           `vlmspec.train.magpie`), so the adapters keep its text behaviour.

The shipped parts came from a chain of runs, each from the previous one's parts (`warm_start`, a
fresh schedule, no stage 0) with another answer style and task mix; the model card
(assets/smolvlm-toyworld/README.md) has the commands, docs/alignment.md the attempts that found them.
`vlmspec.train.loop` runs the schedule, budget, evaluations and checkpoints (exact resume); the
result, `out/trained.safetensors`, is what `vlmspec build-target --trained` merges.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field, fields
from itertools import count
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import toyworld
from vlmspec.data.heldout import Conversation
from recipes.train.lora import LoraAdapters, add_lora
from recipes.train.target_sft import answer_loss, batch_seeds, eval_loss, plot_curve, sample_for
from recipes.train.vision_pretrain import SIGN_GROUP, WORD_GROUPS, SceneLabels, SceneProbe, WordProbe, pool_cells, pretrain_batch, scene_labels, word_vectors
from vlmspec.target.assemble import TRAINED_FORMAT
from vlmspec.train.common import clipped_step, save_checkpoint_dir
from vlmspec.train.data import encode_conversations
from vlmspec.train.loop import Hooks, Stage, TrainConfig, new_state, saved_state, train_loop, write_summary
from vlmspec.train.magpie import MagpieConfig, Pair, as_conversation, cached_pairs

# the grounded questions the target must answer, weighted toward the short ones; no toy text-only
# answers (text-only behaviour is SmolLM2-Instruct's own)
ALIGN_MIX = {"count": 0.28, "attribute": 0.26, "read_text": 0.14, "describe": 0.2, "spatial": 0.06, "read_chart": 0.06}
ALIGN_STYLES = ("listed", "scan", "tally")  # toyworld.ANSWER_STYLES the chain's runs answered in, in turn
PROJECTOR = "model.multi_modal_projector."
TOWER = "model.vision_tower.timm_model."


@dataclass
class AlignConfig(TrainConfig):
    steps: int = 420
    batch_size: int = 4
    lr: float = 1e-3  # the projector's peak rate
    lora_lr: float = 4e-4
    lora_rank: int = 16
    lora_alpha: float = 32.0
    warmup: int = 40
    grad_clip: float = 1.0
    bucket: int = 4  # samples of `bucket` batches are drawn together and sorted by length
    followups: int = 4  # more questions about each image in its dialogue
    aux_weight: float = 0.2  # the stage-0 probes' loss kept on during SFT
    text_pairs: int = 96  # Magpie text-only pairs (the base model's own instructions and greedy answers)
    text_per_step: int = 1  # of them in each batch, beside the image dialogues (0: none)
    answer_style: str = "listed"  # one of ALIGN_STYLES
    tower_tail: int = 2  # the tower's last block stages trained in stage 0 (with conv_head, bn2's affine)
    tower_lr: float = 3e-4
    word_weight: float = 1.0  # the word probe's weight beside the scene probes
    probe_steps: int = 240  # stage 0
    probe_batch: int = 16
    probe_lr: float = 3e-3
    ckpt_every: int = 50
    eval_every: int = 250
    eval_samples: int = 24
    warm_start: str | None = None  # a train-align run folder whose trained parts (and probes) this run starts from; no stage 0
    autocast: bool = False  # forwards under bf16 autocast (fp32 master weights, optimizer and loss); where the CPU has bf16 units
    task_mix: dict[str, float] | None = field(default_factory=lambda: dict(ALIGN_MIX))

    def __post_init__(self) -> None:
        if self.answer_style not in ALIGN_STYLES:
            raise ValueError(f"answer_style must be one of {ALIGN_STYLES}, got {self.answer_style!r}")

    @classmethod
    def saved(cls, config: dict[str, Any], **changes: Any) -> "AlignConfig":
        """The config a checkpoint recorded (keys this recipe no longer has left out), with `changes`."""
        known = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in config.items() if k in known}, **changes})


def prepare(model: torch.nn.Module, cfg: AlignConfig) -> tuple[LoraAdapters, list[dict[str, Any]]]:
    """Freeze the base, add the adapters; returns them and the SFT optimizer's parameter groups."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = add_lora(model.model.language_model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
    projector = list(model.model.multi_modal_projector.parameters())
    for p in projector:
        p.requires_grad_(True)
    groups = [{"params": projector, "part": "projector", "weight_decay": 0.0},
              {"params": list(adapters.parameters()), "part": "lora", "weight_decay": 0.0}]
    return adapters, groups


def tower_tail(model: torch.nn.Module, stages: int) -> list[torch.nn.Module]:
    """The timm tower's last `stages` block stages and its 1x1 head (conv_head, bn2): the part
    `train-align` may train; [] for 0."""
    timm_model = model.model.vision_tower.timm_model
    if stages <= 0:
        return []
    assert stages <= len(timm_model.blocks), f"the tower has {len(timm_model.blocks)} block stages, not {stages}"
    return [*timm_model.blocks[-stages:], timm_model.conv_head, timm_model.bn2]


def tail_names(model: torch.nn.Module, stages: int) -> set[str]:
    """State-dict names of the parameters of `tower_tail(model, stages)`."""
    tail = {id(p) for m in tower_tail(model, stages) for p in m.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in tail}


def trained_tensors(model: torch.nn.Module, adapters: LoraAdapters, tower_stages: int = 0) -> dict[str, torch.Tensor]:
    """What ships: the projector's and the trained tower tail's tensors (`tower_stages` block
    stages) by state-dict name, the LoRA pairs under `lora.`."""
    tower = tail_names(model, tower_stages)
    out = {k: v.detach().float().clone() for k, v in model.state_dict().items() if k.startswith(PROJECTOR) or k in tower}
    out.update({f"lora.{k}": v for k, v in adapters.tensors().items()})
    return out


def load_trained(model: torch.nn.Module, adapters: LoraAdapters, tensors: dict[str, torch.Tensor], tower_stages: int = 0) -> None:
    proj = {k[len(PROJECTOR):]: v for k, v in tensors.items() if k.startswith(PROJECTOR)}
    model.model.multi_modal_projector.load_state_dict(proj, strict=True)
    tower = {k: v for k, v in tensors.items() if k.startswith(TOWER)}
    trainable = tail_names(model, tower_stages)
    assert set(tower) == trainable, f"checkpoint tower tensors {sorted(set(tower) ^ trainable)[:4]} do not match the config's tower_tail"
    with torch.no_grad():
        params = dict(model.named_parameters())
        for k, v in tower.items():
            params[k].copy_(v)
    adapters.load_tensors({k[len("lora."):]: v for k, v in tensors.items() if k.startswith("lora.")})


def export(model: torch.nn.Module, adapters: LoraAdapters, path: Path, meta: dict[str, str], tower_stages: int = 0) -> None:
    tensors = trained_tensors(model, adapters, tower_stages)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": TRAINED_FORMAT, **meta})


def load_checkpoint_parts(model: torch.nn.Module, adapters: LoraAdapters, probe: torch.nn.Module, path: Path, tower_stages: int) -> None:
    """A checkpoint's trained parts into `model` / `adapters` and its `probe.*` tensors into `probe` (strict)."""
    tensors = load_file(str(path))
    probe.load_state_dict({k[len("probe."):]: tensors.pop(k) for k in list(tensors) if k.startswith("probe.")}, strict=True)
    load_trained(model, adapters, tensors, tower_stages)


class WarmStartError(ValueError):
    """A --warm-start source that does not fit this run's config."""


# what must match between a warm start's source run and this run for its tensors to fit
WARM_START_KEYS = ("lora_rank", "tower_tail")


def warm_start_source(cfg: AlignConfig) -> dict[str, Any]:
    """The checkpoint state of the run in `cfg.warm_start`, checked against this config before any
    work is done: a missing checkpoint or other shapes are a WarmStartError naming what differs."""
    src = Path(cfg.warm_start) / "checkpoint"
    if not (src / "trainer_state.json").is_file():
        raise WarmStartError(f"--warm-start: no checkpoint in {src} (give a train-align run folder)")
    saved = json.loads((src / "trainer_state.json").read_text())
    theirs, ours = saved["config"], asdict(cfg)
    differ = [k for k in WARM_START_KEYS if theirs.get(k) != ours[k]]
    if differ:
        raise WarmStartError(f"--warm-start: {cfg.warm_start} was trained with " + ", ".join(f"{k}={theirs.get(k)}" for k in differ) +
                             " and this run has " + ", ".join(f"{k}={ours[k]}" for k in differ) + ": start from a run of this recipe")
    return saved


def _set_train_mode(model: torch.nn.Module) -> None:
    model.train()
    model.model.vision_tower.eval()  # frozen BatchNorm statistics


def projected_tokens(model: torch.nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """pixel_values [B, 3, S, S] -> the projector's image tokens, [B, g*g, H]; a frozen tower runs
    without gradient (a trained tail records only its own part: the frozen stages need no grad)."""
    tower = model.model.vision_tower
    with torch.set_grad_enabled(torch.is_grad_enabled() and any(p.requires_grad for p in tower.parameters())):
        feats = tower(pixel_values, return_dict=True).last_hidden_state  # [B, C, g, g]
    return model.model.multi_modal_projector(feats.flatten(2).transpose(1, 2))


def cell_tokens(model: torch.nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """pixel_values [B, 3, S, S] -> projected image tokens pooled to cells, [B, 9, H]."""
    return pool_cells(projected_tokens(model, pixel_values))


class Probes(torch.nn.Module):
    """The training-only probes on the projector's tokens: the scene probe (what is in each cell,
    on the tokens pooled to cells) and the word probe (rows, columns, colours, shapes, sizes and
    sign words, in the language model's own word directions; `word_vectors` by group)."""

    def __init__(self, hidden: int, cfg: AlignConfig, word_vectors: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.scene = SceneProbe(hidden)
        self.words = WordProbe(word_vectors)

    def heads(self) -> list[torch.nn.Linear]:
        return [self.scene.obj, self.scene.size, self.scene.word, self.scene.bars]

    def forward(self, tokens: torch.Tensor, labels: SceneLabels) -> tuple[torch.Tensor, dict[str, float]]:
        """tokens: the projector's [B, g*g, H]. Returns (loss, accuracies)."""
        loss, acc = self.scene(pool_cells(tokens), labels)
        word_loss, word_acc = self.words(tokens, labels)
        acc.update(word_acc)
        return loss + self.cfg.word_weight * word_loss, acc


class ProjectorTap:
    """Keeps the projector's last output ([B, g*g, H]) from the model's own forward, so the probe
    loss needs no second pass through the vision tower."""

    def __init__(self, model: torch.nn.Module):
        self.tokens: torch.Tensor | None = None
        self._hook = model.model.multi_modal_projector.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.tokens = output

    def take(self) -> torch.Tensor:
        assert self.tokens is not None, "no image went through the projector"
        tokens, self.tokens = self.tokens, None
        return tokens

    def remove(self) -> None:
        self._hook.remove()


def text_rms(model: torch.nn.Module) -> float:
    """RMS of the language model's input embeddings (the <image> row, all zeros, left out)."""
    emb = model.get_input_embeddings().weight.detach()
    return float(emb[: model.config.image_token_id].float().pow(2).mean().sqrt())


@torch.no_grad()
def image_token_rms(model: torch.nn.Module, pixel_values: torch.Tensor) -> float:
    tokens = model.model.get_image_features(pixel_values=pixel_values).pooler_output
    return float(tokens.float().pow(2).mean().sqrt())


@torch.no_grad()
def rescale_projector(model: torch.nn.Module, probe: Probes, factor: float) -> None:
    """Multiply the projector's output by `factor` (linear_2's weight and bias) and divide the
    probes' weights by it, so the probes' logits stay what they were."""
    lin = model.model.multi_modal_projector.linear_2
    lin.weight.mul_(factor)
    lin.bias.mul_(factor)
    for head in probe.heads():
        head.weight.div_(factor)
    probe.words.rescale(factor)


def lm_word_vectors(model: torch.nn.Module, tokenizer: Any) -> dict[str, torch.Tensor]:
    """The word probe's class vectors: the language model's input embeddings of ToyWorld's row,
    column, colour, shape and size words, and of the signs' words."""
    emb = model.get_input_embeddings().weight.detach()
    return {name: word_vectors(emb, tokenizer, words, prefix) for name, words, _, prefix in WORD_GROUPS + (SIGN_GROUP,)}


def amp(cfg: AlignConfig) -> torch.autocast:
    """The forwards' precision: bf16 autocast when `cfg.autocast` (weights, gradients and the
    optimizer stay fp32; losses are computed in fp32), else plain fp32."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast)


def pretrain_projector(model, probe, processor, cfg: AlignConfig, state: dict[str, Any], progress: bool) -> None:
    """Stage 0: the projector, the tower's tail and the probes on scene labels; then the tail is
    frozen again and the projector's output rescaled to the text embeddings' scale."""
    if state.get("vision_step", 0) >= cfg.probe_steps:
        return
    state["vision_step"] = 0  # (a stage 0 cut short starts again: it is not checkpointed)
    tower = [p for m in tower_tail(model, cfg.tower_tail) for p in m.parameters()]
    for p in tower:
        p.requires_grad_(True)
    groups = [{"params": list(model.model.multi_modal_projector.parameters()) + list(probe.parameters()), "peak": cfg.probe_lr}]
    if tower:
        groups.append({"params": tower, "peak": cfg.tower_lr})
    opt = torch.optim.AdamW(groups, lr=cfg.probe_lr, weight_decay=0.0)
    params = [p for g in groups for p in g["params"]]

    def step(step: int, batch: tuple[torch.Tensor, SceneLabels]) -> dict[str, float]:
        with amp(cfg):
            loss, acc = probe(projected_tokens(model, batch[0]), batch[1])
        loss.backward()
        clipped_step(opt, params, cfg.grad_clip)
        return {"probe_loss": float(loss.detach()), **{f"acc_{k}": v for k, v in acc.items()}}

    def postfix(r: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{r['probe_loss']:.3f}", "obj": f"{r.get('acc_obj', float('nan')):.2f}", "row": f"{r.get('acc_w_row', float('nan')):.2f}"}

    stage = Stage("stage 0 (projector probes)", cfg.probe_steps, max(1, cfg.probe_steps // 10), cfg.min_lr_ratio,
                  ckpt_every=cfg.probe_steps + 1, counter="vision_step")
    elapsed = state["elapsed_s"]
    batches = (pretrain_batch(s, cfg.probe_batch, cfg.seed, processor) for s in count())
    train_loop(stage, state, batches, opt, Hooks(step=step, save=lambda: None, postfix=postfix), progress)
    state["elapsed_s"] = elapsed  # the budget and the summary count SFT steps
    for p in tower:  # frozen through SFT
        p.requires_grad_(False)
    pixels, _ = pretrain_batch(cfg.probe_steps, cfg.probe_batch, cfg.seed, processor)
    before, want = image_token_rms(model, pixels), text_rms(model)
    rescale_projector(model, probe, want / before)
    state["projector_rescale"] = {"image_rms": before, "text_rms": want, "factor": want / before}
    print(f"stage 0: image tokens at RMS {before:.3f} rescaled to the text embeddings' {want:.3f}")


def dialogue(seed: int, cfg: AlignConfig) -> Conversation:
    """The training dialogue of `seed`: its ToyWorld question, then up to `cfg.followups` more
    about the same image (a pure function of the seed)."""
    style = toyworld.ANSWER_STYLES[cfg.answer_style]
    s = sample_for(seed, cfg, style)
    conv = Conversation.from_sample(s)
    if s.image is not None and cfg.followups > 0:
        more = toyworld.followups(s.meta["scene"], random.Random(seed ^ 0xF011), cfg.followups + 1, style)
        conv.followups = [(q, a) for _, q, a in more if a != s.answer][: cfg.followups]
    return conv


def align_batches(start_step: int, cfg: AlignConfig, processor: Any, text_pairs: list[Pair] = ()):
    """Yields (step, encoded batch, scene metas of the batch's images in order); the order is a
    pure function of the step, samples of `cfg.bucket` batches sorted by length together. Each
    batch also carries `cfg.text_per_step` of `text_pairs` (text only), in turn."""
    step = start_step
    while True:
        seeds, part = batch_seeds(step, cfg)
        convs = [dialogue(s, cfg) for s in seeds]
        lengths = [len(c.prompt) + len(c.answer) + sum(len(q) + len(a) for q, a in c.followups) for c in convs]
        order = sorted(range(len(convs)), key=lambda i: (lengths[i], i))
        while part < cfg.bucket:
            chosen = [convs[i] for i in order[part * cfg.batch_size : (part + 1) * cfg.batch_size]]
            if text_pairs and cfg.text_per_step > 0:
                first = step * cfg.text_per_step
                chosen += [as_conversation(text_pairs[(first + j) % len(text_pairs)]) for j in range(cfg.text_per_step)]
            yield step, encode_conversations(processor, chosen), [c.sample.meta["scene"] for c in chosen if c.images]
            step += 1
            part += 1


def load_base(base: str | Path, out: Path, cfg: AlignConfig, progress: bool) -> tuple[torch.nn.Module, Any, list[Pair]]:
    """The untrained assembly, its processor and the Magpie pairs it writes itself (cached in out/magpie.json)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(cfg.seed)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    model.model.vision_tower.to(memory_format=torch.channels_last)  # the same weights; about 25% faster on CPU
    processor = AutoProcessor.from_pretrained(base)
    text_pairs: list[Pair] = []
    if cfg.text_per_step > 0 and cfg.text_pairs > 0:  # written by the base model before any adapter exists
        text_pairs = cached_pairs(out / "magpie.json", model, processor.tokenizer, MagpieConfig(n=cfg.text_pairs, seed=cfg.seed), progress)
    return model, processor, text_pairs


def train_align(base: str | Path, out: str | Path, cfg: AlignConfig, resume: bool = False, progress: bool = True) -> Path:
    """Train (or resume) into `out`; returns `out/trained.safetensors`."""
    wall0 = time.perf_counter()
    out = Path(out)
    ckpt = out / "checkpoint"
    state = saved_state(out) if resume else new_state()
    if resume:  # the recipe is the checkpoint's; the schedule's length, the budget and the precision are this call's
        cfg = AlignConfig.saved(state["config"], steps=cfg.steps, minutes=cfg.minutes, autocast=cfg.autocast)
    source = warm_start_source(cfg) if cfg.warm_start and not resume else None
    out.mkdir(parents=True, exist_ok=True)
    model, processor, text_pairs = load_base(base, out, cfg, progress)
    if text_pairs:
        state["magpie_pairs"] = len(text_pairs)
    adapters, groups = prepare(model, cfg)
    probe = Probes(model.config.text_config.hidden_size, cfg, lm_word_vectors(model, processor.tokenizer))
    groups.append({"params": list(probe.parameters()), "part": "probe", "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98))
    if resume:
        load_checkpoint_parts(model, adapters, probe, ckpt / "trained.safetensors", cfg.tower_tail)
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    if source is not None:
        load_checkpoint_parts(model, adapters, probe, Path(cfg.warm_start) / "checkpoint" / "trained.safetensors", cfg.tower_tail)
        state["warm_start"] = {"run": str(cfg.warm_start), "step": source["step"], "answer_style": source["config"].get("answer_style")}
        state["vision_step"] = cfg.probe_steps  # stage 0 is the source run's
    state["config"] = asdict(cfg)
    state["base"] = str(base)
    _set_train_mode(model)

    def save() -> None:
        weights = {**trained_tensors(model, adapters, cfg.tower_tail), **{f"probe.{k}": v for k, v in probe.state_dict().items()}}
        save_checkpoint_dir(ckpt, weights, "trained.safetensors", opt, state)
        plot_curve(state["history"], out / "loss.png")

    if state.get("vision_step", 0) < cfg.probe_steps:
        pretrain_projector(model, probe, processor, cfg, state, progress)
        _set_train_mode(model)
        save()
    stopped = sft(model, probe, opt, processor, cfg, state, text_pairs, save, progress)
    save()
    result = out / "trained.safetensors"
    image_size = str(processor.image_processor.size["height"])
    export(model, adapters, result, {"image_size": image_size, "steps": str(state["step"]), "lora_rank": str(cfg.lora_rank)}, cfg.tower_tail)
    write_summary(out, state, stopped, wall0)
    print(f"train-align: step {state['step']}/{cfg.steps} ({stopped}), {state['elapsed_s'] / 60:.1f} min; trained parts in {result}")
    return result


def sft(model, probe: Probes, opt: torch.optim.Optimizer, processor: Any, cfg: AlignConfig, state: dict[str, Any],
        text_pairs: list[Pair], save, progress: bool) -> str:
    """The SFT stage through the shared loop; returns why it stopped."""
    tap = ProjectorTap(model)
    params = [p for g in opt.param_groups for p in g["params"]]

    def step(_: int, item: tuple[int, dict[str, torch.Tensor], list[dict]]) -> dict[str, float]:
        _, batch, scenes = item
        with amp(cfg):
            loss = answer_loss(model, batch)
            total = loss
            if scenes:
                tokens = tap.take()  # [n_images, g*g, H], from this forward
                if cfg.aux_weight > 0:
                    total = loss + cfg.aux_weight * probe(tokens, scene_labels(scenes))[0]
        total.backward()
        clipped_step(opt, params, cfg.grad_clip)
        return {"loss": float(loss.detach())}

    def evaluate(_: int) -> dict[str, float]:
        with amp(cfg):
            figures = eval_loss(model, processor, cfg)
        _set_train_mode(model)
        return figures

    peaks = {"lora": cfg.lora_lr, "tower": cfg.tower_lr}
    stage = Stage.of(cfg, "train-align", peak=lambda g: peaks.get(g["part"], cfg.lr))
    hooks = Hooks(step=step, save=save, evaluate=evaluate, postfix=lambda r: {"loss": f"{r['loss']:.3f}"})
    try:
        return train_loop(stage, state, align_batches(state["step"], cfg, processor, text_pairs), opt, hooks, progress)
    finally:
        tap.remove()


__all__ = ["ALIGN_MIX", "ALIGN_STYLES", "AlignConfig", "Probes", "ProjectorTap", "align_batches", "cell_tokens", "dialogue", "export",
           "lm_word_vectors", "load_trained", "pool_cells", "prepare", "pretrain_projector", "projected_tokens", "rescale_projector",
           "text_rms", "tower_tail", "train_align", "trained_tensors"]
