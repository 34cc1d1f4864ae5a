"""`vlmspec bench ablate`: train drafter variants at equal steps on the same target, measure them
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

    vlmspec bench ablate --suite vision --steps 200 --n 8 --n-select 4 --out docs/ablation-vision

`--reuse` loads a variant whose run folder already holds a finished run with the same config on
the same target weights (re-measuring, or finishing an interrupted ablation); the committed report
is such a re-measurement.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median_high
from typing import Any

import torch

from vlmspec import factory
from vlmspec.bench.harness import write_json
from vlmspec.data import toyworld
from vlmspec.data.heldout import Conversation, heldout
from vlmspec.draft import NoDrafter, TreeConfig
from vlmspec.draft.base import Drafter, PromptContext
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.factory import EngineSpec
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams
from vlmspec.stats import SpecStats
from vlmspec.target import Target
from vlmspec.train.distill import DistillConfig, train_drafter
from vlmspec.vision_compress import FIXED, VisualConfig


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
def drafter_prefill_ms(target: Target, drafter: Any, prompts: list[Conversation]) -> float:
    """Mean ms of the drafter's read of the prompt (start + the rows' forward, no tree), after
    the target's prefill; image prompts only."""
    times = []
    for c in prompts:
        if not c.images:
            continue
        inputs = encode_prompt(target, c.prompt, c.images)
        _, out = target.prefill(inputs, visual=drafter.needs_visual)
        ctx = PromptContext(inputs["input_ids"][0], out.features, inputs, out.image_mask, out.image_embeds, out.attention)
        root = int(out.logits.argmax())
        t0 = time.perf_counter()
        drafter.start(ctx).propose(root, 0)
        times.append(time.perf_counter() - t0)
    return 1000 * sum(times) / max(1, len(times))


def _over_capacity(drafter: Any, n_image: int) -> str | None:
    """The compressor of `drafter` that cannot take `n_image` tokens (a resampler has a fixed
    number of queries, e.g. 64 < 576 / 4), or None."""
    visual = getattr(getattr(drafter, "head", None), "visual", None)
    if visual is None or visual.cfg.sized_for(n_image) == visual.cfg:
        return None
    return "resampler"  # the one compressor with a capacity (VisualConfig.sized_for)


def scale_prompt(target: Target, n_image: int = 576, n_text: int = 48) -> tuple[PromptContext, int]:
    """A prompt the size of a real VLM's (LLaVA-1.5: 576 image tokens): `n_text` text tokens
    around one image of `n_image` tokens, with random target features, image embeddings and
    attention of the target's width; -> (context, root token). The bundled target has only 9
    image tokens, too few for the image rows to dominate; a drafter's read of the prompt depends
    on the shapes only, so this measures what compression saves at real scale."""
    from vlmspec.vision_compress.capture import image_token_id

    g = torch.Generator().manual_seed(0)
    H = target.model.config.get_text_config().hidden_size
    V = int(target.model.config.get_text_config().vocab_size)
    img = image_token_id(target.model)
    text = torch.randint(0, V, (n_text,), generator=g)
    text[text == img] = 0
    head_len = n_text // 4
    ids = torch.cat([text[:head_len], torch.full((n_image,), img), text[head_len:]])
    L = ids.shape[0]
    dev, dt = target.device, target.dtype
    ctx = PromptContext(
        ids.to(dev), torch.randn(L, H, generator=g).to(dev, dt), {}, (ids == img).to(dev),
        torch.randn(n_image, H, generator=g).to(dev, dt), torch.rand(L, generator=g).softmax(0).to(dev),
    )
    return ctx, int(text[0])


def _read_s(drafter: Any, ctx: PromptContext, root: int) -> float:
    """Seconds of one read of the prompt rows by the drafter (no tree)."""
    t0 = time.perf_counter()
    drafter.start(ctx).propose(root, 0)
    return time.perf_counter() - t0


