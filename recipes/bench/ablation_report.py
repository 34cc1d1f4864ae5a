"""The ablation's report: tau's bootstrap intervals, issue #5's goals checked on the rows, and
ablation.md / ablation.json / ablation.png (`python -m recipes ablate`; see `ablation`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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


__all__ = ["NONINFERIORITY", "bootstrap_tau", "vision_goals", "write_report"]
