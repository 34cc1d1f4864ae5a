"""Linear layers over weights prepacked for oneDNN: the CPU's bf16 matrix products at a drafter's
few rows, without repacking the weight on every call.

`F.linear` on a bf16 CPU tensor hands the product to oneDNN, which first reorders the weight into
its blocked layout, on every call. At a draft level's 1-4 rows that reorder is up to half of the
call: on this project's 2-core Zen 4 CPU a [4, 576] x [576, 3072] product takes
120-150 us through `F.linear` and about 60 us over a weight packed once (see for yourself:
`python -m vlmspec.kernels.packed_linear`). The results are equal bit for bit
(tests/test_packed_linear.py holds them so): only when the reorder happens changes.

Only bf16 on CPU is packed. float32 goes through oneDNN's packed path only with different
rounding than `F.linear` (MKL), and CUDA has no reorder to save; both stay on `F.linear`.
"""

from __future__ import annotations

import time

import torch
from torch.nn import functional as F


def packable(weight: torch.Tensor) -> bool:
    """Whether `PackedLinear` packs this weight (bf16 on a CPU whose torch has oneDNN), else it
    runs `F.linear` as it is."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear:
    """y = x @ weight.T + bias, the weight packed once for oneDNN where that is exact and faster
    (`packable`), `F.linear` otherwise. Holds no gradient: for inference only.

    weight [N, K], bias [N] | None; rows: the row count the packing is tuned for (any count runs).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = 4) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows) if packable(self.weight) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if self.packed is None or x.dtype != self.weight.dtype or x.device != self.weight.device:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _median_us(run, repeats: int = 300) -> float:
    for _ in range(20):
        run()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1e6)
    return sorted(times)[len(times) // 2]


def main() -> None:
    """Times F.linear against the packed weight at a drafter's shapes (bf16, this machine's threads)."""
    print(f"bf16, {torch.get_num_threads()} threads: median us per call, F.linear vs packed (same numbers?)")
    # the default model's drafter (hidden 576, 9 + 2 x 3 heads of 64, MLP 1536, K = 4,096)
    for name, n, k in (("q|k|v", 960, 576), ("gate|up", 3072, 576), ("down", 576, 1536), ("cut LM head", 4096, 576)):
        w = torch.randn(n, k).bfloat16()
        packed = PackedLinear(w)
        for rows in (1, 4, 17):
            x = torch.randn(rows, k).bfloat16()
            same = torch.equal(F.linear(x, w), packed(x))
            print(f"  {name:11s} [{rows:2d}, {k}] x [{k}, {n}]: {_median_us(lambda: F.linear(x, w)):7.1f} vs "
                  f"{_median_us(lambda: packed(x)):7.1f}  {'same' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
