"""`vlmspec bench run`: speed side by side, in one process, interleaved, on the same prompts.

Methods: (a) hf_generate: plain HF `generate`; (b) hf_prompt_lookup: HF with
`prompt_lookup_num_tokens`; (c) vlmspec_plain; (d) vlmspec_ngram; (e) vlmspec_eagle (when a
drafter is given or bundled). Per method: end-to-end and decode-only tokens/s, speedups vs (a)
and (c), mean accepted length (bonus included), acceptance per draft position, a time breakdown,
peak memory; at T=0 every method's tokens must equal (a)'s, else the run reports an error.

    vlmspec bench run [--model DIR|HUB_ID] [--drafter DIR] [--prompts test|FILE.jsonl] [-n 12] [--temperature 0]
                      [--max-new-tokens 96] [--warmup 1] [--repeats 1] [--json PATH] [--out DIR]

    report = bench(EngineSpec(model=...), RunOptions(n=12))   # what the command runs
    table = save_report(report, out=Path("docs/bench-t0"))     # results.json / .md / .png
"""

from __future__ import annotations

import json
import math
import platform
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from vlmspec import factory
from vlmspec.bench.repeat import RepeatPlan, pass_markdown, pass_report, repeat_plan
from vlmspec.bench.runner import WaysRun, run_ways
from vlmspec.data.heldout import Conversation, adversarial, heldout
from vlmspec.draft import NgramDrafter, PlainDrafter
from vlmspec.draft.base import Drafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.factory import EngineSpec
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams
from vlmspec.stats import SpecStats
from vlmspec.target import Target
from vlmspec.train.data import load_jsonl

BREAKDOWN = ("vision", "prefill", "draft", "verify", "commit", "other")


@dataclass
class MethodStats:
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    spec: SpecStats = field(default_factory=SpecStats)  # the engine methods' speculation counters, all prompts
    breakdown: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BREAKDOWN, 0.0))
    peak_mem_mb: float = 0.0
    mismatches: list[int] = field(default_factory=list)
    divergences: list[dict[str, Any]] = field(default_factory=list)  # where each mismatch starts, and its top-2 margin
    error: str | None = None

    def add(self, ids: list[int], seconds: float, vision_s: float, result: Any, hf_prefill_s: float, peak_mb: float) -> None:
        """One measured generation. result: the engine's GenerationResult, None for HF methods."""
        self.tokens += len(ids)
        self.seconds += seconds
        self.peak_mem_mb = max(self.peak_mem_mb, peak_mb)
        self.breakdown["vision"] += vision_s
        if result is None:  # HF: prefill measured separately, the rest is its decode loop
            prefill = hf_prefill_s
            self.breakdown["prefill"] += max(0.0, prefill - vision_s)
            self.breakdown["other"] += max(0.0, seconds - prefill)
        else:
            prefill = result.timings["prefill"]
            self.breakdown["prefill"] += max(0.0, prefill - vision_s)
            for k in ("draft", "verify", "commit", "other"):
                self.breakdown[k] += result.timings[k]
            self.spec += result.stats
        self.decode_tokens += max(0, len(ids) - 1)
        self.decode_seconds += max(1e-9, seconds - prefill)

    def summary(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "decode_tokens_per_s": self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0,
            "mean_accepted_length": self.spec.mean_accepted_length if self.spec.num_drafts else None,  # None: HF methods
            "acceptance_by_position": self.spec.acceptance_by_position,
            "time_breakdown_s": self.breakdown,
            # per verify forward (engine methods): the drafting (the head's read of the prompt included) and the verify
            "per_step_ms": {k: 1e3 * self.breakdown[k] / self.spec.num_drafts for k in ("draft", "verify")} if self.spec.num_drafts else None,
            "peak_memory_mb": self.peak_mem_mb,
            "matches_reference": not self.mismatches,
            "mismatched_prompts": self.mismatches,
            "divergences": self.divergences,
            "divergences_at_near_ties": sum(d["near_tie"] for d in self.divergences),
            "error": self.error,
        }


