"""Linear layers over weights prepacked for oneDNN: a drafter's CPU matrix products at a few
rows, without repacking the weight on every call.

`F.linear` on a bf16 CPU tensor hands the product to oneDNN, which reorders the weight into its
blocked layout on every call: at a draft level's 1-4 rows, up to half of the call. Over a weight
packed once the results are equal bit for bit (tests/test_packed_linear.py): only when the reorder
happens changes. float32 `F.linear` goes to MKL; oneDNN's packed product is faster but sums in
another order (about 1e-6 relative): fine for a drafter, whose tokens the target verifies, not for
the target. Timings: docs/default-model.md. CUDA has no reorder to save: other devices and dtypes
stay on `F.linear`. oneDNN caches a primitive per row count; the composition root bounds those
caches (`vlmspec.runtime.onednn`). The target's own layers take packed weights only where the numbers stay
F.linear's to the bit: `ExactPackedLinear`, up to the row count `exact_rows` finds equal
(`vlmspec.target.packing` packs a target's layers).
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

PACKED_DTYPES = (torch.bfloat16, torch.float32)


def packable(weight: torch.Tensor) -> bool:
    """Whether `PackedLinear` packs this weight (bf16 or fp32 on a CPU whose oneDNN packs that
    dtype here, `packs_on_this_cpu`), else it runs `F.linear` as it is."""
    return weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and packs_on_this_cpu(weight.dtype)


@functools.lru_cache(maxsize=None)
def packs_on_this_cpu(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies a `dtype` weight on this CPU, tried once: its bf16 path
    needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and refuses where the CPU, or ONEDNN_MAX_CPU_ISA,
    offers less (e.g. AVX2 alone)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        w = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


class PackedLinear:
    """y = x @ weight.T + bias, the weight packed once for oneDNN where that is faster (`packable`;
    bit for bit `F.linear`'s numbers in bf16, equal to float rounding in fp32), `F.linear`
    otherwise. Holds no gradient: for drafting only.

    weight [N, K], bias [N] | None; rows: the row count the packing is tuned for (any count runs).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = 4) -> None:
        weight = weight.detach()
        self.dtype = weight.dtype
        self.bias = None if bias is None else bias.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows) if packable(weight) else None
        self.weight = None if self.packed is not None else weight  # packed: the packed copy is all it keeps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.dtype != self.dtype or x.device.type != "cpu":
            raise TypeError(f"a weight packed as {self.dtype} on the CPU takes {self.dtype} CPU inputs, got {x.dtype} on {x.device}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class ExactPackedLinear(torch.nn.Linear):
    """An `nn.Linear` (the same parameter objects, so the same state dict and tied weights stay
    tied) that multiplies inputs of at most `rows` rows (all axes but the last) by its weight packed
    once for oneDNN, where `exact_rows` found that product equal to F.linear's to the bit; every
    other call runs F.linear: more rows, gradients wanted, another dtype or device, or a weight or
    bias changed in place or replaced since it was packed. Build with `wrap`."""

    rows: int
    _packed: PackedLinear
    _packed_from: tuple

    @classmethod
    def wrap(cls, linear: torch.nn.Linear, rows: int) -> "ExactPackedLinear":
        assert rows >= 1 and type(linear) is torch.nn.Linear, (rows, type(linear))
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.register_parameter("bias", linear.bias)
        new.rows = rows
        new._packed = PackedLinear(linear.weight, linear.bias)
        new._packed_from = _source(linear.weight, linear.bias)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        w, b = self.weight, self.bias
        if (x.numel() <= self.rows * self.in_features and x.dtype == w.dtype and x.device.type == "cpu"
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
                and _source(w, b) == self._packed_from):
            return self._packed(x)
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, packed up to {self.rows} rows"


def _source(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, ...]:
    """Where the weight and bias are and their versions: what a packed copy was made from (a new
    storage, from `.to()` or an assignment, or an in-place change gives another)."""
    if bias is None:
        return weight.data_ptr(), weight._version
    return weight.data_ptr(), weight._version, bias.data_ptr(), bias._version


def exact_rows(linear: torch.nn.Linear, most: int, seed: int = 0) -> int:
    """The largest R <= `most` such that, at every row count from 1 to R, this layer's product over
    a weight packed for oneDNN equals F.linear's to the bit (random inputs: the kernel, and so the
    order of the sums, follows the shape, not the values). 0 where it does not pack or differs at 1."""
    w, b = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    if not packable(w):
        return 0
    packed = PackedLinear(w, b)
    x = torch.randn(most, w.shape[1], generator=torch.Generator().manual_seed(seed)).to(w.dtype)
    with torch.no_grad():
        for m in range(1, most + 1):
            if not torch.equal(packed(x[:m]), F.linear(x[:m], w, b)):
                return m - 1
    return most
