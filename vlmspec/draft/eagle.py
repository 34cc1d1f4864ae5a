"""EAGLE-style draft head with a dynamic EAGLE-2 tree.

The head reads pairs (target feature at position i, token at position i+1):

    x_i  = fc(concat(norm(embed(token_{i+1})), norm(feature_i)))     # [*, 2H] -> [*, H]
    h_i  = LlamaDecoderLayer(x_i)                                   # one HF decoder layer, own KV cache
    p(token_{i+2}) = softmax(lm_head(h_i))                          # the target's frozen LM head

h_i is trained to predict the target's feature at position i+1, so drafting feeds it back.
Training runs `EagleHead.forward` (the HF layer as it is); drafting runs `EagleHead.decode`, the
same layer in fewer ops over weights packed once for the CPU's matrix units, held to
`forward` proposal for proposal by the tests.
Embedding and LM head are the target's own modules, shared and frozen; only fc, the norms and
the decoder layer are the head's weights.

A drafter checkpoint is a Hugging Face artefact: `config.json` written by `EagleConfig`
(a `PretrainedConfig`, model_type "vlmspec_eagle", registered with `AutoConfig`) plus
`model.safetensors` with the head's weights. It loads from a folder or a hub id ("org/name");
the first format (config.json with "drafter": "eagle") still loads and is converted in memory.

On CUDA, a proposal grows the whole tree on the device and reads it back with ONE
device->host transfer (not one per node); see `_EagleSession.propose`.

SpecDec++ (`acceptance_head`): a small head beside it predicts, for each of a node's top-k
children, the probability that the target accepts that child given that the node was accepted.
A proposal stops deepening the tree once no frontier node's predicted path acceptance (the
product along its path) reaches `stop_threshold`; with the acceptance head off, or threshold 0,
the tree is EAGLE-2's. Only the tree's shape changes, so verification stays lossless. (That
check reads one number per level back from the device.)
"""

from __future__ import annotations

import json
import logging
from dataclasses import field, fields
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, DynamicCache, LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from vlmspec.errors import DrafterLoadError
from vlmspec.kernels.packed_linear import PackedLinear
from vlmspec.transfer import to_device
from vlmspec.draft.base import DraftSession, PromptContext, TreeConfig
from vlmspec.kv_cache import KVCache, cache_kwarg
from vlmspec.target import Target
from vlmspec.vision_compress import VisualAdaptor, VisualConfig
from vlmspec.tree import DraftTree, tree_attention_mask

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_TYPE = "vlmspec_eagle"
LEGACY_KEY = "drafter"  # the first format's marker: {"drafter": "eagle", <EagleConfig fields>}

logger = logging.getLogger("vlmspec.draft")
_ROPE_TABLE_MAX = 1 << 17  # positions: EagleHead.decode reads its rotary angles from a table up to this context


def _rope_theta(text_config: Any) -> float:
    rp = getattr(text_config, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(text_config, "rope_theta", None))
    return float(theta) if theta is not None else 10000.0


