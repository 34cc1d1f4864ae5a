"""The speculative decoding loop, on token ids, over a batch of requests (a batch of one included).

    batch.add(request)   -> prefill into a free slot of the batch's KV cache, first token (root)
    batch.step():                                            # one round over every live request
        depth_b  = control_b.choose(max_depth_b)            # how deep each row drafts (vlmspec.control)
        trees    = propose_all(drafter, sessions, roots, depths, chains)   # per-row trees (EAGLE: rows together)
        out      = target.forward_batch(states, trees)      # ONE target forward over every row's nodes
        verdicts = verify_rows(trees, out.logits, ...)      # each row: accepted path + recovered/bonus token
        target.commit_batch(states, paths); session_b.commit(...)  # keep each row's accepted KV entries
        control_b.observe(...); emit each row's tokens      # rows that finished leave; their slot is free

With the `none` drafter every tree is the root alone and this is plain autoregressive decoding,
which is the oracle every other drafter is tested against. The engine knows token ids only:
detokenization, stop strings and hold-back live in `vlmspec.text`, wrapped around it. Everything
one request needs travels in its `GenerationConfig` and its `_Request` state, never on the engine;
`SpecEngine.generate` / `stream` run a `Batch` of one.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from vlmspec.batch_control import BatchTiming, batch_chains, choose_depths
from vlmspec.control import Controller, Policy, Speculation, SpeculationOptions
from vlmspec.draft.base import Drafter, NoDrafter, PromptContext, TreeConfig, feature_layers, propose_all
from vlmspec.sampling import SamplingParams, next_token
from vlmspec.stats import SpecStats
from vlmspec.errors import ContextLengthError
from vlmspec.slot_cache import SlotCache
from vlmspec.target import Target, TargetState, decoding_sdpa
from vlmspec.transfer import to_device
from vlmspec.verify.acceptance import verify_rows

TIMING_KEYS = ("prefill", "draft", "verify", "commit", "other")


@dataclass
class GenerationConfig:
    """Per-request options of the token-level engine."""

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    ignore_eos: bool = False
    tree: TreeConfig | None = None  # this request's draft-tree shape (None: the drafter's default)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)  # policy, max depth, tree budget
    policy: Policy | None = None  # an explicit policy object (benches, tests); wins over speculation.policy
    sync_timings: bool = True  # on CUDA, synchronise before each timing lap (exact split, one sync per lap)
    # a drafter that learns from traffic (`--drafter suffix`): whose earlier answers this request may be
    # drafted from and whose pool its answer joins (None: the shared pool; the service: one per API key),
    # and whether its answer is kept for later requests at all
    tenant: str | None = None
    remember: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class StepEvent:
    """What one target forward pass produced."""

    token_ids: list[int]  # tokens emitted by this pass (cut at EOS / max tokens)
    num_drafted: int  # drafted nodes in the tree (root excluded)
    num_accepted: int  # accepted drafted tokens (tau of this pass = num_accepted + 1)
    depth: int = 0  # levels the controller chose to draft this pass (0: a plain step, and the prefill's token)


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) | "length" (max tokens or context)
    prompt_tokens: int
    stats: SpecStats  # counters of this generation's verify forwards
    elapsed_s: float
    timings: dict[str, float]  # seconds: prefill, draft, verify, commit, other
    policy: str = "fixed"  # the speculation policy that ran ("none": plain decoding, no depths)
    depths: list[int] = field(default_factory=list)  # [step]: levels the controller chose, per verify forward

    @property
    def num_target_forwards(self) -> int:  # prefill + verify forwards
        return 1 + self.stats.num_drafts

    @property
    def num_drafted(self) -> int:
        return self.stats.num_draft_tokens

    @property
    def num_accepted(self) -> int:
        return self.stats.num_accepted_tokens

    @property
    def mean_accepted_length(self) -> float:  # tokens per verify forward, bonus included
        return self.stats.mean_accepted_length

    @property
    def acceptance_by_position(self) -> list[float]:
        return self.stats.acceptance_by_position

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "num_target_forwards": self.num_target_forwards,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": self.acceptance_by_position,
            "elapsed_s": self.elapsed_s,
            "tokens_per_s": self.tokens_per_s,
            "timings": self.timings,
            "policy": self.policy,
            "depths": self.depths,
        }


class Clock:
    """Wall-clock laps by phase. On CUDA it synchronises first, so GPU work lands in its own phase."""

    def __init__(self, device: torch.device, sync: bool = True) -> None:
        self.t = dict.fromkeys(TIMING_KEYS, 0.0)
        self._sync = sync and device.type == "cuda"
        self._last = time.perf_counter()

    def lap(self, key: str) -> None:
        if self._sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.t[key] += now - self._last
        self._last = now


class Generation:
    """An iterable of one request's StepEvents (a batch of one); `result` is set once iteration ends.
    `close()` stops it early."""

    def __init__(self, engine: "SpecEngine", inputs: dict[str, torch.Tensor], config: GenerationConfig) -> None:
        self.result: GenerationResult | None = None
        self._it = self._run(engine, inputs, config)

    def _run(self, engine: "SpecEngine", inputs: dict[str, torch.Tensor], config: GenerationConfig) -> Iterator[StepEvent]:
        batch = Batch(engine, slots=1)
        req = batch.add(inputs, config)  # raises before anything was emitted (e.g. ContextLengthError)
        try:
            while req.result is None:
                for _, event in batch.step():
                    yield event
        finally:
            if req.result is None:
                batch.cancel(req)
            self.result = req.result

    def __iter__(self) -> Iterator[StepEvent]:
        return self._it

    def close(self) -> None:
        self._it.close()


@dataclass
class _Request:
    """One request's decoding state (nothing of it lives on the engine or the batch)."""

    config: GenerationConfig
    state: TargetState  # its slot of the batch's cache, its committed length
    session: Any  # DraftSession
    control: Controller  # this request's speculation controller
    policy: str  # its policy's name ("none": plain decoding, the `none` drafter)
    tree: TreeConfig | None  # this request's tree shape (None: a drafter without one)
    rng: torch.Generator | None  # its own generator: its samples never depend on the rest of the batch
    eos: set[int]
    timings: dict[str, float]  # seconds by phase (a batch step's time counts for every request in it)
    prompt_tokens: int
    t_start: float
    root: int = -1  # last emitted token, not yet in the target's KV cache
    emitted: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    depths: list[int] = field(default_factory=list)  # the controller's choice per step (none when nothing drafts)
    finish: str = "length"
    done: bool = False
    pending: list[StepEvent] = field(default_factory=list)  # events not yet handed out (the prefill's token)
    result: GenerationResult | None = None  # set when the request leaves its batch

    def max_depth(self, max_positions: int) -> int:
        """How deep this request may draft now (-1: its context is full)."""
        room = max_positions - self.state.seq_len - 1  # the deepest node's position must stay in context
        if room < 0:
            return -1
        depth = min(self.config.max_new_tokens - len(self.emitted) - 1, room)
        if self.tree is not None:  # the controller chooses within the request's tree
            depth = min(depth, self.tree.depth)
        if self.config.speculation.max_depth is not None:
            depth = min(depth, self.config.speculation.max_depth)
        return depth


