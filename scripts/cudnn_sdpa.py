"""Why batched drafting was slow on CUDA: cuDNN's SDPA plans every shape it has not met.

    PYTHONPATH=<checkout> python3 scripts/cudnn_sdpa.py [--model toy]     (a CUDA machine)

1. One masked SDPA call at the default drafter's heads (9 query, 3 key / value, 64 wide; 32
   queries, about 5,000 keys, an additive mask), cuDNN's backend allowed and not: ms per call at
   ten key lengths not met before, then at the last one again.
2. The engine decoding 8 held-out rows together (fixed policy, 4-node trees, bf16): drafting ms
   per step on prompt sets it has not decoded before and on the same sets again, with cuDNN's SDPA
   allowed (the engine before `vlmspec.target.sdpa`) and left out (the engine now).

On a lent H200 (torch 2.11, cuDNN 9.19) a call at a new key length took 68-1,661 ms with cuDNN and
about 0.5 ms without it (0.12 ms with cuDNN once planned), and batched drafting took 403-513 ms
per step on new prompt sets with cuDNN against 24-27 ms without it (docs/batching.md, "On a GPU").
That run toggled torch.backends.cuda.enable_cudnn_sdp on commit 8fbd0bb, before the engine left
the backend out itself; here the engine's context is replaced to allow it.
"""
import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_profile import decode  # noqa: E402

import vlmspec.engine.batch  # noqa: E402
from vlmspec.bench.batch import prompts  # noqa: E402
from vlmspec.factory import EngineSpec, build_engine  # noqa: E402
from vlmspec.target.sdpa import decoding_sdpa  # noqa: E402


def _ms(call) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t)


def one_call(cudnn: bool, first_keys: int) -> str:
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    dev, dt = "cuda", torch.bfloat16
    new = []
    for i in range(10):
        keys = first_keys + 13 * i
        q = torch.randn(1, 9, 32, 64, device=dev, dtype=dt)
        k, v = torch.randn(1, 3, keys, 64, device=dev, dtype=dt), torch.randn(1, 3, keys, 64, device=dev, dtype=dt)
        mask = torch.zeros(1, 1, 32, keys, device=dev, dtype=dt)
        call = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
        new.append(_ms(call))
    again = [_ms(call) for _ in range(5)]
    torch.backends.cuda.enable_cudnn_sdp(True)
    return (f"SDPA [9x32 queries, 3 kv heads, ~{first_keys} keys, additive mask] cudnn_sdp={cudnn}: new key lengths ms "
            + " ".join(f"{x:.2f}" for x in new) + " | same shape again ms " + " ".join(f"{x:.2f}" for x in again))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="toy", help="toy (default) or a model folder")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cudnn_sdpa: needs a CUDA device (cuDNN's SDPA is a CUDA backend)")
        return 0
    print(torch.cuda.get_device_name(0), "torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), flush=True)
    for cudnn, keys in ((True, 5037), (False, 5491)):
        print(one_call(cudnn, keys), flush=True)
    engine = build_engine(EngineSpec(model=args.model, device="cuda", dtype="bfloat16", policy="fixed"))
    ps = prompts(engine.target, 32)
    sets = {key: ps[8 * i: 8 * i + 8] for i, key in enumerate("ABCD")}
    decode(engine, ps[:1], 4, 4)  # warm-up: first kernels
    print("| prompt set | cuDNN's SDPA | drafting ms per step: median / slowest | steps | wall s |\n|---|---|---:|---:|---:|", flush=True)
    for label in ("first time", "again"):
        for key, cudnn in zip("ABCD", (True, False, True, False)):
            vlmspec.engine.batch.decoding_sdpa = (lambda device: contextlib.nullcontext()) if cudnn else decoding_sdpa
            t = time.perf_counter()
            ms, steps = decode(engine, sets[key], 24, 4)
            print(f"| set {key}, {label} | {'allowed' if cudnn else 'left out'} | {statistics.median(ms):.1f} / {max(ms):.1f} | "
                  f"{steps} | {time.perf_counter() - t:.2f} |", flush=True)
    vlmspec.engine.batch.decoding_sdpa = decoding_sdpa
    return 0


if __name__ == "__main__":
    sys.exit(main())
