"""Benchmark: the Triton tree-attention kernel against SDPA with an explicit tree mask.

One attention layer shaped like LLaVA-1.5-7B's language model (32 heads, head dim 128, no GQA,
bf16 by default), a committed prefix of P cached tokens and a draft tree of N tokens. Each call is
timed alone with CUDA events, after writing a buffer larger than L2 (so K/V come from HBM, as they
do when every layer has its own cache), and the median over the repeats is reported.

    vlmspec bench kernel [--prefix 1024 4096] [--tree 16 32 64] [--json out.json]

    report = run(KernelOptions(prefix=(1024,), tree=(16,)))   # ConfigError without CUDA + triton
    print(format_table(report))
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch

from vlmspec.errors import ConfigError
from vlmspec.tree import ancestor_mask, tree_attention_mask

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class KernelOptions:
    prefix: tuple[int, ...] = (1024, 4096)  # prefix lengths P
    tree: tuple[int, ...] = (16, 32, 64)  # tree sizes N
    heads: int = 32  # query heads
    kv_heads: int | None = None  # None: = heads (no GQA)
    head_dim: int = 128
    batch: int = 1
    dtype: str = "bf16"
    warmup: int = 10
    repeats: int = 100
    flush: bool = True  # flush L2 between calls
    seed: int = 0


def _random_parents(n: int, gen: torch.Generator) -> torch.Tensor:
    par = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return torch.tensor(par, dtype=torch.long)


def _time_us(fn: Callable[[], object], warmup: int, repeats: int, flush: torch.Tensor | None) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]
    return {"median_us": statistics.median(times), "min_us": min(times), "mean_us": statistics.fmean(times)}


def run(opts: KernelOptions) -> dict[str, Any]:
    """Time every (P, N): -> {"device", "torch", "triton", "config", "rows"}. ConfigError when
    there is no CUDA GPU or no importable triton, or the heads do not split into the KV heads."""
    if not torch.cuda.is_available():
        raise ConfigError("a CUDA GPU is needed to time the tree-attention kernel (none found)")
    from vlmspec.kernels import tree_attention as ta

    if not ta.kernel_available():
        raise ConfigError("triton is needed to run the tree-attention kernel (not importable)")
    hq, d, bsz = opts.heads, opts.head_dim, opts.batch
    hkv = opts.kv_heads or hq
    if hq % hkv:
        raise ConfigError(f"--heads {hq} must be a multiple of --kv-heads {hkv}")
    if opts.dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")

    dev = torch.device("cuda")
    dtype = DTYPES[opts.dtype]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    gen = torch.Generator().manual_seed(opts.seed)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * 2**20)
    flush = torch.empty(max(2 * l2, 64 * 2**20) // 4, dtype=torch.int32, device=dev) if opts.flush else None

    rows = []
    for p in opts.prefix:
        for n in opts.tree:
            tree = ancestor_mask(_random_parents(n, gen))
            q = torch.randn(bsz, hq, n, d, device=dev, dtype=dtype)
            k = torch.randn(bsz, hkv, p + n, d, device=dev, dtype=dtype)
            v = torch.randn(bsz, hkv, p + n, d, device=dev, dtype=dtype)
            bits = ta.pack_tree_mask(tree.to(dev))
            add_mask = tree_attention_mask(tree.to(dev), p, dtype)  # [1, 1, N, P + N], 0 / min
            bool_mask = add_mask == 0
            ke = k if g == 1 else k.repeat_interleave(g, 1)
            ve = v if g == 1 else v.repeat_interleave(g, 1)

            def run_triton(q=q, k=k, v=v, bits=bits, p=p) -> torch.Tensor:
                return ta.tree_attention(q, k, v, bits, p, scale)

            def run_sdpa_bool(q=q, ke=ke, ve=ve, m=bool_mask) -> torch.Tensor:
                return torch.nn.functional.scaled_dot_product_attention(q, ke, ve, attn_mask=m, scale=scale)

            def run_sdpa_add(q=q, ke=ke, ve=ve, m=add_mask) -> torch.Tensor:
                return torch.nn.functional.scaled_dot_product_attention(q, ke, ve, attn_mask=m, scale=scale)

            ref = ta.tree_attention_reference(q, k, v, tree.to(dev), p, scale).float()
            err = {
                "triton": (run_triton().float() - ref).abs().max().item(),
                "sdpa_bool": (run_sdpa_bool().float() - ref).abs().max().item(),
            }
            t_tri = _time_us(run_triton, opts.warmup, opts.repeats, flush)
            t_bool = _time_us(run_sdpa_bool, opts.warmup, opts.repeats, flush)
            t_add = _time_us(run_sdpa_add, opts.warmup, opts.repeats, flush)
            best_sdpa = min(t_bool["median_us"], t_add["median_us"])
            rows.append(
                {
                    "prefix": p,
                    "tree": n,
                    "triton": t_tri,
                    "sdpa_bool_mask": t_bool,
                    "sdpa_additive_mask": t_add,
                    "speedup_vs_best_sdpa": best_sdpa / t_tri["median_us"],
                    "max_abs_err_vs_fp32_reference": err,
                }
            )
            del q, k, v, ke, ve, add_mask, bool_mask

    return {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": getattr(__import__("triton"), "__version__", None),
        "config": {
            "batch": bsz, "heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": opts.dtype,
            "warmup": opts.warmup, "repeats": opts.repeats, "l2_flush": opts.flush,
        },
        "rows": rows,
    }


def format_table(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"Tree attention, one layer: B={c['batch']}, Hq={c['heads']}, Hkv={c['kv_heads']}, D={c['head_dim']}, {c['dtype']}, "
        f"{report['device']}; median of {c['repeats']} calls{', L2 flushed between calls' if c['l2_flush'] else ''}.\n",
        "| prefix P | tree N | triton (us) | SDPA bool mask (us) | SDPA additive mask (us) | speedup vs best SDPA | max err triton / SDPA |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        e = r["max_abs_err_vs_fp32_reference"]
        lines.append(
            f"| {r['prefix']} | {r['tree']} | {r['triton']['median_us']:.1f} | {r['sdpa_bool_mask']['median_us']:.1f} "
            f"| {r['sdpa_additive_mask']['median_us']:.1f} | {r['speedup_vs_best_sdpa']:.2f}x "
            f"| {e['triton']:.2e} / {e['sdpa_bool']:.2e} |"
        )
    return "\n".join(lines)


__all__ = ["DTYPES", "KernelOptions", "format_table", "run"]
