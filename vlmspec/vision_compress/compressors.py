"""Elastic visual compressors (SpecVLM): one image's projected embeddings [n, H] -> [m, H].

Every compressor returns (embeds [m, H], anchors [m]): `anchors` are indices into the n input
tokens whose positions the outputs take (their own for pruning, the first token of each window
for pooling / convolution, evenly spaced tokens for the resampler). Positions are then
`positions[..., anchors]`, so 1-D ([n]) and M-RoPE ([3, n]) positions are handled alike and
stay increasing. m = ceil(n / ratio) for the pruners and the resampler; the window compressors
use an s x s window (s = round(sqrt(ratio))) over the token grid, ceil-padded at the edges.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FIXED = ("uniform", "attention", "pool", "conv", "resampler", "text_only")


def token_grid(n: int) -> tuple[int, int]:
    """The token grid of one image: square when n is a square, else one row."""
    r = math.isqrt(n)
    return (r, r) if r * r == n else (1, n)


def keep_count(n: int, ratio: float) -> int:
    return 0 if n == 0 else max(1, math.ceil(n / ratio))


def uniform_anchors(n: int, m: int, device: torch.device | None = None) -> torch.Tensor:
    """m evenly spaced indices in [0, n), centred in their strides, strictly increasing."""
    if m == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    return ((torch.arange(m, device=device) + 0.5) * n / m).long().clamp(max=n - 1)


def _window(ratio: float) -> int:
    return max(1, round(math.sqrt(ratio)))


def window_anchors(grid: tuple[int, int], s: int, device: torch.device | None = None) -> torch.Tensor:
    """Index (into the row-major grid) of the first token of each s x s window."""
    gh, gw = grid
    rows = torch.arange(0, gh, s, device=device)
    cols = torch.arange(0, gw, s if gh > 1 else s * s, device=device)
    return (rows[:, None] * gw + cols[None]).flatten()


def _grid_view(x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    gh, gw = grid
    return x.T.reshape(1, x.shape[1], gh, gw)  # [1, H, gh, gw]


class Compressor(nn.Module):
    def forward(self, x: torch.Tensor, ratio: float, attention: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, H]; attention [n] (the target's attention to these tokens) -> ([m, H], [m])."""
        raise NotImplementedError


class UniformPrune(Compressor):
    def forward(self, x, ratio, attention=None):
        idx = uniform_anchors(x.shape[0], keep_count(x.shape[0], ratio), x.device)
        return x[idx], idx


class AttentionPrune(Compressor):
    """Keep the tokens the target attended to most (FastV-style), in their original order."""

    def forward(self, x, ratio, attention=None):
        if attention is None:
            raise ValueError("attention pruning needs the target's attention to the image tokens")
        m = keep_count(x.shape[0], ratio)
        idx = attention.topk(m).indices.sort().values
        return x[idx], idx


class Pool(Compressor):
    """2-D average pooling over the token grid (s x s windows; 1-D windows of s*s for a row)."""

    def forward(self, x, ratio, attention=None):
        grid, s = token_grid(x.shape[0]), _window(ratio)
        kernel = (s, s) if grid[0] > 1 else (1, s * s)
        y = F.avg_pool2d(_grid_view(x, grid), kernel, ceil_mode=True)
        return y.flatten(2)[0].T, window_anchors(grid, s, x.device)


class StridedConv(Compressor):
    """Depthwise s x s convolution with stride s, then a pointwise linear; starts as pooling."""

    def __init__(self, hidden: int, ratio: float) -> None:
        super().__init__()
        self.s = _window(ratio)
        self.depthwise = nn.Parameter(torch.full((hidden, 1, self.s, self.s), 1.0 / self.s**2))
        self.pointwise = nn.Linear(hidden, hidden, bias=False)
        nn.init.eye_(self.pointwise.weight)

    def forward(self, x, ratio, attention=None):
        grid, s = token_grid(x.shape[0]), self.s
        v = _grid_view(x, grid)
        w = self.depthwise
        if grid[0] == 1:  # one row of tokens: the same weights read as a 1 x s*s window
            w = w.reshape(w.shape[0], 1, 1, s * s)
        kh, kw = w.shape[-2:]
        pad_h, pad_w = (-grid[0]) % kh if grid[0] > 1 else 0, (-grid[1]) % kw
        # replicate-pad the ragged edge so a partial window sees its own tokens, not zeros
        v = F.pad(v, (0, pad_w, 0, pad_h), mode="replicate") if pad_h or pad_w else v
        y = F.conv2d(v, w.to(x.dtype), stride=(kh, kw), groups=x.shape[1])
        return self.pointwise(y.flatten(2)[0].T), window_anchors(grid, s, x.device)


