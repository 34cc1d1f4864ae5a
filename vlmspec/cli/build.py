"""`vlmspec build-target`: the real target, built from pip-shipped weights (`vlmspec.target.assemble`)
with the trained parts that `python -m recipes train-align` made."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmspec import assets
from vlmspec.cli.options import UsageError, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("build-target", help="build the real target (SmolLM2-135M + EfficientNet-Lite0 in fast_vlm) from pip packages, offline")
    b.add_argument("--out", help=f"folder to write, replaced when it exists (default: {assets.DEFAULT_TARGET}, "
                                 f"or {assets.BASE_TARGET} with --no-trained)")
    b.add_argument("--image-size", type=positive_int("--image-size"), default=384,
                   help="image side in px, a multiple of 32: (size/32)^2 image tokens (384 -> 144, 768 -> 576)")
    b.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype the weights are stored in")
    b.add_argument("--trained", default=str(assets.DEFAULT_TARGET_PARTS), help="trained parts to apply (python -m recipes train-align)")
    b.add_argument("--no-trained", action="store_true", help="the untrained assembly (the base train-align starts from)")
    b.set_defaults(func=run_build_target)


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
