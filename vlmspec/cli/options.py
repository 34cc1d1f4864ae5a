"""What every subcommand shares: the number validators, the engine options, the usage error.

Validators are argparse `type=` callables; a bad value ends in argparse's one usage line with
exit code 2 and a message of one shape for every option of every subcommand:

    --max-new-tokens must be >= 1, got 0        --top-p must be in (0.0, 1.0], got 0
    --steps must be an integer, got 'ten'       --pause must be a number, got 'x'
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from vlmspec.data import ANSWER_STYLES as ANSWER_STYLE_CHOICES  # the generator's answer styles
from vlmspec.errors import VlmspecError

EXIT_USAGE = 2
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_CHOICES = ("auto", "triton", "sdpa", "eager")
TEXT_STYLE_CHOICES = ("plain", "varied")  # train.distill.TEXT_STYLES (same reason, same test)
POLICY_CHOICES = ("goodput", "fixed")  # vlmspec.policy.control.POLICIES (kept here so --help needs no torch)


class UsageError(VlmspecError):
    """Bad input the CLI itself finds (a missing checkpoint, an impossible combination of options)."""


# ---------------------------------------------------------------------------------------- numbers
def int_in(name: str, low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (either bound optional)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {value!r}") from None
        too_low, too_high = low is not None and n < low, high is not None and n > high
        if (too_low or too_high) and low is not None and high is not None:
            raise argparse.ArgumentTypeError(f"{name} must be in [{low}, {high}], got {n}")
        if too_low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {n}")
        if too_high:
            raise argparse.ArgumentTypeError(f"{name} must be <= {high}, got {n}")
        return n

    return parse


def positive_int(name: str) -> Callable[[str], int]:
    return int_in(name, 1)


def non_negative_int(name: str) -> Callable[[str], int]:
    return int_in(name, 0)


def float_in(name: str, low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """A number in [low, high], or (low, high] with low_open."""

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


def int_list(name: str, low: int = 1) -> Callable[[str], tuple[int, ...]]:
    """A comma-separated list of integers, each >= low ('1,2,4')."""
    one = int_in(name, low)

    def parse(value: str) -> tuple[int, ...]:
        items = [v.strip() for v in value.split(",") if v.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{name} must be a comma-separated list of integers, got {value!r}")
        return tuple(one(v) for v in items)

    return parse


# ---------------------------------------------------------------------------------------- engine
def check_draft_vocab(k: int, vocab_size: int) -> None:
    """--draft-vocab K against the loaded target's vocabulary (UsageError: what to pass instead)."""
    if not 0 <= k <= vocab_size:
        raise UsageError(f"--draft-vocab must be between 0 (no trim) and the target's vocabulary size {vocab_size}, got {k}")


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="auto = bfloat16 on CUDA, float32 on CPU")


TREE_DEFAULT = "default: the drafter's measured tree for the device (its config's tree_defaults), else the device's"


def add_tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree-depth", type=positive_int("--tree-depth"), default=None, help=f"draft-tree depth ({TREE_DEFAULT})")
    p.add_argument("--tree-topk", type=positive_int("--tree-topk"), default=None, help=f"children per expanded node ({TREE_DEFAULT})")
    p.add_argument("--tree-tokens", type=positive_int("--tree-tokens"), default=None, help=f"drafted nodes per tree ({TREE_DEFAULT})")