class Batch:
    """Requests decoded together, each in a slot of one KV cache (`vlmspec.slot_cache`).

    `add` prefills a request into a free slot (alone, as batch 1); `step` runs one draft -> verify ->
    commit round over every live request in ONE target forward and returns each request's events;
    requests leave (EOS, max tokens, full context, `cancel`) between steps and their slot is free at
    once. Every request keeps its own sampling parameters, generator, tree shape and controller, so
    its tokens are those of its batch-1 run.

    slots: requests at once; capacity: cache entries per slot (None: each slot grows as its request
    needs, the batch of one `SpecEngine.generate` runs). With a capacity the memory is preallocated
    and bounded, and a request that could outgrow its slot is refused when it is added.
    per_row_depths: goodput rows choose their own depths where the target verifies rows of unequal
    trees without padding (`Target.verifies_ragged`; `vlmspec.batch_control.choose_depths`); off,
    they share one depth per step, which served more tokens/s on the default model
    (docs/adaptive.md, "Depths per row").
    """

    def __init__(self, engine: "SpecEngine", slots: int = 1, capacity: int | None = None, per_row_depths: bool = False) -> None:
        if slots < 1:
            raise ValueError(f"a batch needs at least one slot, got {slots}")
        if slots > 1:
            engine.target.check_batching()  # e.g. a model that counts positions its own way: one at a time
        self.engine = engine
        self.capacity = capacity
        self.cache = engine.target.new_cache(slots, capacity or 256)
        self.free = list(range(slots))
        self.requests: list[_Request] = []  # live ones, by slot
        self.timings = dict.fromkeys(TIMING_KEYS, 0.0)  # the batch's own seconds by phase (prefills included)
        self.rounds = 0  # target forwards run by `step` (prefills not counted)
        self.cost_timing = BatchTiming()  # its steps' measured / modelled seconds (goodput over the batch)
        ragged = slots > 1 and engine.target.verifies_ragged  # unequal trees verified without padding (checked once, here)
        self.per_row = per_row_depths and ragged  # depths chosen per row, each step priced as a ragged one

    @property
    def full(self) -> bool:
        return not self.free

    def need(self, inputs: dict[str, torch.Tensor], config: GenerationConfig) -> int:
        """Cache entries a request may take: prompt, answer, and the last step's tree."""
        tree = self.engine.request_tree(config)
        return int(inputs["input_ids"].shape[1]) + config.max_new_tokens + (tree.total_tokens + 1 if tree else 1)

    def add(self, inputs: dict[str, torch.Tensor], config: GenerationConfig) -> "_Request":
        """Prefill a request into a free slot; its first token comes with the next `step`."""
        if not self.free:
            raise RuntimeError("the batch is full: add a request when one has left (Batch.full)")
        need = self.need(inputs, config)
        if self.capacity is not None and need > self.capacity:
            raise ContextLengthError(f"the request may need {need} cache entries (prompt + max_tokens + a draft tree) but a slot "
                                     f"holds {self.capacity}: lower max_tokens or shorten the prompt")
        slot = self.free.pop(0)
        try:
            if self.capacity is None:
                self.cache.reserve(need)
            with decoding_sdpa(self.engine.target.device):
                req = self.engine._open(inputs, config, self.cache, slot)
        except BaseException:
            self.free.insert(0, slot)
            raise
        req.pending.append(_emit(req, [req.root], 0, 0))
        for key, sec in req.timings.items():
            self.timings[key] += sec
        self.requests.append(req)
        self.requests.sort(key=lambda r: r.state.slot)  # consecutive slots read as views
        return req

    @property
    def draft_waits(self) -> int:
        """Steps whose goodput rows would have drafted but waited (`BatchTiming.waits`): a counter."""
        return self.cost_timing.waits

    def step(self) -> list[tuple["_Request", StepEvent]]:
        """One round: the prefill tokens of requests that joined, then one draft -> verify -> commit
        over every live request. Requests that finished have left when it returns (their `result` set)."""
        events = [(r, e) for r in self.requests for e in r.pending]
        for r in self.requests:
            r.pending.clear()
        live = []
        for r in self.requests:
            if not r.done and r.max_depth(self.engine.target.max_positions) < 0:
                r.done = True  # the context is full
            if not r.done:
                live.append(r)
        if live:
            with decoding_sdpa(self.engine.target.device):
                events += self._round(live)
        for r in [r for r in self.requests if r.done]:
            self._leave(r)
        return events

    def cancel(self, req: "_Request") -> None:
        """Take a request out between steps (its slot is free at once); the others are not touched."""
        if req in self.requests:
            req.done = True
            self._leave(req)

    def _leave(self, req: "_Request") -> None:
        self.requests.remove(req)
        self.free.append(req.state.slot)
        self.free.sort()
        req.result = GenerationResult(req.emitted, req.finish, req.prompt_tokens, req.stats, time.perf_counter() - req.t_start,
                                      dict(req.timings), req.policy, req.depths)
        finish = getattr(req.session, "finish", None)  # a drafter that learns from traffic keeps the answer
        if finish is not None:
            finish(req.emitted)

    def _round(self, reqs: list["_Request"]) -> list[tuple["_Request", StepEvent]]:
        """Draft for every row, verify every row in one target forward, commit, emit."""
        target = self.engine.target
        clock = Clock(target.device, any(r.config.sync_timings for r in reqs))
        t_step = time.perf_counter()
        batch_cost = self.engine.speculation.batch_cost
        controls = [r.control for r in reqs]
        depths = choose_depths(controls, [r.max_depth(target.max_positions) for r in reqs], batch_cost, self.cost_timing, self.per_row)
        chains = batch_chains(controls, batch_cost)  # goodput rows of a batch draft a chain
        trees = [t.truncate_depth(d) for t, d in zip(propose_all(self.engine.drafter, [r.session for r in reqs], [r.root for r in reqs], depths, chains), depths)]
        clock.lap("draft")
        out = target.forward_batch([r.state for r in reqs], trees, feature_layers(self.engine.drafter))  # logits [B, N, V]
        verdicts = verify_rows(trees, out.logits, [r.config.sampling for r in reqs], [r.rng for r in reqs])
        clock.lap("verify")
        target.commit_batch([r.state for r in reqs], [v.path for v in verdicts])
        clock.lap("commit")
        paths = [torch.tensor(v.path, dtype=torch.long) for v in verdicts]
        for b, (r, t, path) in enumerate(zip(reqs, trees, paths)):
            r.session.commit(t.tokens[path], out.features[b][to_device(path, out.features.device)])
        clock.lap("draft")
        seconds = time.perf_counter() - t_step
        if batch_cost is not None and len(reqs) > 1:
            drafted = [int(t.depth.max()) for t in trees]
            self.cost_timing.observe(batch_cost, len(reqs), max(drafted), seconds, sum(v.num_accepted for v in verdicts) + len(reqs),
                                     batch_cost.step_seconds(drafted, self.per_row))
        events = []
        for r, t, v, path, depth, chain in zip(reqs, trees, verdicts, paths, depths, chains):
            drafted_depth = int(t.depth.max())
            r.stats.observe(t.size - 1, v.num_accepted, drafted_depth)
            r.control.observe(drafted_depth, v.num_accepted, seconds if len(reqs) == 1 else None,  # a batch's time is not the row's own
                              t.first_chain_run(v.path), chain)
            if r.policy != "none":  # plain decoding chooses no depth
                r.depths.append(depth)
            r.root = v.next_token
            events.append((r, _emit(r, t.tokens[path[1:]].tolist() + [v.next_token], t.size - 1, v.num_accepted, depth)))
        clock.lap("other")
        self.rounds += 1
        for key, sec in clock.t.items():
            self.timings[key] += sec
            for r in reqs:
                r.timings[key] += sec
        return events


