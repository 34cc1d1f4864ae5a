"""The `vlmspec` command line. Bad input ends with one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


def _int_at_least(name: str, low: int):
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {value!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {n}")
        return n

    return parse


def _positive_int(name: str):
    return _int_at_least(name, 1)


def _non_negative_int(name: str):
    return _int_at_least(name, 0)


def _float_in(name: str, low: float, high: float, low_open: bool = False):
    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {value!r}") from None
        if x != x or x > high or x < low or (low_open and x == low):
            bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{name} must be in {bound}, got {value}")
        return x

    return parse


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target VLM: a local folder or a hub id (default: the bundled ToyWorld VLM)")
    p.add_argument("--drafter", default="auto", help="a drafter folder, 'ngram' or 'none' (default: the bundled drafter with the bundled model, else ngram)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--attention", default="auto", choices=["auto", "triton", "sdpa", "eager"], help="tree attention: auto = Triton kernel on CUDA, SDPA on CPU")
    p.add_argument("--tree-depth", type=_positive_int("--tree-depth"), default=None)
    p.add_argument("--tree-topk", type=_positive_int("--tree-topk"), default=None)
    p.add_argument("--tree-tokens", type=_positive_int("--tree-tokens"), default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmspec", description="Lossless speculative decoding for vision-language models")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer one prompt (with images) and print the text or a JSON record")
    g.add_argument("--image", action="append", default=[], help="image file (repeat for several images)")
    g.add_argument("--prompt", required=True)
    _add_model_args(g)
    g.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=128)
    g.add_argument("--temperature", type=_float_in("--temperature", 0.0, 100.0), default=0.0)
    g.add_argument("--top-p", type=_float_in("--top-p", 0.0, 1.0, low_open=True), default=1.0)
    g.add_argument("--top-k", type=_non_negative_int("--top-k"), default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    t = sub.add_parser("train-target", help="train the bundled target VLM from scratch on ToyWorld (resumable)")
    t.add_argument("--out", required=True, help="run folder: checkpoint/, model/, loss.png")
    t.add_argument("--steps", type=_positive_int("--steps"), default=1300)
    t.add_argument("--batch-size", type=_positive_int("--batch-size"), default=16)
    t.add_argument("--lr", type=_float_in("--lr", 0.0, 1.0, low_open=True), default=1e-3)
    t.add_argument("--minutes", type=_float_in("--minutes", 0.0, 1e6, low_open=True), default=None, help="wall-clock budget of this run")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    t.add_argument("--init-from", help="exported model folder (e.g. runs/x/model or assets/toyworld-vlm) whose weights and processor start this run")
    t.add_argument("--task-mix", help="training task mix, e.g. 'count=0.3,attribute=0.3,describe=0.2' (default: ToyWorld's mix)")
    t.add_argument("--vision-steps", type=_non_negative_int("--vision-steps"), default=1500,
                   help="stage 0: steps of supervised vision-tower pre-training on scene labels (0 = none)")
    t.add_argument("--stop-at", type=_positive_int("--stop-at"), default=None,
                   help="end this run after this SFT step (checkpointed; continue with --resume)")
    t.add_argument("--aux-weight", type=_float_in("--aux-weight", 0.0, 100.0), default=0.2,
                   help="weight of the stage-0 probe loss kept on during SFT")
    t.add_argument("--hidden", type=_positive_int("--hidden"), default=None, help="decoder width (default 160, the bundled v4's)")
    t.add_argument("--intermediate", type=_positive_int("--intermediate"), default=None, help="decoder MLP width (default 448)")
    t.add_argument("--heads", type=_positive_int("--heads"), default=None, help="decoder attention heads (default 5)")
    t.add_argument("--kv-heads", type=_positive_int("--kv-heads"), default=None, help="decoder key/value heads (default 5)")

    d = sub.add_parser("train", help="distil an EAGLE-style draft head from a frozen target (online logits)")
    d.add_argument("--target", help="target VLM folder or hub id (default: the bundled model)")
    d.add_argument("--data", default="toyworld", help="'toyworld' or a LLaVA-style JSONL file")
    d.add_argument("--out", required=True, help="run folder: checkpoint/, drafter/, train_curve.png")
    d.add_argument("--steps", type=_positive_int("--steps"), default=1000)
    d.add_argument("--batch-size", type=_positive_int("--batch-size"), default=8)
    d.add_argument("--lr", type=_float_in("--lr", 0.0, 1.0, low_open=True), default=3e-4)
    d.add_argument("--w-ce", type=_float_in("--w-ce", 0.0, 1e3), default=0.1)
    d.add_argument("--w-feat", type=_float_in("--w-feat", 0.0, 1e3), default=1.0)
    d.add_argument("--ttt-steps", type=_positive_int("--ttt-steps"), default=2, help="training-time test unroll (1 = off)")
    d.add_argument("--curriculum-steps", type=_non_negative_int("--curriculum-steps"), default=0, help="text-only -> multimodal ramp")
    d.add_argument("--visual", default="none", choices=["none", "gate", "uniform", "attention", "pool", "conv", "resampler", "text_only"],
                   help="VLM-aware head: compress the image tokens the drafter reads (issue #5); none = all of them")
    d.add_argument("--ratio", type=_float_in("--ratio", 1.0, 4096.0), default=4.0, help="compression ratio for --visual")
    d.add_argument("--decouple", action="store_true", help="MSD: visual rows take the image embeddings directly (bypass fc)")
    d.add_argument("--global-feature", action="store_true", help="ViSpec: fuse a global image feature into later text rows")
    d.add_argument("--gate-cost", type=_float_in("--gate-cost", 0.0, 100.0), default=0.05, help="--visual gate: weight of its kept fraction")
    d.add_argument("--regenerate", action="store_true",
                   help="ViSpec: train on the target's own greedy answers (generated once, cached in OUT/answers_rank*.jsonl)")
    d.add_argument("--eval-every", type=_positive_int("--eval-every"), default=200)
    d.add_argument("--minutes", type=_float_in("--minutes", 0.0, 1e6, low_open=True), default=None)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default=None)
    d.add_argument("--resume", action="store_true")
    d.add_argument("--json", action="store_true", help="print one JSON summary at the end")

    ed = sub.add_parser("eval-drafter", help="mean accepted length per task on held-out ToyWorld prompts")
    ed.add_argument("--model", help="target folder (default: the bundled model)")
    ed.add_argument("--drafter", default="auto", help="drafter folder, ngram or none (default: the bundled drafter)")
    ed.add_argument("--n", type=_positive_int("--n"), default=8, help="prompts per task")
    ed.add_argument("--temperature", type=_float_in("--temperature", 0.0, 100.0), default=0.0)
    ed.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=128)
    ed.add_argument("--json", action="store_true")

    e = sub.add_parser("eval-target", help="score a target on held-out ToyWorld items, with real and with noise images")
    e.add_argument("--model", help="target folder (default: the bundled model)")
    e.add_argument("--n", type=_positive_int("--n"), default=600)
    e.add_argument("--seed", type=_non_negative_int("--seed"), default=0)
    e.add_argument("--json", action="store_true")

    sub.add_parser("serve", help="the OpenAI-compatible REST API on the bundled model or --model (vlmspec serve --help)", add_help=False)
    b = sub.add_parser(
        "bench",
        help="speed of every method side by side (default), or: verify-cost (tree forward vs one-token step), kernel (Triton vs SDPA), "
        "ablate (drafter variants at equal training steps)",
    )
    b.add_argument("rest", nargs=argparse.REMAINDER, help="[run|verify-cost|kernel|ablate] and its own options (vlmspec bench [WHICH] --help)")
    return parser


def _bench_verify_cost(argv: list[str]) -> int:
    from vlmspec.bench.verify_cost import main as run

    return run(argv)


def _bench_kernel(argv: list[str]) -> int:
    from vlmspec.bench.kernel import main as run

    return run(argv)


def _bench_run(argv: list[str]) -> int:
    from vlmspec.bench.harness import main as run

    return run(argv)


def _bench_ablate(argv: list[str]) -> int:
    from vlmspec.bench.ablation import main as run

    return run(argv)


BENCHES = {"run": _bench_run, "verify-cost": _bench_verify_cost, "kernel": _bench_kernel, "ablate": _bench_ablate}


def cmd_bench(args: argparse.Namespace) -> int:
    rest = list(args.rest)
    which = rest.pop(0) if rest and rest[0] in BENCHES else "run"
    return BENCHES[which](rest)


def _load_images(paths: Sequence[str]) -> list[Any]:
    from PIL import Image, UnidentifiedImageError

    images = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise UsageError(f"image not found: {p}")
        try:
            with Image.open(path) as im:
                im.load()
                images.append(im.convert("RGB"))
        except (UnidentifiedImageError, OSError) as exc:
            raise UsageError(f"not a readable image: {p} ({exc.__class__.__name__})") from None
    return images


def _resolve_device(arg: str | None) -> str:
    import torch

    if arg is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if arg not in ("cpu", "cuda") and not arg.startswith("cuda:"):
        raise UsageError(f"--device must be cpu or cuda, got {arg!r}")
    if arg.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available")
    return arg


def resolve_model_and_drafter(model: str | None, drafter: str) -> tuple[str, str]:
    """--model default: the bundled target; --drafter auto: its bundled drafter, else ngram."""
    from vlmspec import assets

    if not model:
        bundled = assets.bundled_target()
        if bundled is None:
            raise UsageError(f"no --model given and the bundled model is missing ({assets.BUNDLED_TARGET}): pass --model DIR|HUB_ID")
        model = str(bundled)
    if drafter == "auto":
        bundled_drafter = assets.bundled_drafter()
        same = assets.bundled_target() is not None and Path(model).resolve() == assets.BUNDLED_TARGET.resolve()
        drafter = str(bundled_drafter) if same and bundled_drafter is not None else "ngram"
    return model, drafter


def load_engine(args: argparse.Namespace):
    """Target + drafter from the CLI options (shared by generate / serve / bench)."""
    import torch

    from vlmspec.draft import TreeConfig, load_drafter
    from vlmspec.draft.eagle import DrafterLoadError
    from vlmspec.engine import SpecEngine
    from vlmspec.target import Target, TargetLoadError

    model, drafter_spec = resolve_model_and_drafter(args.model, args.drafter)
    device = _resolve_device(args.device)
    dtype = {
        "auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[args.dtype]
    base = TreeConfig.for_device(device)
    tree = TreeConfig(
        depth=args.tree_depth or base.depth,
        top_k=args.tree_topk or base.top_k,
        total_tokens=args.tree_tokens or base.total_tokens,
    )
    try:
        target = Target.load(model, device=device, dtype=dtype, attention=args.attention)
        drafter = load_drafter(drafter_spec, target, tree)
    except (TargetLoadError, DrafterLoadError) as exc:
        raise UsageError(str(exc)) from None
    return SpecEngine(target, drafter)


def cmd_generate(args: argparse.Namespace) -> int:
    from vlmspec.engine import GenerationConfig
    from vlmspec.sampling import SamplingParams
    from vlmspec.target import ContextLengthError

    images = _load_images(args.image)
    engine = load_engine(args)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, stop=tuple(args.stop))
    try:
        inputs = engine.target.encode(args.prompt, images)
        if args.json:
            result = engine.generate(inputs, config)
        else:
            stream = engine.stream(inputs, config)
            for event in stream:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            result = stream.result
    except ContextLengthError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        record = result.to_dict()
        record["drafter"] = engine.drafter.name
        print(json.dumps(record))
    else:
        print(
            f"[{len(result.token_ids)} tokens in {result.elapsed_s:.2f}s, {result.tokens_per_s:.1f} tok/s, "
            f"{result.num_target_forwards} target forwards, mean accepted length {result.mean_accepted_length:.2f}]",
            file=sys.stderr,
        )
    return 0


def cmd_train_target(args: argparse.Namespace) -> int:
    from vlmspec.train.target_sft import SFTConfig, TargetArch, parse_task_mix, train

    if args.resume and not (Path(args.out) / "checkpoint").is_dir():
        raise UsageError(f"--resume: no checkpoint in {args.out}/checkpoint")
    try:
        mix = parse_task_mix(args.task_mix) if args.task_mix else None
    except ValueError as exc:
        raise UsageError(f"--task-mix: {exc}") from None
    sizes = {k: v for k, v in (("hidden", args.hidden), ("intermediate", args.intermediate), ("heads", args.heads),
                               ("kv_heads", args.kv_heads)) if v is not None}
    if args.init_from and not sizes and (Path(args.init_from) / "config.json").is_file():  # the sizes of the model it starts from
        text = json.loads((Path(args.init_from) / "config.json").read_text()).get("text_config", {})
        sizes = {k: text[hf] for k, hf in (("hidden", "hidden_size"), ("intermediate", "intermediate_size"),
                                           ("heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads")) if hf in text}
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


def cmd_train(args: argparse.Namespace) -> int:
    from vlmspec.target import Target, TargetLoadError
    from vlmspec.train.data import DataError
    from vlmspec.train.distill import DistillConfig, train_drafter

    model, _ = resolve_model_and_drafter(args.target, "none")
    if args.data != "toyworld" and not Path(args.data).is_file():
        raise UsageError(f"data file not found: {args.data} (use 'toyworld' or a JSONL file)")
    if args.resume and not (Path(args.out) / "checkpoint").is_dir():
        raise UsageError(f"--resume: no checkpoint in {args.out}/checkpoint")
    try:
        target = Target.load(model, device=_resolve_device(args.device))
    except TargetLoadError as exc:
        raise UsageError(str(exc)) from None
    cfg = DistillConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, w_ce=args.w_ce, w_feat=args.w_feat,
        ttt_steps=args.ttt_steps, curriculum_steps=args.curriculum_steps, eval_every=args.eval_every,
        minutes=args.minutes, seed=args.seed, regenerate=args.regenerate,
    )
    from vlmspec.vision_compress import VisualConfig

    vis = VisualConfig(args.visual, args.ratio, args.decouple, args.global_feature, gate_cost=args.gate_cost if args.visual == "gate" else 0.0)
    cfg.visual = {} if vis.is_plain else vis.to_dict()
    try:
        train_drafter(target, args.data, args.out, cfg, resume=args.resume, progress=not args.json)
    except DataError as exc:
        raise UsageError(str(exc)) from None
    summary = json.loads((Path(args.out) / "train_summary.json").read_text())
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"train: {summary['step']} steps in {summary['elapsed_s'] / 60:.1f} min; drafter in {args.out}/drafter")
    return 0


def cmd_eval_drafter(args: argparse.Namespace) -> int:
    from vlmspec.bench.ablation import heldout
    from vlmspec.draft import TreeConfig, load_drafter
    from vlmspec.target import Target
    from vlmspec.train.distill import accepted_length

    model, drafter_spec = resolve_model_and_drafter(args.model, args.drafter)
    target = Target.load(model)
    drafter = load_drafter(drafter_spec, target, TreeConfig.for_device("cpu"))
    prompts = heldout(args.n)
    taus = accepted_length(target, drafter, prompts, temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    record = {"temperature": args.temperature, "prompts_per_task": args.n, "drafter": drafter_spec, "mean_accepted_length": taus}
    if args.json:
        print(json.dumps(record))
    else:
        for task, tau in taus.items():
            print(f"{task:>12}: {tau:.2f}")
    return 0


def cmd_eval_target(args: argparse.Namespace) -> int:
    from vlmspec.target import Target, TargetLoadError
    from vlmspec.train.target_eval import evaluate, format_table

    model, _ = resolve_model_and_drafter(args.model, "none")
    try:
        target = Target.load(model)
    except TargetLoadError as exc:
        raise UsageError(str(exc)) from None
    result = evaluate(target, n=args.n, seed=args.seed, progress=not args.json)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "bench": cmd_bench,
    "train-target": cmd_train_target,
    "eval-target": cmd_eval_target,
    "eval-drafter": cmd_eval_drafter,
    "train": cmd_train,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from app.server import main as serve_main  # parses its own options (vlmspec serve --help)

        return serve_main(argv[1:])
    if argv[:1] == ["bench"] and not {"-h", "--help"} & set(argv[1:2]):
        args = argparse.Namespace(command="bench", rest=argv[1:])  # each benchmark parses its own options
    else:
        args = parser.parse_args(argv)  # argparse itself exits 2 with a one-line usage error
    try:
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"vlmspec {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