class EagleConfig(PretrainedConfig):
    """The head's shape, the target it was trained for, and its variant settings (`extra`).

    A `PretrainedConfig`: `save_pretrained(dir)` writes config.json, `from_pretrained(dir or hub id)`
    reads it, and `AutoConfig` knows model_type "vlmspec_eagle".
    """

    model_type = MODEL_TYPE

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    target_model_type: str = ""
    draft_vocab_size: int = 0  # K > 0: the head predicts over K target tokens only (`d2t` in the weights); 0: all
    acceptance_head: bool = False  # SpecDec++: an acceptance-prediction head in the weights (`accept.*`)
    stop_threshold: float = 0.0  # stop deepening when no path's predicted acceptance reaches it (0: never; chosen on validation)
    extra: dict[str, Any] = field(default_factory=dict)  # variant settings: {"visual": VisualConfig dict}
    # measured best tree per device type, {"cpu": [depth, top_k, total_tokens]} (`vlmspec bench trees`;
    # the card says how); a device without an entry gets `TreeConfig.for_device`
    tree_defaults: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self, **kwargs: Any) -> None:
        for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.rope_theta, self.rms_norm_eps = float(self.rope_theta), float(self.rms_norm_eps)
        k = self.draft_vocab_size
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be an integer in 0..vocab_size ({self.vocab_size}), got {k!r}")
        self.stop_threshold = float(self.stop_threshold)
        if not isinstance(self.acceptance_head, bool) or not 0.0 <= self.stop_threshold < 1.0:
            raise ValueError(f"acceptance_head must be a bool and stop_threshold in [0, 1), got {self.acceptance_head!r}, {self.stop_threshold!r}")
        if self.stop_threshold > 0 and not self.acceptance_head:
            raise ValueError("stop_threshold needs acceptance_head (the stop rule reads its predictions)")
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a JSON object, got {self.extra!r}")
        if not isinstance(self.tree_defaults, dict):
            raise ValueError(f"tree_defaults must be a JSON object, got {self.tree_defaults!r}")
        for device, shape in self.tree_defaults.items():
            ok = isinstance(shape, (list, tuple)) and len(shape) == 3 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape)
            if device not in ("cpu", "cuda") or not ok:
                raise ValueError(f"tree_defaults maps 'cpu' / 'cuda' to [depth, top_k, total_tokens] (positive integers), got {device!r}: {shape!r}")
        super().__post_init__(**kwargs)

    @property
    def visual(self) -> VisualConfig:
        return VisualConfig.from_dict(self.extra.get("visual"))

    def default_tree(self, device: str | torch.device) -> TreeConfig | None:
        """The tree measured best for this drafter on `device`'s type; None when none was recorded."""
        shape = self.tree_defaults.get(torch.device(device).type)
        return None if shape is None else TreeConfig(*shape)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The head's own settings (what the first, plain-JSON format held)."""
        own = {f.name for f in fields(PretrainedConfig)}
        return tuple(f.name for f in fields(cls) if f.name not in own)

    @classmethod
    def from_legacy_dict(cls, raw: dict[str, Any]) -> "EagleConfig":
        """The first format: {"drafter": "eagle", <the fields above>}."""
        raw = dict(raw)
        kind = raw.pop(LEGACY_KEY, None)
        unknown = sorted(set(raw) - set(cls.field_names()))
        if kind != "eagle" or unknown:
            raise ValueError(f"drafter kind {kind!r}, unknown keys {unknown[:5]}")
        return cls(**raw)

    @classmethod
    def from_target(cls, target: Target) -> "EagleConfig":
        tc = target.text_config

        def attr(name: str) -> Any:
            """The text config's field; where its layers differ in it (Gemma 4's per-layer configs,
            Gemma 3n's per-layer lists), the first layer's."""
            try:
                value = getattr(tc, name, None)
            except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
                value = getattr(tc.per_layer_config[0], name, None)
            return value[0] if isinstance(value, (list, tuple)) else value

        heads = int(attr("num_attention_heads"))
        ffn = attr("intermediate_size") or attr("moe_intermediate_size")  # MoE decoders: the expert's
        return cls(
            hidden_size=int(tc.hidden_size),
            vocab_size=int(tc.vocab_size),
            num_attention_heads=heads,
            num_key_value_heads=int(attr("num_key_value_heads") or heads),
            head_dim=int(attr("head_dim") or tc.hidden_size // heads),
            intermediate_size=int(ffn or 4 * tc.hidden_size),
            max_position_embeddings=target.max_positions,
            rope_theta=_rope_theta(tc),
            rms_norm_eps=float(attr("rms_norm_eps") or 1e-6),
            target_model_type=str(getattr(target.model.config, "model_type", "")),
        )

    def llama_config(self, attn_implementation: str = "sdpa") -> LlamaConfig:
        cfg = LlamaConfig(
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            num_hidden_layers=1,
        )
        cfg._attn_implementation = attn_implementation
        return cfg

    def check_against(self, target: Target) -> None:
        """Refuse a head trained for another target (a silent mismatch destroys acceptance)."""
        want = EagleConfig.from_target(target)
        problems = [
            f"{name}: drafter {getattr(self, name)} != target {getattr(want, name)}"
            for name in ("hidden_size", "vocab_size", "max_position_embeddings", "rope_theta")
            if getattr(self, name) != getattr(want, name)
        ]
        vis = self.visual
        if vis.sized_for(target.image_tokens) != vis:  # its resampler has fewer queries than one image needs
            problems.append(f"its resampler reads images of up to {vis.max_queries * vis.ratio:g} tokens at {vis.ratio:g}x "
                            f"and this target's take {target.image_tokens}")
        if problems:
            raise DrafterLoadError(
                "this drafter was trained for a different target (" + "; ".join(problems) + "). "
                "Train one for this target with `vlmspec train`, or pass the matching --model."
            )


AutoConfig.register(MODEL_TYPE, EagleConfig, exist_ok=True)  # AutoConfig.from_pretrained(drafter) works too


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
        self.embed_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.feat_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
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
        x = self._layer_input(*_batch_of_one(token_ids, features, direct, fuse, global_feat), packed=lin)[0]  # [n, H]
        n, d, heads, kv = x.shape[0], att.head_dim, self.config.num_attention_heads, self.config.num_key_value_heads
        qkv = lin.qkv(_rms_norm(layer.input_layernorm, x)).view(n, heads + 2 * kv, d)
        cos, sin = self._rope(x, position_ids)  # [n, 1, d]
        qk = qkv[:, : heads + kv]  # [n, heads + kv, d]: HF's apply_rotary_pos_emb, on q and k at once
        qk = qk * cos + rotate_half(qk) * sin
        q, k, v = (t.transpose(0, 1)[None] for t in (qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :]))  # [1, heads | kv, n, d]
        k, v = cache.update(k, v, att.layer_idx)
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=att.scaling, enable_gqa=True)
        x = x + lin.o(a[0].transpose(0, 1).reshape(n, heads * d))  # [n, H]
        gate, up = lin.gate_up(_rms_norm(layer.post_attention_layernorm, x)).chunk(2, dim=-1)
        return x + lin.down(layer.mlp.act_fn(gate) * up)

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
        return self._decode_linears().logits(hidden).float()

    def _decode_linears(self) -> "_DecodeLinears":
        """decode()'s packed weights, rebuilt whenever one of them changed (another tensor, or one
        written in place: a training step, a load, a new draft vocabulary)."""
        att, mlp = self.layer.self_attn, self.layer.mlp
        mods = (self.fc, att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj, self.lm_head)
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