class VisionTimer:
    """Times the target's vision tower with forward hooks (the engine and HF both call it)."""

    NAMES = ("vision_tower", "visual", "vision_model")

    def __init__(self, model: torch.nn.Module) -> None:
        base = getattr(model, "model", model)
        self.module = next((getattr(base, n) for n in self.NAMES if hasattr(base, n)), None)
        self.total = 0.0
        self._t0 = 0.0
        if self.module is not None:
            self.module.register_forward_pre_hook(self._start)
            self.module.register_forward_hook(self._stop)

    def _start(self, *_: Any) -> None:
        _sync()
        self._t0 = time.perf_counter()

    def _stop(self, *_: Any) -> None:
        _sync()
        self.total += time.perf_counter() - self._t0

    @contextmanager
    def measure(self) -> Iterator[Callable[[], float]]:
        start = self.total
        yield lambda: self.total - start


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (Linux: KiB)


def load_prompts(spec: str, n: int) -> list[Conversation]:
    """'test' / 'val': held-out ToyWorld items (mixed tasks, the "bench" set); 'text': the held-out
    text-only instructions (`heldout.TEXT_PROMPTS`, in turn); else a LLaVA-style JSONL file
    (DataError when it cannot be used)."""
    if spec in ("test", "val"):
        return heldout("bench", n, split=spec)
    if spec == "text":
        return adversarial("unseen_text", n)
    convs, _ = load_jsonl(spec)
    return convs[:n]


def _hf_run(target: Target, inputs: dict[str, torch.Tensor], cfg: GenerationConfig, lookup: int | None) -> list[int]:
    kw: dict[str, Any] = {"max_new_tokens": cfg.max_new_tokens}
    if cfg.sampling.greedy:
        kw["do_sample"] = False
    else:
        kw.update(do_sample=True, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k or None)
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    out = target.model.generate(**inputs, **kw)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def run_bench(
    target: Target,
    drafters: dict[str, Any],
    prompts: list[Conversation],
    temperature: float = 0.0,
    max_new_tokens: int = 96,
    warmup: int = 1,
    repeats: int = 1,
    hf_lookup: int = 10,
    progress: bool = True,
    plan: RepeatPlan | None = None,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """drafters: name -> Drafter for the vlmspec methods. Returns {"methods": {...}, "env": {...}}.
    Every method on every prompt through `runner.run_ways` (interleaved, order rotated), but the
    methods in `skip`. A drafter that learns from traffic keeps each prompt's last round only; with
    a `plan` that repeats prompts (`vlmspec.bench.repeat`), "passes" has each pass apart."""
    sampling = SamplingParams(temperature=temperature)
    vision = VisionTimer(target.model)
    once = {id(c): encode_prompt(target, c.prompt, c.images) for c in {id(c): c for c in prompts}.values()}  # a repeat: encoded once
    prefill_s = {key: _hf_prefill_seconds(target, inputs) for key, inputs in once.items()}
    encoded, hf_prefill = [once[id(c)] for c in prompts], [prefill_s[id(c)] for c in prompts]
    calls: dict[str, Callable[[dict[str, torch.Tensor], GenerationConfig], tuple[list[int], Any]]] = {
        "hf_generate": lambda inputs, cfg: (_hf_run(target, inputs, cfg, None), None),
        "hf_prompt_lookup": lambda inputs, cfg: (_hf_run(target, inputs, cfg, hf_lookup), None)}
    for name, d in drafters.items():
        calls[f"vlmspec_{name}"] = _engine_call(SpecEngine(target, d))
    calls = {m: c for m, c in calls.items() if m == "hf_generate" or m not in skip}

    def way(call: Callable) -> Callable[[int, int], tuple[list[int], Any, float, float]]:
        def run(pi: int, rnd: int) -> tuple[list[int], Any, float, float]:
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, seed=1000 * pi + rnd,
                                   remember=rnd == warmup + repeats - 1)  # the prompt's last round only
            if target.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(target.device)
            with vision.measure() as vis:
                ids, result = call(encoded[pi], cfg)
                return ids, result, vis(), _peak_mb(target.device)

        return run

    run = run_ways({m: way(c) for m, c in calls.items()}, len(encoded), "hf_generate", repeats, warmup,
                   fails=(RuntimeError, ValueError, TypeError, NotImplementedError), sync=_sync,
                   progress="bench" if progress else None)
    stats = _method_stats(run, list(calls), hf_prefill)
    if temperature == 0:
        _check_parity(target, encoded, run, stats)
    out = _summaries(stats, temperature)
    report = {"methods": out, "env": environment(target, temperature, max_new_tokens, len(prompts), warmup, repeats)}
    if plan is not None and any(plan.repeat):
        report["passes"] = pass_report(plan, lambda keep: _summaries(_method_stats(run, list(calls), hf_prefill, keep), temperature),
                                       lambda m, keep: list(run.paired(m, keep).ratios), [m for m in calls if m != "hf_generate"])
        report["env"]["repeat_share"] = plan.share
    return report


