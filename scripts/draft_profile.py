"""Where a batched drafted step's time goes: drafting ms per step by variant, then one variant's
operations under torch.profiler. Written for the next GPU run of `make gpu-check` (part 5).

    PYTHONPATH=<checkout> python3 scripts/draft_profile.py [--model toy] [--device cuda] [--out DIR]

On a lent H200 the batched EAGLE drafting of 8 rows with 4-node trees took 451 ms per step on the
default model (19 ms at one row), on every step, and 263-270 ms on the toy model
(docs/batching.md, "On a GPU"), while the start-up cost model, which drafts chains on 8 copies of
one short prompt, measured 25 ms. Two differences between those runs are suspects: the rows'
prompts (the held-out mix: ragged lengths and images, or one prompt copied) and the draft's shape
(4-node trees, kept from the device's default tree: 7 levels of top-10 on CUDA; or chains, top-1). Four variants cross them, each B rows decoding
`--tokens` tokens together under the fixed policy; each prints its median drafting ms per step
(the engine's own phase timings, which synchronise on CUDA). Then the ragged 4-node run is decoded
again under torch.profiler: its top operations by self CPU time (and by CUDA time on a GPU), and
how many CUDA runtime calls it made that synchronise, copy or launch. On this project's 2-core CPU
every variant drafts in 7 to 17 ms per step (toy model, bf16).

What it found on the next lent H200: cuDNN's SDPA, which torch picked for the drafter's masked
attention, plans each shape it has not met, at 68 ms to 1.7 s a time, and batched drafting meets
a new key length at nearly every call. The engine now runs its forwards without that backend
(`vlmspec.target.sdpa`); `--cudnn-sdpa` lets SDPA take it again, as before, for
the comparison in docs/batching.md ("On a GPU").
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from vlmspec.bench.batch import prompts
from vlmspec.policy.control import SpeculationOptions
from vlmspec.engine import GenerationConfig
from vlmspec.factory import EngineSpec, build_engine

RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy",
                 "cudaLaunchKernel", "cudaMalloc", "cudaFree")


def decode(engine, requests: list, tokens: int, tree_tokens: int | None) -> tuple[list[float], int]:
    """Decode `requests` together (fixed policy) -> (each drafted step's drafting ms, steps)."""
    batch = engine.batch(len(requests))
    cfg = GenerationConfig(max_new_tokens=tokens, ignore_eos=True, speculation=SpeculationOptions(policy="fixed", tree_tokens=tree_tokens))
    for r in requests:
        batch.submit(r, cfg)
    per_step, steps = [], 0
    with torch.no_grad():
        while not batch.idle:
            before = batch.timings["draft"]
            batch.step()
            per_step.append(1e3 * (batch.timings["draft"] - before))
            steps += 1
    return per_step[1:] or per_step, steps  # the first step's drafting also runs the prompts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="toy", help="toy (default) or a model folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--out", default=None, help="folder for profile.md (else the console only)")
    parser.add_argument("--cudnn-sdpa", action="store_true",
                        help="let SDPA take cuDNN's backend on CUDA, as the engine did before decoding_sdpa left it out")
    args = parser.parse_args()
    if args.cudnn_sdpa:
        import contextlib

        import vlmspec.engine.batch

        vlmspec.engine.batch.decoding_sdpa = lambda device: contextlib.nullcontext()  # torch's own choice of backend
    lines = [f"`{' '.join(['python3', *sys.argv])}`", "",
             f"{args.model}, {args.dtype} on {args.device}, {args.batch} rows, {args.tokens} tokens each, fixed policy"
             + (", cuDNN's SDPA allowed" if args.cudnn_sdpa else ""), "",
             "| draft | rows | drafting ms per step: median / slowest | steps |", "|---|---|---:|---:|"]
    engines = {"4-node trees": (build_engine(EngineSpec(model=args.model, device=args.device, dtype=args.dtype, policy="fixed")), 4),
               "chains (top-1)": (build_engine(EngineSpec(model=args.model, device=args.device, dtype=args.dtype, policy="fixed",
                                                          tree_topk=1)), None)}
    engine = engines["4-node trees"][0]
    mixed = prompts(engine.target, args.batch)
    rows = {"held-out mix": mixed, "one prompt, copied": [mixed[0]] * args.batch}
    for name, (eng, tree_tokens) in engines.items():
        decode(eng, mixed[:1], 4, tree_tokens)  # warm-up: first shapes, first kernels
        for label, reqs in rows.items():
            ms, steps = decode(eng, reqs, args.tokens, tree_tokens)
            lines.append(f"| {name} | {label} | {statistics.median(ms):.1f} / {max(ms):.1f} | {steps} |")
            print(lines[-1], flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        decode(engine, mixed, args.tokens, 4)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    calls = {e.key: e.count for e in events if e.key in RUNTIME_CALLS}
    lines += ["", f"Profiled: 4-node trees, held-out mix, {wall:.2f} s under the profiler. CUDA runtime calls: "
              + (", ".join(f"{k} {v}" for k, v in sorted(calls.items())) or "none (no GPU)"), "",
              "```", events.table(sort_by="self_cpu_time_total", row_limit=25), "```"]
    if args.device.startswith("cuda"):
        lines += ["", "```", events.table(sort_by="self_cuda_time_total", row_limit=15), "```"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
