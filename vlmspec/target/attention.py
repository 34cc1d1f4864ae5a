"""Which attention implementation the target's language model runs its forwards with.

On CPU 'auto' is SDPA that reads grouped key / value heads in place (`GQA_SDPA`): transformers'
own SDPA path, given a mask and more than one query, copies every key / value head once per query
head it serves (`repeat_kv`) over the whole cache in every layer; torch's SDPA takes them as they
are (`enable_gqa=True`), with the same numbers bit for bit on CPU (tests/test_attention.py).
In bf16 a masked call of a few queries per row goes further: the query heads sharing a key / value
head are laid along the query axis ([B, Hkv, G * Lq, D], blocks of up to `PACKED_QUERIES`) and SDPA
runs ungrouped, exact only where the CPU's kernel gives each query of a block its numbers alone: a
one-time check per head width and group size (`packing_is_exact`) decides, else the grouped call
runs. One query, fewer than `PACKED_MIN_ROWS` rows and fp32 keep the grouped call. Timings:
docs/batching.md (`python -m recipes kernels attention`).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from transformers.integrations import sdpa_attention

from vlmspec.errors import TargetLoadError

ATTENTION_MODES = ("auto", "triton", "sdpa", "eager")
GQA_SDPA = "vlmspec_sdpa_gqa"  # the registered name of `gqa_sdpa_forward`
_UNSUPPORTED = ("position_bias", "softcap", "s_aux", "sinks")  # extras only transformers' own functions apply
PACKED_QUERIES = 32  # bf16: pack a group's query heads along the query axis up to this many queries per key / value head
PACKED_MIN_ROWS = 4  # ... from this many rows on (`python -m recipes kernels attention` times both)


def set_attention(model: torch.nn.Module, mode: str = "auto") -> str:
    """Pick the language model's attention: 'auto' (SDPA over grouped heads on CPU, transformers' SDPA
    elsewhere), 'triton' (the Triton tree kernel), 'sdpa' (transformers' own) or 'eager'. The vision
    tower keeps its own. Returns the implementation's name. 'auto' leaves the kernel out on CUDA: on
    an H200 it took 2-5x SDPA's time per call and compiles each new shape (docs/batching.md)."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {mode!r}")
    device = next(model.parameters()).device
    if mode == "triton":
        from vlmspec.kernels import tree_attention  # imports triton: only when the kernel is asked for

        if not tree_attention.kernel_available():
            raise TargetLoadError("attention 'triton' needs CUDA and Triton (or TRITON_INTERPRET=1); use 'sdpa'")
        impl = tree_attention.register()
    elif mode == "auto" and device.type == "cpu":
        impl = register_gqa_sdpa()
    else:
        impl = "eager" if mode == "eager" else "sdpa"
    has_text = "text_config" in getattr(model.config, "sub_configs", {})
    model.set_attn_implementation({"text_config": impl} if has_text else impl)
    return impl


@dataclass(frozen=True)
class RaggedRows:
    """A batch's nodes laid end to end (row 0's n_0 nodes, then row 1's, ...: T = sum n_b tokens in one
    sequence), so the forward's projections and MLPs run on the T real nodes, not on B rows padded to
    n = max n_b. Attention alone sees the rows padded, each query over its own row's cache.

    gather [B * n] long: for row b's padded position j < n, its node's index in the T (a padding
    position takes the row's first node); real [T] long: each node's index in the B * n."""

    gather: torch.Tensor
    real: torch.Tensor
    rows: int
    width: int

    @classmethod
    def of(cls, sizes: list[int], device: torch.device) -> "RaggedRows":
        n, start, gather, real = max(sizes), 0, [], []
        for b, size in enumerate(sizes):
            gather += [start + j for j in range(size)] + [start] * (n - size)
            real += [b * n + j for j in range(size)]
            start += size
        both = torch.tensor(gather + real, dtype=torch.long).to(device, non_blocking=True)
        return cls(both[: len(gather)], both[len(gather) :], len(sizes), n)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] laid end to end -> [B, n, ...] padded (padding positions: copies of the row's first)."""
        return x.index_select(0, self.gather).view(self.rows, self.width, *x.shape[1:])


RAGGED_KWARG = "vlmspec_ragged"  # the forward's keyword that carries `RaggedRows` down to `gqa_sdpa_forward`


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, Lq, D] ([1, Hq, T, D] with RaggedRows)
    key: torch.Tensor,  # [B, Hkv, Lk, D], Hq a multiple of Hkv
    value: torch.Tensor,  # [B, Hkv, Lk, Dv]
    attention_mask: torch.Tensor | None,  # [B or 1, 1 or Hq, Lq, Lk], additive or bool
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # [B, Lq, Hq, Dv] ([1, T, Hq, Dv] with RaggedRows)
    """transformers' SDPA attention function, except that a masked call on grouped heads reads the
    key / value heads in place instead of copying them per query head. Calls that differ in more
    than that (no mask: transformers passes `is_causal` or packs a lone query itself; no grouping;
    a gradient; position biases, soft caps, sinks) go to transformers' own function unchanged.
    Given `RaggedRows` (keyword `RAGGED_KWARG`), the query's nodes laid end to end are padded to
    their rows first and the output laid end to end again."""
    ragged: RaggedRows | None = kwargs.pop(RAGGED_KWARG, None)
    if ragged is not None:
        hq = query.shape[1]
        padded = ragged.pad(query[0].transpose(0, 1))  # [B, n, Hq, D]
        out, _ = gqa_sdpa_forward(module, padded.transpose(1, 2), key, value, attention_mask, dropout, scaling, **kwargs)
        return out.reshape(ragged.rows * ragged.width, hq, -1).index_select(0, ragged.real)[None], None  # [1, T, Hq, Dv]
    grouped = key.shape[1] != query.shape[1]
    extras = any(kwargs.get(name) is not None for name in _UNSUPPORTED) or kwargs.get("output_attentions", False)
    if attention_mask is None or not grouped or extras or query.device.type != "cpu" or (torch.is_grad_enabled() and query.requires_grad):
        return sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if packs(query, key, attention_mask):
        out = _packed_sdpa(query, key, value, attention_mask, dropout, scaling)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def packs(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor) -> bool:
    """Whether `gqa_sdpa_forward` lays a group's query heads along the query axis (see the module docstring)."""
    lq, groups = query.shape[2], query.shape[1] // key.shape[1]
    rows_ok = query.shape[0] >= PACKED_MIN_ROWS  # fewer rows (a request alone): the grouped call is as fast or faster
    shape_ok = query.dtype == torch.bfloat16 and rows_ok and lq > 1 and groups * lq <= PACKED_QUERIES and attention_mask.shape[1] == 1
    return shape_ok and packing_is_exact(query.shape[3], groups, torch.get_num_threads())


