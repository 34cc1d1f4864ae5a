"""`python -m recipes ablate`: train drafter variants at equal steps on the same target, measure them
on the same held-out prompts, write a Markdown table, a JSON record and a plot.

Suites:
  loss    (issue #4) CE only / feature only / both, each with and without training-time test;
  vision  (issue #5) the plain EAGLE head (all image tokens), every compressor at 4x and 16x,
          text-only, the gate, + decoupling (MSD), + global image feature (ViSpec).

Per variant: mean accepted length (bonus included, CPU tree defaults) at T=0 and T=1, the
drafter's prefill time (its read of the prompt rows, after the target's prefill) on the test
prompts and on a 576-image-token prompt (time and counted FLOPs), and the T=0 end-to-end speedup
over plain decoding (vlmspec `none`) on the same prompts.

"The best fixed compressor" and "the best variant" are picked on selection prompts (val split,
T=0) and compared on the test prompts: picked and compared on the same prompts, the winner of
many noisy estimates would carry its own luck into the comparison (winner's curse).

    python -m recipes ablate --suite vision --steps 200 --n 8 --n-select 4 --out docs/ablation-vision

`--reuse` loads a variant whose run folder already holds a finished run with the same config on
the same target weights (re-measuring, or finishing an interrupted ablation); the committed report
is such a re-measurement.

A research suite (issues #4 and #5 asked its questions once). Files: this one (the suites, training
and measuring the variants, the command's options), `ablation_prefill` (the drafter's read of the
prompt, timed and counted at 576 image tokens), `ablation_report` (intervals, goals, the report).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlmspec import factory
from vlmspec.bench.harness import write_json
import toyworld
from vlmspec.data.heldout import Conversation, heldout
from vlmspec.draft import PlainDrafter, TreeConfig
from vlmspec.draft.base import Drafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.factory import EngineSpec
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams
from vlmspec.stats import SpecStats
from vlmspec.target import Target
from vlmspec.train.distill import DistillConfig, train_drafter
from recipes.bench.ablation_prefill import drafter_prefill_ms, prefill_at_scale, read_flops, scale_prompt
from recipes.bench.ablation_report import bootstrap_tau, vision_goals, write_report
from vlmspec.vision_compress import FIXED, VisualConfig

# read_flops, scale_prompt and vision_goals are this suite's too (imported from here by tests and notes)
__all__ = ["PARTIAL", "TEACHER", "AblateOptions", "Variant", "ablate", "bootstrap_tau", "drafter_prefill_ms", "finished_run",
           "gate_picks", "prefill_at_scale", "read_flops", "run", "run_prompts", "scale_prompt", "suite", "target_fingerprint",
           "vision_goals", "write_report"]


@dataclass
class Variant:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)  # DistillConfig fields


def suite(name: str) -> list[Variant]:
    if name == "loss":
        out = []
        for label, ce, feat in (("CE only", 1.0, 0.0), ("feature only", 0.0, 1.0), ("CE + feature", 0.1, 1.0)):
            out.append(Variant(f"{label}, no TTT", {"w_ce": ce, "w_feat": feat, "ttt_steps": 1}))
            out.append(Variant(f"{label}, TTT x2", {"w_ce": ce, "w_feat": feat, "ttt_steps": 2}))
        return out
    if name == "vision":
        vis = [VisualConfig()]
        vis += [VisualConfig(c, r) for r in (4, 16) for c in FIXED if c != "text_only"]
        vis += [VisualConfig("text_only"), VisualConfig("gate", 16, gate_cost=0.05)]
        vis += [VisualConfig("gate", 16, decouple=True, gate_cost=0.05), VisualConfig("gate", 16, decouple=True, global_feature=True, gate_cost=0.05)]
        return [Variant(v.label(), {"visual": {} if v.is_plain else v.to_dict()}) for v in vis]
    raise ValueError(f"unknown suite {name!r}: expected 'loss' or 'vision'")


@torch.no_grad()
def run_prompts(target: Target, drafter: Any, prompts: list[Conversation], temperature: float, max_new_tokens: int) -> dict[str, Any]:
    """tau (bonus included), decode seconds, and per prompt the tokens emitted by verify forwards
    (`emitted`: accepted + one bonus each) and the verify forwards (`forwards`), for intervals."""
    engine = SpecEngine(target, drafter)
    total = SpecStats()
    emitted, forwards = [], []
    seconds, tokens = 0.0, 0
    for i, c in enumerate(prompts):
        inputs = encode_prompt(target, c.prompt, c.images)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=temperature), seed=i)
        t0 = time.perf_counter()
        r = engine.generate(inputs, cfg)
        seconds += time.perf_counter() - t0
        tokens += len(r.token_ids)
        total += r.stats
        emitted.append(r.stats.num_emitted_tokens)  # the prefill forward's first token excluded: it verifies nothing
        forwards.append(r.stats.num_drafts)
    # the eval-drafter figure: tokens per verify forward, bonus included
    return {"tau": total.mean_accepted_length, "seconds": seconds, "tokens": tokens,
            "per_prompt": {"emitted": emitted, "forwards": forwards}}


@torch.no_grad()
def gate_picks(target: Target, drafter: Any, prompts: list[Conversation]) -> dict[str, int]:
    """How often a gated drafter picks each compressor on the image prompts ({} if not gated)."""
    visual = getattr(drafter.head, "visual", None) if hasattr(drafter, "head") else None
    if visual is None or visual.gate is None:
        return {}
    from vlmspec.draft.eagle import question_embedding
    from vlmspec.vision_compress.capture import image_token_id

    img = image_token_id(target.model)
    picks: dict[str, int] = {}
    for c in prompts:
        if not c.images:
            continue
        inputs = encode_prompt(target, c.prompt, c.images)
        ids = inputs["input_ids"][0].to(target.device)
        q = question_embedding(drafter.head, ids, ids == img)
        name = visual.names[int(visual.gate(q).argmax())]
        picks[name] = picks.get(name, 0) + 1
    return picks


TEACHER = "ablation_teacher.json"  # in a variant's run folder: the fingerprint of the target it was trained on


def target_fingerprint(target: Target) -> str:
    """sha256 of the target's input embedding matrix: tells trained weights apart, cheaply."""
    import hashlib

    w = target.input_embeddings().weight.detach().float().cpu().contiguous()
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()


