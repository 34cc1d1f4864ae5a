"""`vlmspec bench [run|verify-cost|kernel|ablate]`: the benchmarks' options; the work is `vlmspec.bench.*`.

`vlmspec bench` with no sub-benchmark (or with options only) runs `bench run`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmspec.cli.options import (
    ANSWER_STYLE_CHOICES,
    UsageError,
    add_device_args,
    add_engine_args,
    add_tree_args,
    check_draft_vocab,
    engine_spec,
    float_in,
    int_list,
    non_negative_int,
    positive_int,
)

BENCHES = ("run", "verify-cost", "kernel", "ablate", "server", "adaptive", "stop-head", "trees")
DEFAULT = "run"


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench",
        help="speed of every method side by side (default: run), or verify-cost, kernel, ablate, server, adaptive, stop-head, trees",
        description="Benchmarks. `vlmspec bench WHICH --help` for the options of each; without WHICH, `run`.",
    )
    which = b.add_subparsers(dest="bench", metavar="{" + ",".join(BENCHES) + "}", required=True)

    r = which.add_parser("run", help="every method side by side on the same prompts: HF generate, HF prompt lookup, "
                                     "vlmspec none / ngram / eagle (T=0 parity checked)")
    r.add_argument("--model", help="target folder or hub id (default: models/smolvlm-toyworld when built with trained parts, else the toy; 'toy' selects the toy)")
    r.add_argument("--drafter", action="append", default=[],
                   help="EAGLE drafter folder, or self / self:E for self-speculation (repeatable; default: the EAGLE drafter shipped for the model, if any)")
    r.add_argument("--prompts", default="test", help="'test' / 'val' (held-out ToyWorld), 'text' (held-out text-only instructions) or a LLaVA-style JSONL")
    r.add_argument("-n", type=positive_int("-n"), default=12, help="number of prompts")
    r.add_argument("--temperature", type=float_in("--temperature", 0.0, 100.0), default=0.0, help='sampling temperature (0 = greedy, where every method must match HF generate)')
    r.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=96, help='new tokens per prompt')
    r.add_argument("--warmup", type=non_negative_int("--warmup"), default=1, help="unmeasured runs per prompt and method")
    r.add_argument("--repeats", type=positive_int("--repeats"), default=1, help="measured runs per prompt and method")
    add_tree_args(r)
    add_device_args(r)
    r.add_argument("--json", dest="json_path", help="write the results JSON here")
    r.add_argument("--out", help="folder for results.json, results.md and results.png")
    r.set_defaults(func=run_bench)

    sv = which.add_parser("server", help="per-request time through the HTTP service vs the same engine called directly "
                                         "(interleaved, same held-out prompts, answers checked equal)")
    add_engine_args(sv)
    sv.add_argument("-n", type=positive_int("-n"), default=6, help="held-out ToyWorld prompts (the bench set)")
    sv.add_argument("--repeats", type=positive_int("--repeats"), default=3, help="measured runs per prompt and path")
    sv.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=64, help="new tokens per request")
    sv.add_argument("--stream", action="store_true", help="stream the served answers (SSE) instead of one response")
    sv.add_argument("--json", dest="json_path", help="write the per-request rows and the summary here")
    sv.set_defaults(func=run_server_bench)

    ad = which.add_parser("adaptive", help="adaptive speculation (goodput) vs plain decoding and the fixed tree, in domain and on "
                                           "adversarial prompts (photos it cannot answer, random tokens, unseen text)")
    _add_ways_args(ad, n=4, n_help="prompts per category", temperatures="0 and 1.5")
    ad.set_defaults(func=run_adaptive_bench)

    sh = which.add_parser("stop-head", help="SpecDec++: one drafter with its acceptance head's stop rule and without, at a fixed "
                                            "depth and under goodput, against plain decoding (held-out ToyWorld prompts)")
    _add_ways_args(sh, n=8, n_help="held-out ToyWorld prompts (the bench set)", temperatures="0 and 1")
    sh.set_defaults(func=run_stop_head_bench)

    tr = which.add_parser("trees", help="draft-tree shapes against plain decoding through one engine, interleaved, answers "
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

    v = which.add_parser("verify-cost", help="ms per target forward over a tree of N nodes vs a one-token step")
    v.add_argument("--model", help="a model folder (default: a synthetic --shape with random weights)")
    v.add_argument("--shape", default="bundled", choices=["bundled", "bundled-v2", "llava-7b"], help="decoder shape to time: the toy (bundled), the wider v2 toy, or LLaVA-7B's text decoder")
    v.add_argument("--layers", type=positive_int("--layers"), default=None, help="override the synthetic shape's layer count")
    add_device_args(v)
    v.add_argument("--prefix", type=positive_int("--prefix"), default=256, help="cached prompt tokens before the tree")
    v.add_argument("--sizes", type=int_list("--sizes"), default=(1, 2, 4, 8, 16, 32, 64), help="tree sizes, e.g. 1,2,4,8")
    v.add_argument("--repeats", type=positive_int("--repeats"), default=10, help='timed repetitions per size')
    v.add_argument("--warmup", type=non_negative_int("--warmup"), default=3, help='untimed warm-up repetitions per size')
    v.add_argument("--draft-vocab", type=int_list("--draft-vocab"), default=(), metavar="K,K,...",
                   help="also time the LM head cut to K rows at 1 and 4 rows per call (a trimmed drafter's head), e.g. 2048,4096,8192")
    v.add_argument("--json", dest="json_path", help="write the results JSON here")
    v.set_defaults(func=run_verify_cost)

    k = which.add_parser("kernel", help="the Triton tree-attention kernel vs SDPA with a tree mask (needs a CUDA GPU)")
    k.add_argument("--prefix", type=non_negative_int("--prefix"), nargs="+", default=[1024, 4096], help="prefix lengths P")
    k.add_argument("--tree", type=positive_int("--tree"), nargs="+", default=[16, 32, 64], help="tree sizes N")
    k.add_argument("--heads", type=positive_int("--heads"), default=32, help="query heads")
    k.add_argument("--kv-heads", type=positive_int("--kv-heads"), default=None, help="KV heads (default: = heads, no GQA)")
    k.add_argument("--head-dim", type=positive_int("--head-dim"), default=128, help='attention head dimension')
    k.add_argument("--batch", type=positive_int("--batch"), default=1, help='batch size')
    k.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help='dtype of q/k/v')
    k.add_argument("--warmup", type=non_negative_int("--warmup"), default=10, help='untimed warm-up calls')
    k.add_argument("--repeats", type=positive_int("--repeats"), default=100, help='timed calls')
    k.add_argument("--no-flush", action="store_true", help="do not flush L2 between calls")
    k.add_argument("--seed", type=int, default=0, help='random seed of the inputs')
    k.add_argument("--json", metavar="PATH", dest="json_path", default=None, help="also write the numbers as JSON")
    k.set_defaults(func=run_kernel)

    a = which.add_parser("ablate", help="drafter variants trained at equal steps, measured on the same held-out prompts")
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


def show_run_options(bench: argparse.ArgumentParser) -> None:
    """`vlmspec bench --help` also lists the options of `bench run`, the default (#22)."""
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    run = sub.choices[DEFAULT]
    text = run.format_help()
    options = text[text.index("options:"):] if "options:" in text else text
    bench.epilog = f"`vlmspec bench [OPTIONS]` runs `bench {DEFAULT}`; its {options}"


def default_to_run(argv: list[str]) -> list[str]:
    """`vlmspec bench [OPTIONS]` means `vlmspec bench run [OPTIONS]` (help stays the bench overview)."""
    if argv[:1] == ["bench"] and (len(argv) == 1 or (argv[1] not in BENCHES and argv[1] not in ("-h", "--help"))):
        return ["bench", DEFAULT, *argv[1:]]
    return argv


def run_bench(args: argparse.Namespace) -> int:
    from vlmspec.bench.harness import RunOptions, bench, mismatched, save_report

    opts = RunOptions(prompts=args.prompts, n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                      warmup=args.warmup, repeats=args.repeats, eagle=tuple(args.drafter))
    report = bench(engine_spec(args, drafter="auto"), opts)  # the drafters: --drafter folders, none, ngram
    report["env"]["command"] = args.command_line
    print(save_report(report, out=Path(args.out) if args.out else None, json_path=Path(args.json_path) if args.json_path else None))
    bad = mismatched(report)
    if bad:
        print(f"ERROR: at T=0 these methods did not reproduce hf_generate's tokens: {bad}")
        return 1
    return 0


def run_server_bench(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.data.heldout import heldout

    try:
        from vlmspec.app import ServerSettings
        from vlmspec.app.serve import serving
        from vlmspec.bench.server import format_report, measure
    except ModuleNotFoundError as exc:
        raise UsageError(f"bench server needs the service's packages: pip install 'vlmspec[serve]' ({exc.name} is missing)") from None
    engine = factory.build_engine(engine_spec(args))
    settings = ServerSettings(model="bench", max_queue=4, request_timeout_s=600, ui=False)
    with serving(engine, settings) as url:
        report = measure(engine, heldout("bench", args.n), url, settings.model, max_tokens=args.max_new_tokens, repeats=args.repeats,
                         stream=args.stream, progress=True)
    return _report(report, format_report(report), args)


def _add_ways_args(p: argparse.ArgumentParser, n: int, n_help: str, temperatures: str) -> None:
    """The options of the benches that time ways to speculate through one engine, interleaved."""
    add_engine_args(p)
    p.add_argument("-n", type=positive_int("-n"), default=n, help=n_help)
    p.add_argument("--temperature", action="append", type=float_in("--temperature", 0.0, 100.0), default=[],
                   help=f"sampling temperature (repeatable; default: {temperatures})")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=2, help="measured runs per prompt and way")
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=64, help="new tokens per prompt (EOS ignored)")
    p.add_argument("--json", dest="json_path", help="write the per-run rows and the summary here")