class EagleDrafter:
    name = "eagle"

    @property
    def needs_visual(self) -> bool:
        """VLM-aware variants read the image embeddings and the target's attention at prefill."""
        return self.head.visual is not None

    def __init__(self, head: EagleHead, tree: TreeConfig | None = None, stop_threshold: float | None = None) -> None:
        """stop_threshold: SpecDec++'s stop rule (None: the config's; 0: off, EAGLE-2's tree)."""
        self.head = head.eval()
        self.tree = tree or TreeConfig()
        self.stop_threshold = head.config.stop_threshold if stop_threshold is None else float(stop_threshold)
        if self.stop_threshold and head.accept is None:
            raise ValueError("a stop threshold needs a drafter with an acceptance head (vlmspec train --acceptance-head)")
        assert 0.0 <= self.stop_threshold < 1.0, self.stop_threshold

    # ------------------------------------------------------------ construction / io
    @classmethod
    def random_init(cls, target: Target, tree: TreeConfig | None = None, seed: int = 0) -> "EagleDrafter":
        torch.manual_seed(seed)
        head = EagleHead(EagleConfig.from_target(target), target.input_embeddings(), target.output_embeddings(), target.attention)
        return cls(head.to(device=target.device, dtype=target.dtype), tree)

    def save(self, directory: str | Path) -> None:
        """config.json (`EagleConfig.save_pretrained`) + model.safetensors (the head's weights only)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.head.config.save_pretrained(d)
        save_file(self.head.head_state_dict(), str(d / WEIGHTS_NAME), metadata={"format": "pt"})

    @staticmethod
    def default_tree(folder_or_hub_id: str | Path, device: str | torch.device) -> TreeConfig | None:
        """The tree a drafter's config records as measured best on `device`'s type (None: none recorded)."""
        return _read_config(_checkpoint_folder(str(folder_or_hub_id))).default_tree(device)

    @classmethod
    def from_pretrained(cls, folder_or_hub_id: str | Path, target: Target, tree: TreeConfig | None = None) -> "EagleDrafter":
        """A drafter folder, or a hub id ("org/name"): from the hub when it answers, else from the
        local Hugging Face cache (DrafterLoadError when neither has it)."""
        return cls.load(_checkpoint_folder(str(folder_or_hub_id)), target, tree)

    @classmethod
    def load(cls, directory: str | Path, target: Target, tree: TreeConfig | None = None) -> "EagleDrafter":
        """A drafter folder (either format), checked against `target`, weights loaded strictly."""
        d = Path(directory)
        w_path = d / WEIGHTS_NAME
        if not (d / CONFIG_NAME).is_file() or not w_path.is_file():
            raise DrafterLoadError(f"{d} is not a drafter folder: it needs {CONFIG_NAME} and {WEIGHTS_NAME}")
        config = _read_config(d)
        config.check_against(target)
        head = EagleHead(config, target.input_embeddings(), target.output_embeddings(), target.attention)
        try:
            state = load_file(str(w_path))
        except SafetensorError as exc:
            raise DrafterLoadError(f"{w_path}: not a readable safetensors file ({exc})") from exc
        expected = set(head.state_dict())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise DrafterLoadError(f"{w_path}: weights do not match the config "
                                   f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
        head.load_state_dict(state, strict=True)
        if head.trimmed:
            try:
                check_draft_vocab(head.d2t, config.draft_vocab_size, config.vocab_size)
            except ValueError as exc:
                raise DrafterLoadError(f"{w_path}: {exc}") from None
        return cls(head.to(device=target.device, dtype=target.dtype), tree or config.default_tree(target.device))

    def start(self, prompt: PromptContext, tree: TreeConfig | None = None) -> DraftSession:
        return _EagleSession(self.head, tree or self.tree, prompt, self.stop_threshold)


def _read_config(folder: Path) -> EagleConfig:
    """config.json in the Hugging Face format, or the first format (converted in memory, with a warning)."""
    path = folder / CONFIG_NAME
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        if raw.get("model_type") == MODEL_TYPE:
            return EagleConfig.from_pretrained(str(folder), local_files_only=True)
        if LEGACY_KEY not in raw:
            raise ValueError(f'neither model_type "{MODEL_TYPE}" nor "{LEGACY_KEY}": "eagle"')
        config = EagleConfig.from_legacy_dict(raw)
    except (OSError, ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise DrafterLoadError(f"{path}: not a valid EAGLE drafter config ({exc})") from exc
    logger.warning("%s is in the first drafter format (\"drafter\": \"eagle\"); converted in memory. "
                   "Re-save it as a Hugging Face artefact with `vlmspec.draft.eagle.EagleDrafter.save`.", path)
    return config


def looks_like_hub_id(spec: str) -> bool:
    """"org/name" with the hub's characters (a drafter repo always has an owner)."""
    parts = spec.split("/")
    ok = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
    return len(parts) == 2 and all(p and set(p) <= ok and not p.startswith(".") for p in parts)