PROBE_ROWS = (PACKED_MIN_ROWS, 16)  # rows and cached entries `packing_is_exact` tries (either side of the
PROBE_CACHED = (30, 700)  # kernel's key-block sizes)


@functools.lru_cache(maxsize=None)
def packing_is_exact(head_dim: int, groups: int, threads: int) -> bool:
    """Whether this CPU's SDPA kernel gives the packed call (`_packed_sdpa`) the grouped call's bf16
    numbers to the bit at every query count that packs (2 .. PACKED_QUERIES / groups), over
    `PROBE_ROWS` rows of unequal lengths and `PROBE_CACHED` cached entries. A fact about this
    machine's kernels at this shape and thread count (the kernel splits its work by the threads)."""
    g = torch.Generator().manual_seed(head_dim * 131 + groups)
    lo = torch.finfo(torch.bfloat16).min
    with torch.no_grad():
        for rows, n, cached in itertools.product(PROBE_ROWS, range(2, PACKED_QUERIES // groups + 1), PROBE_CACHED):
            q = torch.randn(rows, groups * 2, n, head_dim, generator=g).to(torch.bfloat16)
            k, v = (torch.randn(rows, 2, cached + n, head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
            mask = torch.zeros(rows, 1, n, cached + n, dtype=torch.bfloat16)
            mask[..., cached:] = lo * torch.ones(n, n, dtype=torch.bfloat16).triu(1)
            for b in range(rows):
                mask[b, :, :, : 3 * b] = lo  # rows of unequal lengths
            grouped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            if not torch.equal(_packed_sdpa(q, k, v, mask, 0.0, None), grouped):
                return False
    return True


def _packed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, dropout: float,
                 scaling: float | None) -> torch.Tensor:
    """SDPA over grouped heads with each group's G query heads along the query axis: query [B, Hkv * G, Lq, D]
    -> [B, Hkv, G * Lq, D] (query head h = kv * G + g, as `repeat_kv` pairs them), mask [B or 1, 1, Lq, Lk]
    repeated for each of the G heads. Returns [B, Hq, Lq, Dv]."""
    b, hq, lq, _ = query.shape
    hkv, groups = key.shape[1], hq // key.shape[1]
    packed = query.reshape(b, hkv, groups * lq, query.shape[3])
    mask = mask[:, :, None].expand(mask.shape[0], 1, groups, lq, mask.shape[3]).reshape(mask.shape[0], 1, groups * lq, mask.shape[3])
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.view(b, hq, lq, value.shape[3])


def register_gqa_sdpa() -> str:
    """Register `gqa_sdpa_forward` (with SDPA's mask builder) for `set_attn_implementation`; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, gqa_sdpa_forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    return GQA_SDPA