SERVICE_PROMPT_CACHE_MIB = 256  # the service's --prompt-cache (serve, bench soak); the other commands: 0


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """--model --drafter --device --dtype --attention --packed-weights --tree-* --policy: the fields of `vlmspec.factory.EngineSpec`."""
    p.add_argument("--model", help="target VLM: a local folder (e.g. models/smolvlm-base, the real target make setup "
                                   "builds), a hub id, or 'toy' (the 4M-parameter ToyWorld toy); default: the target a --drafter "
                                   "folder records it was trained for, else models/smolvlm-toyworld when built with trained parts, else the toy")
    p.add_argument("--drafter", default="auto",
                   help="'plain' (plain decoding; 'none', the old spelling, is read as plain), 'ngram', 'eagle' (the EAGLE drafter shipped for the model: the toy's or the default "
                        "model's), 'self' / 'self:E' / 'self:E:K' (the target's own first layers: exit after layer E, draft over the "
                        "first K token ids), 'suffix' (SuffixDecoding: from earlier answers and the request's own text), 'hybrid' "
                        "(eagle + suffix, the likelier tree per step; DIR+suffix for another EAGLE drafter), a drafter folder, or a "
                        "drafter's hub id (org/name) (default: auto = eagle where one is shipped for the model, ngram otherwise)")
    p.add_argument("--suffix-memory", type=non_negative_int("--suffix-memory"), default=None, metavar="TOKENS",
                   help="suffix / hybrid drafters: tokens of earlier answers kept across requests, oldest evicted first "
                        "(default 200000; 0: no cross-request memory, each request drafts from its own prompt and answer)")
    p.add_argument("--prompt-cache", type=non_negative_int("--prompt-cache"), default=0, metavar="MIB", dest="prompt_cache_mb",
                   help="keep the prefills of prompts seen before (their KV entries, logits and features) in this many MiB, "
                        "least recently used out first, and serve a repeated prompt from them instead of a new prefill; "
                        "the same answers (default: %(default)s; 0: every prompt is prefilled)")
    add_device_args(p)
    p.add_argument("--attention", default="auto", choices=ATTENTION_CHOICES, help="tree attention: auto = SDPA over grouped heads in place on CPU, transformers' SDPA elsewhere; triton = the Triton tree kernel (CUDA); sdpa = transformers' own")
    p.add_argument("--packed-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="on a CPU, the target's decode steps multiply by linear weights packed once for oneDNN where that "
                        "gives the same numbers to the bit (bf16: decode steps 5-15%% faster on the default model, for a packed "
                        "copy of the weights in memory); --no-packed-weights: F.linear only")
    add_tree_args(p)
    p.add_argument("--policy", default="goodput", choices=POLICY_CHOICES,
                   help="how deep to draft each step: goodput = per step by expected tokens per second, from the request's "
                        "acceptance so far and a cost model measured at start-up (SmartSpec; drafts nothing when drafting "
                        "does not pay); fixed = always the tree's full depth")


def engine_spec(args: argparse.Namespace, **overrides: object):
    """The `EngineSpec` of the parsed options (fields a parser lacks keep their defaults)."""
    from vlmspec.factory import EngineSpec

    fields = ("model", "drafter", "device", "dtype", "attention", "packed_weights", "tree_depth", "tree_topk", "tree_tokens", "policy",
              "suffix_memory", "prompt_cache_mb")
    values = {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}
    values.update(overrides)
    spec = EngineSpec(**values)  # type: ignore[arg-type]
    if spec.dtype == "bfloat16":
        import torch

        warn_emulated_bf16(spec.device or ("cuda" if torch.cuda.is_available() else "cpu"), True)
    return spec


def warn_emulated_bf16(device: str, bf16: bool) -> None:
    """bf16 asked for on a CPU without bf16 units: say so on stderr (a warning: the run goes on)."""
    from vlmspec.factory import bf16_cpu_warning

    line = bf16_cpu_warning(device, bf16)
    if line:
        print(line, file=sys.stderr)


def describe_speculation(engine) -> str:
    """One line: the engine's default policy and, for goodput, the cost model it measured."""
    spec = engine.speculation
    if spec.cost is None:
        return f"policy {spec.policy().name}"
    c = spec.cost
    drafted = ", ".join(f"{s * 1e3:.1f}" for s in c.by_depth) or (
        f"+{c.draft_s * 1e3:.1f} + {c.per_level_s * 1e3:.1f} per level")
    return (f"policy goodput, cost model measured at start-up: a plain step {c.step_s * 1e3:.1f} ms, a step drafting 1, 2, ... "
            f"levels {drafted} ms (--policy fixed: always the full depth)")


def env_default(name: str) -> str | None:
    return os.environ.get(name) or None


def write_figures(folder: str, stem: str, report: dict, table: str, command_line: str):
    """A bench's figures in `folder`: STEM.json (the report) and STEM.md (its command, then the table).
    Returns the folder (a Path), made if missing, for the plots."""
    import json
    from pathlib import Path

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.md").write_text(f"`{command_line}`\n\n{table}\n")
    return out
