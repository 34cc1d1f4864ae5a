"""`vlmspec train-align`: align the assembled real target (EfficientNet-Lite0 + SmolLM2-135M in
`fast_vlm`) on ToyWorld, LLaVA stage-1 style plus low-rank adapters on the language model.

Trained: the projector (1280 -> 576 -> 576) and LoRA pairs on every projection of the 30 decoder
layers; frozen: the vision tower (its BatchNorms in eval mode) and every base weight. Answer-only
next-token cross-entropy, averaged per sample; AdamW, warm-up + cosine; the data order is a pure
function of the step (exact resume); safetensors checkpoints of the trained tensors only; a loss
curve with the held-out loss and the image gap (held-out loss with shuffled images minus real).
The result, `out/trained.safetensors`, is what `vlmspec build-target --trained` merges.

    vlmspec build-target --no-trained --out runs/base
    vlmspec train-align --base runs/base --out runs/align --steps 1500 --minutes 85 [--resume]
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vlmspec.target.assemble import TRAINED_FORMAT
from vlmspec.train.common import save_checkpoint_dir, warmup_cosine
from vlmspec.train.lora import LoraAdapters, add_lora
from vlmspec.train.target_sft import answer_loss, batches, eval_loss, plot_curve

# the grounded questions the target must answer, weighted toward the short ones; no toy text-only
# answers (text-only behaviour is SmolLM2-Instruct's own)
ALIGN_MIX = {"count": 0.24, "attribute": 0.24, "read_text": 0.16, "describe": 0.2, "spatial": 0.08, "read_chart": 0.08}
PROJECTOR = "model.multi_modal_projector."


@dataclass
class AlignConfig:
    steps: int = 1500
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
    ckpt_every: int = 50
    eval_every: int = 250
    eval_samples: int = 24
    minutes: float | None = None
    task_mix: dict[str, float] | None = field(default_factory=lambda: dict(ALIGN_MIX))


def prepare(model: torch.nn.Module, cfg: AlignConfig) -> tuple[LoraAdapters, list[dict[str, Any]]]:
    """Freeze the base, add the adapters; returns them and the optimizer's parameter groups."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = add_lora(model.model.language_model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
    projector = list(model.model.multi_modal_projector.parameters())
    for p in projector:
        p.requires_grad_(True)
    return adapters, [{"params": projector, "part": "projector", "weight_decay": 0.0},
                      {"params": list(adapters.parameters()), "part": "lora", "weight_decay": 0.0}]


def trained_tensors(model: torch.nn.Module, adapters: LoraAdapters) -> dict[str, torch.Tensor]:
    """What ships: the projector's tensors by state-dict name, the LoRA pairs under `lora.`."""
    out = {k: v.detach().float().clone() for k, v in model.state_dict().items() if k.startswith(PROJECTOR)}
    out.update({f"lora.{k}": v for k, v in adapters.tensors().items()})
    return out


def load_trained(model: torch.nn.Module, adapters: LoraAdapters, tensors: dict[str, torch.Tensor]) -> None:
    proj = {k[len(PROJECTOR):]: v for k, v in tensors.items() if k.startswith(PROJECTOR)}
    model.model.multi_modal_projector.load_state_dict(proj, strict=True)
    adapters.load_tensors({k[len("lora."):]: v for k, v in tensors.items() if k.startswith("lora.")})


def export(model: torch.nn.Module, adapters: LoraAdapters, path: Path, meta: dict[str, str]) -> None:
    tensors = trained_tensors(model, adapters)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": TRAINED_FORMAT, **meta})


def _set_train_mode(model: torch.nn.Module) -> None:
    model.train()
    model.model.vision_tower.eval()  # frozen BatchNorm statistics


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
        cfg = AlignConfig(**{**saved["config"], "steps": cfg.steps, "minutes": cfg.minutes})
    else:
        saved = {"step": 0, "history": [], "elapsed_s": 0.0}
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(base)
    adapters, groups = prepare(model, cfg)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98))
    state: dict[str, Any] = saved
    if resume:
        load_trained(model, adapters, load_file(str(ckpt / "trained.safetensors")))
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    state["config"] = asdict(cfg)
    state["base"] = str(base)
    image_size = str(processor.image_processor.size["height"])
    _set_train_mode(model)

    def save() -> None:
        save_checkpoint_dir(ckpt, trained_tensors(model, adapters), "trained.safetensors", opt, state)
        plot_curve(state["history"], out / "loss.png")

    t0, elapsed0 = time.perf_counter(), state["elapsed_s"]
    bar = tqdm(total=cfg.steps, initial=state["step"], disable=not progress, desc="train-align", dynamic_ncols=True)
    stop = "steps"
    for step, batch, _ in batches(state["step"], cfg, processor):
        if step >= cfg.steps:
            break
        lr = warmup_cosine(step, cfg.steps, 1.0, cfg.warmup, cfg.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr * (cfg.lr if g["part"] == "projector" else cfg.lora_lr)
        loss = answer_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] = step + 1
        state["elapsed_s"] = elapsed0 + time.perf_counter() - t0
        state["history"].append({"step": step, "loss": float(loss.detach())})
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", lr=f"{lr * cfg.lr:.1e}")
        if state["step"] % cfg.eval_every == 0 or state["step"] == cfg.steps:
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
    save()
    result = out / "trained.safetensors"
    export(model, adapters, result, {"image_size": image_size, "steps": str(state["step"]), "lora_rank": str(cfg.lora_rank)})
    (out / "train_summary.json").write_text(json.dumps(
        {"step": state["step"], "elapsed_s": state["elapsed_s"], "stopped_by": stop, "config": state["config"]}, indent=2))
    print(f"train-align: step {state['step']}/{cfg.steps} ({stop}), {state['elapsed_s'] / 60:.1f} min; trained parts in {result}")
    return result


__all__ = ["ALIGN_MIX", "AlignConfig", "export", "load_trained", "prepare", "train_align", "trained_tensors"]
