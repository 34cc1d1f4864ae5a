"""`vlmspec train-align`: align the assembled real target (EfficientNet-Lite0 + SmolLM2-135M in
`fast_vlm`) on ToyWorld, LLaVA stage-1 style plus low-rank adapters on the language model.

Trained: the projector (1280 -> 576 -> 576) and LoRA pairs on every projection of the 30 decoder
layers; with `tower_tail` (attempt 6) also the vision tower's last block stages and its 1x1 head.
Frozen: the rest of the tower (all its BatchNorm statistics: eval mode) and every base weight.
Attempt 6 (tower tail 2 + the cell probe + more spatial questions) wrote each token's cell into it
(probe 1.00) but read images worse than attempt 5 (signs 0.05 against 1.00), so the defaults
are attempt 5's. Attempt 7 asks the tokens for their place and content in the language model's
own word embeddings (`word_weight`, `vision_pretrain.WordProbe`: "top" / "left", "red" / "star"),
the tower tail trained in stage 0 only (`tower_in_sft=False`): places and names right (spatial
0.90, attributes 1.00), signs lost (0.05). Attempt 8 (word probe, tower frozen) placed nothing
(0.25) and read signs 0.25: the places come from the tail, and the probe costs the signs.
Attempt 9 added `sign_words` (the sign's word, in the embedding of the word as answers quote it):
signs 1.00 again, places and attributes kept; counting 0.55. Attempt 10 continued it
(`warm_start`) on the "scan" count answers: 0.60; attempt 11 on the "tally" ones (each counted
object marked with its ordinal as it is named): 0.80 (attempt 12, 20 more minutes at half the rates: 0.75);
attempt 13, 72 more minutes from attempt 11 on new scenes: 1.00, the shipped parts (docs/alignment.md).

  stage 0  the projector alone, through linear probes (`vision_pretrain.SceneProbe`) on its
           tokens average-pooled to ToyWorld's 3x3 cells: each cell's object and size, the sign's
           word, the chart's bars (with `probe_per_token`, attempt 4, every token is asked about its
           own cell instead: harder for the linear projector, per-token object accuracy 0.66
           against 0.93 pooled, and the run read images worse); with `position_weight` (attempt 6)
           a probe asks every token which cell it lies in, so the tokens carry where they are
           (the CNN tower has no position embedding: a linear probe on the frozen tower's tokens
           names their cell 0.66 of the time, and attempt 5 named objects but put them in the
           wrong places). No language-model forward, so it is cheap. Then the projector's
           output is rescaled to the RMS of the text embeddings (measured after the first attempt,
           which had no such step: image tokens at RMS 1.5 against text at 0.14, not read at all).
  SFT      answer-only next-token cross-entropy, averaged per sample, on dialogues: each image
           with its ToyWorld question and `followups` more questions about the same scene, so the
           144 image positions are paid once for several supervised answers; plus `aux_weight`
           times the stage-0 probe loss, so the image tokens stay readable; plus `text_per_step`
           text-only pairs per batch that the base model wrote itself before training (Magpie:
           its own instructions and greedy answers, `train.magpie`), so the adapters keep its
           text behaviour (attempt 3 had none and drifted: 1 of 16 held-out text answers identical).

AdamW, warm-up + cosine; the data order is a pure function of the step (exact resume);
safetensors checkpoints of the trained tensors only; a loss curve with the held-out loss and the
image gap (held-out loss with shuffled images minus real). The result, `out/trained.safetensors`,
is what `vlmspec build-target --trained` merges.

    vlmspec build-target --no-trained --out runs/base
    vlmspec train-align --base runs/base --out runs/align --steps 420 --minutes 62 [--resume]
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vlmspec.data import toyworld
from vlmspec.data.heldout import Conversation
from vlmspec.target.assemble import TRAINED_FORMAT
from vlmspec.train.common import clipped_step, save_checkpoint_dir, warmup_cosine
from vlmspec.train.data import encode_conversations
from vlmspec.train.lora import LoraAdapters, add_lora
from vlmspec.train.target_sft import answer_loss, batch_seeds, eval_loss, plot_curve, sample_for
from vlmspec.train.magpie import MagpieConfig, Pair, as_conversation, cached_pairs
from vlmspec.train.vision_pretrain import SIGN_GROUP, WORD_GROUPS, CellProbe, SceneProbe, SceneLabels, WordProbe, pool_cells, pretrain_batch, scene_labels, word_vectors

# the grounded questions the target must answer, weighted toward the short ones; no toy text-only
# answers (text-only behaviour is SmolLM2-Instruct's own)
ALIGN_MIX = {"count": 0.28, "attribute": 0.26, "read_text": 0.14, "describe": 0.2, "spatial": 0.06, "read_chart": 0.06}
# attempt 6's (--task-mix): more of the questions that need places; with the tower tail it read worse
PROJECTOR = "model.multi_modal_projector."
TOWER = "model.vision_tower.timm_model."


@dataclass
class AlignConfig:
    steps: int = 420
    batch_size: int = 4
    lr: float = 1e-3  # the projector's peak rate
    lora_lr: float = 4e-4
    lora_rank: int = 16
    lora_alpha: float = 32.0
    warmup: int = 40
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    bucket: int = 4  # samples of `bucket` batches are drawn together and sorted by length
    followups: int = 4  # more questions about each image in its dialogue
    aux_weight: float = 0.2  # the stage-0 probe loss kept on during SFT
    probe_per_token: bool = False  # True: the probes ask every image token about its own cell (attempt 4: worse); False: cells pooled
    text_pairs: int = 96  # Magpie text-only pairs (the base model's own instructions and greedy answers)
    text_per_step: int = 1  # of them in each batch, beside the image dialogues (0: none)
    answer_style: str = "listed"  # toyworld.ANSWER_STYLES: "listed" (attempt 5), "scan", "tally" or "short" (attempts 1-4)
    tower_tail: int = 0  # the tower's last block stages trained (with conv_head, bn2's affine); 0: frozen (attempts 1-5; attempt 6: 2, worse)
    tower_lr: float = 3e-4
    tower_in_sft: bool = True  # False (attempt 7): the tower tail trains in stage 0 only, frozen through SFT
    position_weight: float = 0.0  # the per-token cell probe's weight in the probe loss (0: none; attempt 6: 1.0)
    word_weight: float = 0.0  # the word probe's weight (`vision_pretrain.WordProbe`; 0: none; attempt 7: 1.0)
    sign_words: bool = False  # the word probe also asks for the sign's word in the language model's embedding of it
    probe_steps: int = 240  # stage 0 (attempts 1-4: 80, where the probes were still improving)
    probe_batch: int = 16
    probe_lr: float = 3e-3
    ckpt_every: int = 50
    eval_every: int = 250
    eval_samples: int = 24
    minutes: float | None = None
    warm_start: str | None = None  # a train-align run folder whose trained parts (and probes) this run starts from; no stage 0
    autocast: bool = False  # forwards under bf16 autocast (fp32 master weights, optimizer and loss); where the CPU has bf16 units
    task_mix: dict[str, float] | None = field(default_factory=lambda: dict(ALIGN_MIX))


def prepare(model: torch.nn.Module, cfg: AlignConfig) -> tuple[LoraAdapters, list[dict[str, Any]]]:
    """Freeze the base, add the adapters; returns them and the optimizer's parameter groups."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = add_lora(model.model.language_model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
    projector = list(model.model.multi_modal_projector.parameters())
    tower = [p for m in tower_tail(model, cfg.tower_tail) for p in m.parameters()] if cfg.tower_in_sft else []
    for p in projector + tower:
        p.requires_grad_(True)
    groups = [{"params": projector, "part": "projector", "weight_decay": 0.0},
              {"params": list(adapters.parameters()), "part": "lora", "weight_decay": 0.0}]
    if tower:
        groups.append({"params": tower, "part": "tower", "weight_decay": 0.0})
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
WARM_START_KEYS = ("lora_rank", "tower_tail", "word_weight", "sign_words", "probe_per_token", "position_weight")


