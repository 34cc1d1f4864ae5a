"""`python -m recipes COMMAND`: the recipes' own command line (`--help` lists the commands)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from vlmspec.errors import VlmspecError
from recipes.bench import cli as bench_cli
from recipes.train import cli as train_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipes",
                                     description="How the bundled models' trained parts were made, and the research suites",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train_cli.register(sub)
    bench_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(given)
    args.command_line = " ".join(["python -m recipes", *given])
    try:
        return int(args.func(args) or 0)
    except VlmspecError as exc:
        print(f"{args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what a suite measured so far is on disk
        return 130


if __name__ == "__main__":
    sys.exit(main())