def _method_stats(run: WaysRun, methods: list[str], hf_prefill: list[float], keep: Callable[[int], bool] | None = None) -> dict[str, MethodStats]:
    """Each method's counters over its measured runs on the prompts `keep` accepts (all by default)."""
    stats = {m: MethodStats(error=run.errors.get(m)) for m in methods}
    for t in run.runs:
        if keep is None or keep(t.item):
            ids, result, vis_s, peak = t.result
            stats[t.way].add(ids, t.seconds, vis_s, result, hf_prefill[t.item], peak)
    return stats


def _engine_call(engine: SpecEngine) -> Callable[[dict[str, torch.Tensor], GenerationConfig], tuple[list[int], Any]]:
    def call(inputs: dict[str, torch.Tensor], cfg: GenerationConfig) -> tuple[list[int], Any]:
        r = engine.generate(inputs, cfg)
        return r.token_ids, r

    return call


def _check_parity(target: Target, encoded: list[dict[str, torch.Tensor]], run: WaysRun, stats: dict[str, MethodStats]) -> None:
    """At T=0, each method's tokens on each prompt's last measured round against hf_generate's:
    a mismatch is recorded with where it starts and the reference's top-2 margin there."""
    last: dict[int, dict[str, list[int]]] = {}
    for (pi, _), runs in run.rounds().items():
        last.setdefault(pi, {}).update({m: t.result[0] for m, t in runs.items()})  # later rounds replace earlier
    for pi, ids_of in last.items():
        reference = ids_of.get("hf_generate")
        if reference is None:
            continue
        for m, ids in ids_of.items():
            if ids != reference:
                stats[m].mismatches.append(pi)
                stats[m].divergences.append({"prompt": pi, **divergence(target, encoded[pi], reference, ids)})


def _summaries(stats: dict[str, MethodStats], temperature: float) -> dict[str, dict[str, Any]]:
    """Each method's summary, with its speedups over hf_generate and vlmspec_plain and the n/a marks."""
    out = {m: s.summary() for m, s in stats.items()}
    for s in out.values():
        s["status"] = "ok" if s["error"] is None else "n/a"
        if s["error"] is not None:  # unavailable, not slow: no figure a consumer could read as 0.00x
            s["reason"] = s["error"]
            for k in ("tokens_per_s", "decode_tokens_per_s", "mean_accepted_length", "matches_reference"):
                s[k] = None
    base_a = out["hf_generate"]["tokens_per_s"]
    base_c = out.get("vlmspec_plain", {}).get("tokens_per_s")
    plain_step = (out.get("vlmspec_plain", {}).get("per_step_ms") or {}).get("verify")  # one-token target step, ms
    for s in out.values():  # a drafter's cost per tree in target steps (#20: a trimmed head's goal is <= 0.25)
        s["draft_per_step_vs_target_step"] = s["per_step_ms"]["draft"] / plain_step if plain_step and s["per_step_ms"] else None
    for s in out.values():
        s["speedup_vs_hf_generate"] = s["tokens_per_s"] / base_a if base_a and s["tokens_per_s"] is not None else None
        s["speedup_vs_vlmspec_plain"] = s["tokens_per_s"] / base_c if base_c and s["tokens_per_s"] is not None else None
        if temperature != 0 and s["status"] == "ok":
            s["matches_reference"] = None  # sampled outputs differ by design; losslessness is tested statistically
    return out


