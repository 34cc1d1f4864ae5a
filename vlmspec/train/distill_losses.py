"""The distillation losses of `vlmspec train` (see `vlmspec.train.distill`), the frozen teacher's
forward, and `DistillStep`: the loss as one module, so DistributedDataParallel can wrap it.

Every mean over trained rows is a mean over the rows of the whole step's batch, every process's
share included (`shard_mean`): DDP averages the processes' gradients, so N processes with equal
shares then compute exactly the gradient one process computes on the whole batch.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vlmspec.draft.eagle import EagleHead, draft_entropy
from vlmspec.target import Target
from vlmspec.target.model import layer_features
from vlmspec.train.distill_config import DistillConfig
from vlmspec.vision_compress.capture import capture, image_token_id, last_layer_attention


def distributed() -> bool:
    """True inside a multi-process run (torchrun) whose process group is set up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def global_count(mask: torch.Tensor) -> int:
    """The number of True entries of `mask` [...] over every process's share of the batch."""
    n = mask.sum().to(torch.float64 if mask.device.type == "cpu" else torch.float32)
    if distributed():
        dist.all_reduce(n)
    return int(n)


def shard_mean(values: torch.Tensor, count: int) -> torch.Tensor:
    """values [N] (this process's rows) -> this process's share of the mean over all `count` rows of
    every process: sum x world / count. DDP's gradient average over the processes then equals the
    gradient of the whole batch's mean; in one process it is values.mean()."""
    world = dist.get_world_size() if distributed() else 1
    return values.sum() * (world / count)


