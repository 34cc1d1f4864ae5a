"""The trimmed draft vocabulary: d2t [K] maps draft token j to its target id. Choosing it from
the target's token counts, checking one, and the inverse map (t2d)."""

from __future__ import annotations

import torch


def check_draft_vocab(d2t: torch.Tensor, size: int, vocab_size: int) -> None:
    """ValueError unless d2t is `size` distinct target ids in 0..vocab_size-1."""
    if d2t.ndim != 1 or d2t.numel() != size or d2t.dtype != torch.long:
        raise ValueError(f"the draft vocabulary must be {size} long token ids, got {tuple(d2t.shape)} {d2t.dtype}")
    if size and (int(d2t.min()) < 0 or int(d2t.max()) >= vocab_size or d2t.unique().numel() != size):
        raise ValueError(f"the draft vocabulary must be distinct ids of this target's {vocab_size}-token vocabulary; "
                         "this drafter was built for another vocabulary: train one for this target with `vlmspec train`")


def draft_vocabulary(counts: torch.Tensor, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """counts [V]: how often the target wrote each token (on the training data) -> d2t [size]: the
    `always` ids (e.g. end of turn) and the most frequent others, ties by id, sorted by id."""
    assert 0 < size <= counts.numel() and len(set(always)) <= size, (size, counts.numel(), always)
    score = counts.double().clone()
    score[list(always)] = float("inf")
    order = torch.argsort(-score, stable=True)[:size]  # most frequent first, ties by id
    return order.sort().values


def t2d_map(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """d2t [K] -> t2d [V]: each target id's draft index, -1 for ids outside the draft vocabulary."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(d2t.numel())
    return t2d
