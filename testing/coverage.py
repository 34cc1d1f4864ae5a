"""The coverage matrix: every image-text-to-text family, lossless or refused, never silently wrong.

For each family (`testing.families`) a tiny random build runs through the engine with the
three drafters (`plain`, `ngram`, a random EAGLE head) on a text prompt of 20 random tokens (past
the builds' 8-token sliding windows and attention chunks) and, where a tiny processor exists, an
image prompt; 24 greedy tokens each must equal HF `generate`'s. Then one tree (the reference
continuation with a wrong sibling in front of every right token) is verified in one forward and
its path's logits compared with the same tokens run as plain steps (max gap <= 1e-4, fp32). Last,
the prompts and a shorter text prompt are decoded together in one batch (EAGLE drafter), each row
at its own length: each must again give HF `generate`'s tokens.

"The same tokens" holds up to near-ties: CPU kernels pick their blocking by the number of rows they
multiply, so a tree of several nodes, or several rows, rounds a logit differently from HF's one-token
step (about 1e-7 in fp32). Where a token differs, the reference's own logits at that step are read:
if its token beat vlmspec's by no more than `MAX_LOGIT_GAP` (the logit check's bound) the divergence
is a near-tie, reported with its margin (`Row.near_ties`, printed, not written into the docs: it
depends on the CPU) and the row keeps its status; a larger margin fails the row.

A row's status:
  lossless    every prompt, every drafter, the logit check, and the batch;
  plain only  plain decoding is exact, and the speculative drafters are refused with vlmspec's
              message (a decoder whose state cannot be rolled back);
  refused     vlmspec refuses the model with its own message;
  not built   no tiny model of the family can be built here (the reason says why: not vlmspec's doing);
  FAILED      a token differs (beyond a near-tie), a logit gap is over the bound, or vlmspec raised
              a raw exception.

    python -m testing.coverage              # the table, to stdout
    python -m testing.coverage --write      # and into docs/families.md and the README's list
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import multiprocessing
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from vlmspec.draft.base import PlainDrafter, TreeConfig
from vlmspec.draft.eagle import EagleDrafter
from vlmspec.draft.ngram import NgramDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.errors import VlmspecError
from vlmspec.inputs import encode_prompt
from vlmspec.target import Target
from testing.families import SPECIAL_ZONE, VOCAB, NotBuildable, build_family, families, first_line, tiny_config
from vlmspec.tree import DraftTree

NEW_TOKENS = 24
PROMPT_TOKENS = 20
MAX_LOGIT_GAP = 1e-4
TREE = TreeConfig(depth=4, top_k=3, total_tokens=10)
STATUSES = ("lossless", "plain only", "refused", "not built", "FAILED")

# a tiny processor per family, when one can be built (image prompts); None: text prompts only
ProcessorFactory = Callable[[str, Any], Any]


@dataclass
class Row:
    family: str
    status: str
    detail: str = ""
    prompts: list[str] = field(default_factory=list)  # the prompts run ("text", "image")
    max_gap: float | None = None  # the logit check's largest gap over the prompts
    seconds: float = 0.0
    near_ties: list[str] = field(default_factory=list)  # tokens that took the other side of a near-tie, with margins


class _Failed(Exception):
    """A check that did not hold (the message says which)."""


def text_prompt(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB - SPECIAL_ZONE, (1, PROMPT_TOKENS), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def hf_greedy(model: torch.nn.Module, inputs: dict[str, Any], n: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def recomputed_greedy(model: torch.nn.Module, inputs: dict[str, Any], n: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens by full recomputation, no cache (a text prompt): the reference where HF
    `generate` itself breaks on a family."""
    ids, out = inputs["input_ids"], []
    with torch.no_grad():
        for _ in range(n):
            nxt = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(nxt))
            ids = torch.cat([ids, nxt], dim=1)
    return out


def decoy_tree(root: int, continuation: list[int], vocab: int) -> tuple[DraftTree, list[int]]:
    """root -> (decoy, right) at every level, the right token continuing: the tree and its right path's nodes."""
    tokens, parents, path, node = [root], [-1], [0], 0
    for tok in continuation:
        tokens += [(tok + 1) % vocab, tok]
        parents += [node, node]
        node = len(tokens) - 1
        path.append(node)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents)), path


