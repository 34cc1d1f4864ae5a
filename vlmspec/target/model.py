"""Target adapter over an unmodified Hugging Face VLM.

Three calls, all on explicit state (nothing is hung on the model):
- ``prefill(inputs)``: the prompt with its images -> TargetState, next-token logits, features;
- ``forward_tree(state, tree)``: N tree tokens in ONE forward pass, with a 4D ancestor mask and
  per-node position ids (3-axis M-RoPE ids for Qwen2.5-VL) -> logits [N, V], features [N, H];
- ``commit(state, path)``: keep exactly the accepted path's KV entries.

"Features" are the target's last hidden states (what its LM head consumes): what an EAGLE-style
drafter is trained to predict.

Loading (`vlmspec.target.loading`), the attention backend (`vlmspec.target.attention`) and
prompts (`vlmspec.inputs`) live next to this class, not in it.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from vlmspec.errors import ConfigError, ContextLengthError, InputError
from vlmspec.kv_cache import ATTENTION_KINDS, KVCache, blocker_message, cache_kwarg, layer_kinds, rollback_blockers
from vlmspec.transfer import to_device
from vlmspec.tree import DraftTree, additive_mask, windowed_tree_mask
from vlmspec.vision_compress.capture import capture, image_token_id, last_layer_attention


@dataclass
class TargetState:
    """Per-request target state: the KV cache and where the sequence stands."""

    cache: KVCache
    seq_len: int  # tokens committed to the KV cache
    rope_delta: int = 0  # M-RoPE: text position = sequence index + rope_delta on all 3 axes


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [N, V] float32
    features: torch.Tensor  # [N, H]
    # prefill(visual=True) only:
    image_mask: torch.Tensor | None = None  # [L] bool
    image_embeds: torch.Tensor | None = None  # [n_img, H] the projected image embeddings the decoder read
    attention: torch.Tensor | None = None  # [L] last layer's head-averaged attention of the last token


def last_hidden(hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The decoder's last hidden states [B, L, H] from a forward's `hidden_states`. Gemma 3n keeps
    AltUp streams there, [S, B, L, H]: its main stream, 0, is the one the others are predicted from."""
    h = hidden_states[-1]
    return h[0] if h.ndim == 4 else h


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


# families whose models number positions from other than 0 (transformers computes them so itself)
POSITION_OFFSETS = {"paligemma": 1}


def _windows(kinds: list[str], kwargs: list[dict[str, Any]]) -> dict[str, int]:
    """{kind: window} for the sliding and chunked layers; one window per kind (the models' masks have one)."""
    out: dict[str, int] = {}
    for i, (kind, kw) in enumerate(zip(kinds, kwargs)):
        if kind in ("sliding_attention", "chunked_attention"):
            window = int(kw["sliding_window"])
            if out.setdefault(kind, window) != window:
                raise ConfigError(f"layer {i} ({kind}) has window {window} but an earlier one has {out[kind]}: "
                                  "tree verification needs one window per layer kind")
    return out


