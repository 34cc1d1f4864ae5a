"""Target adapter over an unmodified Hugging Face VLM.

Calls on explicit state (nothing is hung on the model); a request is a row of a batch:
- ``prefill(inputs, cache, slot)``: the prompt with its images, into its slot of the batch's
  `SlotCache` -> TargetState, next-token logits, features;
- ``forward_batch(states, trees)``: every row's tree (N_b nodes) in ONE forward pass, each row with
  its own 4D ancestor mask over its own committed entries and its own per-node position ids (3-axis
  M-RoPE ids with the row's rope delta) -> logits [B, N, V], features [B, N, H] (N = max N_b);
- ``commit_batch(states, paths)``: keep exactly each row's accepted path's KV entries.
``forward_tree`` / ``commit`` are the same for one row. "Features" are the target's last hidden
states (what an EAGLE-style drafter learns to predict), or with `layers` those layers' states
concatenated [.., m x H] from the same forward. Loading, the attention backend, where a prompt may
be cut (chunked prefill) and prompts live beside this class: `loading`, `attention`, `pieces`, `vlmspec.inputs`.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from vlmspec.errors import ConfigError, ContextLengthError, InputError
from vlmspec.kernels import tree_attention
from vlmspec.kernels.packed_linear import ExactPackedLinear
from vlmspec.cache.kv_cache import ATTENTION_KINDS, blocker_message, cache_kwarg, layer_kinds, rollback_blockers
from vlmspec.cache.slot_cache import SlotCache, single_slot_reason
from vlmspec.target.attention import GQA_SDPA, RAGGED_KWARG, RaggedRows
from vlmspec.target.pieces import probe_prompt_pieces
from vlmspec.runtime.transfer import to_device
from vlmspec.tree import DraftTree, additive_mask, windowed_tree_mask
from vlmspec.vision_compress.capture import capture, image_token_id, last_layer_attention


# Unequal trees are laid end to end when padding would be at least this share of the padded batch's
# nodes. Laying out costs about 1.7-1.9 ms a forward and a padding node saves about 0.3-0.4 (bf16,
# the default model, 8 rows on this CPU, `vlmspec bench verify-cost --model models/smolvlm-toyworld
# --dtype bfloat16 --prefix 184 --sizes 1 --rows ...`: no padding lost 1.7-1.9 ms, 6 padding nodes
# of 32 saved 0.2, 24 of 40 saved 7.0, 64 of 136 saved 16.2; docs/batching.md)
RAGGED_MIN_PADDING = 0.25


@dataclass
class TargetState:
    """One request's target state: its slot of the batch's KV cache and where its sequence stands."""

    cache: SlotCache  # the batch's cache (shared by every request of the batch)
    seq_len: int  # tokens committed to the slot
    rope_delta: int = 0  # M-RoPE: text position = sequence index + rope_delta on all 3 axes
    slot: int = 0  # this request's row of every layer's buffer

    def entries(self, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The committed keys and values of layers < num_layers, [1, kv_heads, seq_len, head_dim] views."""
        return self.cache.entries(self.slot, self.seq_len, num_layers)


@dataclass
class BatchOut:
    logits: torch.Tensor  # [B, N, V] float32: row b, node i < N_b: the distribution after node i
    features: torch.Tensor  # [B, N, H] (or [B, N, mH]: the `layers` asked for)


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [N, V] float32
    features: torch.Tensor  # [N, H] (or [N, mH]: the `layers` asked for)
    # prefill(visual=True) only:
    image_mask: torch.Tensor | None = None  # [L] bool
    image_embeds: torch.Tensor | None = None  # [n_img, H] the projected image embeddings the decoder read
    attention: torch.Tensor | None = None  # [L] last layer's head-averaged attention of the last token


def _main_stream(h: torch.Tensor) -> torch.Tensor:
    """One entry of `hidden_states` as [B, L, H]. Gemma 3n keeps AltUp streams there, [S, B, L, H]:
    its main stream, 0, is the one the others are predicted from."""
    return h[0] if h.ndim == 4 else h


