"""`vlmspec build-target` and `vlmspec train-align`: the real target, built from pip-shipped weights
(`vlmspec.target.assemble`) and aligned on ToyWorld (`vlmspec.train.align`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmspec import assets
from vlmspec.cli.options import ANSWER_STYLE_CHOICES, UsageError, float_in, positive_int, warn_emulated_bf16


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("build-target", help="build the real target (SmolLM2-135M + EfficientNet-Lite0 in fast_vlm) from pip packages, offline")
    b.add_argument("--out", help=f"folder to write, replaced when it exists (default: {assets.DEFAULT_TARGET}, "
                                 f"or {assets.BASE_TARGET} with --no-trained)")
    b.add_argument("--image-size", type=positive_int("--image-size"), default=384,
                   help="image side in px, a multiple of 32: (size/32)^2 image tokens (384 -> 144, 768 -> 576)")
    b.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype the weights are stored in")
    b.add_argument("--trained", default=str(assets.DEFAULT_TARGET_PARTS), help="trained parts to apply (vlmspec train-align)")
    b.add_argument("--no-trained", action="store_true", help="the untrained assembly (the base train-align starts from)")
    b.set_defaults(func=run_build_target)

    a = sub.add_parser("train-align", help="align the real target's untrained assembly on ToyWorld: projector + LoRA (resumable)")
    a.add_argument("--base", required=True, help="the untrained assembly (vlmspec build-target --no-trained --out BASE)")
    a.add_argument("--out", required=True, help="run folder: checkpoint/, trained.safetensors, loss.png")
    a.add_argument("--steps", type=positive_int("--steps"), default=420, help="steps of the cosine schedule")
    a.add_argument("--batch-size", type=positive_int("--batch-size"), default=4, help='samples per step')
    a.add_argument("--lr", type=float_in("--lr", 0.0, 1.0, low_open=True), default=1e-3, help="the projector's peak rate")
    a.add_argument("--lora-lr", type=float_in("--lora-lr", 0.0, 1.0, low_open=True), default=4e-4, help="the LoRA pairs' peak learning rate")
    a.add_argument("--lora-rank", type=positive_int("--lora-rank"), default=16, help='LoRA rank on every projection of the 30 decoder layers (alpha = 2 x rank)')
    a.add_argument("--followups", type=int, default=4, help="more questions about each image in its training dialogue (0: one question per image)")
    a.add_argument("--aux-weight", type=float_in("--aux-weight", 0.0, 100.0), default=0.2, help="weight of the scene-probe loss on the image tokens during SFT")
    a.add_argument("--answer-style", choices=ANSWER_STYLE_CHOICES, default="listed",
                   help="listed: count answers name the counted objects first, descriptions go in reading order (attempt 5); "
                        "scan: a count of a colour or shape names every object first, then picks the asked ones out; "
                        "tally: every object named, each counted one followed by its running ordinal (attempt 11); short: attempts 1-4")
    a.add_argument("--probe-steps", type=int, default=240, help="stage 0: steps of the projector on the scene probes alone (0: none)")
    a.add_argument("--probe-tokens", action="store_true", help="the probes ask every image token about its own cell instead of reading cells pooled (attempt 4; measured worse)")
    a.add_argument("--tower-tail", type=int, choices=range(0, 8), default=0, metavar="{0..7}",
                   help="the vision tower's last block stages trained with its 1x1 head (attempt 6: 2, read signs worse); 0: frozen")
    a.add_argument("--tower-stage0-only", action="store_true",
                   help="with --tower-tail: the tail trains in stage 0 (on the probes) only and stays frozen through SFT (attempt 7)")
    a.add_argument("--word-weight", type=float_in("--word-weight", 0.0, 100.0), default=0.0,
                   help="weight of the word probe: image tokens asked for their row / column / colour / shape / size in the "
                        "language model's own word embeddings (attempt 7: 1.0; 0: none)")
    a.add_argument("--sign-words", action="store_true", help="with --word-weight: the word probe also asks for each sign's word, "
                                                             "against the language model's embedding of the word as answers quote it")
    a.add_argument("--position-weight", type=float_in("--position-weight", 0.0, 100.0), default=0.0,
                   help="weight of the probe that asks every image token for its cell (attempt 6: 1.0; 0: none)")
    a.add_argument("--task-mix", help="the image questions' mix, e.g. 'count=0.26,attribute=0.24,read_text=0.1,describe=0.18,spatial=0.16,read_chart=0.06' "
                                      "(attempt 6's; default: attempt 5's, vlmspec.train.align.ALIGN_MIX)")
    a.add_argument("--text-pairs", type=int, default=96, help="text-only pairs the base model writes itself (Magpie) to keep its text behaviour (0: none)")
    a.add_argument("--text-per-step", type=int, default=1, help="of those text pairs in each batch")
    a.add_argument("--minutes", type=float_in("--minutes", 0.0, 1e6, low_open=True), default=None, help="wall-clock budget of this run")
    a.add_argument("--seed", type=int, default=0, help="seed of the adapters' initialisation and of the training scenes")
    a.add_argument("--autocast", action="store_true", help="forwards in bf16 autocast (fp32 weights and optimizer): faster on CPUs with "
                                                          "bf16 units (AVX512-BF16 / AMX), slower where bf16 is emulated; with --resume, this call's choice")
    a.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    a.add_argument("--warm-start", metavar="RUN", help="start from another train-align run's trained parts and probes (RUN/checkpoint), "
                                                      "with this call's recipe and a fresh schedule; no stage 0 (RUN's is kept). "
                                                      "RUN's --lora-rank, --tower-tail and probe flags must be given again")
    a.set_defaults(func=run_train_align)


def run_build_target(args: argparse.Namespace) -> int:
    from vlmspec.target.assemble import PATCH, assemble

    if args.image_size % PATCH:
        raise UsageError(f"--image-size must be a multiple of {PATCH} px (one image token per 32 x 32), got {args.image_size}")
    out = Path(args.out or (assets.BASE_TARGET if args.no_trained else assets.DEFAULT_TARGET))
    trained = None if args.no_trained else Path(args.trained)
    if trained is not None and not trained.is_file():
        raise UsageError(f"--trained: {trained} not found (the aligned parts have not shipped yet, issue #19; "
                         "--no-trained builds the untrained assembly)")
    assemble(out, image_size=args.image_size, dtype=args.dtype, trained=trained)
    return 0


def run_train_align(args: argparse.Namespace) -> int:
    from vlmspec.train.align import ALIGN_MIX, AlignConfig, WarmStartError, train_align
    from vlmspec.train.target_sft import parse_task_mix

    if not (Path(args.base) / "config.json").is_file():
        raise UsageError(f"--base: {args.base} is not a built model folder (vlmspec build-target --no-trained --out {args.base})")
    if args.tower_stage0_only and not args.tower_tail:
        raise UsageError("--tower-stage0-only needs --tower-tail N (N >= 1): which of the tower's stages to train in stage 0")
    if args.sign_words and not args.word_weight:
        raise UsageError("--sign-words is part of the word probe: give it a weight with --word-weight W (W > 0)")
    if args.warm_start and args.resume:
        raise UsageError("--warm-start starts a new run from another run's parts; --resume continues OUT's own run: give one of them")
    if args.resume and not (Path(args.out) / "checkpoint").is_dir():
        raise UsageError(f"--resume: no checkpoint in {args.out}/checkpoint")
    warn_emulated_bf16("cpu", args.autocast)  # train-align runs on the CPU
    try:
        mix = parse_task_mix(args.task_mix) if args.task_mix else dict(ALIGN_MIX)
    except ValueError as exc:
        raise UsageError(f"--task-mix: {exc}") from None
    cfg = AlignConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, lora_lr=args.lora_lr, lora_rank=args.lora_rank,
                      lora_alpha=2.0 * args.lora_rank, minutes=args.minutes, seed=args.seed, followups=args.followups,
                      aux_weight=args.aux_weight, probe_steps=args.probe_steps, probe_per_token=args.probe_tokens,
                      answer_style=args.answer_style, tower_tail=args.tower_tail, position_weight=args.position_weight,
                      tower_in_sft=not args.tower_stage0_only, word_weight=args.word_weight, sign_words=args.sign_words,
                      text_pairs=args.text_pairs, text_per_step=args.text_per_step, task_mix=mix, autocast=args.autocast, warm_start=args.warm_start)
    try:
        train_align(args.base, args.out, cfg, resume=args.resume)
    except WarmStartError as exc:  # a warm start's source missing or not fitting these flags (checked before any work)
        raise UsageError(str(exc)) from None
    return 0