def read_flops(drafter: Any, ctx: PromptContext, root: int) -> int:
    """Floating-point operations of one read of the prompt rows (`_read_s`'s work), counted by
    torch's FlopCounterMode: matrix products, plus two kinds of op the counter leaves out on CPU:
    attention (aten._scaled_dot_product_flash_attention_for_cpu), counted as QK^T and PV of every
    query against every key (the read passes a dense mask, not a causal flag), and the drafter's
    products over packed weights (mkldnn._linear_pointwise: 2 x rows x in x out)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def packed_linear(x_shape, *args, out_shape=None, **kwargs) -> int:  # x [..., K] -> out [..., N]
        return 2 * math.prod(x_shape) * out_shape[-1]

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa}
    if torch.backends.mkldnn.is_available():
        mapping[torch.ops.mkldnn._linear_pointwise] = packed_linear
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        drafter.start(ctx).propose(root, 0)
    return int(counter.get_total_flops())


@torch.no_grad()
def prefill_at_scale(target: Target, drafters: dict[str, Any], rounds: int = 21, baseline: str = "plain",
                     n_image: int = 576, n_text: int = 48, blocks: int = 1, pause_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Each drafter's read of `scale_prompt`, timed round-robin: every round times every drafter
    once (order reversed on odd rounds), so a slow spell of the machine hits all of them alike.
    `blocks` blocks of `rounds` rounds, `pause_s` apart, spread the rounds over time: on a shared
    machine the ratio of one short block moves with what the neighbours do (3.1x to 4.4x for the
    same two drafters, blocks seconds apart), so the result pools every round of every block.
    -> {name: {"ms": median ms over all rounds, "vs_baseline": median over all rounds of baseline
    time / this time, "vs_baseline_blocks": that median per block, "gflop": the read's GFLOP
    (`read_flops`)}}; all None for a drafter that cannot read that many image tokens (a
    resampler's fixed query count), the ratios None without a measurable `baseline`."""
    ctx, root = scale_prompt(target, n_image, n_text)
    able = {k: d for k, d in drafters.items() if _over_capacity(d, n_image) is None}
    for d in able.values():
        _read_s(d, ctx, root)  # warm-up
    times: dict[str, list[list[float]]] = {k: [] for k in able}  # [block][round]
    for blk in range(blocks):
        if blk:
            time.sleep(pause_s)
        for k in able:
            times[k].append([])
        for r in range(rounds):
            for k in (list(able) if r % 2 == 0 else list(able)[::-1]):
                times[k][-1].append(_read_s(able[k], ctx, root))

    def ratios(k: str, blk: int) -> list[float]:
        return [b / t for b, t in zip(times[baseline][blk], times[k][blk])]

    measured = baseline in able
    out: dict[str, dict[str, Any]] = {}
    for k in drafters:
        if k not in able:
            out[k] = {"ms": None, "vs_baseline": None, "vs_baseline_blocks": None, "gflop": None}
            continue
        out[k] = {
            "ms": 1000 * median_high([t for blk in times[k] for t in blk]),
            "vs_baseline": median_high([x for blk in range(blocks) for x in ratios(k, blk)]) if measured else None,
            "vs_baseline_blocks": [median_high(ratios(k, blk)) for blk in range(blocks)] if measured else None,
            "gflop": read_flops(able[k], ctx, root) / 1e9,
        }
    return out


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