def _report(report: dict, text: str, args: argparse.Namespace) -> int:
    """Print a bench's table; write its JSON (with the command) where --json asks."""
    from vlmspec.bench.harness import write_json

    report["command"] = args.command_line
    print(text)
    if args.json_path:
        write_json(args.json_path, report)
    return 0


def run_adaptive_bench(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.bench.adaptive import categories, format_table, measure

    engine = factory.build_engine(engine_spec(args))
    if engine.drafter.tree is None:
        raise UsageError("bench adaptive compares ways to speculate: give a drafter that drafts (--drafter eagle, ngram or a folder)")
    report = measure(engine, categories(engine.target, args.n), tuple(args.temperature or (0.0, 1.5)), args.max_new_tokens, args.repeats)
    return _report(report, format_table(report), args)


def run_stop_head_bench(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.bench.stop_head import format_table, measure
    from vlmspec.data.heldout import heldout
    from vlmspec.draft.eagle import EagleDrafter

    engine = factory.build_engine(engine_spec(args))
    d = engine.drafter
    if not isinstance(d, EagleDrafter) or d.head.accept is None or not d.stop_threshold:
        raise UsageError("bench stop-head needs an EAGLE drafter trained with an acceptance head: "
                         "vlmspec train --acceptance-head --out RUN, then --drafter RUN/drafter")
    report = measure(engine, heldout("bench", args.n), tuple(args.temperature or (0.0, 1.0)), args.max_new_tokens, args.repeats)
    return _report(report, format_table(report), args)


def tree_shape(text: str):
    from vlmspec.bench.trees import parse_shape

    try:
        return parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_trees_bench(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.bench.harness import load_prompts
    from vlmspec.bench.trees import SHAPES, format_table, measure

    engine = factory.build_engine(engine_spec(args))
    if engine.drafter.tree is None:
        raise UsageError("bench trees compares draft-tree shapes: give a drafter that drafts (--drafter eagle, ngram or a folder)")
    report = measure(engine, load_prompts(args.prompts, args.n), tuple(args.shape) or SHAPES, args.temperature,
                     args.max_new_tokens, args.repeats)
    return _report(report, format_table(report), args)


def run_verify_cost(args: argparse.Namespace) -> int:
    from vlmspec.bench.verify_cost import VerifyCostOptions, format_table, measure

    opts = VerifyCostOptions(model=args.model, shape=args.shape, layers=args.layers, device=args.device, dtype=args.dtype,
                             prefix=args.prefix, sizes=tuple(args.sizes), repeats=args.repeats, warmup=args.warmup,
                             draft_vocab=tuple(args.draft_vocab))
    report = measure(opts)
    return _report(report, format_table(report), args)


def run_kernel(args: argparse.Namespace) -> int:
    from vlmspec.bench.kernel import KernelOptions, format_table, run

    opts = KernelOptions(prefix=tuple(args.prefix), tree=tuple(args.tree), heads=args.heads, kv_heads=args.kv_heads,
                         head_dim=args.head_dim, batch=args.batch, dtype=args.dtype, warmup=args.warmup, repeats=args.repeats,
                         flush=not args.no_flush, seed=args.seed)
    report = run(opts)  # ConfigError without CUDA / triton: one line, exit 2
    return _report(report, format_table(report), args)


def run_ablate(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.bench.ablation import AblateOptions, ablate, suite

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
