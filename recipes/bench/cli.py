"""The `python -m recipes` commands of this folder: the research suites' options; the work
is `recipes.bench.*` (the product's benches are `vlmspec bench`, vlmspec/cli/bench.py).

    python -m recipes ablate --suite loss|vision ...   drafter variants trained at equal steps (issues #4, #5)
    python -m recipes adaptive ...                     goodput vs plain and the fixed tree (#21)
    python -m recipes stop-head ...                    SpecDec++'s stop rule with and without (#21)
    python -m recipes trees ...                        which draft-tree shape pays (#20)
    python -m recipes kernels WHICH                    the CPU kernels the product chose between, timed here
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmspec.cli import HelpFormatter
from vlmspec.cli.bench import print_report
from vlmspec.cli.options import (
    ANSWER_STYLE_CHOICES,
    UsageError,
    add_device_args,
    add_engine_args,
    check_draft_vocab,
    engine_spec,
    float_in,
    non_negative_int,
    positive_int,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add this folder's commands to the recipes' command line (each one's help line is also its --help description)."""
    a = _add_parser(sub, "ablate", help="drafter variants trained at equal steps, measured on the same held-out prompts")
    a.add_argument("--suite", required=True, choices=["loss", "vision"], help='loss: CE / feature / both, with and without training-time test; vision: compressors, gate, MSD, ViSpec')
    a.add_argument("--model", help="target folder (default: models/smolvlm-toyworld when built with trained parts, else the toy; 'toy' selects the toy)")
    add_device_args(a)
    a.add_argument("--steps", type=positive_int("--steps"), default=300, help='training steps per variant (equal for all)')
    a.add_argument("--batch-size", type=positive_int("--batch-size"), default=8, help='training batch size')
    a.add_argument("--lr", type=float_in("--lr", 0.0, 1.0, low_open=True), default=1e-3, help='peak learning rate')
    a.add_argument("--n", type=positive_int("--n"), default=4, help="held-out test prompts per task")
    a.add_argument("--n-select", type=non_negative_int("--n-select"), default=0,
                   help="selection prompts per task (val split): the best fixed compressor / variant is picked on these")
    a.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=96, help='new tokens per evaluation prompt')
    a.add_argument("--only", action="append", default=[], help="run only this variant (repeatable)")
    a.add_argument("--answer-style", choices=ANSWER_STYLE_CHOICES, default="short",
                   help="ToyWorld answers phrased as the target was aligned (as `vlmspec train --answer-style`; the default model: tally)")
    a.add_argument("--draft-vocab", type=non_negative_int("--draft-vocab"), default=0, metavar="K",
                   help="every variant's head over the K tokens the target writes most (as `vlmspec train --draft-vocab`; 0: all)")
    a.add_argument("--out", required=True, help="report folder: ablation.md, ablation.json, ablation.png")
    a.add_argument("--runs", help="folder for the variants' training runs (default: runs/ablate-SUITE)")
    a.add_argument("--reuse", action="store_true",
                   help="load a variant whose run folder holds a finished run with the same config and target instead of retraining it")
    a.add_argument("--rounds", type=positive_int("--rounds"), default=21, help="round-robin rounds per block of the prefill timing at 576 image tokens")
    a.add_argument("--blocks", type=positive_int("--blocks"), default=8, help="blocks of --rounds rounds, --pause seconds apart: the timing pools them all")
    a.add_argument("--pause", type=float_in("--pause", 0.0, 3600.0), default=5.0, help="seconds between two blocks of the prefill timing")
    a.set_defaults(func=run_ablate)

    ad = _add_parser(sub, "adaptive", help="adaptive speculation (goodput) vs plain decoding and the fixed tree, in domain and on "
                                           "adversarial prompts (photos it cannot answer, random tokens, unseen text)")
    _add_ways_args(ad, n=4, n_help="prompts per category", temperatures="0 and 1.5")
    ad.add_argument("--categories", default=None, help="comma-separated subset of in_domain, photo_unknown, random_tokens, unseen_text (default: all)")
    ad.add_argument("--no-probe-way", action="store_true",
                    help="also time goodput without its shallow probes (first drafts and retries at full depth), interleaved")
    ad.set_defaults(func=run_adaptive_bench)

    sh = _add_parser(sub, "stop-head", help="SpecDec++: one drafter with its acceptance head's stop rule and without, at a fixed "
                                            "depth and under goodput, against plain decoding (held-out ToyWorld prompts)")
    _add_ways_args(sh, n=8, n_help="held-out ToyWorld prompts (the bench set)", temperatures="0 and 1")
    sh.set_defaults(func=run_stop_head_bench)

    tr = _add_parser(sub, "trees", help="draft-tree shapes against plain decoding through one engine, interleaved, answers "
                                        "ending at the end of turn: which shape pays on this device, dtype and drafter")
    add_engine_args(tr)
    tr.add_argument("--prompts", default="test", help="'test' / 'val' (held-out ToyWorld), 'text' (held-out text-only instructions) or a LLaVA-style JSONL")
    tr.add_argument("-n", type=positive_int("-n"), default=8, help="number of prompts")
    tr.add_argument("--shape", action="append", type=tree_shape, default=[], metavar="D,K,N",
                    help="a tree shape: depth, children per node, drafted nodes (repeatable; default: chains of 4-6, 5,2,8, 6,2,10, 5,4,16)")
    tr.add_argument("--temperature", type=float_in("--temperature", 0.0, 100.0), default=0.0, help="sampling temperature")
    tr.add_argument("--repeats", type=positive_int("--repeats"), default=1, help="measured runs per prompt and shape")
    tr.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=96, help="new tokens per prompt at most")
    tr.add_argument("--json", dest="json_path", help="write the per-run rows and the summary here")
    tr.set_defaults(func=run_trees_bench)
    _register_kernels(sub)


