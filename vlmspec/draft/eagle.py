"""EAGLE-style draft head with a dynamic EAGLE-2 tree.

The head reads pairs (target feature at position i, token at position i+1):

    x_i  = fc(concat(norm(embed(token_{i+1})), norm(feature_i)))     # [*, 2H] -> [*, H]
    h_i  = LlamaDecoderLayer(x_i)                                   # one HF decoder layer, own KV cache
    p(token_{i+2}) = softmax(lm_head(h_i))                          # the target's frozen LM head

h_i is trained to predict the target's feature at position i+1, so drafting feeds it back.
Embedding and LM head are the target's own modules, shared and frozen; only fc, the norms and
the decoder layer are the head's weights (saved as config.json + model.safetensors).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from vlmspec.errors import DrafterLoadError
from vlmspec.draft.base import DraftSession, PromptContext, TreeConfig
from vlmspec.kv_cache import KVCache
from vlmspec.target import Target
from vlmspec.vision_compress import VisualAdaptor, VisualConfig
from vlmspec.tree import DraftTree, tree_attention_mask

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def _rope_theta(text_config: Any) -> float:
    rp = getattr(text_config, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(text_config, "rope_theta", None))
    return float(theta) if theta is not None else 10000.0


@dataclass
class EagleConfig:
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float = 1e-6
    target_model_type: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # variant settings: {"visual": VisualConfig dict}

    @property
    def visual(self) -> VisualConfig:
        return VisualConfig.from_dict(self.extra.get("visual"))

    @classmethod
    def from_target(cls, target: Target) -> "EagleConfig":
        tc = target.text_config
        heads = int(tc.num_attention_heads)
        return cls(
            hidden_size=int(tc.hidden_size),
            vocab_size=int(tc.vocab_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", heads) or heads),
            head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // heads),
            intermediate_size=int(tc.intermediate_size),
            max_position_embeddings=target.max_positions,
            rope_theta=_rope_theta(tc),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
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
        if problems:
            raise DrafterLoadError(
                "this drafter was trained for a different target (" + "; ".join(problems) + "). "
                "Train one for this target with `vlmspec train`, or pass the matching --model."
            )


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
        # shared with the target, never trained or saved by the head
        self._frozen = (embed, lm_head)

    @property
    def embed(self) -> nn.Module:
        return self._frozen[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._frozen[1]

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
        batched = token_ids.ndim == 2
        if not batched:
            token_ids, features, position_ids = token_ids[None], features[None], position_ids[None]
            direct = None if direct is None else direct[None]
            fuse = None if fuse is None else fuse[None]
            global_feat = None if global_feat is None else global_feat[None]
        emb = self.embed(token_ids)
        features = features.to(emb.dtype)
        if global_feat is not None and fuse is not None and self.visual is not None:
            features = self.visual.fuse_global(features, global_feat, fuse)
        x = self.fc(torch.cat([self.embed_norm(emb), self.feat_norm(features)], dim=-1))
        if direct is not None:
            x = torch.where(direct[..., None], features, x)
        out = self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
            position_embeddings=self.rotary(x, position_ids),
        )
        out = out[0] if isinstance(out, tuple) else out
        return out if batched else out[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}


class EagleDrafter:
    name = "eagle"

    @property
    def needs_visual(self) -> bool:
        """VLM-aware variants read the image embeddings and the target's attention at prefill."""
        return self.head.visual is not None

    def __init__(self, head: EagleHead, tree: TreeConfig | None = None) -> None:
        self.head = head.eval()
        self.tree = tree or TreeConfig()

    # ------------------------------------------------------------ construction / io
    @classmethod
    def random_init(cls, target: Target, tree: TreeConfig | None = None, seed: int = 0) -> "EagleDrafter":
        torch.manual_seed(seed)
        head = EagleHead(EagleConfig.from_target(target), target.input_embeddings(), target.output_embeddings(), target.attention)
        return cls(head.to(device=target.device, dtype=target.dtype), tree)

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / CONFIG_NAME).write_text(json.dumps({"drafter": "eagle", **asdict(self.head.config)}, indent=2))
        save_file(self.head.head_state_dict(), str(d / WEIGHTS_NAME))

    @classmethod
    def load(cls, directory: str | Path, target: Target, tree: TreeConfig | None = None) -> "EagleDrafter":
        d = Path(directory)
        cfg_path, w_path = d / CONFIG_NAME, d / WEIGHTS_NAME
        if not cfg_path.is_file() or not w_path.is_file():
            raise DrafterLoadError(f"{d} is not a drafter folder: it needs {CONFIG_NAME} and {WEIGHTS_NAME}")
        try:
            raw = json.loads(cfg_path.read_text())
            raw.pop("drafter", None)
            config = EagleConfig(**raw)
        except (json.JSONDecodeError, TypeError) as exc:
            raise DrafterLoadError(f"{cfg_path}: not a valid EAGLE drafter config ({exc})") from exc
        config.check_against(target)
        head = EagleHead(config, target.input_embeddings(), target.output_embeddings(), target.attention)
        state = load_file(str(w_path))
        expected = set(head.state_dict())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise DrafterLoadError(f"{w_path}: weights do not match the config (missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
        head.load_state_dict(state, strict=True)
        return cls(head.to(device=target.device, dtype=target.dtype), tree)

    def start(self, prompt: PromptContext, tree: TreeConfig | None = None) -> DraftSession:
        return _EagleSession(self.head, tree or self.tree, prompt)


class _EagleSession:
    def __init__(self, head: EagleHead, tree: TreeConfig, prompt: PromptContext) -> None:
        self.head = head
        self.tree = tree
        self.cache = KVCache()
        p = next(self.head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.prompt: PromptContext | None = prompt  # turned into rows at the first propose (needs the root)
        self.global_feat: torch.Tensor | None = None  # [H] ViSpec global image feature
        self.next_pos = 0  # position of the next row (rows of a compressed image span are gone)
        # features not yet paired with the token that follows them
        self.pending_feats = prompt.features[:0].to(self.device, self.dtype)
        self.pending_next = prompt.token_ids[:0].to(self.device)

    def commit(self, token_ids: torch.Tensor, features: torch.Tensor) -> None:
        assert self.pending_feats.shape[0] == 0 and self.prompt is None, "propose() must run between commits"
        self.pending_feats = features.to(self.device, self.dtype)
        self.pending_next = token_ids[1:].to(self.device)

    def _prompt_rows(self, root: int) -> tuple[torch.Tensor, ...]:
        """(tokens [n], feats [n, H], positions [n], direct [n] | None, fuse [n] | None)."""
        prompt, self.prompt = self.prompt, None
        ids = torch.cat([prompt.token_ids.to(self.device), torch.tensor([root], device=self.device)])
        feats = prompt.features.to(self.device, self.dtype)
        adaptor = self.head.visual
        if adaptor is None:
            return ids[1:], feats, torch.arange(feats.shape[0], device=self.device), None, None
        rows = adaptor.prompt_rows(
            ids, feats, _image_mask(prompt, ids.shape[0] - 1, self.device), _to(prompt.image_embeds, self.device, self.dtype),
            _to(prompt.attention, self.device, torch.float32), question_embedding(self.head, prompt.token_ids.to(self.device), prompt.image_mask),
        ).kept()
        self.global_feat = rows.global_feat
        return rows.tokens, rows.feats, rows.positions, rows.direct, rows.fuse

    @torch.no_grad()
    def propose(self, root: int, max_depth: int) -> DraftTree:
        head, cfg = self.head, self.tree
        # 1. the committed pairs (feature_i, token_{i+1}); the last one pairs with the root
        if self.prompt is not None:
            toks, feats, pos, direct, fuse = self._prompt_rows(root)
        else:
            toks = torch.cat([self.pending_next, torch.tensor([root], device=self.device)])
            feats = self.pending_feats
            pos = torch.arange(self.next_pos, self.next_pos + toks.shape[0], device=self.device)
            direct = None
            fuse = None if self.global_feat is None else torch.ones_like(toks, dtype=torch.bool)
        start = self.cache.seq_len
        n = toks.shape[0]
        assert n == feats.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        mask = tree_attention_mask(causal, start, self.dtype)
        hidden = head(toks, feats, pos, mask, self.cache.hf, direct, fuse, self.global_feat)
        self.pending_feats = self.pending_feats[:0]
        self.next_pos = int(pos[-1]) + 1
        committed = self.cache.seq_len
        depth = min(cfg.depth, max_depth)
        if depth <= 0:
            return DraftTree.root_only(root)
        node_fuse = None if self.global_feat is None else torch.ones(1, dtype=torch.bool, device=self.device)

        # 2. grow: nodes hold token, parent, cumulative log-prob; node 0 = root
        k = cfg.top_k
        tokens, parents, scores = [root], [-1], [0.0]
        out_hidden: dict[int, torch.Tensor] = {0: hidden[-1]}  # node -> head output at its pair
        slot: dict[int, int] = {}  # expanded node -> index of its entry in the draft-tree KV part
        logp = torch.log_softmax(head.logits(hidden[-1:]), -1)  # [1, V]
        frontier = [0]
        for d in range(1, depth + 1):
            top = torch.topk(logp, k, dim=-1)  # per frontier node: [F, k]
            cand = (torch.tensor([scores[f] for f in frontier], device=logp.device)[:, None] + top.values).flatten()
            children = []
            for fi, f in enumerate(frontier):
                for j in range(k):
                    tokens.append(int(top.indices[fi, j]))
                    parents.append(f)
                    scores.append(float(cand[fi * k + j]))
                    children.append(len(tokens) - 1)
            if d == depth:
                break
            best = torch.topk(cand, min(k, cand.numel())).indices.tolist()
            frontier = [children[b] for b in best]
            # run the head on the new frontier: token of the node, feature = its parent's output
            ftoks = torch.tensor([tokens[f] for f in frontier], device=self.device)
            ffeat = torch.stack([out_hidden[parents[f]] for f in frontier])
            n_tree = len(slot)
            allowed = torch.zeros(len(frontier), n_tree + len(frontier), dtype=torch.bool, device=self.device)
            for i, f in enumerate(frontier):
                allowed[i, n_tree + i] = True
                a = parents[f]
                while a > 0:
                    allowed[i, slot[a]] = True
                    a = parents[a]
            for i, f in enumerate(frontier):
                slot[f] = n_tree + i
            mask = tree_attention_mask(allowed, committed, self.dtype)
            fpos = torch.full((len(frontier),), self.next_pos - 1 + d, device=self.device)
            ffuse = None if node_fuse is None else node_fuse.expand(len(frontier))
            h = head(ftoks, ffeat, fpos, mask, self.cache.hf, None, ffuse, self.global_feat)
            for i, f in enumerate(frontier):
                out_hidden[f] = h[i]
            logp = torch.log_softmax(head.logits(h), -1)
        self.cache.crop(committed)

        # 3. rerank: keep the best total_tokens drafted nodes (a child never outscores its parent,
        #    ties go to the earlier node, so the selection is closed under parents)
        order = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[: cfg.total_tokens]
        keep = torch.tensor([0, *sorted(order)], dtype=torch.long)
        full = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
        return full.select(keep)


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