def logit_gap(target: Target, inputs: dict[str, Any], ref: list[int], depth: int = 5) -> float:
    """Max |tree logits - plain-step logits| over the right path of a decoy tree of `depth` levels."""
    state, _ = target.prefill(inputs)
    tree, path = decoy_tree(ref[0], ref[1 : depth + 1], target.vocab_size)
    tree_logits = target.forward_tree(state, tree).logits[path]  # [depth + 1, V]
    state, _ = target.prefill(inputs)
    plain = []
    for tok in ref[: depth + 1]:
        plain.append(target.forward_tree(state, DraftTree.root_only(tok)).logits[0])
        target.commit(state, [0])
    return float((tree_logits - torch.stack(plain)).abs().max())


def reference_margin(reference: Callable[..., list[int]], model: torch.nn.Module, inputs: dict[str, Any], ref: list[int],
                     k: int, other: int) -> float:
    """How far the reference's own logits at new token k put its token ref[k] above `other`: HF
    `generate`'s logits at that step (`recomputed_greedy`: the full forward over the prompt and ref[:k])."""
    with torch.no_grad():
        if reference is recomputed_greedy:
            ids = torch.cat([inputs["input_ids"], torch.tensor([ref[:k]], dtype=inputs["input_ids"].dtype)], dim=1)
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0, -1]
        else:
            out = model.generate(**inputs, max_new_tokens=k + 1, min_new_tokens=k + 1, do_sample=False, eos_token_id=None,
                                 output_logits=True, return_dict_in_generate=True)
            logits = out.logits[k][0]
    return float(logits[ref[k]] - logits[other])


def compare(got: list[int], ref: list[int], what: str, margin: Callable[[int, int], float]) -> str:
    """'' when `got` is `ref`; a near-tie note when they part where the reference's margin
    (`margin(k, got[k])`) is at most `MAX_LOGIT_GAP`; raises _Failed otherwise."""
    if got == ref:
        return ""
    k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    if k >= min(len(got), len(ref)):
        raise _Failed(f"{what}: {len(got)} tokens against HF generate's {len(ref)}")
    m = margin(k, got[k])
    if m <= MAX_LOGIT_GAP:
        return f"{what}: token {k} took the other side of a near-tie (HF generate's margin {m:.1e})"
    raise _Failed(f"{what}: token {k} differs from HF generate (its margin {m:.1e})")


def _drafters(target: Target) -> dict[str, Callable[[], Any]]:
    """The three drafters, each made when its turn comes (a refusal of one does not stop the others)."""
    return {"plain": PlainDrafter, "ngram": lambda: NgramDrafter(TREE), "eagle": lambda: EagleDrafter.random_init(target, TREE, seed=1)}


def check_prompt(target: Target, inputs: dict[str, Any], label: str, reference: Callable[..., list[int]] = hf_greedy,
                 near_ties: list[str] | None = None) -> tuple[list[str], float | None]:
    """Run one prompt through every drafter; returns (refusal messages, logit gap or None when refused).
    Raises _Failed on a differing token (beyond a near-tie, noted in `near_ties`) or logit,
    VlmspecError when plain decoding itself is refused."""
    ref = reference(target.model, inputs)
    margin = functools.partial(reference_margin, reference, target.model, inputs, ref)
    refusals: list[str] = []
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for name, make in _drafters(target).items():
        try:
            engine = SpecEngine(target, make())
        except VlmspecError as exc:
            if name == "plain":
                raise
            refusals.append(str(exc))
            continue
        note = compare(engine.generate(inputs, config).token_ids, ref, f"{label} prompt, drafter {name}", margin)
        if note and near_ties is not None:
            near_ties.append(note)
    if refusals:
        return refusals, None
    gap = logit_gap(target, inputs, ref)
    if not gap <= MAX_LOGIT_GAP:
        raise _Failed(f"{label} prompt: tree vs plain-step logit gap {gap:.2e} > {MAX_LOGIT_GAP:g}")
    return refusals, gap