def last_hidden(hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The decoder's last hidden states [B, L, H] from a forward's `hidden_states`."""
    return _main_stream(hidden_states[-1])


def layer_features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...] | None) -> torch.Tensor:
    """A forward's `hidden_states` -> the features a drafter reads: [B, L, H], the last hidden state
    (layers None), or [B, L, m x H], the hidden states decoder layers `layers` read (id i is
    `hidden_states[i]`: 0 the embedding output, i the output of layer i - 1), concatenated in order."""
    if layers is None:
        return last_hidden(hidden_states)
    assert max(layers) < len(hidden_states) - 1, (layers, len(hidden_states))
    return torch.cat([_main_stream(hidden_states[i]) for i in layers], dim=-1)


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
    """A Hugging Face image-text-to-text model plus its processor: prefill into a slot of a `SlotCache`,
    verify the draft trees of several slots in one forward (`forward_batch`), commit each accepted path."""

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
        self._ragged: bool | None = None  # whether unequal trees can be laid end to end: checked once (`verifies_ragged`)
        self._pieces_problem: str | None = None  # why a prompt cannot be prefilled in pieces: checked once

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
    def packed_layers(self) -> int:
        """Linear layers that multiply a decode step's rows by a packed weight (`ExactPackedLinear`)."""
        return sum(isinstance(m, ExactPackedLinear) for m in self.model.modules())

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
        problem = self._explicit_inputs_problem()
        if problem:
            raise ConfigError(f"{problem} Use --drafter plain (plain decoding through the same engine, exact) with this model.")

    def check_batching(self) -> None:
        """Raise ConfigError when rows of different lengths could not share a forward exactly: rows
        need the same explicit masks and positions a tree does (`check_speculative`)."""
        problem = self._explicit_inputs_problem() or single_slot_reason(self.model.config)
        if problem:
            raise ConfigError(f"{problem.rstrip('.')}. It decodes one request at a time (a batch of one slot).")

    def _explicit_inputs_problem(self) -> str:
        """'' when forwards given explicit 4D masks and position ids are exact for this model, else why not."""
        if self.rollback_blockers:
            return blocker_message(self.name, self.rollback_blockers).split(" Use --drafter plain")[0]
        tc = self.text_config
        if getattr(tc, "attn_temperature_tuning", False) and 0 in (getattr(tc, "no_rope_layers", None) or []):
            return (f"{self.name}: its layers without RoPE scale attention by a token's index in the forward, "
                    "not by its position, so tree nodes would be scaled as if laid out in a row.")
        if self._tree_problem is None:
            self._tree_problem = self._probe_tree_inputs()
        if self._tree_problem:
            return f"{self.name}: {self._tree_problem}, so a draft tree cannot be verified in one forward."
        return ""

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

    def prompt_pieces_problem(self) -> str:
        """'' when a prompt may be prefilled in pieces (chunked prefill), else why not: checked once
        (`vlmspec.target.pieces.probe_prompt_pieces`)."""
        if self._pieces_problem is None:
            self._pieces_problem = probe_prompt_pieces(self)
        return self._pieces_problem

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

    def new_cache(self, slots: int = 1, capacity: int = 256) -> SlotCache:
        """A KV cache for `slots` requests at once (`vlmspec.cache.slot_cache`); `capacity` entries per slot
        are allocated at the first write (more when a request needs them)."""
        return SlotCache(self.model.config, slots=slots, capacity=capacity)

    @torch.no_grad()
    def prefill(self, inputs: dict[str, torch.Tensor], visual: bool = False, cache: SlotCache | None = None,
                slot: int = 0, layers: tuple[int, ...] | None = None) -> tuple[TargetState, ForwardOut]:
        """Run the prompt (with images) into `slot` of `cache` (None: a cache of its own, one slot).
        Returns the state and logits/features of the LAST token (logits [1, V]) plus features of every
        prompt token ([L, H]). visual=True also captures the image embeddings and the last token's
        attention (for VLM-aware drafters). `layers`: the features are those layers' hidden states
        ([L, mH], `layer_features`). The prompt runs alone, as batch 1: its numbers are the
        same whatever else the batch holds."""
        ids = inputs["input_ids"]
        assert ids.shape[0] == 1, "one prompt per prefill"
        length = ids.shape[1]
        if length >= self.max_positions:
            raise ContextLengthError(
                f"prompt is {length} tokens but the model's context is {self.max_positions}: shorten the prompt or use fewer images"
            )
        position_ids, delta = self._prefill_positions(inputs)
        cache = cache if cache is not None else self.new_cache(1, length + 64)
        cache.reset_slot(slot)
        cache.begin([slot], [0])
        kwargs = dict(inputs)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        with capture(self.model, attention=visual) if visual else nullcontext() as cap:
            try:
                out = self.model(
                    **kwargs, **cache_kwarg(self.model, cache), use_cache=True, output_hidden_states=True, logits_to_keep=1, return_dict=True
                )
            except ValueError as exc:  # the model's own check of its inputs (e.g. one that runs only with an image)
                raise InputError(f"{self.name} cannot run this prompt: {exc}", code="unsupported_prompt") from exc
        state = TargetState(cache=cache, slot=slot, seq_len=length, rope_delta=delta)
        result = ForwardOut(out.logits[0, -1:].float(), layer_features(out.hidden_states, layers)[0])
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
        return self.batch_position_ids([state], depth[None])

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

    def batch_position_ids(self, states: list[TargetState], depth: torch.Tensor) -> torch.Tensor:
        """Per-row, per-node positions: the row's committed length + depth (+ the row's rope delta on
        every M-RoPE axis). depth: [B, N] (padding nodes at depth 0) -> [B, N] or [3, B, N]."""
        base = torch.tensor([s.seq_len + s.rope_delta + self.position_offset for s in states], dtype=torch.long)
        pos = to_device(base[:, None] + depth, self.device)
        return pos[None].expand(3, -1, -1) if self.uses_mrope else pos

    def batch_masks(self, states: list[TargetState], trees: list[DraftTree], n: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive masks of a batched tree forward, [B, 1, n, max(seq_len) + n] each (one tensor, or
        one per layer kind as `tree_masks`). Row b is its own `tree_masks` (its committed entries, its
        tree's ancestors, its kinds' windows) laid at its own offset; everything else of the row is
        masked: other rows' longer prefixes, stale entries of rejected drafts, and the padding nodes
        after its own, which see only themselves (no row is all masked)."""
        if len(states) == 1 and trees[0].size == n:  # one row: its own mask is the batch's
            return self._described(self.tree_masks(states[0], trees[0]), states, trees, n)
        width = max(s.seq_len for s in states) + n
        lo = torch.finfo(self.dtype).min
        per_row = [self.tree_masks(s, t) for s, t in zip(states, trees)]
        kinds = list(per_row[0]) if isinstance(per_row[0], dict) else [None]
        out = {}
        for kind in kinds:
            full = torch.full((len(states), 1, n, width), lo, dtype=self.dtype, device=self.device)
            for b, (state, tree, mask) in enumerate(zip(states, trees, per_row)):
                row = mask if kind is None else mask[kind]  # [1, 1, n_b, seq_b + n_b]
                full[b, 0, : tree.size, : row.shape[-1]] = row[0, 0]
                pad = torch.arange(tree.size, n, device=self.device)
                full[b, 0, pad, state.seq_len + pad] = 0
            out[kind] = full
        return self._described(out[None] if kinds == [None] else out, states, trees, n)  # type: ignore[index]

    def _described(self, masks: torch.Tensor | dict[str, torch.Tensor], states: list[TargetState], trees: list[DraftTree],
                   n: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """With the Triton tree kernel as the attention, say what the full-attention mask holds (each
        row's committed length and its tree's ancestors, padding nodes seeing themselves), so the
        kernel takes every row at its own offset and reads nothing back from the device. Windowed
        kinds are not described: their masks go to SDPA, or are analysed when every row is alike."""
        full = masks.get("full_attention") if isinstance(masks, dict) else masks if self._mask_kinds == ["full_attention"] else None
        if full is None or self.attention != tree_attention.DEFAULT_NAME:
            return masks
        eye = torch.eye(n, dtype=torch.bool)
        bits = []
        for tree in trees:
            allowed = eye.clone()
            allowed[: tree.size, : tree.size] = tree.ancestor_mask()
            bits.append(tree_attention.pack_tree_mask(allowed))
        lengths = torch.tensor([s.seq_len for s in states], dtype=torch.int32)
        tree_attention.describe_mask(full, to_device(torch.stack(bits), self.device), to_device(lengths, self.device))
        return masks

    @torch.no_grad()
    def forward_batch(self, states: list[TargetState], trees: list[DraftTree], layers: tuple[int, ...] | None = None,
                      ragged: bool | None = None) -> BatchOut:
        """Every row's tree in one forward over the rows' committed entries (all rows in one cache).
        Writes each row's N entries after its committed ones: call `commit_batch` afterwards (until
        then the row's length is unchanged, so another forward would overwrite them).
        logits [B, N, V]: row b, node i < N_b is the distribution after that node; rows are padded
        to N = max N_b with copies of their root at depth 0, which nothing reads. `layers`: as `prefill`.
        Trees of unequal sizes go in laid end to end where the target takes it (`verifies_ragged`;
        `ragged` forces either way): the forward then computes the real nodes only, padding happens
        inside attention (`RaggedRows`), and the outputs come back padded as above."""
        cache = states[0].cache
        assert all(s.cache is cache for s in states), "the rows of a batch share one cache"
        for s, t in zip(states, trees):
            if s.seq_len + int(t.depth.max()) + 1 > self.max_positions:
                raise ContextLengthError(f"tree reaches past the context of {self.max_positions} tokens")
        sizes = [t.size for t in trees]
        n = max(sizes)
        if ragged is None:  # worth it where padding is a quarter of the batch's nodes or more (`RAGGED_MIN_PADDING`)
            ragged = len(trees) > 1 and (len(trees) * n - sum(sizes)) >= RAGGED_MIN_PADDING * len(trees) * n and self.verifies_ragged
        cache.begin([s.slot for s in states], [s.seq_len for s in states], sizes if ragged else None)
        depth = torch.stack([torch.cat([t.depth, t.depth.new_zeros(n - t.size)]) for t in trees])  # [B, n]
        # one row, a lone root: a plain decode step, the model's own causal (and windowed) masks and
        # positions are exact (models count positions their own way) and take the fast kernels
        plain = len(states) == 1 and n == 1
        positions = None if plain and not self.uses_mrope else self.batch_position_ids(states, depth)  # [B, n] or [3, B, n]
        rows = RaggedRows.of(sizes, self.device) if ragged else None
        if rows is None:
            tokens = torch.stack([torch.cat([t.tokens, t.tokens[:1].expand(n - t.size)]) for t in trees])  # [B, n]
        else:
            assert positions is not None
            tokens = torch.cat([t.tokens for t in trees])[None]  # [1, T]
            positions = positions.flatten(-2)[..., rows.real].unsqueeze(-2)  # [1, T] or [3, 1, T]
        out = self.model(
            input_ids=to_device(tokens, self.device),
            attention_mask=None if plain else self.batch_masks(states, trees, n),
            position_ids=positions,
            **cache_kwarg(self.model, cache),
            use_cache=True,
            output_hidden_states=True,
            return_dict=True,
            **({RAGGED_KWARG: rows} if rows is not None else {}),
        )
        logits, features = out.logits, layer_features(out.hidden_states, layers)
        if rows is not None:
            logits, features = rows.pad(logits[0]), rows.pad(features[0])
        return BatchOut(logits.float(), features)

    @property
    def verifies_ragged(self) -> bool:
        """Whether `forward_batch` lays unequal trees end to end: with the attention that takes them
        (`GQA_SDPA`, 'auto' on CPU), once a one-time check (`_probe_ragged`) finds this model gives
        the padded forward's logits that way."""
        if self.attention != GQA_SDPA:
            return False
        if self._ragged is None:
            self._ragged = self._probe_ragged()
        return self._ragged

    @torch.no_grad()
    def _probe_ragged(self) -> bool:
        """Rows of 1 and 3 nodes after prompts of 2 and 3 tokens, padded and laid end to end: the same
        logits within `_probe_tree_inputs`' bound, or False for a model whose forward does not pass the
        rows' layout down to its attention (or has no explicit-input tree forward at all). Never in
        float32: laid end to end, every linear layer multiplies another number of rows than padded,
        and CPU kernels follow the row count (AVX2's gave the padded numbers at 4 rows against 6, not
        at 7 against 12), so no one-time check can show the layout changes no number; the fp32 rows
        are padded. bf16 promises answers up to near-ties, which the bound is for."""
        if self.dtype == torch.float32 or self._explicit_inputs_problem() or single_slot_reason(self.model.config):
            return False
        cache = self.new_cache(2, 16)
        states = []
        for slot, ids in enumerate(([1, 2], [1, 2, 6])):
            prompt = {"input_ids": torch.tensor([ids], device=self.device)}
            states.append(self.prefill({**prompt, "attention_mask": torch.ones_like(prompt["input_ids"])}, cache=cache, slot=slot)[0])
        trees = [DraftTree.root_only(3), DraftTree.chain(3, [4, 5])]
        padded = self.forward_batch(states, trees, ragged=False).logits
        try:
            laid = self.forward_batch(states, trees, ragged=True).logits
        except (TypeError, ValueError, RuntimeError, AttributeError, KeyError):
            return False
        want, got = torch.cat([padded[0, :1], padded[1]]), torch.cat([laid[0, :1], laid[1]])
        return float((got - want).abs().max()) <= 5e-2 * max(1.0, float(want.abs().max()))

    def forward_tree(self, state: TargetState, tree: DraftTree, layers: tuple[int, ...] | None = None) -> ForwardOut:
        """One row's tree (`forward_batch` of one): logits [N, V], features [N, H] (or [N, mH], `layers`)."""
        out = self.forward_batch([state], [tree], layers)
        return ForwardOut(out.logits[0], out.features[0])

    def commit_batch(self, states: list[TargetState], paths: list[list[int]]) -> None:
        """Each row keeps the KV entries of its accepted path (root first) and drops the rest of its tree."""
        states[0].cache.commit([s.slot for s in states], [s.seq_len for s in states], paths)
        for state, path in zip(states, paths):
            state.seq_len += len(path)

    def commit(self, state: TargetState, path: list[int]) -> None:
        self.commit_batch([state], [path])
