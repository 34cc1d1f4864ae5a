"""`vlmspec data`: a drafter-training corpus whose answers the target writes itself (issue #71).

The work is `vlmspec.train.data_engine.generate_corpus` over the plan of `vlmspec.train.data_plan`;
the corpus format and its check are `vlmspec.data.corpus`; photographs come from
`vlmspec.data.photos`. Documented in docs/data.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vlmspec.cli.options import (
    UsageError,
    add_device_args,
    engine_spec,
    float_in,
    int_list,
    positive_int,
)


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("data", help="write a drafter-training corpus whose answers the target writes itself (sharded JSONL + "
                                    "manifest, resumable); --verify checks one")
    d.add_argument("--model", help="target VLM folder or hub id (default: models/smolvlm-toyworld when built with trained parts, "
                                   "else the toy; 'toy' selects the toy)")
    add_device_args(d)
    d.add_argument("--out", help="corpus folder: shard-NNNNN.jsonl, images/, manifest.json (an existing one is resumed)")
    d.add_argument("--samples", type=positive_int("--samples"), default=1000, help="conversations to write in all")
    d.add_argument("--shard-size", type=positive_int("--shard-size"), default=64,
                   help="conversations per shard (a kill loses at most the shard in progress)")
    d.add_argument("--seed", type=int, default=0, help="seed of every draw (prompts, photos, sampling); per shard and sample")
    d.add_argument("--text", type=float_in("--text", 0.0, 1e6), default=0.4,
                   help="share of instructions the target writes itself (Magpie, varied openers and topics)")
    d.add_argument("--followup", type=float_in("--followup", 0.0, 1e6), default=0.2,
                   help="share of 2-3 turn dialogues whose later turns refer to the answer before")
    d.add_argument("--photo", type=float_in("--photo", 0.0, 1e6), default=0.25,
                   help="share of real photographs (augmented) with varied questions")
    d.add_argument("--toyworld", type=float_in("--toyworld", 0.0, 1e6), default=0.15, help="share of ToyWorld scenes (train split)")
    d.add_argument("--jsonl", metavar="FILE", help="a LLaVA-style JSONL (as `vlmspec train --data` reads): its prompts, answered anew")
    d.add_argument("--jsonl-share", type=float_in("--jsonl-share", 0.0, 1e6), default=0.0, help="share of --jsonl prompts")
    d.add_argument("--sampled-share", type=float_in("--sampled-share", 0.0, 1.0), default=0.3,
                   help="share of conversations answered with sampling (--temperature, --top-p); the rest greedy")
    d.add_argument("--temperature", type=float_in("--temperature", 0.0, 100.0), default=1.0, help="temperature of the sampled answers")
    d.add_argument("--top-p", type=float_in("--top-p", 0.0, 1.0, low_open=True), default=0.95, help="nucleus of the sampled answers")
    d.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=192, help="length limit of each answer")
    d.add_argument("--followup-turns", type=int_list("--followup-turns"), default=(1, 2), metavar="MIN,MAX",
                   help="later user turns of a follow-up dialogue, between MIN and MAX")
    d.add_argument("--slots", type=positive_int("--slots"), default=8, help="rows the batched engine decodes at once")
    d.add_argument("--verify", metavar="DIR", help="only check the corpus in DIR (every shard's sha256, lines, JSON; with --images "
                                                   "every image too); exit 1 when one is bad")
    d.add_argument("--images", action="store_true", help="--verify: check every image against its sha256 too")
    d.add_argument("--json", action="store_true", help="print one JSON summary at the end (no progress bar)")
    d.set_defaults(func=run_data)


def run_data(args: argparse.Namespace) -> int:
    if args.verify:
        return _verify(args)
    if not args.out:
        raise UsageError("give --out DIR (the corpus folder to write or resume), or --verify DIR to check one")
    followup_turns = tuple(args.followup_turns)
    if len(followup_turns) == 1:
        followup_turns = followup_turns * 2
    if len(followup_turns) != 2:
        raise UsageError(f"--followup-turns takes MIN,MAX, got {args.followup_turns}")
    if args.jsonl and not Path(args.jsonl).is_file():
        raise UsageError(f"--jsonl: file not found: {args.jsonl}")
    if args.jsonl_share > 0 and not args.jsonl:
        raise UsageError("--jsonl-share needs --jsonl FILE")

    from vlmspec import factory
    from vlmspec.data.corpus import folder_digest
    from vlmspec.train.data_engine import generate_corpus
    from vlmspec.train.data_plan import DataConfig, Resources

    shares = {"text": args.text, "followup": args.followup, "photo": args.photo, "toyworld": args.toyworld,
              "jsonl": args.jsonl_share if args.jsonl else 0.0}
    cfg = DataConfig(samples=args.samples, shard_size=args.shard_size, seed=args.seed, shares=shares,
                     jsonl=str(Path(args.jsonl).resolve()) if args.jsonl else "", sampled_share=args.sampled_share,
                     temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                     followup_turns=followup_turns, slots=args.slots)  # ConfigError: one line
    res = Resources(photos=_photos(cfg, args.json), jsonl=_jsonl(cfg, args.json))
    spec = engine_spec(args, drafter="plain", policy="fixed")
    model = factory.resolve_model(spec.model)
    engine = factory.build_engine(spec)
    target = engine.target
    info = {"id": model, "name": target.name, "digest": folder_digest(model) if Path(model).is_dir() else "",
            "dtype": str(target.dtype).replace("torch.", ""), "device": str(target.device)}
    run = generate_corpus(engine, cfg, args.out, res, info, progress=not args.json)
    summary = {"out": str(run.folder), "shards_kept": run.kept, "shards_written": run.written, "rewritten": run.rewritten,
               "samples": run.samples, "answer_tokens": run.answer_tokens, "minutes": round(run.seconds / 60, 3),
               "samples_per_min": round(run.samples_per_min, 2), "tokens_per_s": round(run.tokens_per_s, 1)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"data: {run.written} shards written ({run.samples} conversations in {run.seconds / 60:.1f} min: "
              f"{run.samples_per_min:.1f} conversations/min, {run.tokens_per_s:.0f} answer tokens/s), {run.kept} kept; "
              f"corpus in {run.folder} (manifest.json)")
    return 0


def _photos(cfg, quiet: bool) -> list:
    from vlmspec.data.photos import available_photos

    photos, missing = available_photos()
    if not quiet and missing and (cfg.shares.get("photo", 0) > 0 or cfg.shares.get("followup", 0) > 0):
        print(f"data: {len(photos)} photographs; left out: " + "; ".join(missing), file=sys.stderr)
    return photos


def _jsonl(cfg, quiet: bool) -> list:
    if not cfg.jsonl:
        return []
    from vlmspec.train.data import load_jsonl
    from vlmspec.train.data_plan import usable_jsonl

    convs, problems = load_jsonl(cfg.jsonl)
    kept, heldout = usable_jsonl(convs)
    if not quiet:
        print(f"data: {cfg.jsonl}: {len(kept)} conversations ({heldout} with a held-out prompt left out, "
              f"{len(problems)} bad lines skipped)", file=sys.stderr)
    return kept


def _verify(args: argparse.Namespace) -> int:
    from vlmspec.data.corpus import verify

    report = verify(args.verify, images=args.images)  # CorpusError (no manifest): one line, exit 2
    if args.json:
        print(json.dumps({"folder": str(report.folder), "ok": report.ok, "good": len(report.good), "lines": report.lines,
                          "bad": report.bad, "stray": report.stray}))
    else:
        print(report.summary())
    return 0 if report.ok else 1