def check_batched(target: Target, prompts: dict[str, dict[str, Any]], references: dict[str, Callable[..., list[int]]],
                  near_ties: list[str] | None = None) -> str:
    """The family's prompts plus a shorter text prompt decoded together in one batch (each row its own
    length, masks and positions) with the EAGLE drafter: each must give its reference's tokens (up to
    near-ties, noted in `near_ties`). Raises _Failed otherwise; returns a note when the model decodes
    one request at a time."""
    try:
        target.check_batching()
    except VlmspecError as exc:
        return f"one request at a time: {first_line(exc)}"
    short = {k: v[:, : PROMPT_TOKENS // 2] for k, v in text_prompt(1).items()}
    batch = {**prompts, "short text": short}
    how = {label: references.get(label) or references["text"] for label in batch}
    refs = {label: how[label](target.model, inputs) for label, inputs in batch.items()}
    engine = SpecEngine(target, EagleDrafter.random_init(target, TREE, seed=1))
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    results = engine.generate_many([(inputs, config) for inputs in batch.values()], slots=len(batch))
    for (label, ref), result in zip(refs.items(), results):
        margin = functools.partial(reference_margin, how[label], target.model, batch[label], ref)
        note = compare(result.token_ids, ref, f"{label} prompt in a batch of {len(batch)}", margin)
        if note and near_ties is not None:
            near_ties.append(note)
    return ""


def _fails(reference: Callable[..., list[int]], model: torch.nn.Module, inputs: dict[str, Any]) -> str | None:
    """None when `reference` runs two greedy tokens on the build, else why not (HF's own failure)."""
    try:
        reference(model, inputs, 2)
    except (TypeError, ValueError, RuntimeError, IndexError, AttributeError, KeyError) as exc:
        return f"{type(exc).__name__}: {first_line(exc)}"
    return None


def check_family(family: str, processor_factory: ProcessorFactory | None = None, image: Any = None) -> Row:
    """One row of the matrix (see the module docstring)."""
    t0 = time.perf_counter()
    row = Row(family, "FAILED")
    try:
        config = tiny_config(family)
        processor = None
        if processor_factory is not None and image is not None:
            try:
                processor = processor_factory(family, config)  # may set the config's image token ids
            except NotBuildable:
                processor = None
        model = build_family(family, config)
        target = Target(model, processor, name=family)
        prompts = {"text": text_prompt()}
        if processor is not None:  # through the product's own prompt encoder
            prompts["image"] = encode_prompt(target, "describe the image", [image])
        references, notes = {}, []  # HF itself must run the build before vlmspec is judged on it
        for label in list(prompts):
            why = _fails(hf_greedy, model, prompts[label])
            if why is None:
                references[label] = hf_greedy
            elif label == "text" and _fails(recomputed_greedy, model, prompts[label]) is None:
                references[label] = recomputed_greedy  # a text prompt has a second oracle
                notes.append(f"text reference: greedy by recomputation (HF generate fails: {why})")
            elif label == "image":
                del prompts[label]
                notes.append(f"image prompt left out (HF generate fails on it: {why})")
            else:
                raise NotBuildable(f"HF generate fails on the tiny build: {why}")
        row.detail = "; ".join(notes)
        gaps, refusals = [], []
        for label, inputs in prompts.items():
            r, gap = check_prompt(target, inputs, label, references[label], row.near_ties)
            refusals += r
            if gap is not None:
                gaps.append(gap)
            row.prompts.append(label)
        row.max_gap = max(gaps) if gaps else None
        if not refusals:
            note = check_batched(target, prompts, references, row.near_ties)
            row.detail = "; ".join(x for x in (row.detail, note) if x)
        row.status, row.detail = ("plain only", refusals[0]) if refusals else ("lossless", row.detail)
    except NotBuildable as exc:
        row.status, row.detail = "not built", str(exc)
    except VlmspecError as exc:
        row.status, row.detail = "refused", str(exc)
    except _Failed as exc:
        row.detail = str(exc)
    except Exception as exc:  # noqa: BLE001  (the matrix records a raw exception as a failure, with its type)
        row.detail = f"raw {type(exc).__name__}: {first_line(exc)}"
    row.seconds = time.perf_counter() - t0
    return row


def run_matrix(names: list[str] | None = None, processor_factory: ProcessorFactory | None = None, image: Any = None,
               progress: bool = False, workers: int = 1) -> list[Row]:
    """Every family's row, in order. `workers` > 1 checks families in that many fresh processes of one
    thread each (tiny models gain little from a second thread; two processes on two cores nearly
    halve the matrix's time); each family's row is what one process gives (a row depends on nothing
    but its own family, the factory and the image, which must be picklable)."""
    names = list(names or families())
    if workers > 1 and len(names) > 1:
        ctx = multiprocessing.get_context("spawn")  # never fork a process whose OpenMP pool has run
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(names)), mp_context=ctx, initializer=_one_thread) as pool:
            found = pool.map(check_family, names, [processor_factory] * len(names), [image] * len(names))
            return [_shown(row, progress) for row in found]
    return [_shown(check_family(name, processor_factory, image), progress) for name in names]


