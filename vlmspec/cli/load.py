"""`vlmspec bench load` and `vlmspec bench soak`: the service under load (the work is
`vlmspec.bench.load` and `vlmspec.bench.soak`).

Builds the engine once (`vlmspec.factory`), starts the services over it (`vlmspec.app.serve.serving`:
for load one per --max-batch value and the one-at-a-time baseline with max_batch 1, for soak one),
and sends the requests to their URLs. With --url, load starts nothing: the sweep goes to a service
already running there (e.g. `vlmspec serve --replicas N`, Ray Serve's proxy), and the engine options
are unused.
"""

from __future__ import annotations

import argparse
import contextlib

from vlmspec.cli.options import (
    UsageError,
    SERVICE_PROMPT_CACHE_MIB,
    add_engine_args,
    engine_spec,
    int_list,
    non_negative_int,
    float_in,
    positive_int,
    write_figures,
)

WAY_NAMES = ("plain", "fixed", "goodput", "baseline")


def register(which: argparse._SubParsersAction) -> None:
    ld = which.add_parser("load", help="the HTTP service under load: 1..16 closed-loop clients, plain / fixed tree / goodput per request "
                                       "and the one-at-a-time service; tokens/s, p50/p99 latency, time to first token")
    add_engine_args(ld)  # --prompt-cache 0 here: the ways of a level share the engine, and the first would pay every prompt's miss
    ld.add_argument("--concurrency", type=int_list("--concurrency"), default=(1, 2, 4, 8, 16), help="concurrent clients per level, e.g. 1,4,8")
    ld.add_argument("--requests", type=positive_int("--requests"), default=8, help="requests per level at least (and two per client)")
    ld.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=64, help="new tokens per request (at most, with --no-ignore-eos)")
    ld.add_argument("--prompts", type=positive_int("--prompts"), default=12, help="distinct held-out requests, sent in turn")
    ld.add_argument("--warmup", type=non_negative_int("--warmup"), default=1, help="unmeasured requests per way before the sweep")
    ld.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="every answer runs to --max-new-tokens past the model's end of turn, so every request is as long "
                         "(the default); --no-ignore-eos: each answer ends where the model ends it, as users get it")
    ld.add_argument("--repeat-share", type=float_in("--repeat-share", 0.0, 0.95), default=None,
                    help="the repeating mix: each level sends the --prompts distinct requests, then this share of repeats of "
                         "them (0.5: a second pass), every one of them (default: today's mix, requests sent in turn)")
    ld.add_argument("--max-batch", type=int_list("--max-batch"), default=(16,),
                    help="the batched service's --max-batch; several (e.g. 4,8,16): one server each, every batched way on each, interleaved")
    ld.add_argument("--ways", default=None,
                    help=f"which to run, comma-separated: {', '.join(WAY_NAMES)} (baseline: the service with max_batch 1); "
                         "default: all of them, with --url all but baseline")
    ld.add_argument("--prefill-chunk", type=non_negative_int("--prefill-chunk"), default=512,
                    help="the service's --prefill-chunk: prompts longer than this enter in pieces, one step's budget each (0: whole prompts)")
    ld.add_argument("--prefill-first", action=argparse.BooleanOptionalAction, default=True,
                    help="the service's --prefill-first (default) or --no-prefill-first")
    ld.add_argument("--url", help="a running service's base URL (e.g. http://127.0.0.1:8000 of vlmspec serve --replicas N): send "
                                  "the sweep there instead of starting servers (plain, fixed, goodput ways only; the engine and "
                                  "--max-batch options are then the service's own)")
    ld.add_argument("--out", help="folder for load.json, load.md, load_throughput.png and load_latency.png")
    ld.set_defaults(func=run)

    sk = which.add_parser("soak", help="the HTTP service for minutes under mixed closed-loop load with cancels and timeouts: every "
                                       "answer checked against the same request alone, memory sampled, slots free at the end")
    add_engine_args(sk)
    sk.set_defaults(prompt_cache_mb=SERVICE_PROMPT_CACHE_MIB)
    sk.add_argument("--minutes", type=float_in("--minutes", 0.0, 24 * 60.0, low_open=True), default=10.0, help="how long the clients send requests")
    sk.add_argument("--clients", type=positive_int("--clients"), default=8, help="concurrent closed-loop clients")
    sk.add_argument("--max-batch", type=positive_int("--max-batch"), default=16, help="the service's --max-batch")
    sk.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=48, help="new tokens per answer at most")
    sk.add_argument("--prompts", type=positive_int("--prompts"), default=6, help="distinct held-out prompts")
    sk.add_argument("--request-timeout", type=float_in("--request-timeout", 0.0, 3600.0, low_open=True), default=30.0,
                    help="the service's request timeout in seconds (the server-timeout kind runs past it)")
    sk.add_argument("--seed", type=int, default=0, help="seed of the clients' draws")
    sk.add_argument("--prefill-chunk", type=non_negative_int("--prefill-chunk"), default=512,
                    help="the service's --prefill-chunk (a small one, e.g. 32, sends every image prompt in pieces; 0: whole prompts)")
    sk.add_argument("--prefill-first", action=argparse.BooleanOptionalAction, default=True,
                    help="the service's --prefill-first (default) or --no-prefill-first")
    sk.add_argument("--out", help="folder for soak.json, soak.md and soak.png")
    sk.set_defaults(func=run_soak)


def _ways(text: str) -> list[str]:
    ways = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in ways if w not in WAY_NAMES]
    if bad or not ways:
        raise UsageError(f"--ways must list some of {', '.join(WAY_NAMES)}, got {text!r}")
    return ways