def _emit(req: _Request, new: list[int], num_drafted: int, num_accepted: int, depth: int = 0) -> StepEvent:
    """Append tokens up to EOS / max tokens; marks the request done when either is reached."""
    keep: list[int] = []
    for tok in new:
        keep.append(tok)
        if tok in req.eos:
            req.finish, req.done = "stop", True
            break
        if len(req.emitted) + len(keep) >= req.config.max_new_tokens:
            req.done = True
            break
    req.emitted.extend(keep)
    return StepEvent(keep, num_drafted, num_accepted, depth)


class SpecEngine:
    def __init__(self, target: Target, drafter: Drafter, speculation: Speculation | None = None) -> None:
        if not isinstance(drafter, NoDrafter):
            target.check_speculative()  # e.g. conv / recurrent state: plain decoding only, said at load
        self.target = target
        self.drafter = drafter
        self.speculation = speculation or Speculation()  # default policy + cost model (read-only)

    def request_tree(self, config: GenerationConfig) -> TreeConfig | None:
        """The tree shape of a request: its own or the drafter's, within its tree budget."""
        tree = config.tree or self.drafter.tree
        budget = config.speculation.tree_tokens
        return tree if tree is None or budget is None else dataclasses.replace(tree, total_tokens=budget)

    def generate(self, inputs: dict[str, torch.Tensor], config: GenerationConfig) -> GenerationResult:
        gen = self.stream(inputs, config)
        for _ in gen:
            pass
        assert gen.result is not None
        return gen.result

    def stream(self, inputs: dict[str, torch.Tensor], config: GenerationConfig) -> Generation:
        return Generation(self, inputs, config)

    def batch(self, slots: int, capacity: int | None = None, per_row_depths: bool = False) -> Batch:
        """A batch of `slots` requests decoded together (see `Batch`)."""
        return Batch(self, slots, capacity, per_row_depths)

    def generate_many(self, requests: list[tuple[dict[str, torch.Tensor], GenerationConfig]], slots: int,
                      capacity: int | None = None) -> list[GenerationResult]:
        """Every request, at most `slots` at a time, each joining as soon as a slot is free; results in order."""
        batch = self.batch(slots, capacity)
        waiting = list(enumerate(requests))
        running: dict[int, _Request] = {}
        while waiting or batch.requests:
            while waiting and not batch.full:
                i, (inputs, config) = waiting.pop(0)
                running[i] = batch.add(inputs, config)
            batch.step()
        return [running[i].result for i in range(len(requests))]  # type: ignore[misc]

    def _open(self, inputs: dict[str, torch.Tensor], config: GenerationConfig, cache: SlotCache, slot: int) -> _Request:
        """Prefill into `slot`, open the drafter's session, pick the first token."""
        target = self.target
        t_start = time.perf_counter()
        clock = Clock(target.device, config.sync_timings)
        state, out = target.prefill(inputs, visual=self.drafter.needs_visual, cache=cache, slot=slot, layers=feature_layers(self.drafter))
        clock.lap("prefill")
        prompt = PromptContext(inputs["input_ids"][0].cpu(), out.features, inputs, out.image_mask, out.image_embeds, out.attention,
                               kv=state.entries, tenant=config.tenant, remember=config.remember)
        tree = self.request_tree(config)
        session = self.drafter.start(prompt, tree)
        clock.lap("draft")
        rng = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
        policy = config.policy or self.speculation.policy(config.speculation.policy)
        name = "none" if isinstance(self.drafter, NoDrafter) else policy.name  # plain decoding: no policy at work
        req = _Request(config, state, session, policy.start(), name, tree, rng,
                       set() if config.ignore_eos else target.eos_token_ids, clock.t, state.seq_len, t_start)
        req.root = next_token(out.logits[0], config.sampling, rng)
        return req


__all__ = ["SpecEngine", "Batch", "GenerationConfig", "GenerationResult", "StepEvent", "Generation", "Clock", "TIMING_KEYS"]