# a greedy choice that flips between two numerically different but equivalent computations (a tree
# forward against a one-token step) is a near-tie when the reference's top-2 logits are this many
# units in the last place of their dtype apart, or fewer (bf16: 8 significant bits)
NEAR_TIE_ULPS = 4.0


def first_divergence(reference: list[int], got: list[int]) -> int:
    """The first position where two token sequences differ (the shorter length when one is a prefix)."""
    return next((i for i, (a, b) in enumerate(zip(reference, got)) if a != b), min(len(reference), len(got)))


def top2_margin_ulps(logits: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """logits [V] -> (top-1 minus top-2, that margin in units in the last place of `dtype` at the top-1 value)."""
    top = logits.float().topk(2).values
    margin = float(top[0] - top[1])
    # eps = 2^-(stored mantissa bits): bf16 2^-7, fp32 2^-23
    ulp = 2.0 ** math.floor(math.log2(max(abs(float(top[0])), 1e-30))) * torch.finfo(dtype).eps
    return margin, margin / ulp


@torch.no_grad()
def divergence(target: Target, inputs: dict[str, torch.Tensor], reference: list[int], got: list[int]) -> dict[str, Any]:
    """Where `got` leaves the greedy `reference`, and the reference's top-2 margin there (one teacher-forced forward)."""
    pos = first_divergence(reference, got)
    prefix = torch.tensor([reference[:pos]], dtype=inputs["input_ids"].dtype, device=inputs["input_ids"].device)
    ids = torch.cat([inputs["input_ids"], prefix], dim=1)
    feed = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    logits = target.model(**feed, use_cache=False, logits_to_keep=1).logits[0, -1]
    margin, ulps = top2_margin_ulps(logits, target.dtype)
    return {"position": pos, "reference_token": reference[pos] if pos < len(reference) else None,
            "token": got[pos] if pos < len(got) else None, "top2_margin": margin, "margin_ulps": ulps,
            "near_tie": ulps <= NEAR_TIE_ULPS}


def _hf_prefill_seconds(target: Target, inputs: dict[str, torch.Tensor]) -> float:
    """HF's prefill cost for a prompt (a one-token greedy generate), for HF's decode-only rate."""
    one = GenerationConfig(max_new_tokens=1)
    _hf_run(target, inputs, one, None)  # warm
    _sync()
    t0 = time.perf_counter()
    _hf_run(target, inputs, one, None)
    _sync()
    return time.perf_counter() - t0


def environment(target: Target, temperature: float, max_new: int, n: int, warmup: int, repeats: int) -> dict[str, Any]:
    import transformers

    dev = target.device
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "dtype": str(target.dtype),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "target": target.name,
        "attention": target.attention,
        "temperature": temperature,
        "max_new_tokens": max_new,
        "prompts": n,
        "warmup": warmup,
        "repeats": repeats,
    }


# ------------------------------------------------------------------------------------ reports
MIN_MEASURED = 8  # measured generations per method below which the table says its ratios are noise


