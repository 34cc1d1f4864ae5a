"""The head module: `EagleHead` (its training `forward`, the HF decoder layer as it is, and its
packed `decode`, the same layer in fewer ops over weights packed once), `Eagle3Head` (EAGLE-3's
head on the same machinery), SpecDec++'s `AcceptanceHead`, and the helpers they share.
`build_head` makes the one a config's `arch` names."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from vlmspec.kernels.packed_linear import PackedLinear
from vlmspec.cache.kv_cache import cache_kwarg
from vlmspec.vision_compress import VisualAdaptor
from vlmspec.draft.eagle.config import EagleConfig
from vlmspec.draft.eagle.vocab import check_draft_vocab

_ROPE_TABLE_MAX = 1 << 17  # positions: EagleHead.decode reads its rotary angles from a table up to this context


class AcceptanceHead(nn.Module):
    """SpecDec++'s acceptance predictor: a node's head output and the draft log-probs of its top-k
    children -> for each child, the logit of P(the target accepts it | the node was accepted).
    Per child it reads the node's state (projected), the child's log-prob, the best child's and the
    draft distribution's entropy."""

    def __init__(self, hidden: int, width: int = 32, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        self.proj = nn.Linear(hidden, width)
        self.mlp = nn.Sequential(nn.Linear(width + 3, width), nn.SiLU(), nn.Linear(width, 1))

    def forward(self, hidden: torch.Tensor, top_logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], top_logp [..., k] (best first), entropy [...] -> logits [..., k] (float32)."""
        k = top_logp.shape[-1]
        node = self.proj(self.norm(hidden)).float()  # [..., W]
        x = torch.cat([node[..., None, :].expand(*top_logp.shape, node.shape[-1]), top_logp[..., None],
                       top_logp[..., :1, None].expand(*top_logp.shape, 1), entropy[..., None, None].expand(*top_logp.shape, 1)], dim=-1)
        assert x.shape[-2] == k
        return self.mlp(x.to(self.proj.weight.dtype)).squeeze(-1).float()


def draft_entropy(logp: torch.Tensor) -> torch.Tensor:
    """[..., V] log-probs -> [...] entropy (nats)."""
    return -(logp.exp() * logp).sum(-1)


class EagleHead(nn.Module):
    """The trainable part of the drafter, over the target's shared, frozen embedding and LM head."""

    def __init__(self, config: EagleConfig, embed: nn.Module, lm_head: nn.Module, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        lcfg = config.llama_config(attn_implementation)
        h = config.hidden_size
        self._input_modules(config)
        self.layer = LlamaDecoderLayer(lcfg, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(lcfg)
        vis = config.visual
        # VLM-aware variants (compression, decoupling, global feature); None = the plain head
        self.visual = None if vis.is_plain else VisualAdaptor(vis, h)
        # SpecDec++ acceptance prediction (trained on detached inputs: the head's own training is unchanged)
        self.accept = AcceptanceHead(h, eps=config.rms_norm_eps) if config.acceptance_head else None
        # shared with the target, never trained or saved by the head
        self._frozen = (embed, lm_head)
        # a trimmed draft vocabulary: d2t[j] = the target id of draft token j (saved with the weights)
        if config.draft_vocab_size:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self._draft_weight: tuple[tuple, torch.Tensor] | None = None  # lm_head rows of d2t, cached (never saved)
        self._decode: tuple[tuple, _DecodeLinears] | None = None  # decode()'s packed weights, cached (never saved)
        self._rope_table: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # decode()'s cos, sin [P, d], cached

    def _input_modules(self, config: EagleConfig) -> None:
        """What turns (token, feature) into the decoder layer's input: fc over the normed pair."""
        h = config.hidden_size
        self.embed_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.feat_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)

    @property
    def predicts_features(self) -> bool:
        """True: the head's output is trained to be the target's next feature (EAGLE-1's regression)."""
        return True

    @property
    def embed(self) -> nn.Module:
        return self._frozen[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._frozen[1]

    def _layer_input(
        self,
        token_ids: torch.Tensor,  # [B, n]
        features: torch.Tensor,  # [B, n, H]
        direct: torch.Tensor | None,  # [B, n] bool
        fuse: torch.Tensor | None,  # [B, n] bool
        global_feat: torch.Tensor | None,  # [B, H]
        packed: _DecodeLinears | None = None,  # decode(): fc over its packed weight, the norms fused
    ) -> torch.Tensor:  # [B, n, H]: what the decoder layer reads
        emb = self.embed(token_ids)
        features = features.to(emb.dtype)
        if global_feat is not None and fuse is not None and self.visual is not None:
            features = self.visual.fuse_global(features, global_feat, fuse)
        if packed is None:
            x = self.fc(torch.cat([self.embed_norm(emb), self.feat_norm(features)], dim=-1))
        else:
            x = packed.fc(torch.cat([_rms_norm(self.embed_norm, emb), _rms_norm(self.feat_norm, features)], dim=-1))
        if direct is not None:
            x = torch.where(direct[..., None], features, x)
        return x

    def forward(
        self,
        token_ids: torch.Tensor,  # [n] or [B, n]: the token that follows each feature
        features: torch.Tensor,  # [n, H] or [B, n, H]: target (or predicted) features
        position_ids: torch.Tensor,  # [n] or [B, n]
        attention_mask: torch.Tensor | None,  # [1|B, 1, n, cache + n] additive; None = causal
        cache: DynamicCache | None,
        direct: torch.Tensor | None = None,  # [n] or [B, n] bool: rows whose input IS the feature (MSD)
        fuse: torch.Tensor | None = None,  # [n] or [B, n] bool: rows that get the global feature
        global_feat: torch.Tensor | None = None,  # [H] or [B, H] (ViSpec)
    ) -> torch.Tensor:  # [n, H] or [B, n, H]: predicted next features
        """Training and the reference: the HF decoder layer as it is. Drafting runs `decode`."""
        batched = token_ids.ndim == 2
        if not batched:
            token_ids, features, position_ids, direct, fuse, global_feat = _batch_of_one(
                token_ids, features, position_ids, direct, fuse, global_feat)
        x = self._layer_input(token_ids, features, direct, fuse, global_feat)
        out = self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwarg(self.layer, cache),
            use_cache=cache is not None,
            position_embeddings=self.rotary(x, position_ids),
        )
        out = out[0] if isinstance(out, tuple) else out
        return out if batched else out[0]

    @torch.no_grad()
    def decode(
        self,
        token_ids: torch.Tensor,  # [n]
        features: torch.Tensor,  # [n, H]
        position_ids: torch.Tensor,  # [n]
        attention_mask: torch.Tensor,  # [1, 1, n, cache + n] additive
        cache: DynamicCache,
        direct: torch.Tensor | None = None,  # [n] bool
        fuse: torch.Tensor | None = None,  # [n] bool
        global_feat: torch.Tensor | None = None,  # [H]
    ) -> torch.Tensor:  # [n, H]
        """`forward` for drafting: one sequence, no gradients, fewer and cheaper ops. q/k/v and
        gate/up run as one matrix product each, every product over a weight packed once for oneDNN
        (`PackedLinear`: at a level's 1-4 rows, repacking the weight on each call cost more than the
        product); the norms in torch's fused kernel, the rotary angles read from a table, q and k
        rotated together, the attention straight into SDPA: 78 aten calls for a level of 4 rows,
        where the HF layer makes 124 (counted under a TorchDispatchMode). In bf16 the numbers are
        `forward`'s bit for bit; in fp32 equal to float rounding (oneDNN sums in another order than
        MKL). Every proposal is held to `forward`'s in tests/test_drafters.py."""
        layer, att = self.layer, self.layer.self_attn
        lin = self._decode_linears()
        a_in, x = self._decode_input(token_ids, features, direct, fuse, global_feat, lin)  # [n, H_in], [n, H]
        n, d, heads, kv = x.shape[0], att.head_dim, self.config.num_attention_heads, self.config.num_key_value_heads
        qkv = lin.qkv(a_in).view(n, heads + 2 * kv, d)
        cos, sin = self._rope(x, position_ids)  # [n, 1, d]
        qk = qkv[:, : heads + kv]  # [n, heads + kv, d]: HF's apply_rotary_pos_emb, on q and k at once
        qk = qk * cos + rotate_half(qk) * sin
        q, k, v = (t.transpose(0, 1)[None] for t in (qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :]))  # [1, heads | kv, n, d]
        k, v = cache.update(k, v, att.layer_idx)
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=att.scaling, enable_gqa=True)
        x = x + lin.o(a[0].transpose(0, 1).reshape(n, heads * d))  # [n, H]
        gate, up = lin.gate_up(_rms_norm(layer.post_attention_layernorm, x)).chunk(2, dim=-1)
        return x + lin.down(layer.mlp.act_fn(gate) * up)

    def _decode_input(self, token_ids: torch.Tensor, features: torch.Tensor, direct: torch.Tensor | None, fuse: torch.Tensor | None,
                      global_feat: torch.Tensor | None, lin: "_DecodeLinears") -> tuple[torch.Tensor, torch.Tensor]:
        """decode()'s attention input [n, H_in] (here H: the layer's input norm of x) and residual x [n, H]."""
        x = self._layer_input(*_batch_of_one(token_ids, features, direct, fuse, global_feat), packed=lin)[0]  # [n, H]
        return _rms_norm(self.layer.input_layernorm, x), x

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, H], position_ids [n] -> cos, sin [n, 1, d]: the head's rotary module's numbers, read
        from a table of every position the target reaches (P = max_position_embeddings), built once
        per dtype and device. Each angle is one product, position x frequency, so a row of the
        table equals the module's output bit for bit (tests/test_drafters.py). A context longer
        than _ROPE_TABLE_MAX positions computes them per call."""
        size = self.config.max_position_embeddings
        if size > _ROPE_TABLE_MAX:
            cos, sin = self.rotary(x, position_ids)
        else:
            key = (x.dtype, x.device, self.rotary.inv_freq.data_ptr(), self.rotary.inv_freq._version)
            if self._rope_table is None or self._rope_table[0] != key:
                cos, sin = self.rotary(x[:1], torch.arange(size, device=x.device))
                self._rope_table = (key, cos, sin)
            cos, sin = self._rope_table[1][position_ids], self._rope_table[2][position_ids]
        return cos[:, None], sin[:, None]

    @torch.no_grad()
    def decode_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`logits` for drafting: [..., H] -> [..., V'] float32, over the packed weight."""
        return self._decode_linears().logits(self._final_norm(hidden)).float()

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads of the head's output (EAGLE-1: the output itself, a predicted feature)."""
        return hidden

    @property
    def logits_module(self) -> nn.Module:
        """The LM head the draft logits come from (EAGLE-1: the target's, trimmed to d2t)."""
        return self.lm_head

    def _decode_linears(self) -> "_DecodeLinears":
        """decode()'s packed weights, rebuilt whenever one of them changed (another tensor, or one
        written in place: a training step, a load, a new draft vocabulary)."""
        att, mlp = self.layer.self_attn, self.layer.mlp
        mods = (self.fc, att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj, self.logits_module)
        assert all(getattr(m, "bias", None) is None for m in mods[:-1]), "the head's projections have no biases"
        vocab = self.d2t if self.trimmed else None
        key = tuple((t.data_ptr(), t._version, t.dtype) for t in [m.weight for m in mods] + ([] if vocab is None else [vocab]))
        if self._decode is None or self._decode[0] != key:
            w = [m.weight.detach() for m in mods[:-1]]
            self._decode = (key, _DecodeLinears(
                fc=PackedLinear(w[0]), qkv=PackedLinear(torch.cat(w[1:4])), o=PackedLinear(w[4]),
                gate_up=PackedLinear(torch.cat(w[5:7])), down=PackedLinear(w[7]), logits=PackedLinear(*self._draft_head())))
        return self._decode[1]

    @property
    def trimmed(self) -> bool:
        return bool(self.config.draft_vocab_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V'] float32 over the draft vocabulary (V' = K when trimmed, else V)."""
        if not self.trimmed:
            return self.lm_head(hidden).float()
        return nn.functional.linear(hidden, *self._draft_head()).float()

    def _draft_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's rows of the draft vocabulary: weight [V', H], bias [V'] | None (detached;
        the trimmed weight is cached until the LM head or the vocabulary changes)."""
        vocab, full = (self.d2t if self.trimmed else None), self.lm_head.weight.detach()
        if vocab is None:
            w = full
        else:
            key = (full.data_ptr(), full._version, full.dtype, vocab.data_ptr(), vocab._version)
            if self._draft_weight is None or self._draft_weight[0] != key:
                self._draft_weight = (key, full.index_select(0, vocab.to(full.device)))
            w = self._draft_weight[1]
        bias = getattr(self.lm_head, "bias", None)
        return w, None if bias is None else (bias.detach() if vocab is None else bias.detach()[vocab])

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices (any shape) -> target token ids."""
        return self.d2t[draft_ids] if self.trimmed else draft_ids

    def draft_view(self, target_logits: torch.Tensor) -> torch.Tensor:
        """Target logits [..., V] -> the draft vocabulary's columns [..., V'] (a teacher for training)."""
        return target_logits.index_select(-1, self.d2t.to(target_logits.device)) if self.trimmed else target_logits

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        """d2t [K] long: distinct target ids, K = config.draft_vocab_size."""
        check_draft_vocab(d2t, self.config.draft_vocab_size, self.config.vocab_size)
        self.d2t.copy_(d2t)  # in place: the cached weights of its rows (_draft_head) follow

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}


def _rms_norm(norm: LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` in torch's fused kernel: 4 ops where LlamaRMSNorm runs 8, the same numbers (the
    float32 sum of squares, then the weight times the result in x's dtype; tests/test_drafters.py)."""
    return norm.weight * nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