PARTIAL = "ablation.partial.json"  # the rows measured so far, while a suite runs


def _visual_in_full(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded DistillConfig with its visual variant written out in full (VisualConfig's fields
    added since the record at their defaults: the variant was built with those)."""
    if not config.get("visual"):
        return config
    return {**config, "visual": VisualConfig.from_dict(config["visual"]).to_dict()}


def finished_run(run_dir: Path, cfg: DistillConfig, fingerprint: str) -> bool:
    """`run_dir` holds a drafter trained to the end with exactly `cfg` (train_summary.json) on the
    target of `fingerprint` (a run without the record is not reused). A field that DistillConfig
    gained after the run was recorded matches when `cfg` leaves it at its default: the run was
    trained the way that default trains."""
    summary, teacher = run_dir / "train_summary.json", run_dir / TEACHER
    if not (summary.is_file() and teacher.is_file() and (run_dir / "drafter").is_dir()):
        return False
    saved = json.loads(summary.read_text())
    recorded = _visual_in_full(saved.get("config", {}))
    wanted, defaults = _visual_in_full(json.loads(json.dumps(asdict(cfg)))), json.loads(json.dumps(asdict(DistillConfig())))
    added_since = {k: v for k, v in wanted.items() if k not in recorded and v == defaults[k]}
    return (saved.get("step") == cfg.steps and {**added_since, **recorded} == wanted
            and json.loads(teacher.read_text()).get("sha256") == fingerprint)


def run(target: Target, which: str, steps: int, n_per_task: int, runs: Path, base: DistillConfig, max_new_tokens: int = 96,
        only: list[str] | None = None, n_select: int = 0, reuse: bool = False, rounds: int = 21, blocks: int = 8,
        pause_s: float = 5.0, partial: Path | None = None) -> list[dict[str, Any]]:
    """Train and measure every variant of the suite (their run folders go under `runs`);
    `n_select` > 0 also measures tau at T=0 on that many selection prompts per task (val split).
    reuse: a variant whose run folder already holds a finished run with the same config, on the
    same target weights, is loaded, not retrained (e.g. to re-measure, or after an interrupted
    ablation).
    The prefill at 576 image tokens is timed at the end, all variants round-robin (`blocks` blocks
    of `rounds` rounds, `pause_s` apart). partial: a JSON file rewritten with the rows measured so
    far after each variant (an interrupted suite keeps its figures; its runs resume with `reuse`)."""
    from tqdm import tqdm

    prompts = heldout("drafter-eval", n_per_task, per_task=True)
    select = heldout("drafter-eval", n_select, per_task=True, split="val") if n_select > 0 else []
    tree = TreeConfig.for_device("cpu")
    variants = [v for v in suite(which) if not only or v.name in only]
    run_prompts(target, PlainDrafter(), prompts[:1], 0.0, max_new_tokens)  # warm-up: the baseline is not the process's first run
    rows, drafters = [], {}
    fingerprint = target_fingerprint(target)
    for v in tqdm(variants, desc=f"ablate {which}", dynamic_ncols=True):
        cfg = DistillConfig(**{**asdict(base), "steps": steps, "eval_every": 10**9, **v.overrides})
        run_dir = runs / _slug(v.name)
        reused = reuse and finished_run(run_dir, cfg, fingerprint)
        if reused:
            drafter = _load_variant(run_dir, target, tree)
        else:
            drafter = train_drafter(target, "toyworld", run_dir, cfg, tree=tree, progress=False)
            (run_dir / TEACHER).write_text(json.dumps({"sha256": fingerprint}))
        train_s = json.loads((run_dir / "train_summary.json").read_text())["elapsed_s"]  # the training loop's time
        drafters[v.name] = drafter
        # plain decoding timed right before each variant, so the speed-up compares two runs made a
        # minute apart (one baseline at the start let anything that slowed it skew every row)
        plain_t0 = run_prompts(target, PlainDrafter(), prompts, 0.0, max_new_tokens)
        greedy = run_prompts(target, drafter, prompts, 0.0, max_new_tokens)
        sampled = run_prompts(target, drafter, prompts, 1.0, max_new_tokens)
        chosen = run_prompts(target, drafter, select, 0.0, max_new_tokens) if select else None
        rows.append({
            "variant": v.name, "overrides": v.overrides, "steps": steps, "train_s": round(train_s, 1), "reused_run": reused,
            "tau_t0": greedy["tau"], "tau_t1": sampled["tau"],
            "tau_t0_ci": bootstrap_tau([greedy["per_prompt"]]), "tau_t1_ci": bootstrap_tau([sampled["per_prompt"]]),
            "per_prompt_t0": greedy["per_prompt"], "per_prompt_t1": sampled["per_prompt"],
            "drafter_prefill_ms": drafter_prefill_ms(target, drafter, prompts),
            "speedup_t0": plain_t0["seconds"] / greedy["seconds"] * greedy["tokens"] / max(1, plain_t0["tokens"]),
            "plain_t0_s": plain_t0["seconds"],
            "gate_picks": gate_picks(target, drafter, prompts),
            **({"tau_select": chosen["tau"], "per_prompt_select": chosen["per_prompt"]} if chosen else {}),
        })
        r = rows[-1]
        if partial is not None:
            write_json(partial, {"suite": which, "complete": False, "rows": rows})
        tqdm.write(f"{v.name}: tau T=0 {r['tau_t0']:.2f}, T=1 {r['tau_t1']:.2f}, prefill {r['drafter_prefill_ms']:.2f} ms, "
                   f"x{r['speedup_t0']:.2f}" + (" (reused run)" if reused else ""))
    scale = prefill_at_scale(target, drafters, rounds, blocks=blocks, pause_s=pause_s)
    for r in rows:
        r["drafter_prefill_ms_576"] = scale[r["variant"]]["ms"]
        r["prefill_576_vs_plain"] = scale[r["variant"]]["vs_baseline"]
        r["prefill_576_gflop"] = scale[r["variant"]]["gflop"]
        r["prefill_576_vs_plain_blocks"] = scale[r["variant"]]["vs_baseline_blocks"]
        r["prefill_576_rounds"] = rounds
        r["prefill_576_blocks"] = blocks
    return rows


def _load_variant(run_dir: Path, target: Target, tree: TreeConfig) -> Drafter:
    """The drafter of a finished variant run, with the ablation's tree."""
    spec = EngineSpec(drafter=str(run_dir / "drafter"), tree_depth=tree.depth, tree_topk=tree.top_k, tree_tokens=tree.total_tokens)
    return factory.drafter_for(spec, target)


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name).strip("_").lower()