class Target:
    """A Hugging Face image-text-to-text model plus its processor, batch size 1."""

    def __init__(self, model: torch.nn.Module, processor: Any, name: str = "target") -> None:
        self.model = model.eval()
        self.processor = processor
        self.name = name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        base = getattr(model, "model", None)
        self._rope_index_fn = getattr(base, "get_rope_index", None)  # Qwen2-VL family: 3-axis M-RoPE
        self._rope_index_args = None if self._rope_index_fn is None else set(inspect.signature(self._rope_index_fn).parameters)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = gen_eos if gen_eos is not None else getattr(_text_config(model.config), "eos_token_id", None)
        self.eos_token_ids: set[int] = set() if eos is None else set(eos if isinstance(eos, list) else [eos])
        kinds, kwargs = layer_kinds(model.config)
        self.layer_kinds: list[str] = kinds  # per decoder layer: 'full_attention', 'sliding_attention', 'conv', ...
        self.windows = _windows(kinds, kwargs)  # {'sliding_attention': W, 'chunked_attention': C} where present
        # the attention kinds a tree forward masks, each its own way (one kind: one mask tensor)
        self._mask_kinds = sorted({k for k in kinds if k in ATTENTION_KINDS}) or ["full_attention"]
        # kinds whose state a rejected draft cannot be taken out of: plain decoding only (check_speculative)
        self.rollback_blockers = rollback_blockers(kinds)
        # where the model's own position count starts (PaliGemma counts from 1: a shift RoPE cannot
        # see in the tokens, but one the logits carry at float rounding)
        self.position_offset = POSITION_OFFSETS.get(str(getattr(model.config, "model_type", "")), 0)
        self._tree_problem: str | None = None  # checked once, when a speculative drafter first asks

    # ---------------------------------------------------------------- properties
    @property
    def text_config(self) -> Any:
        return _text_config(self.model.config)

    @property
    def attention(self) -> str:
        """The attention implementation the language model runs ('sdpa', 'eager', 'vlmspec_tree', ...)."""
        return str(self.text_config._attn_implementation)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.text_config, "max_position_embeddings", 1 << 30))

    @property
    def image_tokens(self) -> int | None:
        """Tokens one image takes in the prompt, where the config fixes it (None: it varies by image)."""
        n = getattr(self.model.config, "image_seq_length", None)
        return int(n) if isinstance(n, int) and n > 0 else None

    @property
    def uses_mrope(self) -> bool:
        return self._rope_index_fn is not None

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    def check_speculative(self) -> None:
        """Raise ConfigError, saying what works instead, when drafts verified as a tree would not be
        exact: decoder state a rejected draft cannot be rolled back out of, attention scaled by token
        index, or a model that counts positions its own way or does not take the tree's masks (a
        one-time check, `_probe_tree_inputs`). Plain decoding needs none of this."""
        if self.rollback_blockers:
            raise ConfigError(blocker_message(self.name, self.rollback_blockers))
        tc = self.text_config
        if getattr(tc, "attn_temperature_tuning", False) and 0 in (getattr(tc, "no_rope_layers", None) or []):
            raise ConfigError(f"{self.name}: its layers without RoPE scale attention by a token's index in the forward, "
                              "not by its position, so tree nodes would be scaled as if laid out in a row. Use --drafter none "
                              "(plain decoding, exact) with this model.")
        if self._tree_problem is None:
            self._tree_problem = self._probe_tree_inputs()
        if self._tree_problem:
            raise ConfigError(f"{self.name}: {self._tree_problem}, so a draft tree cannot be verified in one forward. "
                              "Use --drafter none (plain decoding, exact) with this model.")

    @torch.no_grad()
    def _probe_tree_inputs(self) -> str:
        """'' when three tokens verified as one chain (explicit position ids, masks per layer kind) give
        the logits of the same tokens as the model's own plain steps, else what goes wrong: positions
        it counts its own way (M2M100 / Kosmos), or masks its wrapper does not take (PaliGemma 2).
        The bound is loose enough for bf16 rounding; what it catches is far larger, or an exception."""
        prompt = {"input_ids": torch.tensor([[1, 2]], device=self.device)}
        prompt["attention_mask"] = torch.ones_like(prompt["input_ids"])
        try:
            state, _ = self.prefill(prompt)
            steps = []
            for tok in (3, 4, 5):
                steps.append(self.forward_tree(state, DraftTree.root_only(tok)).logits[0])
                self.commit(state, [0])
            state, _ = self.prefill(prompt)
        except (TypeError, ValueError, RuntimeError) as exc:  # e.g. a model that runs only with an image
            return f"the model does not run a text-only check of a tree forward ({type(exc).__name__}: {str(exc)[:120]})"
        try:
            chain = self.forward_tree(state, DraftTree.chain(3, [4, 5])).logits
        except (TypeError, ValueError, RuntimeError, AttributeError, KeyError) as exc:
            return f"the model does not take a tree's per-layer masks and position ids ({type(exc).__name__}: {str(exc)[:120]})"
        plain = torch.stack(steps)
        tol = (1e-3 if self.dtype == torch.float32 else 5e-2) * max(1.0, float(plain.abs().max()))
        if float((chain - plain).abs().max()) <= tol:
            return ""
        return "the model computes its own position ids or masks (a chain given explicitly changes its logits)"

    def input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def output_embeddings(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    # ---------------------------------------------------------------- forwards
    def _prefill_positions(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, int]:
        """M-RoPE: the prompt's position ids [3, 1, L] and its rope delta, from the model's own
        `get_rope_index` given whichever of the processor's outputs it takes (image grids for
        Qwen-VL, target sizes for MiniCPM-V, ...); other models: (None, 0)."""
        if not self.uses_mrope:
            return None, 0
        assert self._rope_index_args is not None
        ids = inputs["input_ids"]
        kwargs = {k: v for k, v in inputs.items() if k in self._rope_index_args and k != "input_ids"}
        if not set(kwargs) - {"attention_mask", "mm_token_type_ids"}:  # no image or video: every axis counts tokens
            return torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(3, 1, -1), 0
        pos, delta = self._rope_index_fn(ids, **kwargs)
        return pos, int(delta.reshape(-1)[0])

    @torch.no_grad()
    def prefill(self, inputs: dict[str, torch.Tensor], visual: bool = False) -> tuple[TargetState, ForwardOut]:
        """Run the prompt (with images). Returns the state and logits/features of the LAST token
        (logits [1, V]) plus features of every prompt token ([L, H]). visual=True also captures
        the image embeddings and the last token's attention (for VLM-aware drafters)."""
        ids = inputs["input_ids"]
        assert ids.shape[0] == 1, "batch size 1"
        length = ids.shape[1]
        if length >= self.max_positions:
            raise ContextLengthError(
                f"prompt is {length} tokens but the model's context is {self.max_positions}: shorten the prompt or use fewer images"
            )
        position_ids, delta = self._prefill_positions(inputs)
        cache = KVCache.for_model(self.model.config)
        kwargs = dict(inputs)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        with capture(self.model, attention=visual) if visual else nullcontext() as cap:
            try:
                out = self.model(
                    **kwargs, **cache_kwarg(self.model, cache.hf), use_cache=True, output_hidden_states=True, logits_to_keep=1, return_dict=True
                )
            except ValueError as exc:  # the model's own check of its inputs (e.g. one that runs only with an image)
                raise InputError(f"{self.name} cannot run this prompt: {exc}", code="unsupported_prompt") from exc
        state = TargetState(cache=cache, seq_len=length, rope_delta=delta)
        assert cache.seq_len == length, (cache.seq_len, length)
        result = ForwardOut(out.logits[0, -1:].float(), last_hidden(out.hidden_states)[0])
        if visual:
            mask = ids[0] == image_token_id(self.model)
            result.image_mask = mask
            result.image_embeds = cap.inputs_embeds[0, mask]
            result.attention = last_layer_attention(self.model, cap, torch.tensor([length - 1], device=ids.device))[0]
        return state, result

    def tree_position_ids(self, state: TargetState, depth: torch.Tensor) -> torch.Tensor:
        """Per-node positions: committed length + depth (+ rope delta on every M-RoPE axis).

        depth: [N] -> [1, N] (1-D RoPE) or [3, 1, N] (M-RoPE).
        """
        pos = to_device(state.seq_len + state.rope_delta + self.position_offset + depth, self.device)[None]
        if self.uses_mrope:
            return pos[None].expand(3, 1, -1)
        return pos

    def tree_masks(self, state: TargetState, tree: DraftTree) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive masks of a tree forward, [1, 1, N, seq_len + N] each: one for all layers when
        every layer is of one kind, else one per layer kind (the form transformers' models that mix
        kinds take), each cut by that kind's window. Built on the host, copied without a
        host sync on CUDA."""
        ancestors = tree.ancestor_mask()

        def mask(kind: str) -> torch.Tensor:
            allowed = windowed_tree_mask(ancestors, state.seq_len, tree.depth, kind, self.windows.get(kind))
            return to_device(additive_mask(allowed, self.dtype), self.device)

        if len(self._mask_kinds) == 1:  # one kind for every layer: one tensor (what a model with one mask function takes)
            return mask(self._mask_kinds[0])
        return {kind: mask(kind) for kind in self._mask_kinds}

    @torch.no_grad()
    def forward_tree(self, state: TargetState, tree: DraftTree) -> ForwardOut:
        """All N tree nodes in one forward over the cached prefix. Appends N KV entries: call
        `commit` afterwards. logits [N, V]: row i is the distribution after node i."""
        if state.seq_len + int(tree.depth.max()) + 1 > self.max_positions:
            raise ContextLengthError(f"tree reaches past the context of {self.max_positions} tokens")
        # a lone root is a plain decode step: the model's own causal (and windowed) masks are exact
        # and take the fast kernels
        mask = None if tree.size == 1 else self.tree_masks(state, tree)
        out = self.model(
            input_ids=to_device(tree.tokens[None], self.device),
            attention_mask=mask,
            # a plain step takes the model's own next position (models count positions their own way);
            # a tree gives every node its own (check_speculative: only where the two agree)
            position_ids=self.tree_position_ids(state, tree.depth) if tree.size > 1 or self.uses_mrope else None,
            **cache_kwarg(self.model, state.cache.hf),
            use_cache=True,
            output_hidden_states=True,
            return_dict=True,
        )
        return ForwardOut(out.logits[0].float(), last_hidden(out.hidden_states)[0])

    def commit(self, state: TargetState, path: list[int]) -> None:
        """Keep the KV entries of the accepted path (root first) and drop the rest of the tree."""
        state.cache.commit(state.seq_len, torch.tensor(path, dtype=torch.long))
        state.seq_len += len(path)