def markdown_table(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [
        f"device: {env['device']} | dtype {env['dtype']} | {env['threads']} threads | torch {env['torch']} | "
        f"transformers {env['transformers']} | T={env['temperature']} | {env['prompts']} prompts x {env['repeats']} repeats | "
        f"max {env['max_new_tokens']} new tokens",
        "",
        "| method | tok/s (e2e) | tok/s (decode) | vs hf_generate | vs vlmspec_plain | tau | accept@1..3 | "
        + " | ".join(f"{k} s" for k in BREAKDOWN)
        + " | draft / target step | peak MB | matches |",
        "|---|---:|---:|---:|---:|---:|---|" + "---:|" * len(BREAKDOWN) + "---:|---:|---|",
    ]
    for m, s in report["methods"].items():
        if s.get("error"):
            lines.append(f"| {m} | n/a: {s['error']} |" + " |" * (8 + len(BREAKDOWN)))
            continue
        fmt = lambda x, p=2, unit="": "-" if x is None else f"{x:.{p}f}{unit}"  # noqa: E731
        acc = ", ".join(f"{a:.2f}" for a in s["acceptance_by_position"][:3]) or "-"
        match = {True: "yes", False: f"NO ({len(s['mismatched_prompts'])}; {s.get('divergences_at_near_ties', 0)} at near-ties)",
                 None: "n/a (T>0)"}[s["matches_reference"]]
        lines.append(
            f"| {m} | {fmt(s['tokens_per_s'], 1)} | {fmt(s['decode_tokens_per_s'], 1)} | {fmt(s['speedup_vs_hf_generate'], unit='x')} | "
            f"{fmt(s['speedup_vs_vlmspec_plain'], unit='x')} | {fmt(s['mean_accepted_length'])} | {acc} | "
            + " | ".join(f"{s['time_breakdown_s'][k]:.2f}" for k in BREAKDOWN)
            + f" | {fmt(s.get('draft_per_step_vs_target_step'))} | {s['peak_memory_mb']:.0f} | {match} |"
        )
    if "passes" in report:
        lines.append(pass_markdown(report["passes"]))
    measured = env["prompts"] * env["repeats"]
    if measured < MIN_MEASURED:
        lines.append(f"\nwarning: {measured} measured generations per method (fewer than {MIN_MEASURED}): on a shared "
                     "machine these ratios are noise-level; use -n 12 or more (and --repeats) before reading them")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m, s in report["methods"].items() if not s.get("error")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    rates = [report["methods"][m]["tokens_per_s"] for m in methods]
    bars = a.bar(methods, rates, color=["#999999" if m.startswith("hf") else "#3a76c4" for m in methods])
    for bar, m in zip(bars, methods):
        sp = report["methods"][m]["speedup_vs_hf_generate"]
        a.annotate(f"{sp:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9)
    a.set_ylabel("tokens / s (end to end)")
    a.set_title(f"T={report['env']['temperature']}  ({report['env']['device']})", fontsize=10)
    a.tick_params(axis="x", rotation=20)
    bottom = [0.0] * len(methods)
    for k in BREAKDOWN:
        vals = [report["methods"][m]["time_breakdown_s"][k] for m in methods]
        b.bar(methods, vals, bottom=bottom, label=k)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_ylabel("seconds (all prompts)")
    b.set_title("where the time goes", fontsize=10)
    b.tick_params(axis="x", rotation=20)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------ the command
@dataclass(frozen=True)
class RunOptions:
    """What `vlmspec bench run` measures (the engine side is an `EngineSpec`)."""

    prompts: str = "test"  # 'test' / 'val' (held-out ToyWorld), 'text' (held-out text-only) or a LLaVA-style JSONL file
    n: int = 12
    temperature: float = 0.0
    max_new_tokens: int = 96
    warmup: int = 1
    repeats: int = 1
    eagle: tuple[str, ...] = ()  # EAGLE drafter folders, self[:E], suffix, hybrid; () = the drafter shipped for the target, if any
    repeat_share: float = 0.0  # this share of the requests repeat earlier ones (`vlmspec.bench.repeat`; 0.5: a second pass)
    skip: tuple[str, ...] = ()  # methods left out (e.g. hf_prompt_lookup, vlmspec_ngram); never hf_generate

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1 or self.repeats < 1 or self.warmup < 0 or self.temperature < 0:
            raise ValueError(f"n, max_new_tokens and repeats must be >= 1, warmup and temperature >= 0: {self}")
        if not 0.0 <= self.repeat_share < 1.0:
            raise ValueError(f"repeat_share must be in [0, 1), got {self.repeat_share}")


def bench_drafters(spec: EngineSpec, target: Target, eagle: tuple[str, ...] = ()) -> dict[str, Drafter]:
    """none, ngram, and one drafter per entry of `eagle`: an EAGLE folder (default: the drafter
    `spec`'s "auto" resolves to, when that is a trained one), `self` / `self:E` (self-speculation),
    `suffix` or `hybrid` / `X+suffix` (each with a cross-request store of its own), each with
    `spec`'s tree knobs over its own default for the target's device (`factory.tree_config`)."""
    drafters: dict[str, Drafter] = {"plain": PlainDrafter(), "ngram": NgramDrafter(factory.tree_config(spec, str(target.device)))}
    auto = factory.resolve_drafter("auto", target.name)
    folders = 0
    for entry in eagle or ([auto] if auto not in ("ngram", "plain") else []):
        if entry == "self" or entry.startswith("self:") or entry == "suffix":
            name = entry
        elif entry == "hybrid" or entry.endswith("+suffix"):
            name = "hybrid" if "hybrid" not in drafters else f"hybrid_{Path(entry.removesuffix('+suffix')).name}"
        else:
            name, folders = ("eagle" if folders == 0 else f"eagle_{Path(entry).name}"), folders + 1
        drafters[name] = factory.drafter_for(replace(spec, drafter=entry), target)
    return drafters


def bench(spec: EngineSpec, opts: RunOptions, progress: bool = True) -> dict[str, Any]:
    """`vlmspec bench run`: load the target of `spec`, measure every method on the prompts."""
    target = factory.load(spec)
    drafters = bench_drafters(spec, target, opts.eagle)
    prompts = load_prompts(opts.prompts, opts.n)
    plan = repeat_plan(len(prompts), opts.repeat_share)
    report = run_bench(target, drafters, [prompts[i] for i in plan.items], opts.temperature, opts.max_new_tokens, opts.warmup, opts.repeats,
                       progress=progress, plan=plan, skip=opts.skip)
    # each drafting method's tree: the spec's knobs over its drafter's measured default, else the device's
    report["env"]["trees"] = {f"vlmspec_{name}": [d.tree.depth, d.tree.top_k, d.tree.total_tokens]
                              for name, d in drafters.items() if d.tree is not None}
    return report


def write_json(path: str | Path, data: Any) -> None:
    """Write a bench's numbers as JSON, making the folder first (a missing folder must not lose a run)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def save_report(report: dict[str, Any], out: Path | None = None, json_path: Path | None = None) -> str:
    """Write the report (JSON at `json_path`; results.json / .md / .png in `out`); -> the Markdown table."""
    table = markdown_table(report)
    if json_path:
        write_json(json_path, report)
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "results.json", report)
        (out / "results.md").write_text(table + "\n")
        plot(report, out / "results.png")
    return table


def mismatched(report: dict[str, Any]) -> list[str]:
    """The methods that did not reproduce hf_generate's tokens at T=0: in fp32 any difference; in a
    lower precision one that starts where the reference's top-2 logits are more than a near-tie apart
    (a batched or tree matmul may round an exact near-tie the other way there: `near_tie_divergences`)."""
    exact = report["env"].get("dtype") == "torch.float32"
    return [m for m, s in report["methods"].items() if s["matches_reference"] is False
            and (exact or not s["divergences"] or not all(d["near_tie"] for d in s["divergences"]))]


def near_tie_divergences(report: dict[str, Any]) -> dict[str, int]:
    """{method: divergences} for the methods that differ from hf_generate at near-ties only (not fp32)."""
    bad = set(mismatched(report))
    return {m: len(s["divergences"]) for m, s in report["methods"].items() if s["matches_reference"] is False and m not in bad}
