"""The one training loop every trainer runs (`vlmspec train`'s drafters, and the recipes that made the
bundled targets): resume from the step a checkpoint saved, a progress bar, the warm-up + cosine
learning-rate schedule, evaluation, a wall-clock budget, checkpoints, and the run's summary.

A trainer supplies what is its own through `Hooks`: one optimizer step on a batch, an evaluation,
a checkpoint writer. Its batches must be a pure function of the step (exact resume); `Stage.peak`
gives each of its optimizer's parameter groups its peak rate.

    stage = Stage.of(cfg, "train")
    stopped = train_loop(stage, state, batches(state["step"]), opt, Hooks(step=..., save=...))
    write_summary(out, state, stopped, wall0)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from vlmspec.train.common import warmup_cosine

CKPT = "checkpoint"  # the checkpoint folder inside a run folder


@dataclass
class TrainConfig:
    """The fields every trainer's config shares (each trainer's config subclasses it, with its own
    defaults). Under torchrun `batch_size` is per process: N processes train on N x batch_size."""

    steps: int = 1000  # length of the cosine schedule
    batch_size: int = 8  # samples per step (per process)
    lr: float = 3e-4  # peak learning rate
    warmup: int = 50  # linear warm-up steps
    min_lr_ratio: float = 0.1  # the cosine ends at min_lr_ratio x the peak
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global L2 norm of the gradients
    seed: int = 0
    eval_every: int = 200  # evaluate every this many steps (and at the last)
    ckpt_every: int = 100  # checkpoint every this many steps (and at the last, and when the budget is spent)
    minutes: float | None = None  # wall-clock budget of this run's steps; None = none


@dataclass
class Stage:
    """One pass of the loop: its counter in the trainer state, its length, schedule and cadence."""

    desc: str  # the progress bar's label
    steps: int
    warmup: int
    min_lr_ratio: float
    ckpt_every: int
    eval_every: int = 0  # 0: never
    minutes: float | None = None
    counter: str = "step"  # the trainer-state key counting this stage's steps (and naming them in the history)
    peak: Callable[[dict[str, Any]], float] = lambda group: group["peak"]  # a parameter group -> its peak rate

    @classmethod
    def of(cls, cfg: TrainConfig, desc: str, **changes: Any) -> "Stage":
        """The stage a config's shared fields describe (every parameter group peaking at cfg.lr
        unless `peak` is given)."""
        fields = dict(desc=desc, steps=cfg.steps, warmup=cfg.warmup, min_lr_ratio=cfg.min_lr_ratio, ckpt_every=cfg.ckpt_every,
                      eval_every=cfg.eval_every, minutes=cfg.minutes, peak=lambda group: cfg.lr)
        return cls(**{**fields, **changes})

    def scale(self, step: int) -> float:
        """The schedule's factor at `step` (of the peak rate)."""
        return warmup_cosine(step, self.steps, 1.0, self.warmup, self.min_lr_ratio)


@dataclass
class Hooks:
    """What a trainer gives the loop. `step(step, batch)` runs one optimizer step and returns its
    history record (a "loss" first); `save()` writes the checkpoint; `evaluate(step)` returns
    held-out figures for the history, or None (e.g. on the ranks that do not evaluate);
    `postfix(record)` the progress bar's text."""

    step: Callable[[int, Any], dict[str, float]]
    save: Callable[[], None]
    evaluate: Callable[[int], dict[str, float] | None] | None = None
    postfix: Callable[[dict[str, float]], dict[str, str]] | None = None


def new_state(**extra: Any) -> dict[str, Any]:
    """A fresh trainer state: step 0, an empty history, no time spent."""
    return {"step": 0, "history": [], "elapsed_s": 0.0, **extra}


def saved_state(out: Path) -> dict[str, Any]:
    """The trainer state of `out`'s checkpoint; FileNotFoundError naming the folder when there is none."""
    path = Path(out) / CKPT / "trainer_state.json"
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint in {path.parent}")
    return json.loads(path.read_text())


def train_loop(
    stage: Stage,
    state: dict[str, Any],
    batches: Iterable[Any],
    optimizer: torch.optim.Optimizer,
    hooks: Hooks,
    progress: bool = True,
    stop_at: int | None = None,
    main: bool = True,
) -> str:
    """Run `stage` from `state[stage.counter]` (a resumed run continues where its checkpoint
    stopped) until its last step, `stop_at`, or its wall-clock budget; `batches` yields the batch of
    that step onward. Only the `main` process shows progress and checkpoints. Updates `state`
    (counter, elapsed_s, history) in place; returns why it stopped: "steps", "time budget" or
    "--stop-at N"."""
    from tqdm import tqdm

    key = stage.counter
    peaks = [stage.peak(g) for g in optimizer.param_groups]
    bar = tqdm(total=stage.steps, initial=state[key], disable=not (progress and main), desc=stage.desc, dynamic_ncols=True)
    t0, elapsed0 = time.perf_counter(), state["elapsed_s"]
    stopped = "steps"
    for batch in batches:
        step = state[key]
        if step >= stage.steps:
            break
        if stop_at is not None and step >= stop_at:
            stopped = f"--stop-at {stop_at}"
            break
        scale = stage.scale(step)
        for group, top in zip(optimizer.param_groups, peaks):
            group["lr"] = scale * top
        record = hooks.step(step, batch)
        state[key] = step + 1
        state["elapsed_s"] = elapsed0 + time.perf_counter() - t0
        state["history"].append({key: step, **record})
        last = state[key] == stage.steps
        if hooks.evaluate is not None and stage.eval_every and (state[key] % stage.eval_every == 0 or last):
            figures = hooks.evaluate(step)
            if figures:
                state["history"].append({key: step, **figures})
            if figures and progress and main:
                bar.write(f"{stage.desc} step {state[key]}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))
        bar.update(1)
        if hooks.postfix is not None:
            bar.set_postfix(hooks.postfix(record))
        out_of_time = stage.minutes is not None and time.perf_counter() - t0 > stage.minutes * 60
        if main and (state[key] % stage.ckpt_every == 0 or last or out_of_time):
            hooks.save()
        if out_of_time:
            stopped = "time budget"
            break
    bar.close()
    return stopped


def write_summary(out: Path, state: dict[str, Any], stopped: str, wall0: float, **extra: Any) -> dict[str, Any]:
    """out/train_summary.json: steps done, seconds of training steps, this run's wall time since
    `wall0` (time.perf_counter()), why it stopped, the config. Returns it."""
    summary = {"step": state["step"], "elapsed_s": state["elapsed_s"], "run_wall_s": time.perf_counter() - wall0,
               "stopped_by": stopped, "config": state["config"], **extra}
    (Path(out) / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
