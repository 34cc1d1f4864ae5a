"""`SpecEngine`: a target and a drafter, the request's first step (`_open`: prefill, the drafter's
session, the first token), and `generate` / `stream` / `generate_many` over a `Batch`."""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import torch

from vlmspec.policy.control import Speculation
from vlmspec.draft.base import Drafter, PlainDrafter, PromptContext, TreeConfig, feature_layers
from vlmspec.engine.batch import Batch, _Request
from vlmspec.engine.prefill import PromptPieces
from vlmspec.engine.prompt_cache import PromptCache
from vlmspec.engine.types import Clock, GenerationConfig, GenerationResult, StepEvent
from vlmspec.sampling import next_token
from vlmspec.cache.slot_cache import SlotCache
from vlmspec.target import Target
from vlmspec.target.pieces import first_piece, prompt_head


class Generation:
    """An iterable of one request's StepEvents (a batch of one); `result` is set once iteration ends.
    `close()` stops it early."""

    def __init__(self, engine: "SpecEngine", inputs: dict[str, torch.Tensor], config: GenerationConfig) -> None:
        self.result: GenerationResult | None = None
        self._it = self._run(engine, inputs, config)

    def _run(self, engine: "SpecEngine", inputs: dict[str, torch.Tensor], config: GenerationConfig) -> Iterator[StepEvent]:
        batch = Batch(engine, slots=1)
        ticket = batch.submit(inputs, config)
        try:
            while ticket.result is None:
                events = batch.step()
                if ticket.error is not None:  # raised before anything was emitted (e.g. ContextLengthError)
                    raise ticket.error
                for _, event in events:
                    yield event
            if ticket.request.failure is not None:  # the step failed for this request: it left the batch
                raise ticket.request.failure.error
        finally:
            if ticket.result is None:
                batch.cancel(ticket)
            self.result = ticket.result

    def __iter__(self) -> Iterator[StepEvent]:
        return self._it

    def close(self) -> None:
        self._it.close()


class SpecEngine:
    def __init__(self, target: Target, drafter: Drafter, speculation: Speculation | None = None,
                 prompt_cache: PromptCache | None = None) -> None:
        if not isinstance(drafter, PlainDrafter):
            target.check_speculative()  # e.g. conv / recurrent state: plain decoding only, said at load
        self.target = target
        self.drafter = drafter
        self.speculation = speculation or Speculation()  # default policy + cost model (read-only)
        self.prompt_cache = prompt_cache  # prefills of prompts seen before (None: every prompt runs)

    def request_tree(self, config: GenerationConfig) -> TreeConfig | None:
        """The tree shape of a request: its own or the drafter's, within its tree budget."""
        tree = config.tree or self.drafter.tree
        budget = config.speculation.tree_tokens
        return tree if tree is None or budget is None else dataclasses.replace(tree, total_tokens=budget)

    def tree_room(self, config: GenerationConfig) -> int:
        """Cache entries a request takes beyond its prompt and answer: its last step's tree."""
        tree = self.request_tree(config)
        return tree.total_tokens + 1 if tree else 1

    def generate(self, inputs: dict[str, torch.Tensor], config: GenerationConfig) -> GenerationResult:
        gen = self.stream(inputs, config)
        for _ in gen:
            pass
        assert gen.result is not None
        return gen.result

    def stream(self, inputs: dict[str, torch.Tensor], config: GenerationConfig) -> Generation:
        return Generation(self, inputs, config)

    def batch(self, slots: int, capacity: int | None = None, prefill_budget: int | None = None,
              prefill_chunk: int | None = None, prefill_first: bool = False) -> Batch:
        """A batch of `slots` requests decoded together (see `Batch`)."""
        return Batch(self, slots, capacity, prefill_budget, prefill_chunk, prefill_first)

    def generate_many(self, requests: list[tuple[dict[str, torch.Tensor], GenerationConfig]], slots: int,
                      capacity: int | None = None, prefill_budget: int | None = None,
                      prefill_chunk: int | None = None) -> list[GenerationResult]:
        """Every request, at most `slots` at a time, each joining as soon as a slot is free; results in
        order. A request whose admission (or a step, for it alone) fails raises its error once the
        others have finished."""
        batch = self.batch(slots, capacity, prefill_budget=prefill_budget, prefill_chunk=prefill_chunk)
        tickets = [batch.submit(inputs, config) for inputs, config in requests]
        while not batch.idle:
            batch.step()
        for ticket in tickets:
            if ticket.error is not None:
                raise ticket.error
            if ticket.request is not None and ticket.request.failure is not None:
                raise ticket.request.failure.error
        return [t.result for t in tickets]  # type: ignore[misc]

    def first_piece(self, inputs: dict[str, torch.Tensor], chunk: int | None) -> int:
        """The prompt tokens a request's first prefill takes when pieces are `chunk` tokens at most
        (`vlmspec.target.pieces.first_piece`); drafters that read the prompt's attention get it whole."""
        return first_piece(self.target, inputs, None if self.drafter.needs_visual else chunk)

    def _open(self, inputs: dict[str, torch.Tensor], config: GenerationConfig, cache: SlotCache, slot: int,
              end: int | None = None) -> _Request:
        """Prefill into `slot` the prompt's first `end` tokens (None: all; the rest enter in pieces,
        `vlmspec.engine.prefill`). Once the whole prompt is in, `_begin`."""
        target = self.target
        t_start = time.perf_counter()
        clock = Clock(target.device, config.sync_timings)
        end = int(inputs["input_ids"].shape[1]) if end is None else end
        head, visual, layers = prompt_head(inputs, end), self.drafter.needs_visual, feature_layers(self.drafter)
        if self.prompt_cache is not None:
            state, out = self.prompt_cache.prefill(target, head, visual, cache, slot, layers)
        else:
            state, out = target.prefill(head, visual=visual, cache=cache, slot=slot, layers=layers)
        clock.lap("prefill")
        rng = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
        policy = config.policy or self.speculation.policy(config.speculation.policy)
        name = "plain" if isinstance(self.drafter, PlainDrafter) else policy.name  # plain decoding: no policy at work
        req = _Request(config, state, None, policy.start(), name, self.request_tree(config), rng,
                       set() if config.ignore_eos else target.eos_token_ids, clock.t, int(inputs["input_ids"].shape[1]), t_start)
        req.pieces = PromptPieces(inputs, out, end, [out.features], out.logits)
        if req.pieces.left == 0:
            self._begin(req)
        return req

    def _begin(self, req: _Request) -> dict[str, float]:
        """The whole prompt is in its slot: open the drafter's session on its features, pick the first
        token. Returns its seconds by phase (also added to the request's)."""
        pieces, config = req.pieces, req.config
        assert pieces is not None and pieces.left == 0 and pieces.logits is not None
        clock = Clock(self.target.device, config.sync_timings)
        first = pieces.first
        prompt = PromptContext(pieces.inputs["input_ids"][0].cpu(), pieces.prompt_features(), pieces.inputs, first.image_mask,
                               first.image_embeds, first.attention, kv=req.state.entries, tenant=config.tenant, remember=config.remember)
        req.session = self.drafter.start(prompt, req.tree)
        req.root = next_token(pieces.logits[0], config.sampling, req.rng)
        req.pieces = None
        clock.lap("draft")
        for key, sec in clock.t.items():
            req.timings[key] += sec
        return clock.t
