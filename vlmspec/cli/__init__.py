"""The `vlmspec` command line: the product's only argument parser (the lab's recipes/ and testing/ have
theirs). Each command parses its options here and calls the library (engines through `vlmspec.factory`);
nothing imports the CLI.

    vlmspec generate | serve (lazily imports vlmspec.app)              vlmspec/cli/generate.py, serve.py
    vlmspec bench run|batch|verify-cost|kernel|server | bench load|soak   vlmspec/cli/bench.py, load.py
    vlmspec train | eval-drafter | features | data                      vlmspec/cli/train.py, data.py
    vlmspec export | build-target                                       vlmspec/cli/export.py, build.py
    number validators, engine options                                   vlmspec/cli/options.py

Bad input: one line on stderr, exit code 2 (argparse's usage error, or "vlmspec COMMAND: error: ..." for a VlmspecError).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Sequence

from vlmspec.cli import bench, build, export, generate, serve, train
from vlmspec.cli import data as data_cmd
from vlmspec.cli.options import EXIT_USAGE, UsageError
from vlmspec.errors import VlmspecError

__all__ = ["EXIT_USAGE", "UsageError", "build_parser", "main"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help line (unless the help already says it, or there is none:
    None, False, an empty list); descriptions and epilogs keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        nothing = action.default is None or action.default is False or action.default == [] or action.default == argparse.SUPPRESS
        if "default" in text or nothing:
            return text
        return super()._get_help_string(action)


def _document(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command: defaults shown, and its one-line help as the description of its own --help."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                sub.description = sub.description or helps.get(name)
                _document(sub)


class _OneLineParser(argparse.ArgumentParser):
    """A usage error is one line (no usage block), saying where the options are listed; every
    subcommand's parser is one of these too (argparse makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="vlmspec", description="Lossless speculative decoding for vision-language models")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.register(sub)
    serve.register(sub)
    bench.register(sub)
    train.register(sub)
    data_cmd.register(sub)
    export.register(sub)
    build.register(sub)
    _document(parser)
    bench.show_run_options(sub.choices["bench"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(bench.default_to_run(given))  # argparse exits 2 with a one-line usage error
    args.command_line = " ".join(["vlmspec", *given])
    prog = " ".join(["vlmspec", args.command] + ([args.bench] if args.command == "bench" else []))
    try:
        return args.func(args)
    except VlmspecError as exc:  # UsageError, ConfigError, TargetLoadError, DrafterLoadError, InputError, ...
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