# ------------------------------------------------------------------------------------ losses
def soft_ce(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """[..., V] x [..., V] -> [...]: cross-entropy against the teacher's distribution."""
    return -(teacher_logits.float().softmax(-1) * draft_logits.float().log_softmax(-1)).sum(-1)


@dataclass
class RowBatch:
    """The head's step-1 rows for a batch (see vision_compress.adaptor). Shapes [B, T] / [B, T, H]."""

    tokens: torch.Tensor  # token that follows each row's feature
    feats: torch.Tensor
    positions: torch.Tensor
    keep: torch.Tensor  # bool
    direct: torch.Tensor | None  # bool, None = no decoupled rows
    fuse: torch.Tensor | None  # bool, None = no global feature
    fixed: torch.Tensor  # bool: image-content rows (keep their input in every unroll step)
    global_feat: torch.Tensor | None  # [B, H]
    gate_logits: torch.Tensor | None = None  # [B, C] the gate's logits (gate variants)
    gate_fracs: torch.Tensor | None = None  # [B, C] fraction of each sample's image tokens each choice keeps


def plain_rows(input_ids: torch.Tensor, feats: torch.Tensor, pad_id: int = 0) -> RowBatch:
    """The plain head's rows: (F_t, x_{t+1}) at position t."""
    B, T, _ = feats.shape
    toks = torch.cat([input_ids[:, 1:], input_ids.new_full((B, 1), pad_id)], 1)
    pos = torch.arange(T, device=feats.device).expand(B, T)
    none = torch.zeros(B, T, dtype=torch.bool, device=feats.device)
    return RowBatch(toks, feats, pos, ~none, None, None, none, None)


def visual_rows(head: EagleHead, input_ids: torch.Tensor, feats: torch.Tensor, captured: dict[str, torch.Tensor],
                force: str | None = None) -> RowBatch:
    """Rows of a VLM-aware head, sample by sample through its VisualAdaptor; `force` makes a
    gate use that choice for every sample (gated_losses)."""
    from vlmspec.draft.eagle import question_embedding

    B, T, H = feats.shape
    image_mask, embeds, attention, prompt_len = captured["image_mask"], captured["inputs_embeds"], captured["attention"], captured["prompt_len"]
    out: list = []
    for b in range(B):
        ids = torch.cat([input_ids[b], input_ids.new_zeros(1)])
        q = question_embedding(head, input_ids[b, : int(prompt_len[b])], image_mask[b, : int(prompt_len[b])])
        out.append(head.visual.prompt_rows(ids, feats[b], image_mask[b], embeds[b, image_mask[b]], attention[b], q, force))
    st = lambda name: torch.stack([getattr(r, name) for r in out])  # noqa: E731
    has_global = head.visual.cfg.global_feature
    glob = torch.stack([r.global_feat if r.global_feat is not None else feats.new_zeros(H) for r in out]) if has_global else None
    gated = head.visual.gate is not None
    fracs = [head.visual.kept_fractions(max(1, int(image_mask[b].sum()))) for b in range(B)] if gated else None
    return RowBatch(
        st("tokens"), st("feats"), st("positions"), st("keep"),
        st("direct") if head.visual.cfg.decouple else None,
        st("fuse") if has_global else None,
        st("fixed"), glob,
        torch.stack([r.gate_logits if r.gate_logits is not None else feats.new_zeros(len(head.visual.names)) for r in out]) if gated else None,
        torch.stack(fracs).to(feats.device) if gated else None,
    )


def distill_losses(
    head: EagleHead,
    rows: RowBatch,  # the head's step-1 rows
    feats: torch.Tensor,  # [B, T, H] teacher features (last hidden state; EAGLE-3: its layers, [B, T, mH])
    teacher_logits: torch.Tensor,  # [B, T, V]
    labels: torch.Tensor,  # [B, T], -100 = not trained
    cfg: DistillConfig,
    row_weights: torch.Tensor | None = None,  # [B] weight of each sample's rows (gated_losses); None = 1
) -> tuple[torch.Tensor, dict[str, float]]:
    """The unrolled distillation loss. Step j (1-based), row t stands at slot t+j-1: it reads
    (the step-(j-1) prediction of F_{t+j-1} [the teacher's F_t at step 1], token x_{t+j}) and
    predicts F_{t+j} and the teacher's next-token distribution there. Image-content rows keep
    their input in every step; dropped (compressed-away) rows are hidden from every query.
    EAGLE-3 (`head.predicts_features` False): step 1 reads the teacher's layers [mH], later steps
    the head's own outputs [H], and only the token distributions are distilled (no regression)."""
    B, T, _ = feats.shape
    total = feats.new_zeros(())
    stats: dict[str, float] = {}
    prev = rows.feats  # step 1 reads the teacher's own features (or image content)
    causal = torch.ones(T, T, dtype=torch.bool, device=feats.device).tril()
    for j in range(1, cfg.ttt_steps + 1):
        n = T - j
        if n <= 1:
            break
        sl = slice(j - 1, j - 1 + n)
        if j == 1 or not head.predicts_features:  # (EAGLE-3's plain rows: nothing is fixed, widths differ)
            assert j == 1 or not bool(rows.fixed.any()), "an EAGLE-3 head has no image-content rows"
            inp = rows.feats[:, sl] if j == 1 else prev[:, :n]  # [B, n, H | mH]
        else:
            inp = torch.where(rows.fixed[:, sl, None], rows.feats[:, sl], prev[:, :n])  # [B, n, H]
        keep = rows.keep[:, sl]
        mask = None
        if not bool(keep.all()):
            allowed = (causal[:n, :n] & keep[:, None, :]) | torch.eye(n, dtype=torch.bool, device=feats.device)
            mask = torch.zeros(B, 1, n, n, dtype=inp.dtype, device=feats.device).masked_fill(~allowed[:, None], torch.finfo(inp.dtype).min)
        h = head(
            rows.tokens[:, sl], inp, rows.positions[:, sl], mask, None,
            None if rows.direct is None else rows.direct[:, sl],
            None if rows.fuse is None else rows.fuse[:, sl],
            rows.global_feat,
        )  # [B, n, H]
        target_f = feats[:, j : j + n]  # F_{t+j}
        target_l = teacher_logits[:, j : j + n]  # p(x_{t+j+1} | ...)
        lmask = torch.zeros(B, n, dtype=torch.bool, device=feats.device)
        lmask[:, :-1] = labels[:, j + 1 : j + n] != -100  # the next token is an answer token
        lmask &= keep & ~rows.fixed[:, sl]
        count = global_count(lmask)  # the step's trained rows, every process's included
        if count == 0:
            break
        w = 1.0 if row_weights is None else row_weights[:, None].expand(B, n)[lmask]
        ce = shard_mean(soft_ce(head.logits(h[lmask]), head.draft_view(target_l[lmask])) * w, count)
        if head.predicts_features:
            fl = shard_mean(F.smooth_l1_loss(h[lmask].float(), target_f[lmask].float(), reduction="none").mean(-1) * w, count)
            total = total + (cfg.w_ce * ce + cfg.w_feat * fl) / cfg.ttt_steps
            stats[f"feat{j}"] = float(fl.detach())
        else:
            total = total + cfg.w_ce * ce / cfg.ttt_steps
        with torch.no_grad():
            acc = (head.target_ids(head.logits(h[lmask]).argmax(-1)) == target_l[lmask].argmax(-1)).float().mean()
        stats.update({f"ce{j}": float(ce.detach()), f"acc{j}": float(acc)})
        if head.accept is not None:
            bce, calib = acceptance_loss(head, h[lmask].detach(), target_l[lmask], cfg, count)
            total = total + cfg.w_accept * bce / cfg.ttt_steps
            stats.update({f"accept_bce{j}": float(bce.detach()), f"accept_rate{j}": calib})
        prev = h
    return total, stats


def gated_losses(
    head: EagleHead,
    input_ids: torch.Tensor,  # [B, T]
    feats: torch.Tensor,  # [B, T, H] teacher features
    captured: dict[str, torch.Tensor],  # teacher(visual=True)
    teacher_logits: torch.Tensor,  # [B, T, V]
    labels: torch.Tensor,  # [B, T]
    cfg: DistillConfig,
    gate_cost: float,
    tau: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A gate's training loss (Gumbel-softmax relaxation of the per-input choice). Every choice c
    gives its rows and its distillation loss; y = gumbel_softmax(gate logits) [B, C] weighs
    sample b's rows under choice c by y[b, c]. The gate's gradient moves its mass toward the
    choices with the lower loss for that question, and every compressor keeps learning in
    proportion to how often it would be picked. + gate_cost x the expected kept fraction."""
    total = feats.new_zeros(())
    stats: dict[str, float] = {}
    y = probs = fracs = None
    for c, name in enumerate(head.visual.names):
        rows = visual_rows(head, input_ids, feats, captured, force=name)
        assert rows.gate_logits is not None and rows.gate_fracs is not None
        if y is None:
            y = F.gumbel_softmax(rows.gate_logits, tau=tau, hard=False)  # [B, C]
            probs, fracs = rows.gate_logits.softmax(-1), rows.gate_fracs
        loss_c, st = distill_losses(head, rows, feats, teacher_logits, labels, cfg, row_weights=y[:, c])
        total = total + loss_c
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + v / len(head.visual.names)
    assert probs is not None and fracs is not None
    kept = (probs * fracs).sum(-1).mean()
    if gate_cost > 0:
        total = total + gate_cost * kept
    stats["gate_kept"] = float(kept.detach())
    stats["gate_entropy"] = float(-(probs * probs.clamp_min(1e-9).log()).sum(-1).mean().detach())
    return total, stats


@torch.no_grad()
def teacher(target: Target, batch: dict[str, torch.Tensor], visual: bool = False,
            layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Frozen target forward: (features [B, T, H], or [B, T, mH] of `layers` (EAGLE-3,
    `layer_features`), logits [B, T, V], captured). With visual=True,
    captured holds image_mask [B, T], inputs_embeds [B, T, H], prompt_len [B] and attention
    [B, T] (last layer, from each sample's last prompt token)."""
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    # (M-RoPE targets compute their 3-axis positions from mm_token_type_ids inside this forward)
    with capture(target.model) if visual else nullcontext() as cap:
        out = target.model(**kwargs, output_hidden_states=True, return_dict=True)
    captured: dict[str, torch.Tensor] = {}
    if visual:
        ids = batch["input_ids"]
        answer = batch["labels"] != -100
        prompt_len = torch.where(answer.any(1), answer.float().argmax(1), torch.full_like(ids[:, 0], ids.shape[1]))
        captured = {
            "image_mask": ids == image_token_id(target.model),
            "inputs_embeds": cap.inputs_embeds,
            "prompt_len": prompt_len,
            "attention": last_layer_attention(target.model, cap, (prompt_len - 1).clamp(min=0)),
        }
    return layer_features(out.hidden_states, layers), out.logits, captured



def acceptance_loss(head: EagleHead, hidden: torch.Tensor, teacher_logits: torch.Tensor, cfg: DistillConfig,
                    count: int | None = None) -> tuple[torch.Tensor, float]:
    """SpecDec++'s loss. hidden [N, H] (detached head outputs), teacher_logits [N, V] -> (weighted
    BCE of the acceptance head on whether each of the top-k draft children is the teacher's argmax,
    the fraction of children that are). The head's own weights get no gradient from it. `count`:
    the rows of the whole step's batch (`shard_mean`; None: these N)."""
    with torch.no_grad():
        logp = torch.log_softmax(head.logits(hidden), -1)  # [N, V']
        top = logp.topk(min(cfg.accept_top_k, logp.shape[-1]), dim=-1)  # [N, k]
        accepted = (head.target_ids(top.indices) == teacher_logits.argmax(-1, keepdim=True)).float()  # [N, k]
        weight = torch.where(accepted > 0, 1.0, cfg.accept_rej_weight)
    logits = head.accept(hidden, top.values, draft_entropy(logp))  # [N, k]
    bce = F.binary_cross_entropy_with_logits(logits, accepted, weight=weight, reduction="none").mean(-1)  # [N]
    return shard_mean(bce, len(bce) if count is None else count), float(accepted.mean())


def mixed_precision(target: Target):
    """The head keeps float32 weights; with a bf16 / fp16 target it computes in the target's dtype
    (autocast), as it will at inference."""
    if target.dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(target.device.type, dtype=target.dtype)
    return nullcontext()



class DistillStep(torch.nn.Module):
    """One step's loss as a module around the head, so that DistributedDataParallel can wrap it
    (its gradient hooks see every use of the head's weights in the unrolled steps)."""

    def __init__(self, head: EagleHead, cfg: DistillConfig, gate_cost: float = 0.0) -> None:
        super().__init__()
        self.head, self.cfg, self.gate_cost = head, cfg, gate_cost

    def forward(self, input_ids: torch.Tensor, feats: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                captured: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """input_ids / labels [B, T], the teacher's feats [B, T, H] (float32) and logits [B, T, V],
        `teacher(visual=True)`'s captured tensors ({} for the plain head) -> (loss, stats).
        An EAGLE-3 head's feats are the teacher's layers, [B, T, mH]."""
        head = self.head
        if head.visual is None:
            return distill_losses(head, plain_rows(input_ids, feats), feats, logits, labels, self.cfg)
        captured = {**captured, "inputs_embeds": captured["inputs_embeds"].float()}
        if head.visual.gate is not None:
            return gated_losses(head, input_ids, feats, captured, logits, labels, self.cfg, self.gate_cost)
        return distill_losses(head, visual_rows(head, input_ids, feats, captured), feats, logits, labels, self.cfg)