def _one_thread() -> None:
    torch.set_num_threads(1)


def _shown(r: Row, progress: bool) -> Row:
    if progress:
        print(f"{r.family:28s} {r.status:10s} {r.seconds:5.1f}s {r.detail[:100]}", file=sys.stderr, flush=True)
        for note in r.near_ties:
            print(f"{'':28s} near-tie: {note}", file=sys.stderr, flush=True)
    return r


# ---------------------------------------------------------------------------------------- the docs
def table(rows: list[Row]) -> str:
    """The matrix as a Markdown table, one row per family."""
    lines = ["| family | status | prompts | max logit gap | note |", "|---|---|---|---:|---|"]
    for r in rows:
        gap = gap_bucket(r.max_gap) if r.max_gap is not None else ""
        note = r.detail.replace("|", "\\|")
        lines.append(f"| {r.family} | {r.status} | {', '.join(r.prompts)} | {gap} | {note} |")
    return "\n".join(lines)


def gap_bucket(gap: float) -> str:
    """The logit check's gap as the docs show it: its bound to a power of ten, not its digits, which
    follow the CPU's kernels (2.1e-07 on one machine, 1.8e-07 on another)."""
    for bound in (1e-5, MAX_LOGIT_GAP):
        if gap < bound:
            return f"< {bound:.0e}"
    return f"{gap:.0e}"


def summary(rows: list[Row]) -> str:
    """One line per status with its families (the README's list)."""
    out = []
    for status in STATUSES:
        names = [r.family for r in rows if r.status == status]
        if names:
            out.append(f"- **{status}** ({len(names)}): {', '.join(names)}")
    return "\n".join(out)


BEGIN, END = "<!-- families:begin (generated by python -m testing.coverage --write) -->", "<!-- families:end -->"


def replace_block(text: str, block: str) -> str:
    """`text` with the generated block between BEGIN and END replaced by `block`."""
    head, sep, rest = text.partition(BEGIN)
    if not sep:
        raise ValueError(f"no {BEGIN!r} marker")
    _, sep, tail = rest.partition(END)
    if not sep:
        raise ValueError(f"no {END!r} marker")
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.coverage", description=__doc__.split("\n")[0])
    parser.add_argument("families", nargs="*", help="families to check (default: all)")
    parser.add_argument("--write", action="store_true", help="write docs/families.md and the README's list")
    parser.add_argument("--workers", type=int, default=2, help="processes checking families at once, one thread each (default: 2)")
    args = parser.parse_args(argv)
    from testing.tiny import tiny_image
    from testing.tiny_processors import build_processor

    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = run_matrix(args.families or None, build_processor, tiny_image(0), progress=True, workers=args.workers)
    print(table(rows))
    if args.write:
        root = Path(__file__).resolve().parents[2]
        page = root / "docs" / "families.md"
        page.write_text(replace_block(page.read_text(), table(rows)))
        readme = root / "README.md"
        readme.write_text(replace_block(readme.read_text(), summary(rows)))
    return 1 if any(r.status == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