def bootstrap_tau(per: list[dict[str, list[int]]], signs: list[float] | None = None, n_boot: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval over prompts of sum_k signs[k] x tau_k, each tau_k =
    sum(emitted) / sum(forwards) of run k, prompts resampled jointly (paired): one run gives
    the interval of its tau, two runs with signs (1, -1) the interval of their difference."""
    import numpy as np

    signs = signs or [1.0] * len(per)
    rng = np.random.default_rng(seed)
    n = len(per[0]["emitted"])
    idx = rng.integers(0, n, size=(n_boot, n))
    stat = np.zeros(n_boot)
    for sgn, run_ in zip(signs, per):
        e, f = np.asarray(run_["emitted"], float), np.asarray(run_["forwards"], float)
        stat += sgn * e[idx].sum(1) / np.maximum(1.0, f[idx].sum(1))
    lo, hi = np.percentile(stat, [2.5, 97.5])
    return float(lo), float(hi)


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
    run_prompts(target, NoDrafter(), prompts[:1], 0.0, max_new_tokens)  # warm-up: the baseline is not the process's first run
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
        plain_t0 = run_prompts(target, NoDrafter(), prompts, 0.0, max_new_tokens)
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


def _ci(r: dict[str, Any], key: str) -> str:
    ci = r.get(f"{key}_ci")
    return f"{r[key]:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{r[key]:.2f}"


def _paired(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float] | None:
    """95% paired interval of tau_t0(a) - tau_t0(b) on the test prompts, or None."""
    if a.get("per_prompt_t0") and b.get("per_prompt_t0"):
        return bootstrap_tau([a["per_prompt_t0"], b["per_prompt_t0"]], [1.0, -1.0])
    return None


def _pick_best(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The row with the highest selection tau (val prompts), else the highest test tau at T=0."""
    if all("tau_select" in r for r in rows):
        return max(rows, key=lambda r: r["tau_select"]), "picked on the selection prompts"
    return max(rows, key=lambda r: r["tau_t0"]), "picked on the test prompts themselves"


def _vs_plain(r: dict[str, Any], plain: dict[str, Any]) -> float:
    """How many times cheaper r's prefill at 576 image tokens is than the plain head's: the
    median of the round-robin ratios when measured so, else the ratio of the two times."""
    return r.get("prefill_576_vs_plain") or plain["drafter_prefill_ms_576"] / r["drafter_prefill_ms_576"]


def _block_range(r: dict[str, Any]) -> str:
    """' (lo-hi)': the lowest and highest per-block ratio when the timing ran in several blocks."""
    blk = r.get("prefill_576_vs_plain_blocks")
    return f" ({min(blk):.1f}-{max(blk):.1f})" if blk and len(blk) > 1 else ""


def _flops_vs_plain(r: dict[str, Any], plain: dict[str, Any]) -> float | None:
    """How many times fewer FLOPs r's read at 576 image tokens takes than the plain head's."""
    a, b = plain.get("prefill_576_gflop"), r.get("prefill_576_gflop")
    return a / b if a and b else None


NONINFERIORITY = 0.03  # "as good as" within the 3% issue #5 allows compression to cost


def vision_goals(rows: list[dict[str, Any]]) -> list[str]:
    """Issue #5's goals, checked on the rows (Markdown bullets; 'met' / 'NOT met' each). The
    gate and the best variant are compared on the test prompts, at T=0, with the competitor
    picked on the selection prompts when the rows have them (`tau_select`)."""
    by = {r["variant"]: r for r in rows}
    plain = by.get("plain")
    fixed = [r for r in rows if "@" in r["variant"] and not r["variant"].startswith(("gate", "text_only")) and "+" not in r["variant"]]
    at16 = [r for r in fixed if r["variant"].endswith("@16x") and r.get("drafter_prefill_ms_576")]
    gate = by.get("gate@16x")
    out: list[str] = []
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    if plain and at16:
        for r in at16:
            keep = min(r["tau_t0"] / plain["tau_t0"], r["tau_t1"] / plain["tau_t1"])
            cheaper = _vs_plain(r, plain)
            fewer = _flops_vs_plain(r, plain)
            out.append(f"- {r['variant']}: accepted length {r['tau_t0']:.2f} / {r['tau_t1']:.2f} at T=0 / T=1 = "
                       f"{100 * keep:.0f}% of the plain head's at worst (goal >= 97%: {verdict(keep >= 0.97)}); "
                       f"drafter prefill at 576 image tokens {cheaper:.1f}x cheaper in time{_block_range(r)} (goal >= 4x: {verdict(cheaper >= 4)})"
                       + (f", {fewer:.1f}x fewer FLOPs" if fewer else ""))
        floor = next((r for r in rows if r["variant"].startswith("text_only") and r.get("drafter_prefill_ms_576")), None)
        if floor:  # no image row at all: what no compressor can beat on this read
            fewer = _flops_vs_plain(floor, plain)
            out.append(f"- bound: {floor['variant']} (no image row at all) is {_vs_plain(floor, plain):.1f}x cheaper in time{_block_range(floor)}"
                       + (f" ({fewer:.1f}x fewer FLOPs)" if fewer else "") + "; no compressor's read can be cheaper than that")
    if gate and fixed:
        best, how = _pick_best(fixed)
        line = (f"- gate@16x vs the best fixed compressor ({best['variant']}, {how}) at T=0: {gate['tau_t0']:.2f} vs "
                f"{best['tau_t0']:.2f} (goal: at least as good: {verdict(gate['tau_t0'] >= best['tau_t0'])})")
        ci = _paired(gate, best)
        if ci:
            margin = NONINFERIORITY * best["tau_t0"]
            line += (f"; paired 95% interval of the difference [{ci[0]:+.2f}, {ci[1]:+.2f}], so no worse by more than "
                     f"{100 * NONINFERIORITY:.0f}% ({margin:.2f}): {verdict(ci[0] >= -margin)}")
        if gate.get("gate_picks"):
            line += "; the gate picked " + ", ".join(f"{k} {v}x" for k, v in sorted(gate["gate_picks"].items(), key=lambda kv: -kv[1]))
        out.append(line)
    others = [r for r in rows if r is not plain]
    if plain and others:
        best_all, how = _pick_best(others)
        line = (f"- best variant {best_all['variant']} ({how}) {best_all['tau_t0']:.2f} vs the plain head {plain['tau_t0']:.2f} at T=0 "
                f"(goal: beats it: {verdict(best_all['tau_t0'] > plain['tau_t0'])})")
        ci = _paired(best_all, plain)
        if ci:
            line += f"; paired 95% interval of the difference [{ci[0]:+.2f}, {ci[1]:+.2f}], above 0: {'yes' if ci[0] > 0 else 'no'}"
        out.append(line)
    return out


def write_report(rows: list[dict[str, Any]], which: str, out: Path, env: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.json").write_text(json.dumps({"suite": which, "env": env, "rows": rows}, indent=2))
    base = next((r for r in rows if r["variant"] == "plain"), None)
    lines = [
        f"Command: `{env.get('command', '')}` ({env.get('prompts', '?')} held-out test prompts; tau with its 95% bootstrap interval over prompts"
        + (f"; the best fixed compressor and the best variant picked on {env['selection_prompts']} selection prompts from the val split)"
           if env.get("selection_prompts") else ")"),
        "",
        "| variant | tau T=0 | tau T=1 | drafter prefill (ms) | prefill at 576 image tokens (ms) | vs plain | GFLOP at 576 | vs plain | speedup T=0 vs none |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        at, gf = r.get("drafter_prefill_ms_576"), r.get("prefill_576_gflop")
        at_cells = (f"{at:.2f}", f"{_vs_plain(r, base):.1f}x cheaper{_block_range(r)}") if at and base and base.get("drafter_prefill_ms_576") else ("-", "-")
        fewer = _flops_vs_plain(r, base) if base else None
        gf_cells = (f"{gf:.3f}", f"{fewer:.1f}x fewer" if fewer else "-") if gf else ("-", "-")
        lines.append(f"| {r['variant']} | {_ci(r, 'tau_t0')} | {_ci(r, 'tau_t1')} | {r['drafter_prefill_ms']:.2f} | "
                     f"{at_cells[0]} | {at_cells[1]} | {gf_cells[0]} | {gf_cells[1]} | {r['speedup_t0']:.2f}x |")
    if any(r.get("prefill_576_rounds") for r in rows):
        nb = rows[0].get("prefill_576_blocks") or 1
        spread = (f"{nb} blocks of {rows[0]['prefill_576_rounds']} rounds, seconds apart" if nb > 1
                  else f"{rows[0]['prefill_576_rounds']} rounds")
        lines += ["", f"Prefill at 576 image tokens: {spread}; each round times every variant once, in turn. 'vs plain' is the "
                  "median over all rounds of the plain head's time / the variant's"
                  + (", in brackets the lowest and highest of the blocks' medians" if nb > 1 else "") + ". "
                  "GFLOP: one read counted by torch's FlopCounterMode (matrix products and attention)."]
    if which == "vision":
        goals = vision_goals(rows)
        if goals:
            lines += ["", "Goals of issue #5, checked on these rows:", "", *goals]
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    flops = any(r.get("prefill_576_gflop") for r in rows) and base is not None
    fig, axes = plt.subplots(1, 3 if flops else 2, figsize=(19 if flops else 13, max(3.5, 0.38 * len(rows) + 1.5)))
    a, b = axes[0], axes[1]
    names = [r["variant"] for r in rows][::-1]
    y = range(len(rows))
    for off, key, label in ((0.2, "tau_t0", "T=0"), (-0.2, "tau_t1", "T=1")):
        vals = [r[key] for r in rows][::-1]
        cis = [r.get(f"{key}_ci") or (r[key], r[key]) for r in rows][::-1]
        err = [[v - c[0] for v, c in zip(vals, cis)], [c[1] - v for v, c in zip(vals, cis)]]
        a.barh([i + off for i in y], vals, height=0.4, xerr=err, capsize=2, label=f"{label} (95% interval)")
    a.set_yticks(list(y), names)
    a.set_xlabel("mean accepted length (held out)")
    a.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    a.grid(axis="x", alpha=0.3)
    b.barh([i + 0.2 for i in y], [r.get("drafter_prefill_ms_576") or 0.0 for r in rows][::-1], height=0.4, color="tab:gray",
           label="576 image tokens (LLaVA-1.5 size)")
    b.barh([i - 0.2 for i in y], [r["drafter_prefill_ms"] for r in rows][::-1], height=0.4, color="tab:olive",
           label="the target's own prompts")
    b.set_yticks(list(y), [f"x{r['speedup_t0']:.2f}" for r in rows][::-1])
    b.set_xlabel("drafter prefill (ms); labels: end-to-end speedup at T=0")
    b.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    b.grid(axis="x", alpha=0.3)
    if flops:  # how much cheaper than the plain head, in time and in FLOPs, at 576 image tokens
        c = axes[2]
        timed = [_vs_plain(r, base) if r.get("drafter_prefill_ms_576") and base.get("drafter_prefill_ms_576") else 0.0 for r in rows][::-1]
        fewer = [_flops_vs_plain(r, base) or 0.0 for r in rows][::-1]
        c.barh([i + 0.2 for i in y], [max(t - 1, 0.0) for t in timed], left=1.0, height=0.4, color="tab:gray", label="x cheaper in time")
        c.barh([i - 0.2 for i in y], [max(f - 1, 0.0) for f in fewer], left=1.0, height=0.4, color="tab:purple", label="x fewer FLOPs")
        if which == "vision":
            c.axvline(4.0, color="tab:red", linestyle="--", linewidth=1, label="goal at 16x: 4x")
        c.set_xscale("log", base=2)
        c.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        c.set_yticks(list(y), [""] * len(rows))
        c.set_xlabel("vs the plain head at 576 image tokens (log scale)")
        c.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
        c.grid(axis="x", alpha=0.3)
    fig.suptitle(f"ablation '{which}' at {rows[0]['steps'] if rows else 0} training steps each")
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------ the command
@dataclass(frozen=True)
class AblateOptions:
    """What `vlmspec bench ablate` runs (the target is loaded by the caller, through vlmspec.factory)."""

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
