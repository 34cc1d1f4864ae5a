"""Benchmark: the Triton tree-attention kernel against SDPA with an explicit tree mask.

One attention layer shaped like LLaVA-1.5-7B's language model (32 heads, head dim 128, no GQA,
bf16 by default), a committed prefix of P cached tokens and a draft tree of N tokens. Each call is
timed alone with CUDA events, after writing a buffer larger than L2 (so K/V come from HBM, as they
do when every layer has its own cache), and the median over the repeats is reported.

    vlmspec bench kernel [--prefix 1024 4096] [--tree 16 32 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Callable

import torch

from vlmspec.tree import ancestor_mask, tree_attention_mask

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vlmspec bench kernel", description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, nargs="+", default=[1024, 4096], help="prefix lengths P")
    ap.add_argument("--tree", type=int, nargs="+", default=[16, 32, 64], help="tree sizes N")
    ap.add_argument("--heads", type=int, default=32, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: = heads, no GQA)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--no-flush", action="store_true", help="do not flush L2 between calls")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the numbers as JSON")
    return ap


def _random_parents(n: int, gen: torch.Generator) -> torch.Tensor:
    par = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return torch.tensor(par, dtype=torch.long)


def _time_us(fn: Callable[[], object], warmup: int, repeats: int, flush: torch.Tensor | None) -> dict:
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("vlmspec bench kernel: a CUDA GPU is needed to time the tree-attention kernel (none found)", file=sys.stderr)
        return 2
    from vlmspec.kernels import tree_attention as ta

    if not ta.kernel_available():
        print("vlmspec bench kernel: triton is needed to run the tree-attention kernel (not importable)", file=sys.stderr)
        return 2

    dev = torch.device("cuda")
    dtype = _DTYPES[args.dtype]
    hq, d, bsz = args.heads, args.head_dim, args.batch
    hkv = args.kv_heads or hq
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    gen = torch.Generator().manual_seed(args.seed)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * 2**20)
    flush = None if args.no_flush else torch.empty(max(2 * l2, 64 * 2**20) // 4, dtype=torch.int32, device=dev)

    rows = []
    for p in args.prefix:
        for n in args.tree:
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
            t_tri = _time_us(run_triton, args.warmup, args.repeats, flush)
            t_bool = _time_us(run_sdpa_bool, args.warmup, args.repeats, flush)
            t_add = _time_us(run_sdpa_add, args.warmup, args.repeats, flush)
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

    name = torch.cuda.get_device_name(dev)
    print(
        f"Tree attention, one layer: B={bsz}, Hq={hq}, Hkv={hkv}, D={d}, {args.dtype}, {name}; "
        f"median of {args.repeats} calls{'' if args.no_flush else ', L2 flushed between calls'}.\n"
    )
    print("| prefix P | tree N | triton (us) | SDPA bool mask (us) | SDPA additive mask (us) | speedup vs best SDPA | max err triton / SDPA |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        e = r["max_abs_err_vs_fp32_reference"]
        print(
            f"| {r['prefix']} | {r['tree']} | {r['triton']['median_us']:.1f} | {r['sdpa_bool_mask']['median_us']:.1f} "
            f"| {r['sdpa_additive_mask']['median_us']:.1f} | {r['speedup_vs_best_sdpa']:.2f}x "
            f"| {e['triton']:.2e} / {e['sdpa_bool']:.2e} |"
        )
    if args.json:
        payload = {
            "device": name,
            "torch": torch.__version__,
            "triton": getattr(__import__("triton"), "__version__", None),
            "config": {
                "batch": bsz, "heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": args.dtype,
                "warmup": args.warmup, "repeats": args.repeats, "l2_flush": not args.no_flush,
            },
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
