"""`vlmspec bench [run|batch|verify-cost|kernel|server|load|soak]`: the product's benchmarks' options; the work is `vlmspec.bench.*`.

`vlmspec bench` with no sub-benchmark (or with options only) runs `bench run`. The research suites
(ablate, adaptive, stop-head, trees) are the lab's: `python -m recipes`, recipes/bench/cli.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmspec.cli import load
from vlmspec.cli.options import (
    UsageError,
    add_device_args,
    add_engine_args,
    add_tree_args,
    engine_spec,
    float_in,
    int_list,
    non_negative_int,
    positive_int,
    write_figures,
)

BENCHES = ("run", "batch", "verify-cost", "kernel", "server", "load", "soak")
DEFAULT = "run"


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench",
        help="speed of every method side by side (default: run), or batch, verify-cost, kernel, server, load, soak",
        description="Benchmarks. `vlmspec bench WHICH --help` for the options of each; without WHICH, `run`. "
                    "The research suites (ablate, adaptive, stop-head, trees): `python -m recipes --help`.",
    )
    which = b.add_subparsers(dest="bench", metavar="{" + ",".join(BENCHES) + "}", required=True)

    r = which.add_parser("run", help="every method side by side on the same prompts: HF generate, HF prompt lookup, "
                                     "vlmspec none / ngram / eagle (T=0 parity checked)")
    r.add_argument("--model", help="target folder or hub id (default: models/smolvlm-toyworld when built with trained parts, else the toy; 'toy' selects the toy)")
    r.add_argument("--drafter", action="append", default=[],
                   help="EAGLE drafter folder, eagle, self / self:E for self-speculation, suffix, or hybrid / DIR+suffix "
                        "(repeatable; default: the EAGLE drafter shipped for the model, if any)")
    r.add_argument("--prompts", default="test", help="'test' / 'val' (held-out ToyWorld), 'text' (held-out text-only instructions) or a LLaVA-style JSONL")
    r.add_argument("-n", type=positive_int("-n"), default=12, help="number of prompts")
    r.add_argument("--temperature", type=float_in("--temperature", 0.0, 100.0), default=0.0, help='sampling temperature (0 = greedy, where every method must match HF generate)')
    r.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=96, help='new tokens per prompt')
    r.add_argument("--warmup", type=non_negative_int("--warmup"), default=1, help="unmeasured runs per prompt and method")
    r.add_argument("--repeats", type=positive_int("--repeats"), default=1, help="measured runs per prompt and method")
    r.add_argument("--repeat-share", type=float_in("--repeat-share", 0.0, 0.95), default=0.0,
                   help="this share of the requests repeat earlier ones, after the -n prompts (0.5: each prompt again, a second "
                        "pass); each pass is reported apart (a drafter that learns from traffic: suffix, hybrid)")
    r.add_argument("--skip", default="", help="methods to leave out, comma-separated (e.g. hf_prompt_lookup,vlmspec_ngram)")
    add_tree_args(r)
    add_device_args(r)
    r.add_argument("--json", dest="json_path", help="write the results JSON here")
    r.add_argument("--out", help="folder for results.json, results.md and results.png")
    r.set_defaults(func=run_bench)

    register_batch(which)
    load.register(which)

    sv = which.add_parser("server", help="per-request time through the HTTP service vs the same engine called directly "
                                         "(interleaved, same held-out prompts, answers checked equal)")
    add_engine_args(sv)
    sv.add_argument("-n", type=positive_int("-n"), default=6, help="held-out ToyWorld prompts (the bench set)")
    sv.add_argument("--repeats", type=positive_int("--repeats"), default=3, help="measured runs per prompt and path")
    sv.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=64, help="new tokens per request")
    sv.add_argument("--stream", action="store_true", help="stream the served answers (SSE) instead of one response")
    sv.add_argument("--json", dest="json_path", help="write the per-request rows and the summary here")
    sv.set_defaults(func=run_server_bench)

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
    v.add_argument("--rows", type=int_list("--rows"), default=(), metavar="N,N,...",
                   help="also time one forward over a batch of rows with these tree sizes, padded and laid end to end "
                        "(needs --model DIR on a CPU), e.g. 1,1,1,1,1,1,5,5")
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


def register_batch(which: argparse._SubParsersAction) -> None:
    bb = which.add_parser("batch", help="the batched engine alone: B = 1..16 requests decoded together, plain vs fixed draft-tree "
                                        "sizes, tokens/s in total, latency, memory (answers checked against batch 1)")
    add_engine_args(bb)
    bb.add_argument("--sizes", type=int_list("--sizes"), default=(1, 2, 4, 8, 16), help="batch sizes B, e.g. 1,4,8")
    bb.add_argument("--trees", type=int_list("--trees"), default=(4, 8, 16), help="fixed draft-tree sizes (drafted nodes) to compare")
    bb.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=64, help="new tokens per request")
    bb.add_argument("--repeats", type=positive_int("--repeats"), default=2, help="measured runs per batch size and way")
    bb.add_argument("--out", help="folder for batch.json, batch.md and batch.png")
    bb.set_defaults(func=run_batch_bench)


def run_batch_bench(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.bench.batch import BatchBenchOptions, markdown, measure, plot

    spec = engine_spec(args)
    if spec.drafter == "plain":
        raise UsageError("bench batch compares plain decoding with draft trees: give a drafter that drafts (eagle, ngram, a folder)")
    engine = factory.build_engine(spec)
    report = measure(engine.target, engine.drafter, BatchBenchOptions(tuple(args.sizes), tuple(args.trees), args.max_new_tokens, args.repeats))
    report["env"]["command"] = args.command_line
    table = markdown(report)
    if args.out:
        out = write_figures(args.out, "batch", report, table, args.command_line)
        plot(report, out / "batch.png")
    print(table)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from vlmspec.bench.harness import RunOptions, bench, mismatched, near_tie_divergences, save_report

    opts = RunOptions(prompts=args.prompts, n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                      warmup=args.warmup, repeats=args.repeats, eagle=tuple(args.drafter), repeat_share=args.repeat_share,
                      skip=tuple(m.strip() for m in args.skip.split(",") if m.strip()))
    report = bench(engine_spec(args, drafter="auto"), opts)  # the drafters: --drafter folders, plain, ngram
    report["env"]["command"] = args.command_line
    print(save_report(report, out=Path(args.out) if args.out else None, json_path=Path(args.json_path) if args.json_path else None))
    bad = mismatched(report)
    if bad:
        print(f"ERROR: at T=0 these methods did not reproduce hf_generate's tokens: {bad}")
        return 1
    ties = near_tie_divergences(report)
    if ties:  # bf16: expected, and not an error (fp32 runs are exact: any difference there is one)
        print(f"note: {report['env']['dtype']} answers that differ from hf_generate, each where the reference's top-2 logits "
              f"are a near-tie apart (see 'divergences' in the JSON): {ties}")
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
    return print_report(report, format_report(report), args)


def print_report(report: dict, text: str, args: argparse.Namespace, command: str | None = None) -> int:
    """Print a bench's table; write its JSON (with the command: `command`, else the one parsed) where --json asks."""
    from vlmspec.bench.harness import write_json

    report["command"] = command or args.command_line
    print(text)
    if args.json_path:
        write_json(args.json_path, report)
    return 0


def run_verify_cost(args: argparse.Namespace) -> int:
    from vlmspec.bench.verify_cost import VerifyCostOptions, format_table, measure

    opts = VerifyCostOptions(model=args.model, shape=args.shape, layers=args.layers, device=args.device, dtype=args.dtype,
                             prefix=args.prefix, sizes=tuple(args.sizes), repeats=args.repeats, warmup=args.warmup,
                             draft_vocab=tuple(args.draft_vocab), rows=tuple(args.rows))
    report = measure(opts)
    return print_report(report, format_table(report), args)


def run_kernel(args: argparse.Namespace) -> int:
    from vlmspec.bench.kernel import KernelOptions, format_table, run

    opts = KernelOptions(prefix=tuple(args.prefix), tree=tuple(args.tree), heads=args.heads, kv_heads=args.kv_heads,
                         head_dim=args.head_dim, batch=args.batch, dtype=args.dtype, warmup=args.warmup, repeats=args.repeats,
                         flush=not args.no_flush, seed=args.seed)
    report = run(opts)  # ConfigError without CUDA / triton: one line, exit 2
    return print_report(report, format_table(report), args)