def _service(bench: str):
    """(ServerSettings, serving), or the one line saying what to install."""
    try:
        from vlmspec.app import ServerSettings
        from vlmspec.app.serve import serving
    except ModuleNotFoundError as exc:
        raise UsageError(f"bench {bench} needs the service's packages: pip install 'vlmspec[serve]' ({exc.name} is missing)") from None
    return ServerSettings, serving


def _env(engine, args: argparse.Namespace, max_batch) -> dict:
    """What the reports say about the engine and the run."""
    import torch

    from vlmspec.bench.batch import model_label
    from vlmspec.runtime.onednn import shape_cache_settings

    target = engine.target
    return {"model": model_label(target), "drafter": engine.drafter.name, "dtype": str(target.dtype).replace("torch.", ""),
            "device": str(target.device), "threads": torch.get_num_threads(), "max_batch": max_batch,
            "prefill_chunk": args.prefill_chunk, "prefill_first": args.prefill_first, "prompt_cache_mib": args.prompt_cache_mb,
            "default_policy": engine.speculation.policy().name, "command": args.command_line,
            "onednn_caches": shape_cache_settings(), "packed_layers": target.packed_layers}


def run(args: argparse.Namespace) -> int:
    ways = _ways(args.ways or ",".join(w for w in WAY_NAMES if not (args.url and w == "baseline")))
    if args.url and "baseline" in ways:
        raise UsageError("--ways baseline needs a server of its own (max_batch 1); with --url pass --ways plain, fixed and/or goodput")
    ServerSettings, serving = _service("load")
    from vlmspec.bench.load import Endpoint, LoadOptions, remote, sweep

    opts = LoadOptions(tuple(args.concurrency), args.requests, args.max_new_tokens, args.prompts, args.warmup, args.ignore_eos,
                       args.repeat_share)
    if args.url:
        import httpx

        try:
            endpoints, env = remote(args.url, ways)
        except httpx.HTTPError as exc:
            raise UsageError(f"--url {args.url}: no vlmspec service answers there ({type(exc).__name__}: {exc})") from None
        env = {**env, "command": args.command_line}
        return _report(args, sweep(endpoints, opts, on_level=_checkpoint(args, env)), env)
    from vlmspec import factory

    engine = factory.build_engine(engine_spec(args, max_batch=max(args.max_batch)))

    def settings(max_batch: int) -> ServerSettings:
        return ServerSettings(model="bench", max_batch=max_batch, max_queue=max(opts.concurrency), request_timeout_s=3600,
                              max_tokens_cap=max(1024, opts.max_tokens), ui=False, prefill_chunk=args.prefill_chunk or None,
                              prefill_first=args.prefill_first)

    sizes = list(dict.fromkeys(args.max_batch))
    with contextlib.ExitStack() as stack:  # the servers idle while another one is measured
        urls = {b: stack.enter_context(serving(engine, settings(b))) for b in dict.fromkeys(([1] if "baseline" in ways else []) + sizes)}
        endpoints = [Endpoint(urls[1], "bench", w, 1) for w in ways if w == "baseline"]
        endpoints += [Endpoint(urls[b], "bench", w, b, w if len(sizes) == 1 else f"{w}, max_batch {b}")
                      for w in ways if w != "baseline" for b in sizes]
        env = _env(engine, args, sizes)
        report = sweep(endpoints, opts, on_level=_checkpoint(args, env))
    return _report(args, report, env)


def _checkpoint(args: argparse.Namespace, env: dict):
    """With --out: after each level, load.json and load.md hold the levels so far (a run stopped by
    a time limit keeps them; the table says it stopped part way). None without --out."""
    if not args.out:
        return None
    from vlmspec.bench.load import markdown

    def write(report: dict) -> None:
        report = {**report, "env": env}
        write_figures(args.out, "load", report, markdown(report), args.command_line)

    return write


def _report(args: argparse.Namespace, report: dict, env: dict) -> int:
    """The table on the console (and the figures in --out); 1 when an fp32 answer changed under load."""
    from vlmspec.bench.load import markdown, plot

    report["env"] = env
    table = markdown(report)
    if args.out:
        out = write_figures(args.out, "load", report, table, args.command_line)
        plot(report, out)
    print(table)
    changed = sum(lv["changed"] for lv in report["levels"])
    if changed and report["env"].get("dtype") == "float32":  # fp32 batching is exact: a changed answer is a bug
        print(f"ERROR: {changed} answers under load differ from the same request's answer at the lowest concurrency")
        return 1
    return 0


def run_soak(args: argparse.Namespace) -> int:
    ServerSettings, serving = _service("soak")
    from vlmspec import factory
    from vlmspec.bench.soak import SoakOptions, markdown, plot, soak

    opts = SoakOptions(minutes=args.minutes, clients=args.clients, prompts=args.prompts, max_tokens=args.max_new_tokens, seed=args.seed)
    engine = factory.build_engine(engine_spec(args, max_batch=args.max_batch))
    settings = ServerSettings(model="bench", max_batch=args.max_batch, max_queue=max(args.clients, 16), request_timeout_s=args.request_timeout,
                              max_tokens_cap=max(1024, opts.long_tokens), ui=False, prefill_chunk=args.prefill_chunk or None,
                              prefill_first=args.prefill_first)
    with serving(engine, settings) as url:
        report = soak(url, "bench", opts, args.request_timeout, store=getattr(engine.drafter, "store", None))
    report["env"] = _env(engine, args, args.max_batch)
    table = markdown(report)
    if args.out:
        out = write_figures(args.out, "soak", report, table, args.command_line)
        plot(report, out)
    print(table)
    return 0 if report["passed"] else 1