@dataclass(frozen=True)
class AblateOptions:
    """What `python -m recipes ablate` runs (the target is loaded by the caller, through vlmspec.factory)."""

    suite: str  # loss | vision
    steps: int = 300
    batch_size: int = 8
    lr: float = 1e-3
    n: int = 4  # held-out test prompts per task
    n_select: int = 0  # selection prompts per task (val split)
    max_new_tokens: int = 96
    only: tuple[str, ...] = ()  # run only these variants
    runs: Path | None = None  # the variants' training runs (default: runs/ablate-SUITE)
    reuse: bool = False
    rounds: int = 21
    blocks: int = 8
    pause_s: float = 5.0
    answer_style: str = "short"  # ToyWorld answers as the target was aligned (DistillConfig.answer_style)
    draft_vocab: int = 0  # every variant's trimmed draft vocabulary (DistillConfig.draft_vocab; 0: all)


def ablate(target: Target, opts: AblateOptions, out: Path, command: str = "") -> list[dict[str, Any]]:
    """Train and measure the suite's variants on `target`; write ablation.md / .json / .png to `out`."""
    base = DistillConfig(batch_size=opts.batch_size, lr=opts.lr, ckpt_every=10**9, answer_style=opts.answer_style,
                         draft_vocab=opts.draft_vocab)
    runs = Path(opts.runs or f"runs/ablate-{opts.suite}")
    rows = run(target, opts.suite, opts.steps, opts.n, runs, base, opts.max_new_tokens, list(opts.only) or None, opts.n_select,
               opts.reuse, opts.rounds, opts.blocks, opts.pause_s, partial=Path(out) / PARTIAL)
    env = {"target": target.name, "threads": torch.get_num_threads(), "torch": torch.__version__, "prompts": opts.n * len(toyworld.TASKS),
           "selection_prompts": opts.n_select * len(toyworld.TASKS), "command": command}
    write_report(rows, opts.suite, Path(out), env)
    (Path(out) / PARTIAL).unlink(missing_ok=True)  # ablation.json has every row now
    return rows
