"""Tree attention as a Triton kernel, and a Hugging Face attention function that uses it.

Verifying a draft tree of N tokens: N queries attend over [P cached prefix tokens + the N tree
tokens], each seeing the whole prefix and, inside the tree, its ancestors and itself. SDPA would
need a dense [N, P + N] mask (torch's slower masked kernels); here the prefix needs no mask and the
tree is a bit-packed [N, ceil(N / 32)] int32 matrix (bit j of row i: query i may see tree key j).

* ``tree_attention(q, k, v, tree_mask, prefix_len, scale)``: q [B, Hq, N, D], k / v [B, Hkv, P + N, D] (Hq a multiple
  of Hkv) -> [B, Hq, N, D]; per-row prefixes (``prefix_len`` [B]) and trees (``tree_mask`` [B, N, W]).
  ``tree_attention_reference``: the same in plain PyTorch, for tests; ``pack_tree_mask``: [N, N] bool -> bits.
* ``register(name)`` (``triton_tree_attention_forward``): a transformers attention function that runs
  the kernel when the 4D mask is "full prefix + tree" (``describe_mask``, or found so by analysis: one
  host sync), SDPA otherwise. CUDA tensors, or any under ``TRITON_INTERPRET=1`` (read at first call).
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Any

import torch

try:  # triton ships with CUDA builds of torch; keep the module importable without it
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except (ImportError, RuntimeError):  # pragma: no cover - no triton, or a broken install
    triton = None
    tl = None
    _HAS_TRITON = False

__all__ = [
    "describe_mask",
    "kernel_available",
    "pack_tree_mask",
    "register",
    "tree_attention",
    "tree_attention_reference",
    "triton_tree_attention_forward",
]

DEFAULT_NAME = "vlmspec_tree"
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Availability
# ---------------------------------------------------------------------------------------------


def _interpret_mode() -> bool:
    if not _HAS_TRITON:
        return False
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # older triton: the plain environment variable
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_available() -> bool:
    """True when the kernel can run here: triton importable and CUDA present (or the interpreter on)."""
    if not _HAS_TRITON:
        return False
    return _interpret_mode() or torch.cuda.is_available()


def _can_run_on(t: torch.Tensor) -> bool:
    if not _HAS_TRITON:
        return False
    if _interpret_mode():
        return True
    return t.is_cuda


# ---------------------------------------------------------------------------------------------
# Mask packing and the reference
# ---------------------------------------------------------------------------------------------


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """[N, M] bool (True = visible) -> [N, ceil(M / 32)] int32, bit j % 32 of word j // 32 = mask[:, j]."""
    if mask.ndim != 2:
        raise ValueError(f"pack_tree_mask expects a 2D [N, M] mask, got shape {tuple(mask.shape)}")
    n, m = mask.shape
    words = max(1, (m + 31) // 32)
    padded = torch.zeros(n, words * 32, dtype=torch.int64, device=mask.device)
    padded[:, :m] = mask.to(torch.bool).to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=mask.device), torch.arange(32, device=mask.device))
    packed = (padded.view(n, words, 32) * weights).sum(-1)  # < 2**32, exact in int64
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # two's complement into int32 range
    return packed.to(torch.int32).contiguous()


