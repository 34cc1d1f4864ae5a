"""`python -m vlmspec.recipes COMMAND`: the recipes' own command line (`--help` lists the commands)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from vlmspec.errors import VlmspecError
from vlmspec.recipes.bench import cli as bench_cli
from vlmspec.recipes.train import cli as train_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vlmspec.recipes",
                                     description="How the bundled models' trained parts were made, and the research suites",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train_cli.register(sub)
    bench_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except VlmspecError as exc:
        print(f"{args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