def _register_kernels(sub: argparse._SubParsersAction) -> None:
    k = _add_parser(sub, "kernels", help="times the CPU kernels the product chose between on this machine: onednn (its shape caches' "
                    "memory over new row counts), attention (one layer: transformers' SDPA, grouped heads, packed queries), packing "
                    "(a target's decode step with F.linear and its exact packed layers), packed-linear (the drafter's products)")
    k.add_argument("which", choices=["onednn", "attention", "packing", "packed-linear"])
    k.add_argument("--model", help="packing: a target folder (e.g. models/smolvlm-toyworld)")
    k.add_argument("--rounds", type=positive_int("--rounds"), default=3, help="packing: rounds of both ways, taking turns")
    k.set_defaults(func=run_kernels)


def run_kernels(args: argparse.Namespace) -> int:
    from recipes.bench import kernels

    if args.which == "packing":
        if not args.model:
            raise UsageError("kernels packing needs --model DIR (a target folder, e.g. models/smolvlm-toyworld)")
        kernels.time_packing(args.model, args.rounds)
    else:
        {"onednn": kernels.time_onednn, "attention": kernels.time_attention, "packed-linear": kernels.time_packed_linear}[args.which]()
    return 0


def _add_parser(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)


def _add_ways_args(p: argparse.ArgumentParser, n: int, n_help: str, temperatures: str) -> None:
    """The options of the benches that time ways to speculate through one engine, interleaved."""
    add_engine_args(p)
    p.add_argument("-n", type=positive_int("-n"), default=n, help=n_help)
    p.add_argument("--temperature", action="append", type=float_in("--temperature", 0.0, 100.0), default=[],
                   help=f"sampling temperature (repeatable; default: {temperatures})")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=2, help="measured runs per prompt and way")
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=64, help="new tokens per prompt (EOS ignored)")
    p.add_argument("--json", dest="json_path", help="write the per-run rows and the summary here")


def run_adaptive_bench(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from recipes.bench.adaptive import categories, format_table, measure

    engine = factory.build_engine(engine_spec(args))
    if engine.drafter.tree is None:
        raise UsageError("adaptive compares ways to speculate: give a drafter that drafts (--drafter eagle, ngram or a folder)")
    cats = categories(engine.target, args.n)
    if args.categories:
        keep = [c.strip() for c in args.categories.split(",") if c.strip()]
        if not keep or any(c not in cats for c in keep):
            raise UsageError(f"--categories must list some of {', '.join(cats)}, got {args.categories!r}")
        cats = {c: cats[c] for c in keep}
    report = measure(engine, cats, tuple(args.temperature or (0.0, 1.5)), args.max_new_tokens, args.repeats, no_probe=args.no_probe_way)
    return print_report(report, format_table(report), args, args.command_line)


def run_stop_head_bench(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from recipes.bench.stop_head import format_table, measure
    from vlmspec.data.heldout import heldout
    from vlmspec.draft.eagle import EagleDrafter

    engine = factory.build_engine(engine_spec(args))
    d = engine.drafter
    if not isinstance(d, EagleDrafter) or d.head.accept is None or not d.stop_threshold:
        raise UsageError("stop-head needs an EAGLE drafter trained with an acceptance head: "
                         "vlmspec train --acceptance-head --out RUN, then --drafter RUN/drafter")
    report = measure(engine, heldout("bench", args.n), tuple(args.temperature or (0.0, 1.0)), args.max_new_tokens, args.repeats)
    return print_report(report, format_table(report), args, args.command_line)


def tree_shape(text: str):
    from recipes.bench.trees import parse_shape

    try:
        return parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_trees_bench(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.bench.harness import load_prompts
    from recipes.bench.trees import SHAPES, format_table, measure

    engine = factory.build_engine(engine_spec(args))
    if engine.drafter.tree is None:
        raise UsageError("trees compares draft-tree shapes: give a drafter that drafts (--drafter eagle, ngram or a folder)")
    report = measure(engine, load_prompts(args.prompts, args.n), tuple(args.shape) or SHAPES, args.temperature,
                     args.max_new_tokens, args.repeats)
    return print_report(report, format_table(report), args, args.command_line)


def run_ablate(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from recipes.bench.ablation import AblateOptions, ablate, suite

    names = [v.name for v in suite(args.suite)]
    unknown = [o for o in args.only if o not in names]
    if unknown:
        raise UsageError(f"--only {unknown[0]!r} is not a variant of the {args.suite!r} suite: one of {', '.join(names)}")
    target = factory.load(engine_spec(args))
    check_draft_vocab(args.draft_vocab, target.vocab_size)
    opts = AblateOptions(suite=args.suite, steps=args.steps, batch_size=args.batch_size, lr=args.lr, n=args.n, n_select=args.n_select,
                         max_new_tokens=args.max_new_tokens, only=tuple(args.only), runs=Path(args.runs) if args.runs else None,
                         reuse=args.reuse, rounds=args.rounds, blocks=args.blocks, pause_s=args.pause,
                         answer_style=args.answer_style, draft_vocab=args.draft_vocab)
    out = Path(args.out)
    ablate(target, opts, out, command=args.command_line)
    print((out / "ablation.md").read_text())
    return 0
