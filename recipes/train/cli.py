"""The `python -m recipes` commands of this folder: the trainers of the bundled targets' parts
and the target evaluation their model cards quote.

    python -m recipes train-align --base models/smolvlm-base --out runs/align ...   (align.py)
    python -m recipes train-target --out runs/target ...                           (target_sft.py)
    python -m recipes eval-target --model models/smolvlm-toyworld --json           (target_eval.py)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vlmspec.cli import HelpFormatter
from recipes.train.align import ALIGN_STYLES
from vlmspec.cli.options import (
    UsageError,
    add_device_args,
    engine_spec,
    float_in,
    non_negative_int,
    positive_int,
    warn_emulated_bf16,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add this folder's commands to the recipes' command line."""
    register_train_align(sub)
    register_train_target(sub)
    register_eval_target(sub)


def register_train_align(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("train-align", help="align the default target's untrained assembly on ToyWorld: projector + LoRA (resumable)",
                       formatter_class=HelpFormatter)
    a.add_argument("--base", required=True, help="the untrained assembly (vlmspec build-target --no-trained --out BASE)")
    a.add_argument("--out", required=True, help="run folder: checkpoint/, trained.safetensors, loss.png")
    a.add_argument("--steps", type=positive_int("--steps"), default=420, help="steps of the cosine schedule")
    a.add_argument("--lr", type=float_in("--lr", 0.0, 1.0, low_open=True), default=1e-3, help="the projector's peak rate")
    a.add_argument("--lora-lr", type=float_in("--lora-lr", 0.0, 1.0, low_open=True), default=4e-4, help="the LoRA pairs' peak learning rate")
    a.add_argument("--answer-style", choices=ALIGN_STYLES, default="listed",
                   help="listed: count answers name the counted objects first, descriptions go in reading order; "
                        "scan: a count of a colour or shape names every object first, then picks the asked ones out; "
                        "tally: every object named, each counted one followed by its running ordinal (the shipped parts')")
    a.add_argument("--task-mix", help="the image questions' mix, e.g. 'count=0.36,attribute=0.18,read_text=0.12,describe=0.2,spatial=0.08,read_chart=0.06' "
                                      "(default: recipes.train.align.ALIGN_MIX)")
    a.add_argument("--minutes", type=float_in("--minutes", 0.0, 1e6, low_open=True), default=None, help="wall-clock budget of this run")
    a.add_argument("--seed", type=int, default=0, help="seed of the adapters' initialisation and of the training scenes")
    a.add_argument("--autocast", action="store_true", help="forwards in bf16 autocast (fp32 weights and optimizer): faster on CPUs with "
                                                          "bf16 units (AVX512-BF16 / AMX), slower where bf16 is emulated; with --resume, this call's choice")
    a.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    a.add_argument("--warm-start", metavar="RUN", help="start from another train-align run's trained parts and probes (RUN/checkpoint), "
                                                      "with this call's answer style, mix and rates and a fresh schedule; no stage 0 (RUN's is kept)")
    a.set_defaults(func=run_train_align)


def register_train_target(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train-target", help="train the toy target VLM (--model toy) from scratch on ToyWorld (resumable)",
                       formatter_class=HelpFormatter)
    t.add_argument("--out", required=True, help="run folder: checkpoint/, model/, loss.png")
    t.add_argument("--steps", type=positive_int("--steps"), default=1300, help='SFT steps of the cosine schedule')
    t.add_argument("--batch-size", type=positive_int("--batch-size"), default=16, help='samples per step')
    t.add_argument("--lr", type=float_in("--lr", 0.0, 1.0, low_open=True), default=1e-3, help='peak learning rate')
    t.add_argument("--minutes", type=float_in("--minutes", 0.0, 1e6, low_open=True), default=None, help="wall-clock budget of this run")
    t.add_argument("--seed", type=int, default=0, help='seed of the initialisation and of the training scenes')
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    t.add_argument("--init-from", help="exported model folder (e.g. runs/x/model or assets/toyworld-vlm) whose weights and processor start this run")
    t.add_argument("--task-mix", help="training task mix, e.g. 'count=0.3,attribute=0.3,describe=0.2' (default: ToyWorld's mix)")
    t.add_argument("--vision-steps", type=non_negative_int("--vision-steps"), default=1500,
                   help="stage 0: steps of supervised vision-tower pre-training on scene labels (0 = none)")
    t.add_argument("--stop-at", type=positive_int("--stop-at"), default=None,
                   help="end this run after this SFT step (checkpointed; continue with --resume)")
    t.add_argument("--aux-weight", type=float_in("--aux-weight", 0.0, 100.0), default=0.2,
                   help="weight of the stage-0 probe loss kept on during SFT")
    t.add_argument("--hidden", type=positive_int("--hidden"), default=None, help="decoder width (default 160, the bundled v4's)")
    t.add_argument("--intermediate", type=positive_int("--intermediate"), default=None, help="decoder MLP width (default 448)")
    t.add_argument("--heads", type=positive_int("--heads"), default=None, help="decoder attention heads (default 5)")
    t.add_argument("--kv-heads", type=positive_int("--kv-heads"), default=None, help="decoder key/value heads (default 5)")
    t.set_defaults(func=run_train_target)


def register_eval_target(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval-target", help="score a target on held-out ToyWorld items, with real and with noise images",
                       formatter_class=HelpFormatter)
    e.add_argument("--model", help="target folder (default: models/smolvlm-toyworld when built with trained parts, else the toy; 'toy' selects the toy)")
    add_device_args(e)
    e.add_argument("--n", type=positive_int("--n"), default=600, help='held-out items in all, split evenly over the scored tasks')
    e.add_argument("--seed", type=non_negative_int("--seed"), default=0, help='which block of held-out items (0 = the one the reported figures use)')
    e.add_argument("--text-reference", help="a model folder with the same tokenizer (e.g. the untrained assembly, "
                                            "vlmspec build-target --no-trained): also compare greedy answers to text-only prompts")
    e.add_argument("--json", action="store_true", help='print one JSON object instead of the table')
    e.add_argument("--answers", help="also write every item's answer, reference and score to this JSON file")
    e.set_defaults(func=run_eval_target)


def run_train_align(args: argparse.Namespace) -> int:
    from recipes.train.align import ALIGN_MIX, AlignConfig, WarmStartError, train_align
    from recipes.train.target_sft import parse_task_mix

    if not (Path(args.base) / "config.json").is_file():
        raise UsageError(f"--base: {args.base} is not a built model folder (vlmspec build-target --no-trained --out {args.base})")
    if args.warm_start and args.resume:
        raise UsageError("--warm-start starts a new run from another run's parts; --resume continues OUT's own run: give one of them")
    if args.resume and not (Path(args.out) / "checkpoint").is_dir():
        raise UsageError(f"--resume: no checkpoint in {args.out}/checkpoint")
    warn_emulated_bf16("cpu", args.autocast)  # train-align runs on the CPU
    try:
        mix = parse_task_mix(args.task_mix) if args.task_mix else dict(ALIGN_MIX)
    except ValueError as exc:
        raise UsageError(f"--task-mix: {exc}") from None
    cfg = AlignConfig(steps=args.steps, lr=args.lr, lora_lr=args.lora_lr, minutes=args.minutes, seed=args.seed,
                      answer_style=args.answer_style, task_mix=mix, autocast=args.autocast, warm_start=args.warm_start)
    try:
        train_align(args.base, args.out, cfg, resume=args.resume)
    except WarmStartError as exc:  # a warm start's source missing or not fitting this recipe (checked before any work)
        raise UsageError(str(exc)) from None
    return 0


def run_train_target(args: argparse.Namespace) -> int:
    from recipes.train.target_sft import SFTConfig, TargetArch, parse_task_mix, saved_sizes, train

    if args.resume and not (Path(args.out) / "checkpoint").is_dir():
        raise UsageError(f"--resume: no checkpoint in {args.out}/checkpoint")
    try:
        mix = parse_task_mix(args.task_mix) if args.task_mix else None
    except ValueError as exc:
        raise UsageError(f"--task-mix: {exc}") from None
    sizes = {k: v for k, v in (("hidden", args.hidden), ("intermediate", args.intermediate), ("heads", args.heads),
                               ("kv_heads", args.kv_heads)) if v is not None}
    if args.init_from and not sizes:  # the sizes of the model it starts from
        sizes = saved_sizes(args.init_from)
    arch = TargetArch(**sizes)
    if arch.hidden % arch.heads or arch.heads % arch.kv_heads or (arch.hidden // arch.heads) % 2:
        raise UsageError(f"--hidden {arch.hidden} / --heads {arch.heads} / --kv-heads {arch.kv_heads}: the width must split into "
                         "heads of an even size, and the heads into equal key/value groups")
    if args.resume and sizes:
        raise UsageError("--resume continues with the sizes saved in the checkpoint; drop --hidden/--intermediate/--heads/--kv-heads")
    cfg = SFTConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, minutes=args.minutes, seed=args.seed,
                    vision_steps=args.vision_steps, aux_weight=args.aux_weight, task_mix=mix, arch=arch)
    if args.init_from:
        if args.resume:
            raise UsageError("--init-from starts a new run; drop it to --resume one")
        if not (Path(args.init_from) / "model.safetensors").is_file():
            raise UsageError(f"--init-from: {args.init_from} is not an exported model folder (no model.safetensors)")
    train(args.out, cfg, resume=args.resume, init_from=args.init_from, stop_at=args.stop_at)
    return 0


def run_eval_target(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from recipes.train.target_eval import evaluate, format_table, text_agreement

    spec = engine_spec(args)
    target = factory.load(spec)
    answers: list[dict] | None = [] if args.answers else None
    result = evaluate(target, n=args.n, seed=args.seed, answers=answers)  # progress on stderr, so --json's stdout stays one object
    if args.text_reference:
        reference = factory.load(engine_spec(args, model=args.text_reference))
        result["text_only"] = text_agreement(target, reference)
    if answers is not None:
        Path(args.answers).write_text(json.dumps(answers, indent=1))
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    return 0