def cross_attention(q: torch.Tensor, x: torch.Tensor, attn: nn.MultiheadAttention) -> torch.Tensor:
    """`attn(q, x, x)` for one sequence: q [m, H], x [n, H] -> [m, H], computed without
    projecting the n tokens when that is cheaper.

    Per head h (width d), scores = (q Wq_h + bq_h)(x Wk_h + bk_h)^T = ((q Wq_h + bq_h) Wk_h) x^T + c,
    with c constant along each query's row, which softmax ignores; and P (x Wv_h + bv_h) =
    (P x) Wv_h + bv_h since P's rows sum to 1. Folding Wk into the queries and Wv after the
    weighting costs 2 * heads * m * n * H multiply-adds instead of 2 * n * H^2 + 2 * m * n * H
    for the key / value projections: cheaper when m * (heads - 1) < H, e.g. the global feature's
    single query, or 36 queries over 576 tokens at H >= 144. Same function either way."""
    m, hidden = q.shape
    heads = attn.num_heads
    if m * (heads - 1) >= hidden or attn.in_proj_weight is None or attn.bias_k is not None or (attn.training and attn.dropout > 0):
        return attn(q[None], x[None], x[None], need_weights=False)[0][0]
    d = hidden // heads
    wq, wk, wv = attn.in_proj_weight.to(x.dtype).chunk(3)  # [H, H] each; head h = rows h*d:(h+1)*d
    bq, _, bv = (attn.in_proj_bias.to(x.dtype).chunk(3) if attn.in_proj_bias is not None else (None, None, None))
    qh = F.linear(q, wq, bq).view(m, heads, d).transpose(0, 1)  # [heads, m, d]
    a = qh @ wk.view(heads, d, hidden) * d**-0.5  # [heads, m, H]: the queries in x's space
    p = torch.softmax(a @ x.T, dim=-1)  # [heads, m, n]
    px = p @ x  # [heads, m, H]
    out = (px @ wv.view(heads, d, hidden).transpose(1, 2)).transpose(0, 1).reshape(m, hidden)  # [m, H]
    if bv is not None:
        out = out + bv
    return attn.out_proj(out)


class Resampler(Compressor):
    """k learnable queries, one cross-attention layer over the image tokens (k = ceil(n/ratio))."""

    def __init__(self, hidden: int, max_queries: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(max_queries, hidden) * hidden**-0.5)
        self.norm = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads if hidden % heads == 0 else 1, batch_first=True)

    def forward(self, x, ratio, attention=None):
        n = x.shape[0]
        m = keep_count(n, ratio)
        if m > self.queries.shape[0]:
            raise ValueError(f"the resampler has {self.queries.shape[0]} queries and this image of {n} tokens needs {m} at "
                             f"{ratio:g}x: use a drafter trained at this image size (`vlmspec train` sizes the resampler "
                             "from the target's image tokens) or a higher ratio")
        anchors = uniform_anchors(n, m, x.device)
        q = self.queries[:m].to(x.dtype) + x[anchors]  # [m, H]: each query starts at its anchor's token
        return cross_attention(q, self.norm(x), self.attn) + x[anchors], anchors


class TextOnly(Compressor):
    def forward(self, x, ratio, attention=None):
        return x[:0], torch.zeros(0, dtype=torch.long, device=x.device)


def kept_tokens(name: str, n: int, ratio: float) -> int:
    """How many of an image's n tokens compressor `name` keeps at `ratio`."""
    if name == "text_only" or n == 0:
        return 0
    if name in ("pool", "conv"):
        return int(window_anchors(token_grid(n), _window(ratio)).numel())
    return keep_count(n, ratio)


def build(name: str, hidden: int, ratio: float, max_queries: int = 64) -> Compressor:
    if name == "uniform":
        return UniformPrune()
    if name == "attention":
        return AttentionPrune()
    if name == "pool":
        return Pool()
    if name == "conv":
        return StridedConv(hidden, ratio)
    if name == "resampler":
        return Resampler(hidden, max_queries)
    if name == "text_only":
        return TextOnly()
    raise ValueError(f"unknown compressor {name!r}; expected one of {FIXED}")


class Gate(nn.Module):
    """Picks one compressor per input from the question: a linear map of the mean embedding of
    the prompt's text tokens -> logits over the choices. Inference: argmax. Training
    (vlmspec.train.distill.gated_losses): every choice's distillation loss is computed and
    weighted by a Gumbel-softmax sample of these logits, so the gradient moves the gate's mass
    toward the choices with the lower loss for that kind of question."""

    def __init__(self, hidden: int, n_choices: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, n_choices)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, question: torch.Tensor) -> torch.Tensor:
        """question [..., H] (any float dtype) -> logits [..., C] float32, in the weights' dtype inside."""
        return self.proj(question.to(self.proj.weight.dtype)).float()
