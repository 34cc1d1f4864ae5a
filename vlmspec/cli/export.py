"""`vlmspec export`: a drafter in another project's file format. Today: an EAGLE-3 drafter in the
`speculators` format (what vLLM loads, `vlmspec.draft.eagle.speculators_format`), its verifier named."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmspec.cli.options import UsageError, add_device_args, engine_spec, positive_int

FORMATS = ("speculators",)


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="write an EAGLE-3 drafter in the speculators format (what vLLM and speculators load)")
    e.add_argument("drafter", metavar="DRAFTER", help="a vlmspec EAGLE-3 drafter folder (vlmspec train --arch eagle3), or 'eagle' / 'auto'")
    e.add_argument("--format", choices=FORMATS, default="speculators", help="the file format to write")
    e.add_argument("--out", required=True, help="folder to write (config.json + model.safetensors)")
    e.add_argument("--model", help="the drafter's target (default: the target the drafter records it was trained for, else "
                                   "models/smolvlm-toyworld when built with trained parts, else the toy; 'toy' selects the toy)")
    e.add_argument("--verifier", help="the verifier's name in the written config (default: the target's folder, absolute, or its hub id)")
    e.add_argument("--speculative-tokens", type=positive_int("--speculative-tokens"), default=5,
                   help="speculative tokens of the written greedy proposal method (what vLLM drafts per step by default)")
    add_device_args(e)
    e.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.draft.eagle import EagleDrafter
    from vlmspec.draft.eagle.speculators_format import to_speculators

    spec = engine_spec(args, drafter=args.drafter, device=args.device or "cpu")
    target = factory.load(spec)
    drafter = factory.drafter_for(spec, target)
    if not isinstance(drafter, EagleDrafter):
        raise UsageError(f"{args.drafter}: only a trained EAGLE drafter exports (this is {drafter.name!r})")
    model = factory.resolve_model(spec.model, spec.drafter)
    verifier = args.verifier or (str(Path(model).resolve()) if Path(model).is_dir() else model)
    architectures = list(getattr(target.model.config, "architectures", None) or [])
    try:
        folder = to_speculators(drafter.head, args.out, verifier, architectures, args.speculative_tokens)
    except ValueError as exc:
        raise UsageError(f"{args.drafter}: {exc}") from None
    print(f"export: {args.drafter} -> {folder} (speculators eagle3, verifier {verifier}, layers {drafter.head.config.feature_layers})")
    return 0