def _checkpoint_folder(spec: str) -> Path:
    """A local folder for `spec`: the folder itself, or a hub id's snapshot in the local HF cache."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if not looks_like_hub_id(spec):
        raise DrafterLoadError(f"drafter {spec!r} is neither a drafter folder nor a hub id (org/name)")
    from huggingface_hub import snapshot_download

    from vlmspec.target import hub_reachable

    offline = not hub_reachable()
    try:
        local = snapshot_download(spec, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, "README.md"], local_files_only=offline)
    except (OSError, ValueError) as exc:  # hub errors are OSErrors (HTTP, not cached), id errors ValueErrors
        if offline:
            raise DrafterLoadError(f"drafter {spec!r} looks like a hub id, but the hub is unreachable from here (or "
                                   "HF_HUB_OFFLINE is set) and it is not in the local cache: pass a drafter folder, "
                                   f"or fetch it where the hub answers (`hf download {spec}`)") from None
        raise DrafterLoadError(f"cannot fetch drafter {spec!r} from the hub: {str(exc).splitlines()[0]}") from exc
    return Path(local)


class _EagleSession:
    """One request's drafting state: the head's own KV cache over the committed pairs.

    Host <-> device traffic (CUDA): commit() and propose() each move one small token tensor to the
    device (pinned, non-blocking: no sync); propose() grows the whole tree on the device and reads
    it back with ONE device->host transfer, whatever the depth. The first propose of a VLM-aware
    variant also reads its prompt rows (boolean selections, once per request).
    """

    def __init__(self, head: EagleHead, tree: TreeConfig, prompt: PromptContext, stop_threshold: float = 0.0) -> None:
        self.head = head
        self.tree = tree
        self.stop_threshold = stop_threshold
        self.cache = KVCache()
        p = next(self.head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.prompt: PromptContext | None = prompt  # turned into rows at the first propose (needs the root)
        self.global_feat: torch.Tensor | None = None  # [H] ViSpec global image feature
        self.next_pos = 0  # position of the next row (rows of a compressed image span are gone)
        # features not yet paired with the token that follows them
        self.pending_feats = prompt.features[:0].to(self.device, self.dtype)  # [0, H]
        self.pending_next = prompt.token_ids[:0].to(self.device)  # [0]

    def commit(self, token_ids: torch.Tensor, features: torch.Tensor) -> None:
        """token_ids [k] (root + accepted, any device), features [k, H] (the target's, on its device).
        They wait, with those of earlier steps that drafted nothing, until the next drafted step runs the head."""
        assert self.prompt is None and self.pending_next.shape[0] == self.pending_feats.shape[0], "propose() must run between commits"
        self.pending_feats = torch.cat([self.pending_feats, features.to(self.device, self.dtype)])
        self.pending_next = torch.cat([self.pending_next, to_device(token_ids[1:], self.device)])

    def _prompt_rows(self, root: int) -> tuple[torch.Tensor, ...]:
        """(tokens [n], feats [n, H], positions [n], direct [n] | None, fuse [n] | None); sets next_pos."""
        prompt, self.prompt = self.prompt, None
        ids = to_device(torch.cat([prompt.token_ids.cpu(), torch.tensor([root])]), self.device)  # [L + 1]
        feats = prompt.features.to(self.device, self.dtype)
        adaptor = self.head.visual
        if adaptor is None:
            self.next_pos = feats.shape[0]
            return ids[1:], feats, torch.arange(feats.shape[0], device=self.device), None, None
        rows = adaptor.prompt_rows(
            ids, feats, _image_mask(prompt, ids.shape[0] - 1, self.device), _to(prompt.image_embeds, self.device, self.dtype),
            _to(prompt.attention, self.device, torch.float32), question_embedding(self.head, ids[:-1], prompt.image_mask),
        ).kept()
        self.global_feat = rows.global_feat
        self.next_pos = int(rows.positions[-1]) + 1  # one read, once per request (compressed spans drop rows)
        return rows.tokens, rows.feats, rows.positions, rows.direct, rows.fuse

    def _run_committed(self, root: int) -> torch.Tensor:
        """Run the head over the committed pairs (feature_i, token_{i+1}), the last one pairing with
        the root; their entries stay in the cache. Returns the head's outputs [n, H]."""
        if self.prompt is not None:
            toks, feats, pos, direct, fuse = self._prompt_rows(root)
        else:
            toks = torch.cat([self.pending_next, to_device(torch.tensor([root]), self.device)])  # [n]
            feats = self.pending_feats
            pos = torch.arange(self.next_pos, self.next_pos + toks.shape[0], device=self.device)
            self.next_pos += toks.shape[0]
            direct = None
            fuse = None if self.global_feat is None else torch.ones_like(toks, dtype=torch.bool)
        n = toks.shape[0]
        assert n == feats.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        mask = tree_attention_mask(causal, self.cache.seq_len, self.dtype)
        hidden = self.head.decode(toks, feats, pos, mask, self.cache.hf, direct, fuse, self.global_feat)
        self.pending_feats, self.pending_next = self.pending_feats[:0], self.pending_next[:0]
        return hidden

    @torch.no_grad()
    def propose(self, root: int, max_depth: int) -> DraftTree:
        """The EAGLE-2 tree after `root` (depth <= max_depth, at most total_tokens drafted nodes).
        Node for node the same tree as the first, per-node-read algorithm (tests/test_drafters.py
        keeps it as the oracle): same top-k calls on the same numbers, same rerank on the host."""
        depth = min(self.tree.depth, max_depth)
        if depth <= 0 and self.prompt is None:  # a step without a draft runs no head: its pairs wait for the next draft
            self.pending_next = torch.cat([self.pending_next, to_device(torch.tensor([root]), self.device)])
            return DraftTree.root_only(root)
        hidden = self._run_committed(root)  # [n, H]
        committed = self.cache.seq_len
        if depth <= 0:
            return DraftTree.root_only(root)
        levels = self._grow(hidden[-1:], committed, depth)  # on the device, no sync
        self.cache.crop(committed)
        tokens, parents, scores = _read_levels(root, levels)  # the one device->host transfer
        # rerank: keep the best total_tokens drafted nodes (a child never outscores its parent,
        # ties go to the earlier node, so the selection is closed under parents)
        order = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[: self.tree.total_tokens]
        keep = torch.tensor([0, *sorted(order)], dtype=torch.long)
        full = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
        return full.select(keep)

    def _grow(self, root_hidden: torch.Tensor, committed: int, depth: int) -> list[_Level]:
        """EAGLE-2 growth, all on the device: each level gives every frontier node its top_k
        children, scored by cumulative log-prob; the top_k best children are the next frontier
        and run through the head (their KV entries go after the committed prefix, in frontier
        order). Sizes are known on the host (F = 1, then min(k, F * k)), so nothing is read back.

        root_hidden: [1, H], the head's output at the root's pair. Returns one _Level per depth
        grown: fewer than `depth` when the SpecDec++ stop rule ends the growth.
        """
        head, k, dev = self.head, self.tree.top_k, self.device
        stop = self.stop_threshold > 0
        logp = torch.log_softmax(head.decode_logits(root_hidden), -1)  # [F, V], F = 1: the root
        front_acc = torch.ones(1, device=dev)  # [F] predicted probability that each frontier node's path is accepted
        front_h = root_hidden  # [F, H] head outputs at the frontier nodes' pairs (their children's features)
        front_seen = torch.zeros(1, 0, dtype=torch.bool, device=dev)  # [F, n_tree]: tree KV entries each sees
        front_scores = torch.zeros(1, device=dev)  # [F] float32 cumulative log-probs
        fuse = None if self.global_feat is None else torch.ones(1, dtype=torch.bool, device=dev)
        levels: list[_Level] = []
        for d in range(1, depth + 1):
            top = torch.topk(logp, k, dim=-1)  # values / indices [F, k] (indices in the draft vocabulary)
            ids = head.target_ids(top.indices)  # [F, k] target token ids
            cand = (front_scores[:, None] + top.values).flatten()  # [F * k], child j of node fi at fi * k + j
            if d == depth:
                levels.append(_Level(ids, cand, None))
                break
            best = torch.topk(cand, min(k, cand.numel())).indices  # [F'] the next frontier, best first
            if stop:  # SpecDec++: grow on only while some frontier path is predicted to be accepted often enough
                child_acc = torch.sigmoid(head.accept(front_h, top.values, draft_entropy(logp)))  # [F, k]
                front_acc = (front_acc[:, None] * child_acc).flatten().index_select(0, best)  # [F']
                if float(front_acc.max()) < self.stop_threshold:  # one read per level
                    levels.append(_Level(ids, cand, None))
                    break
            levels.append(_Level(ids, cand, best))
            parent = torch.div(best, k, rounding_mode="floor")  # [F'] row of each one's parent in the frontier
            n_new = best.shape[0]
            # a node sees its parent's entries plus itself (its entry goes right after the tree's so far)
            seen = torch.cat([front_seen.index_select(0, parent), torch.eye(n_new, dtype=torch.bool, device=dev)], dim=1)
            mask = tree_attention_mask(seen, committed, self.dtype)  # [1, 1, F', committed + n_tree + F']
            ftoks = ids.flatten().index_select(0, best)  # [F']
            ffeat = front_h.index_select(0, parent)  # [F', H]: a node's feature is its parent's output
            fpos = torch.full((n_new,), self.next_pos - 1 + d, device=dev)
            ffuse = None if fuse is None else fuse.expand(n_new)
            front_h = head.decode(ftoks, ffeat, fpos, mask, self.cache.hf, None, ffuse, self.global_feat)  # [F', H]
            logp = torch.log_softmax(head.decode_logits(front_h), -1)  # [F', V]
            front_seen, front_scores = seen, cand.index_select(0, best)
        return levels


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


def _rms_norm(norm: LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` in torch's fused kernel: 4 ops where LlamaRMSNorm runs 8, the same numbers (the
    float32 sum of squares, then the weight times the result in x's dtype; tests/test_drafters.py)."""
    return norm.weight * nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


def _batch_of_one(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """One sequence's tensors as a batch of one (a leading dimension of 1); None stays None."""
    return tuple(None if t is None else t[None] for t in tensors)


class _DecodeLinears(NamedTuple):
    """EagleHead.decode()'s matrix products (H = hidden, I = intermediate, d = head dim)."""

    fc: PackedLinear  # [2H] -> [H]
    qkv: PackedLinear  # [H] -> [(heads + 2 kv heads) d]: q_proj | k_proj | v_proj
    o: PackedLinear  # [heads d] -> [H]
    gate_up: PackedLinear  # [H] -> [2I]: gate_proj | up_proj
    down: PackedLinear  # [I] -> [H]
    logits: PackedLinear  # [H] -> [V']: the LM head's rows of the draft vocabulary


class _Level(NamedTuple):
    """One level of growth, on the device (F = that level's frontier size, k = top_k)."""

    indices: torch.Tensor  # [F, k] long: the children's tokens, per frontier node
    scores: torch.Tensor  # [F * k] float32: the children's cumulative log-probs (child j of node fi at fi * k + j)
    best: torch.Tensor | None  # [F'] long: flat ids of the children that form the next frontier; None at the last level


def _read_levels(root: int, levels: list[_Level]) -> tuple[list[int], list[int], list[float]]:
    """The drafted nodes in order (tokens, parents, cumulative log-probs; node 0 = root), read from
    the device with ONE transfer: every level's numbers go into one float64 vector (exact for
    token ids and float32 scores) and come back with a single `.tolist()`."""
    parts = [t.reshape(-1).to(torch.float64) for lvl in levels for t in lvl if t is not None]
    values = torch.cat(parts).tolist()
    tokens, parents, scores = [root], [-1], [0.0]
    frontier, at = [0], 0
    for lvl in levels:
        n = lvl.indices.numel()  # F * k, known from the shape
        ids, cand = values[at : at + n], values[at + n : at + 2 * n]
        at += 2 * n
        k = lvl.indices.shape[1]
        first = len(tokens)  # node id of child j of frontier node fi: first + fi * k + j
        for i in range(n):
            tokens.append(int(ids[i]))
            parents.append(frontier[i // k])
            scores.append(cand[i])
        if lvl.best is not None:
            m = lvl.best.numel()
            frontier = [first + int(b) for b in values[at : at + m]]
            at += m
    return tokens, parents, scores


def _to(x: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(device, dtype)


def _image_mask(prompt: PromptContext, length: int, device: torch.device) -> torch.Tensor:
    if prompt.image_mask is None:
        return torch.zeros(length, dtype=torch.bool, device=device)
    return prompt.image_mask.to(device)


def question_embedding(head: EagleHead, token_ids: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[L] prompt ids -> [H]: mean embedding of the prompt's text (non-image) tokens (the gate's
    input); None when the head has no gate, the only reader."""
    if head.visual is None or head.visual.gate is None:
        return None
    text = token_ids if image_mask is None else token_ids[~image_mask.to(token_ids.device)]
    return head.embed(text).float().mean(0)