def _batch_of_one(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """One sequence's tensors as a batch of one (a leading dimension of 1); None stays None."""
    return tuple(None if t is None else t[None] for t in tensors)


class _DecodeLinears(NamedTuple):
    """EagleHead.decode()'s matrix products (H = hidden, I = intermediate, d = head dim; EAGLE-3:
    fc reads the m fused target layers, [mH] -> [H], and q/k/v read [embedding, fused state], 2H)."""

    fc: PackedLinear  # [2H] -> [H] (EAGLE-3: [mH] -> [H])
    qkv: PackedLinear  # [H] -> [(heads + 2 kv heads) d]: q_proj | k_proj | v_proj (EAGLE-3: [2H] -> ...)
    o: PackedLinear  # [heads d] -> [H]
    gate_up: PackedLinear  # [H] -> [2I]: gate_proj | up_proj
    down: PackedLinear  # [I] -> [H]
    logits: PackedLinear  # [H] -> [V']: the LM head's rows of the draft vocabulary


def question_embedding(head: EagleHead, token_ids: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[L] prompt ids -> [H]: mean embedding of the prompt's text (non-image) tokens (the gate's
    input); None when the head has no gate, the only reader."""
    if head.visual is None or head.visual.gate is None:
        return None
    text = token_ids if image_mask is None else token_ids[~image_mask.to(token_ids.device)]
    return head.embed(text).float().mean(0)


class Eagle3Head(EagleHead):
    """EAGLE-3's head (the shape vLLM, SGLang and `speculators` load), on `EagleHead`'s machinery
    (packed decode, rotary table, trimmed vocabulary, acceptance head, the session's tree search):

        fused_i = fc(concat(F^l1_i, F^l2_i, F^l3_i))       # the target's chosen layers, [mH] -> [H]
        a_i     = concat(input_layernorm(embed(token_{i+1})), hidden_norm(fused_i))    # [2H]
        x_i     = r_i + o_proj(attention(q/k/v over a_i))   # r_i = hidden_norm(fused_i) if norm_before_residual else fused_i
        h_i     = x_i + mlp(post_attention_layernorm(x_i))  # [H]: the next step's fused state
        p(token_{i+2}) = softmax(lm(norm(h_i)))             # its own LM head over the draft vocabulary

    A drafted node's input is its parent's h (width H, no fc): `fc` applies to features of the
    target's width m x H only (vLLM's `combine_hidden_states`). h is not trained to equal any
    target feature (no regression loss): only the token distributions are distilled.
    Its own LM head `lm` [K, H] starts as the target's LM head rows of the draft vocabulary."""

    def __init__(self, config: EagleConfig, embed: nn.Module, lm_head: nn.Module, attn_implementation: str = "sdpa") -> None:
        assert config.arch == "eagle3", config.arch
        super().__init__(config, embed, lm_head, attn_implementation)
        h, att = config.hidden_size, self.layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads [embedding, fused state]: 2H
            setattr(att, name, nn.Linear(2 * h, getattr(att, name).out_features, bias=False))
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm = nn.Linear(h, config.draft_vocab_size or config.vocab_size, bias=False)
        with torch.no_grad():
            self.lm.weight.copy_(self._target_rows(lm_head))

    def _input_modules(self, config: EagleConfig) -> None:
        h = config.hidden_size
        self.fc = nn.Linear(config.feature_width, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def _target_rows(self, lm_head: nn.Module) -> torch.Tensor:
        """The target LM head's rows of the draft vocabulary [K, H] (all of them untrimmed)."""
        w = lm_head.weight.detach()
        return w.index_select(0, self.d2t.to(w.device)) if self.trimmed else w

    @property
    def predicts_features(self) -> bool:
        return False

    @property
    def logits_module(self) -> nn.Module:
        return self.lm

    def _fuse(self, features: torch.Tensor, fc: nn.Module) -> torch.Tensor:
        """[..., mH] target features -> fc -> [..., H]; a drafted node's [..., H] (its parent's output) as it is."""
        return fc(features) if features.shape[-1] != self.config.hidden_size else features

    def forward(
        self,
        token_ids: torch.Tensor,  # [n] or [B, n]
        features: torch.Tensor,  # [n, mH] | [n, H] or batched: the target's layers, or the head's own outputs
        position_ids: torch.Tensor,  # [n] or [B, n]
        attention_mask: torch.Tensor | None,  # [1|B, 1, n, cache + n] additive; None = causal
        cache: DynamicCache | None,
        direct: torch.Tensor | None = None,
        fuse: torch.Tensor | None = None,
        global_feat: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [n, H] or [B, n, H]
        """Training and the reference: the HF layer's own modules, composed as EAGLE-3's layer."""
        assert direct is None and fuse is None and global_feat is None, "the VLM-aware variants are EAGLE-1 heads"
        batched = token_ids.ndim == 2
        if not batched:
            token_ids, features, position_ids = _batch_of_one(token_ids, features, position_ids)
        layer = self.layer
        emb = self.embed(token_ids)
        fused = self._fuse(features.to(emb.dtype), self.fc)
        normed = self.hidden_norm(fused)
        a_in = torch.cat([layer.input_layernorm(emb), normed], dim=-1)  # [B, n, 2H]
        attn, _ = layer.self_attn(a_in, position_embeddings=self.rotary(fused, position_ids), attention_mask=attention_mask,
                                  **cache_kwarg(layer.self_attn, cache))
        x = (normed if self.config.norm_before_residual else fused) + attn
        out = x + layer.mlp(layer.post_attention_layernorm(x))
        return out if batched else out[0]

    def _decode_input(self, token_ids: torch.Tensor, features: torch.Tensor, direct: torch.Tensor | None, fuse: torch.Tensor | None,
                      global_feat: torch.Tensor | None, lin: "_DecodeLinears") -> tuple[torch.Tensor, torch.Tensor]:
        """decode()'s attention input [n, 2H] and residual [n, H] (`forward`'s, over the packed fc and fused norms)."""
        assert direct is None and fuse is None and global_feat is None, "the VLM-aware variants are EAGLE-1 heads"
        emb = self.embed(token_ids)
        fused = self._fuse(features.to(emb.dtype), lin.fc)
        normed = _rms_norm(self.hidden_norm, fused)
        a_in = torch.cat([_rms_norm(self.layer.input_layernorm, emb), normed], dim=-1)
        return a_in, normed if self.config.norm_before_residual else fused

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return _rms_norm(self.norm, hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., K] float32: its own (trained) LM head over the final norm."""
        return self.lm(self.norm(hidden)).float()

    def _draft_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.lm.weight.detach(), None

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        """d2t [K]: the draft vocabulary; its own LM head restarts from the target's rows of it."""
        super().set_draft_vocab(d2t)
        with torch.no_grad():
            self.lm.weight.copy_(self._target_rows(self.lm_head))


def build_head(config: EagleConfig, embed: nn.Module, lm_head: nn.Module, attn_implementation: str = "sdpa") -> EagleHead:
    """The head a config's `arch` names: `EagleHead` (eagle1) or `Eagle3Head` (eagle3)."""
    cls = Eagle3Head if config.arch == "eagle3" else EagleHead
    return cls(config, embed, lm_head, attn_implementation)
