"""`vlmspec train`, `eval-drafter`: training a drafter and measuring it.

Targets and drafters load through `vlmspec.factory`; held-out prompts come from
`vlmspec.data.heldout`; the work is `vlmspec.train.*`. (The recipes that trained the bundled
targets are `python -m recipes train-target | train-align | eval-target`.)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vlmspec.cli.options import (
    ANSWER_STYLE_CHOICES,
    TEXT_STYLE_CHOICES,
    UsageError,
    add_device_args,
    check_draft_vocab,
    engine_spec,
    float_in,
    non_negative_int,
    positive_int,
)

VISUAL_CHOICES = ("none", "gate", "uniform", "attention", "pool", "conv", "resampler", "text_only")


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("train", help="distil an EAGLE-style draft head from a frozen target (online logits)")
    d.add_argument("--target", help="target VLM folder or hub id (default: models/smolvlm-toyworld when built with trained parts, else the toy; 'toy' selects the toy)")
    d.add_argument("--data", default="toyworld", help="'toyworld', a LLaVA-style JSONL file, a corpus folder of `vlmspec data` "
                                                     "(its shards checked against its manifest first), or a feature cache of "
                                                     "`vlmspec features` (offline: no target forward per step)")
    d.add_argument("--out", required=True, help="run folder: checkpoint/, drafter/, train_curve.png")
    d.add_argument("--steps", type=positive_int("--steps"), default=1000, help='training steps')
    d.add_argument("--batch-size", type=positive_int("--batch-size"), default=8, help='samples per step')
    d.add_argument("--lr", type=float_in("--lr", 0.0, 1.0, low_open=True), default=3e-4, help='peak learning rate')
    d.add_argument("--w-ce", type=float_in("--w-ce", 0.0, 1e3), default=0.1, help="weight of the cross-entropy on the target's logits")
    d.add_argument("--w-feat", type=float_in("--w-feat", 0.0, 1e3), default=1.0, help='weight of the feature (hidden-state) regression loss')
    d.add_argument("--ttt-steps", type=positive_int("--ttt-steps"), default=2, help="training-time test unroll (1 = off)")
    d.add_argument("--curriculum-steps", type=non_negative_int("--curriculum-steps"), default=0, help="text-only -> multimodal ramp")
    d.add_argument("--arch", choices=("eagle1", "eagle3"), default="eagle1",
                   help="the head: eagle1 (fc over [embedding, last hidden state], the target's LM head) or eagle3 (the "
                        "hidden states of three target layers, EAGLE-3's defaults [2, n/2, n-3], fused; its own LM head)")
    d.add_argument("--feature-layers", default=None, metavar="I,J,K",
                   help="--arch eagle3: the target layers it reads, as HF hidden_states ids (layer i's input), e.g. 15,22,29 "
                        "(default: EAGLE-3's [2, n/2, n-3])")
    d.add_argument("--visual", default="none", choices=VISUAL_CHOICES,
                   help="VLM-aware head: compress the image tokens the drafter reads (issue #5); none = all of them")
    d.add_argument("--ratio", type=float_in("--ratio", 1.0, 4096.0), default=4.0, help="compression ratio for --visual")
    d.add_argument("--decouple", action="store_true", help="MSD: visual rows take the image embeddings directly (bypass fc)")
    d.add_argument("--global-feature", action="store_true", help="ViSpec: fuse a global image feature into later text rows")
    d.add_argument("--gate-cost", type=float_in("--gate-cost", 0.0, 100.0), default=0.05, help="--visual gate: weight of its kept fraction")
    d.add_argument("--regenerate", action="store_true",
                   help="ViSpec: train on the target's own greedy answers (generated once, cached in OUT/answers_rank*.jsonl)")
    d.add_argument("--draft-vocab", type=int, default=0, metavar="K",
                   help="trim the head's vocabulary to the K tokens the target writes most often in the training answers (0: all)")
    d.add_argument("--acceptance-head", action="store_true",
                   help="SpecDec++: train an acceptance-prediction head alongside; its stop threshold is chosen on validation prompts at the end")
    d.add_argument("--text-pairs", type=non_negative_int("--text-pairs"), default=0, metavar="N",
                   help="add N text-only instructions and answers the target writes itself (Magpie; cached in OUT/magpie.json)")
    d.add_argument("--text-share", type=float_in("--text-share", 0.0, 1.0), default=0.25,
                   help="share of each batch taken by the --text-pairs (default 0.25)")
    d.add_argument("--text-style", choices=TEXT_STYLE_CHOICES, default="plain",
                   help="--text-pairs' instructions: plain = the model's own open user turn (Magpie); varied = turns started "
                        "with common instruction openings (Write, List, Why, ...), for a wider spread of requests")
    d.add_argument("--init-from", metavar="DRAFTER",
                   help="continue training from this drafter folder's weights (same --draft-vocab, --visual and "
                        "--acceptance-head); its draft vocabulary is recounted on this run's data")
    d.add_argument("--answer-style", choices=ANSWER_STYLE_CHOICES, default="short",
                   help="ToyWorld answers phrased as the target was aligned (its train-align --answer-style), so the drafter "
                        "learns on the contexts the target writes (default: short, the bundled toy's)")
    d.add_argument("--eval-every", type=positive_int("--eval-every"), default=200, help='evaluate the acceptance on held-out prompts every this many steps')
    d.add_argument("--eval-n", type=non_negative_int("--eval-n"), default=12, help="held-out prompts of each evaluation (0: no evaluation)")
    d.add_argument("--minutes", type=float_in("--minutes", 0.0, 1e6, low_open=True), default=None, help='wall-clock budget of this run (checkpointed when spent; --resume continues)')
    d.add_argument("--seed", type=int, default=0, help='seed of the initialisation and of the data order')
    add_device_args(d)
    d.add_argument("--resume", action="store_true", help='continue from OUT/checkpoint')
    d.add_argument("--json", action="store_true", help="print one JSON summary at the end")
    d.set_defaults(func=run_train)

    register_features(sub)

    ed = sub.add_parser("eval-drafter", help="mean accepted length (tau) per task and by depth on held-out sets: ToyWorld, "
                                            "free text, photographs, follow-up turns")
    ed.add_argument("--model", help="target folder (default: models/smolvlm-toyworld when built with trained parts, else the toy; 'toy' selects the toy)")
    ed.add_argument("--drafter", default="auto", help="drafter folder, eagle, ngram or plain (default: auto = the EAGLE drafter shipped for the model, else ngram)")
    add_device_args(ed)
    ed.add_argument("--n", type=positive_int("--n"), default=8, help="prompts per task")
    ed.add_argument("--sets", type=eval_sets, default=("toyworld",), metavar="SET[,SET]",
                    help="held-out sets, none trained on: toyworld, text (instructions written apart from any training prompt), "
                         "photo (the sample photographs: questions nothing in them answers, and described), followup (a "
                         "second turn after the target's own answer) (default: toyworld)")
    ed.add_argument("--temperature", type=float_in("--temperature", 0.0, 100.0), default=0.0, help='sampling temperature (0 = greedy)')
    ed.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=128, help='new tokens per prompt')
    ed.add_argument("--json", action="store_true", help='print one JSON object instead of the table')
    ed.set_defaults(func=run_eval_drafter)


def register_features(sub: argparse._SubParsersAction) -> None:
    fe = sub.add_parser("features", help="the offline feature cache: the target's features and top-k logits of a corpus, "
                                         "computed once, for `vlmspec train --data CACHE`")
    fe.add_argument("--target", help="target VLM folder (default: as `vlmspec train`)")
    fe.add_argument("--data", required=True, help="a LLaVA-style JSONL file or a corpus folder of `vlmspec data`")
    fe.add_argument("--out", required=True, help="cache folder: features-NNNNN.safetensors + manifest.json (an existing one is resumed)")
    fe.add_argument("--arch", choices=("eagle1", "eagle3"), default="eagle1", help="the head it is for: eagle1 (the last hidden "
                    "state) or eagle3 (its layers)")
    fe.add_argument("--feature-layers", default=None, metavar="I,J,K", help="--arch eagle3: the layers (default: EAGLE-3's)")
    fe.add_argument("--top-k", type=positive_int("--top-k"), default=64, help="the teacher's logits kept per answer row")
    fe.add_argument("--shard-size", type=positive_int("--shard-size"), default=128, help="conversations per shard (a kill loses at most one)")
    fe.add_argument("--batch-size", type=positive_int("--batch-size"), default=4, help="conversations per target forward")
    fe.add_argument("--limit", type=positive_int("--limit"), default=None, help="only the first N conversations")
    add_device_args(fe)
    fe.add_argument("--json", action="store_true", help="print the manifest's summary as JSON (no progress bar)")
    fe.set_defaults(func=run_features)


def run_train(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.draft.eagle.config import target_depth
    from vlmspec.train.distill import DistillConfig, train_drafter
    from vlmspec.vision_compress import VisualConfig

    spec = engine_spec(args, model=args.target, **process_device(args.device))
    factory.resolve_model(spec.model)  # no bundled model and no --target: say so before anything else
    if args.data != "toyworld" and not Path(args.data).is_file() and not (Path(args.data) / "manifest.json").is_file():
        raise UsageError(f"data file not found: {args.data} (use 'toyworld', a JSONL file or a `vlmspec data` corpus folder)")
    if args.resume and not (Path(args.out) / "checkpoint").is_dir():
        raise UsageError(f"--resume: no checkpoint in {args.out}/checkpoint")
    if args.init_from:
        if args.resume:
            raise UsageError("--init-from starts a new run; drop it to --resume one")
        if not Path(args.init_from).is_dir():
            raise UsageError(f"--init-from: {args.init_from} is not a drafter folder (config.json + model.safetensors)")
    if args.acceptance_head and args.eval_n == 0:
        raise UsageError("--acceptance-head chooses its stop threshold on the held-out prompts: give --eval-n 1 or more")
    if args.arch == "eagle3" and args.visual != "none":
        raise UsageError("--visual variants are EAGLE-1 heads: drop --visual, or train --arch eagle1")
    if args.text_style != "plain" and not args.text_pairs:
        raise UsageError("--text-style shapes the --text-pairs; add --text-pairs N")
    if args.feature_layers is not None and args.arch != "eagle3":
        raise UsageError("--feature-layers chooses an EAGLE-3 head's layers: add --arch eagle3")
    target = factory.load(spec)
    check_draft_vocab(args.draft_vocab, target.vocab_size)
    layers = feature_layer_ids(args.feature_layers, target_depth(target)) if args.feature_layers is not None else ()
    cfg = DistillConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, w_ce=args.w_ce, w_feat=args.w_feat,
        ttt_steps=args.ttt_steps, curriculum_steps=args.curriculum_steps, eval_every=args.eval_every, eval_n=args.eval_n,
        minutes=args.minutes, seed=args.seed, regenerate=args.regenerate, draft_vocab=args.draft_vocab,
        acceptance_head=args.acceptance_head, text_pairs=args.text_pairs, text_share=args.text_share,
        answer_style=args.answer_style, text_style=args.text_style, init_from=args.init_from or "", arch=args.arch,
        feature_layers=layers,
    )
    vis = VisualConfig(args.visual, args.ratio, args.decouple, args.global_feature, gate_cost=args.gate_cost if args.visual == "gate" else 0.0)
    cfg.visual = {} if vis.is_plain else vis.to_dict()
    train_drafter(target, args.data, args.out, cfg, resume=args.resume, progress=not args.json)  # DataError: one line
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, process 0 writes the drafter and reports
        return 0
    summary = json.loads((Path(args.out) / "train_summary.json").read_text())
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"train: {summary['step']} steps, {summary['elapsed_s'] / 60:.1f} min of training steps "
              f"({summary['run_wall_s'] / 60:.1f} min this run with data, evals and the stop threshold); drafter in {args.out}/drafter")
    return 0


def run_features(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.draft.eagle import EagleConfig
    from vlmspec.draft.eagle.config import target_depth
    from vlmspec.train.features import FeatureSpec, build_features

    if not Path(args.data).is_file() and not (Path(args.data) / "manifest.json").is_file():
        raise UsageError(f"--data {args.data}: not a JSONL file or a `vlmspec data` corpus folder")
    if args.feature_layers is not None and args.arch != "eagle3":
        raise UsageError("--feature-layers chooses an EAGLE-3 head's layers: add --arch eagle3")
    spec = engine_spec(args, model=args.target)
    model = factory.resolve_model(spec.model)
    target = factory.load(spec)
    layers = None
    if args.arch == "eagle3":
        chosen = feature_layer_ids(args.feature_layers, target_depth(target)) if args.feature_layers is not None else ()
        layers = tuple(EagleConfig.from_target(target, "eagle3", chosen).feature_layers)
    manifest = build_features(target, model, args.data, args.out, FeatureSpec(layers, args.top_k), args.shard_size, args.batch_size,
                              args.limit, progress=not args.json)
    shards = manifest["shards"]
    summary = {"out": args.out, "shards": len(shards), "conversations": sum(s["samples"] for s in shards),
               "tokens": sum(s["tokens"] for s in shards), "bytes": sum((Path(args.out) / s["file"]).stat().st_size for s in shards)}
    print(json.dumps(summary) if args.json else f"features: {summary['conversations']} conversations, {summary['tokens']} tokens, "
          f"{summary['bytes'] / 2**20:.0f} MiB in {args.out}")
    return 0


def feature_layer_ids(text: str, depth: int) -> tuple[int, ...]:
    """--feature-layers "I,J,K": two or more distinct layer ids of a target `depth` layers deep, in order."""
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--feature-layers {text!r}: give layer ids separated by commas, e.g. 15,22,29") from None
    if len(ids) < 2 or len(set(ids)) != len(ids) or not all(0 <= i < depth for i in ids):
        raise UsageError(f"--feature-layers {text!r}: two or more distinct ids in 0..{depth - 1} (this target has {depth} layers)")
    return tuple(sorted(ids))


def process_device(device: str | None) -> dict[str, str]:
    """Under torchrun with CUDA, each process trains on its own GPU (cuda:LOCAL_RANK) unless
    --device names one; {} otherwise (the device the options say)."""
    import torch

    local = os.environ.get("LOCAL_RANK")
    if local is None or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return {}
    if device == "cuda" or (device is None and torch.cuda.is_available()):
        return {"device": f"cuda:{int(local)}"}
    return {}


def eval_sets(text: str) -> tuple[str, ...]:
    from vlmspec.data.heldout import EVAL_SETS

    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in EVAL_SETS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(EVAL_SETS)} (comma-separated)")
    return names


def run_eval_drafter(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.data.heldout import eval_set
    from vlmspec.train.distill_eval import speculation_stats

    spec = engine_spec(args)
    target = factory.load(spec)
    drafter = factory.drafter_for(spec, target)
    sets = {}
    for name in args.sets:
        stats = speculation_stats(target, drafter, eval_set(name, args.n), temperature=args.temperature, max_new_tokens=args.max_new_tokens)
        sets[name] = {task: {"tau": s.mean_accepted_length, "drafts": s.num_drafts,
                             "acceptance_by_depth": [round(a / r, 4) if r else None for a, r in zip(s.accepted_per_pos, s.reached_per_pos)]}
                      for task, s in stats.items()}
    record = {"temperature": args.temperature, "prompts_per_task": args.n, "max_new_tokens": args.max_new_tokens,
              "drafter": factory.resolve_drafter(spec.drafter, target.name), "dtype": str(target.dtype).replace("torch.", ""), "sets": sets}
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"{'set':>9} {'task':>15} {'tau':>5}  acceptance at depth 1, 2, ...")
    for name, tasks in sets.items():
        for task, row in tasks.items():
            depths = ", ".join("-" if a is None else f"{a:.2f}" for a in row["acceptance_by_depth"])
            print(f"{name:>9} {task:>15} {row['tau']:5.2f}  {depths}")
    return 0