def warm_start_source(cfg: AlignConfig) -> dict[str, Any]:
    """The checkpoint state of the run in `cfg.warm_start`, checked against this config before any
    work is done: a missing checkpoint or other shapes are a WarmStartError naming what to change."""
    src = Path(cfg.warm_start) / "checkpoint"
    if not (src / "trainer_state.json").is_file():
        raise WarmStartError(f"--warm-start: no checkpoint in {src} (give a train-align run folder)")
    saved = json.loads((src / "trainer_state.json").read_text())
    theirs, ours = saved["config"], asdict(cfg)
    def shape(c: dict[str, Any], k: str) -> Any:  # a probe's weight only decides whether it exists
        return bool(c.get(k)) if k.endswith("_weight") else c.get(k)

    differ = [k for k in WARM_START_KEYS if shape(theirs, k) != shape(ours, k)]
    if differ:
        raise WarmStartError(f"--warm-start: {cfg.warm_start} was trained with " + ", ".join(f"{k}={theirs.get(k)}" for k in differ) +
                         " and this run has " + ", ".join(f"{k}={ours[k]}" for k in differ) + ": give the same flags")
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


def probe_input(tokens: torch.Tensor, cfg: AlignConfig) -> torch.Tensor:
    """The projector's tokens [B, g*g, H] as the probes read them under `cfg`."""
    return tokens if cfg.probe_per_token else pool_cells(tokens)