def unpack_tree_mask(bits: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of pack_tree_mask: [..., N, W] int32 -> [..., N, m] bool."""
    b = bits.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(32, device=bits.device)
    unpacked = (b[..., None] >> shifts) & 1  # [..., N, W, 32]
    return unpacked.reshape(*bits.shape[:-1], -1)[..., :m].to(torch.bool)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def tree_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tree_mask: torch.Tensor,
    prefix_len: int | torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Naive tree attention: GQA expanded, a dense per-row [N, K] mask, softmax in fp32. Returns q's
    dtype. Shapes as `tree_attention` (per-row prefix lengths and trees included)."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    assert hq % hkv == 0, "Hq must be a multiple of Hkv"
    lengths = [int(x) for x in torch.as_tensor(prefix_len).reshape(-1).expand(b)]
    assert k.shape[2] >= max(lengths) + n, f"k has {k.shape[2]} positions, fewer than P + N = {max(lengths) + n}"
    if tree_mask.dtype != torch.bool:
        tree_mask = unpack_tree_mask(tree_mask, n)
    trees = tree_mask.reshape(-1, n, n).expand(b, n, n).to(q.device)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = []
    for row, p in enumerate(lengths):  # row b reads its own P_b + N keys only
        kf = _repeat_kv(k[row : row + 1, :, : p + n].float(), hq // hkv)
        vf = _repeat_kv(v[row : row + 1, :, : p + n].float(), hq // hkv)
        allowed = torch.cat([torch.ones(n, p, dtype=torch.bool, device=q.device), trees[row]], dim=1)
        scores = torch.matmul(q[row : row + 1].float(), kf.transpose(-1, -2)) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out.append(torch.matmul(probs, vf))
    return torch.cat(out).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Kernels (plain functions, jit-decorated lazily so TRITON_INTERPRET is read at first use)
# ---------------------------------------------------------------------------------------------


def _tree_attn_fwd(
    Q, K, V, Bits, Lens, O, Opart, Lse,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_bits_b, N, G, HKV, HQ, N_WORDS, KEYS_PER_SPLIT, NUM_SPLITS,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Grid: (row blocks, B * Hkv, splits). The rows of a block are (query head in the GQA group,
    # tree query) pairs flattened as g * N + i, so the g query heads sharing a KV head read it once.
    # Batch row b has its own prefix length P = Lens[b] (its tree keys at P .. P + N - 1, any keys
    # after them unread) and its own tree bits (stride_bits_b = 0: one tree for every row).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    P = tl.load(Lens + b)
    Bits = Bits + b * stride_bits_b

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * N
    qi = rows % N
    hq = kvh * G + rows // N
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    q_ptrs = Q + b * stride_qb + hq[:, None] * stride_qh + qi[:, None] * stride_qn + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if IEEE:  # fp32 inputs (or bf16 under the interpreter, whose bf16 dot is broken): fp32 dots
        q = q.to(tl.float32)

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    kv_len = P + N
    lo = pid_s * KEYS_PER_SPLIT
    hi = tl.minimum(lo + KEYS_PER_SPLIT, kv_len)
    p_full = (P // BLOCK_N) * BLOCK_N  # keys below this are whole prefix blocks: no mask at all

    # 1) whole prefix blocks
    for start in range(lo, tl.minimum(hi, p_full), BLOCK_N):
        cols = start + offs_n
        k = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd)  # [D, BLOCK_N]
        if IEEE:
            k = k.to(tl.float32)
            qk = tl.dot(q, k, input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        qk = qk * qk_scale
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd)  # [BLOCK_N, D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # 2) the tail: the last partial prefix block and the tree keys, masked by the bits
    for start in range(tl.maximum(lo, p_full), hi, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < kv_len
        tj = cols - P
        in_tree = (tj >= 0) & col_ok
        tjc = tl.maximum(tj, 0)
        words = tl.load(
            Bits + qi[:, None] * N_WORDS + (tjc // 32)[None, :],
            mask=row_ok[:, None] & in_tree[None, :],
            other=0,
        )
        bit = (words >> (tjc % 32)[None, :]) & 1
        visible = ((cols < P)[None, :] | (in_tree[None, :] & (bit != 0))) & row_ok[:, None]
        k = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd, mask=col_ok[None, :], other=0.0)
        if IEEE:
            k = k.to(tl.float32)
            qk = tl.dot(q, k, input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=col_ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if SPLIT:
        # partial results in fp32: Opart [B, Hq, S, N, D], Lse [B, Hq, S, N] (log2 domain)
        row_id = (b * HQ + hq) * NUM_SPLITS + pid_s
        op_ptrs = Opart + (row_id[:, None] * N + qi[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(op_ptrs, out, mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(Lse + row_id * N + qi, lse, mask=row_ok)
    else:
        o_ptrs = O + b * stride_ob + hq[:, None] * stride_oh + qi[:, None] * stride_on + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])


def _tree_attn_combine(
    Opart, Lse, O,
    stride_ob, stride_oh, stride_on, stride_od,
    HQ, N, NUM_SPLITS,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # One program per (b, hq, query): merge the NUM_SPLITS partial softmaxes.
    pid = tl.program_id(0)
    qi = pid % N
    bh = pid // N
    b = bh // HQ
    h = bh % HQ
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < NUM_SPLITS
    row_id = bh * NUM_SPLITS + offs_s
    lse = tl.load(Lse + row_id * N + qi, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)
    parts = tl.load(Opart + (row_id[:, None] * N + qi) * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(O + b * stride_ob + h * stride_oh + qi * stride_on + offs_d * stride_od, out.to(O.dtype.element_ty))


_JITTED: dict[bool, tuple[Any, Any]] = {}


def _kernels() -> tuple[Any, Any]:
    if not _HAS_TRITON:
        raise RuntimeError("triton is not installed")
    mode = _interpret_mode()
    if mode not in _JITTED:
        _JITTED[mode] = (triton.jit(_tree_attn_fwd), triton.jit(_tree_attn_combine))
    return _JITTED[mode]


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _pick_splits(programs: int, kv_blocks: int, device: torch.device) -> int:
    """Split the keys (flash-decoding style) when the (row block, batch, KV head) grid under-fills the GPU."""
    sms = _sm_count(device)
    if sms == 0 or programs >= sms:
        return 1
    want = -(-2 * sms // programs)
    return max(1, min(want, -(-kv_blocks // 4), 64))  # at least ~4 key blocks per split


def supported_head_dim(d: int) -> bool:
    return 16 <= d <= 256 and (d & (d - 1)) == 0


def _config(dtype: torch.dtype, d: int, rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head dim d and g * N query rows.

    Sized to stay under ~100 KB of shared memory (consumer GPUs), checked by compiling for sm_80/86/90.
    """
    block_m = min(64, max(16, _next_pow2(rows)))
    if dtype == torch.float32:
        block_n = 32 if d >= 128 else 64
        if d >= 256:
            block_m = 16
        num_stages = 2
    else:
        block_n = 64 if d <= 128 else 32
        num_stages = 2 if d >= 256 else 3
    num_warps = 8 if (d >= 128 and block_m >= 64) else 4
    return block_m, block_n, num_warps, num_stages


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bits: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None = None,
) -> torch.Tensor:
    """bits: [N, W] (every row's tree) or [B, N, W] int32, contiguous; lengths: [B] int32, each row's
    prefix length (P_b + N <= K, the keys' length); out: a [B, Hq, N, D] tensor (any strides, e.g. a
    transposed [B, N, Hq, D] buffer). Nothing here reads the device: no host sync."""
    fwd, combine = _kernels()
    bsz, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kv_len = k.shape[2]  # the longest row's P_b + N at most: the key range the splits cover
    block_m, block_n, num_warps, num_stages = _config(q.dtype, d, g * n)
    m_blocks = -(-(g * n) // block_m)
    kv_blocks = -(-kv_len // block_n)
    splits = num_splits if num_splits is not None else _pick_splits(m_blocks * bsz * hkv, kv_blocks, q.device)
    splits = max(1, min(int(splits), kv_blocks))
    keys_per_split = -(-kv_blocks // splits) * block_n
    splits = -(-kv_len // keys_per_split)
    ieee = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpret_mode())
    if splits > 1:
        opart = torch.empty(bsz, hq, splits, n, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(bsz, hq, splits, n, dtype=torch.float32, device=q.device)
    else:
        opart = lse = out  # unused
    grid = (m_blocks, bsz * hkv, splits)
    fwd[grid](
        q, k, v, bits, lengths, out, opart, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        bits.stride(0) if bits.ndim == 3 else 0, n, g, hkv, hq, bits.shape[-1], keys_per_split, splits,
        float(scale) * _LOG2E,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=splits > 1, IEEE=ieee,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        combine[(bsz * hq * n,)](
            opart, lse, out, *out.stride(), hq, n, splits,
            HEAD_DIM=d, BLOCK_S=max(2, _next_pow2(splits)), num_warps=4 if d >= 128 else 2,
        )
    return out


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be [B, H, L, D]")
    bsz, hq, n, d = q.shape
    if k.shape != v.shape or k.shape[0] != bsz or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if hq % k.shape[1] != 0:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={k.shape[1]}")
    if len(lengths) != bsz or min(lengths) < 0:
        raise ValueError(f"prefix lengths {lengths}: one per batch row ({bsz}), none negative")
    if k.shape[2] < max(lengths) + n:
        raise ValueError(f"k has {k.shape[2]} positions, fewer than the longest prefix + N = {max(lengths) + n}")
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"unsupported dtypes {q.dtype}/{k.dtype}/{v.dtype}: fp16, bf16 or fp32, all alike")
    if not supported_head_dim(d):
        raise ValueError(f"head dim {d} unsupported: a power of two in [16, 256]")


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tree_mask: torch.Tensor,
    prefix_len: int | torch.Tensor,
    scale: float | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Tree attention with the Triton kernel.

    q [B, Hq, N, D]; k, v [B, Hkv, K, D] with K >= P_b + N for every row; prefix_len: one P for every
    row (then K = P + N) or a [B] tensor of per-row P_b (row b's tree keys at P_b .. P_b + N - 1);
    tree_mask: [N, N] or [B, N, N] bool (True = visible), or the packed int32 [N, ceil(N / 32)] /
    [B, N, ceil(N / 32)] bits from pack_tree_mask. Returns [B, Hq, N, D] in q's dtype.
    num_splits: split the keys over that many programs per row block (None: pick from the SM count).
    """
    bsz, n = q.shape[0], q.shape[2]
    lengths = [int(x) for x in torch.as_tensor(prefix_len).reshape(-1).expand(bsz)]
    _check_inputs(q, k, v, lengths)
    if isinstance(prefix_len, int) and k.shape[2] != prefix_len + n:
        raise ValueError(f"k has {k.shape[2]} positions, expected prefix_len + N = {prefix_len + n}")
    if not _can_run_on(q):
        raise RuntimeError("the tree attention kernel needs CUDA tensors (or TRITON_INTERPRET=1)")
    if tree_mask.dtype == torch.bool:
        bits = torch.stack([pack_tree_mask(m) for m in tree_mask.to(q.device).reshape(-1, n, tree_mask.shape[-1])])
    else:
        bits = tree_mask.to(device=q.device, dtype=torch.int32).reshape(-1, *tree_mask.shape[-2:]).contiguous()
    if bits.shape[0] not in (1, bsz) or bits.shape[1] != n or bits.shape[2] < (n + 31) // 32:
        raise ValueError(f"tree mask bits {tuple(bits.shape)} do not fit B={bsz}, N={n}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    return _launch(q, k, v, bits if bits.shape[0] == bsz else bits[0], lens, scale, out, num_splits)


# ---------------------------------------------------------------------------------------------
# The transformers attention function
# ---------------------------------------------------------------------------------------------

# How often the HF function ran the kernel / fell back to SDPA / analysed a new mask (for tests and
# for checking that a model really goes through the kernel). reset_stats() zeroes them.
STATS = {"kernel": 0, "fallback": 0, "mask_analyses": 0}


def reset_stats() -> None:
    for key in STATS:
        STATS[key] = 0


# (weakref to the mask's base tensor, storage offset, shape, strides, version) -> what the kernel
# reads for it: (packed bits [N, W] or [B, N, W], per-row prefix lengths [B] int32 or None: every
# row's prefix is K - N), or None when the mask is not 'full prefix + tree'
_MASK_CACHE: list[tuple[Any, tuple, Any]] = []
_MASK_CACHE_SIZE = 8


def _mask_key(mask: torch.Tensor) -> tuple[Any, tuple]:
    base = mask._base if mask._base is not None else mask
    sig = (mask.storage_offset(), tuple(mask.shape), tuple(mask.stride()), mask.dtype, mask.device, mask._version)
    return base, sig


def _analyse_mask(mask: torch.Tensor, n: int) -> tuple[torch.Tensor, None] | None:
    """A [.., .., N, P + N] HF mask -> (packed tree bits, None), or None if it is not 'full prefix +
    tree'. Reads the device (one host sync), and needs every batch slice alike: a mask's maker that
    knows its rows says what it holds with `describe_mask` instead."""
    m2 = mask[0, 0]
    if mask.dtype == torch.bool:
        visible = m2
        clean = None
    else:
        visible = m2 == 0
        hidden = m2 <= torch.finfo(m2.dtype).min / 2  # 'min' or -inf
        clean = (visible | hidden).all()
    p = m2.shape[1] - n
    checks = [visible[:, :p].all() if p > 0 else torch.ones((), dtype=torch.bool, device=mask.device)]
    if clean is not None:
        checks.append(clean)
    # mask broadcast over batch / heads with size > 1: every slice must be the same
    if mask.shape[0] > 1 or mask.shape[1] > 1:
        checks.append((mask == m2).all())
    if not bool(torch.stack(checks).all().item()):
        return None
    return pack_tree_mask(visible[:, p:]), None


def _remember(mask: torch.Tensor, entry: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
    base, sig = _mask_key(mask)
    _MASK_CACHE.insert(0, (weakref.ref(base), sig, entry))
    del _MASK_CACHE[_MASK_CACHE_SIZE:]


def describe_mask(mask: torch.Tensor, bits: torch.Tensor, lengths: torch.Tensor) -> None:
    """Say what a [B, 1, N, K] 4D mask holds, so the kernel reads it without analysing it: row b sees
    its first lengths[b] keys and, among its tree's N keys at lengths[b] .. lengths[b] + N - 1, those
    of bits[b] (packed [B, N, ceil(N / 32)] int32, `pack_tree_mask` per row); nothing after. bits and
    lengths ([B] int32) on the mask's device. The maker vouches for it (the kernel does not check);
    an in-place edit of the mask afterwards voids the description (the mask is analysed again)."""
    assert bits.ndim == 3 and lengths.shape == (bits.shape[0],), (tuple(bits.shape), tuple(lengths.shape))
    _remember(mask, (bits.to(torch.int32).contiguous(), lengths.to(torch.int32)))


def _tree_bits_for(mask: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    base, sig = _mask_key(mask)
    for ref, s, entry in _MASK_CACHE:
        if s == sig and ref() is base:
            return entry
    entry = _analyse_mask(mask, n)
    STATS["mask_analyses"] += 1
    _remember(mask, entry)
    return entry


def clear_mask_cache() -> None:
    _MASK_CACHE.clear()


def _kernel_applies(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, dropout: float, kwargs: dict) -> bool:
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4:
        return False
    if not _can_run_on(query):
        return False
    if dropout and getattr(module, "training", False):
        return False
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return False
    if kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return False
    if kwargs.get("output_attentions", False):
        return False
    bsz, hq, n, d = query.shape
    if key.shape[2] < n or key.shape != value.shape or hq % key.shape[1] != 0:
        return False
    if query.dtype not in _SUPPORTED_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if not supported_head_dim(d):
        return False
    if mask.shape[-2] != n or mask.shape[-1] != key.shape[2]:
        return False
    if mask.shape[0] not in (1, bsz) or mask.shape[1] not in (1, hq):
        return False
    return mask.device == query.device


def triton_tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: the tree kernel for 'full prefix + tree' 4D masks, SDPA otherwise.

    query [B, Hq, Lq, D], key / value [B, Hkv, Lk, D]; returns ([B, Lq, Hq, D], None) like sdpa.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _kernel_applies(module, query, key, value, attention_mask, dropout, kwargs):
        n = query.shape[2]
        entry = _tree_bits_for(attention_mask, n)
        if entry is not None:
            bits, lengths = entry
            bsz, hq, _, d = query.shape
            if lengths is None:  # an analysed mask: every row's prefix is all keys but the tree's
                lengths = torch.full((bsz,), key.shape[2] - n, dtype=torch.int32, device=query.device)
            out = torch.empty(bsz, n, hq, d, dtype=query.dtype, device=query.device)
            scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
            _launch(query, key, value, bits, lengths, scale, out.transpose(1, 2))
            STATS["kernel"] += 1
            return out, None
    STATS["fallback"] += 1
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register(name: str = DEFAULT_NAME) -> str:
    """Register the attention function (and SDPA's mask builder) under `name`; returns `name`.

    Afterwards ``from_pretrained(..., attn_implementation=name)``, ``model.set_attn_implementation(name)``
    use it with the stock modelling code.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, triton_tree_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
