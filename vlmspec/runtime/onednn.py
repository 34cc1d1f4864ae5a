"""oneDNN's per-shape caches, bounded: a service's memory that stays flat over prompts of every length.

On CPU torch hands some matrix products to oneDNN (the drafter's `PackedLinear`, the vision
encoder's convolutions, in bf16 the target's linear layers), which builds a primitive per shape and
keeps it in two caches of 1,024 entries by default: oneDNN's own (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`)
and that of ideep, torch's wrapper around it (`LRU_CACHE_CAPACITY`). A row count is part of a shape,
and a service meets new ones with every prompt length and batch composition, so its memory grew by
hundreds of MB until both were full, while the shapes it uses over and over are far fewer
(docs/serving.md has the soak that found it, and `python -m recipes kernels onednn`).

`bound_shape_caches` sets both capacities before oneDNN's first primitive (they are read once, then),
unless the environment already sets them: the composition root calls it before it builds an engine.
"""

from __future__ import annotations

import os

import torch

from vlmspec.runtime.memory import rss_bytes

# entries per cache: above the shapes the default model uses over and over in fp32 (see above), far below
# oneDNN's 1,024. In bf16 the target's own products add theirs, and some are rebuilt: about 1% of a soak's
# time, with memory still growing there (docs/serving.md)
SHAPE_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": 256, "LRU_CACHE_CAPACITY": 128}


def bound_shape_caches(capacities: dict[str, int] | None = None) -> dict[str, str | None]:
    """Each cache's capacity (`SHAPE_CACHES` by default) into the environment where it is not set
    there already (a user's setting wins); the settings in effect. oneDNN and ideep read them at
    their first primitive, so this must run before the process's first oneDNN product."""
    for name, capacity in (SHAPE_CACHES if capacities is None else capacities).items():
        os.environ.setdefault(name, str(capacity))
    return shape_cache_settings()


def shape_cache_settings() -> dict[str, str | None]:
    """The capacities in effect, as the environment sets them (None: unset, oneDNN's default)."""
    return {name: os.environ.get(name) for name in SHAPE_CACHES}


def new_shapes_growth(row_counts: range, dtype: torch.dtype = torch.float32) -> float:
    """MiB of resident memory that the default model's drafter's five packed products (hidden 576,
    MLP 1536, a 4,096-token draft vocabulary) take on at `row_counts` rows each, once each."""
    from vlmspec.kernels.packed_linear import PackedLinear

    shapes = ((960, 576), (3072, 576), (576, 1536), (576, 576), (4096, 576))  # [N, K]: qkv, gate|up, down, o, logits
    products = [(PackedLinear(torch.randn(n, k).to(dtype)), k) for n, k in shapes]
    for product, k in products:  # the first call of each allocates what every later one reuses
        product(torch.randn(1, k).to(dtype))
    before = rss_bytes()
    for rows in row_counts:
        for product, k in products:
            product(torch.randn(rows, k).to(dtype))
    return (rss_bytes() - before) / 2**20


__all__ = ["SHAPE_CACHES", "bound_shape_caches", "new_shapes_growth", "shape_cache_settings"]