class Probes(torch.nn.Module):
    """The training-only probes on the projector's tokens: the scene probe (what is in each cell),
    with `cfg.position_weight` the cell probe (where each token is), with `cfg.word_weight` the
    word probe (both, in the language model's own word directions; `word_vectors` by group)."""

    def __init__(self, hidden: int, cfg: AlignConfig, word_vectors: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.cfg = cfg
        self.scene = SceneProbe(hidden)
        self.position = CellProbe(hidden) if cfg.position_weight > 0 else None
        assert (word_vectors is not None) == (cfg.word_weight > 0), "the word probe needs the word vectors, and only it"
        self.words = WordProbe(word_vectors, cfg.sign_words) if word_vectors is not None else None

    def heads(self) -> list[torch.nn.Linear]:
        return [self.scene.obj, self.scene.size, self.scene.word, self.scene.bars] + ([self.position.cell] if self.position else [])

    def forward(self, tokens: torch.Tensor, labels: SceneLabels) -> tuple[torch.Tensor, dict[str, float]]:
        """tokens: the projector's [B, g*g, H]. Returns (loss, accuracies)."""
        loss, acc = self.scene(probe_input(tokens, self.cfg), labels)
        if self.position is not None:
            pos_loss, acc["cell"] = self.position(tokens)
            loss = loss + self.cfg.position_weight * pos_loss
        if self.words is not None:
            word_loss, word_acc = self.words(tokens, labels)
            loss = loss + self.cfg.word_weight * word_loss
            acc.update(word_acc)
        return loss, acc


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
    if probe.words is not None:
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
    """Stage 0: the projector and the probes on scene labels, then the text-scale rescale."""
    from tqdm import tqdm

    if state.get("probe_step", 0) >= cfg.probe_steps:
        return
    groups = [{"params": list(model.model.multi_modal_projector.parameters()) + list(probe.parameters()), "peak": cfg.probe_lr}]
    tower = [p for m in tower_tail(model, cfg.tower_tail) for p in m.parameters()]
    for p in tower:  # trained here even where SFT keeps it frozen (`cfg.tower_in_sft`)
        p.requires_grad_(True)
    if tower:
        groups.append({"params": tower, "peak": cfg.tower_lr})
    opt = torch.optim.AdamW(groups, lr=cfg.probe_lr, weight_decay=0.0)
    params = [p for g in groups for p in g["params"]]
    bar = tqdm(total=cfg.probe_steps, disable=not progress, desc="stage 0 (projector probes)", dynamic_ncols=True)
    for step in range(cfg.probe_steps):
        scale = warmup_cosine(step, cfg.probe_steps, 1.0, max(1, cfg.probe_steps // 10), cfg.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = scale * g["peak"]
        pixels, labels = pretrain_batch(step, cfg.probe_batch, cfg.seed, processor)
        with amp(cfg):
            loss, acc = probe(projected_tokens(model, pixels), labels)
        loss.backward()
        clipped_step(opt, params, cfg.grad_clip)
        state["history"].append({"vision_step": step, "probe_loss": float(loss.detach()), **{f"acc_{k}": v for k, v in acc.items()}})
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", obj=f"{acc.get('obj', float('nan')):.2f}", word=f"{acc.get('word', float('nan')):.2f}",
                        cell=f"{acc.get('cell', acc.get('w_row', float('nan'))):.2f}")
    bar.close()
    for p in tower:
        p.requires_grad_(cfg.tower_in_sft)
    pixels, _ = pretrain_batch(cfg.probe_steps, cfg.probe_batch, cfg.seed, processor)
    before, want = image_token_rms(model, pixels), text_rms(model)
    rescale_projector(model, probe, want / before)
    state["probe_step"] = cfg.probe_steps
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


def train_align(base: str | Path, out: str | Path, cfg: AlignConfig, resume: bool = False, progress: bool = True) -> Path:
    """Train (or resume) into `out`; returns `out/trained.safetensors`."""
    from tqdm import tqdm
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = Path(out)
    ckpt = out / "checkpoint"
    if resume:
        if not (ckpt / "trainer_state.json").is_file():
            raise FileNotFoundError(f"--resume: no checkpoint in {ckpt}")
        saved = json.loads((ckpt / "trainer_state.json").read_text())
        # the recipe is the checkpoint's; the schedule's length, the budget and the precision are this call's
        cfg = AlignConfig(**{**saved["config"], "steps": cfg.steps, "minutes": cfg.minutes, "autocast": cfg.autocast})
    else:
        saved = {"step": 0, "history": [], "elapsed_s": 0.0}
    source = warm_start_source(cfg) if cfg.warm_start and not resume else None
    state: dict[str, Any] = saved
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    model.model.vision_tower.to(memory_format=torch.channels_last)  # the same weights; about 25% faster on CPU
    processor = AutoProcessor.from_pretrained(base)
    text_pairs: list[Pair] = []
    if cfg.text_per_step > 0 and cfg.text_pairs > 0:  # written by the base model before any adapter exists
        text_pairs = cached_pairs(out / "magpie.json", model, processor.tokenizer, MagpieConfig(n=cfg.text_pairs, seed=cfg.seed), progress)
        state["magpie_pairs"] = len(text_pairs)
    adapters, groups = prepare(model, cfg)
    probe = Probes(model.config.text_config.hidden_size, cfg, lm_word_vectors(model, processor.tokenizer) if cfg.word_weight > 0 else None)
    groups.append({"params": list(probe.parameters()), "part": "probe", "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98))
    if resume:
        load_checkpoint_parts(model, adapters, probe, ckpt / "trained.safetensors", cfg.tower_tail)
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    if source is not None:
        load_checkpoint_parts(model, adapters, probe, Path(cfg.warm_start) / "checkpoint" / "trained.safetensors", cfg.tower_tail)
        state["warm_start"] = {"run": str(cfg.warm_start), "step": source["step"], "answer_style": source["config"].get("answer_style")}
        state["probe_step"] = cfg.probe_steps  # stage 0 is the source run's
    state["config"] = asdict(cfg)
    state["base"] = str(base)
    image_size = str(processor.image_processor.size["height"])
    _set_train_mode(model)

    def save() -> None:
        weights = {**trained_tensors(model, adapters, cfg.tower_tail), **{f"probe.{k}": v for k, v in probe.state_dict().items()}}
        save_checkpoint_dir(ckpt, weights, "trained.safetensors", opt, state)
        plot_curve(state["history"], out / "loss.png")

    if state.get("probe_step", 0) < cfg.probe_steps:
        pretrain_projector(model, probe, processor, cfg, state, progress)
        _set_train_mode(model)
        save()

    t0, elapsed0 = time.perf_counter(), state["elapsed_s"]
    bar = tqdm(total=cfg.steps, initial=state["step"], disable=not progress, desc="train-align", dynamic_ncols=True)
    stop = "steps"
    tap = ProjectorTap(model)
    for step, batch, scenes in align_batches(state["step"], cfg, processor, text_pairs):
        if step >= cfg.steps:
            break
        lr = warmup_cosine(step, cfg.steps, 1.0, cfg.warmup, cfg.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr * {"lora": cfg.lora_lr, "tower": cfg.tower_lr}.get(g["part"], cfg.lr)
        with amp(cfg):
            loss = answer_loss(model, batch)
            total = loss
            if scenes:
                tokens = tap.take()  # [n_images, g*g, H], from this forward
                if cfg.aux_weight > 0:
                    total = loss + cfg.aux_weight * probe(tokens, scene_labels(scenes))[0]
        total.backward()
        clipped_step(opt, [p for g in opt.param_groups for p in g["params"]], cfg.grad_clip)
        state["step"] = step + 1
        state["elapsed_s"] = elapsed0 + time.perf_counter() - t0
        state["history"].append({"step": step, "loss": float(loss.detach())})
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", lr=f"{lr * cfg.lr:.1e}")
        if state["step"] % cfg.eval_every == 0 or state["step"] == cfg.steps:
            with amp(cfg):
                ev = eval_loss(model, processor, cfg)
            _set_train_mode(model)
            state["history"].append({"step": step, **ev})
            bar.write(f"step {state['step']}: held-out loss {ev['val_loss']:.4f}, image gap (shuffled - real) {ev['image_gap']:+.4f}")
        out_of_time = cfg.minutes is not None and time.perf_counter() - t0 > cfg.minutes * 60
        if state["step"] % cfg.ckpt_every == 0 or out_of_time:
            save()
        if out_of_time:
            stop = "time budget"
            break
    bar.close()
    tap.remove()
    save()
    result = out / "trained.safetensors"
    export(model, adapters, result, {"image_size": image_size, "steps": str(state["step"]), "lora_rank": str(cfg.lora_rank)}, cfg.tower_tail)
    (out / "train_summary.json").write_text(json.dumps(
        {"step": state["step"], "elapsed_s": state["elapsed_s"], "stopped_by": stop, "config": state["config"]}, indent=2))
    print(f"train-align: step {state['step']}/{cfg.steps} ({stop}), {state['elapsed_s'] / 60:.1f} min; trained parts in {result}")
    return result


__all__ = ["ALIGN_MIX", "AlignConfig", "Probes", "ProjectorTap", "align_batches", "cell_tokens", "pool_cells", "probe_input", "projected_tokens", "dialogue", "export", "lm_word_vectors", "load_trained", "prepare",
           "pretrain_projector", "rescale_projector", "text_rms", "tower_tail", "train_align", "trained_tensors"]
