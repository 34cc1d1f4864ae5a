"""`Batch`: requests decoded together in the slots of one KV cache, the one place requests are
admitted (`submit`, then each `step` prefills under its budget, whole prompts or pieces of long ones,
and runs one draft -> verify -> commit round over every request whose prompt is in)."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from vlmspec.policy.batch_control import BatchTiming, batch_chains, choose_depths
from vlmspec.policy.control import Controller
from vlmspec.draft.base import TreeConfig, feature_layers, propose_all
from vlmspec.engine.prefill import PromptPieces, run_pieces
from vlmspec.engine.types import TIMING_KEYS, Clock, GenerationConfig, GenerationResult, StepEvent
from vlmspec.errors import ContextLengthError
from vlmspec.stats import SpecStats
from vlmspec.target import TargetState, decoding_sdpa
from vlmspec.runtime.transfer import to_device
from vlmspec.verify.acceptance import verify_rows


@dataclass
class RowFailure:
    """Why a request left its batch early: the part of a step that failed for it alone."""

    stage: str  # "prefill" (a piece of its prompt, its drafter's start) | "draft" (its session's propose) | "commit" (its session's commit, controller, tokens)
    error: Exception


@dataclass
class _Request:
    """One request's decoding state (nothing of it lives on the engine or the batch)."""

    config: GenerationConfig
    state: TargetState  # its slot of the batch's cache, its committed length
    session: Any  # DraftSession (None while its prompt is still entering its slot: `pieces`)
    control: Controller  # this request's speculation controller
    policy: str  # its policy's name ("plain": plain decoding, the `plain` drafter)
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
    pieces: PromptPieces | None = None  # its prompt while it enters its slot piece by piece (chunked prefill)
    result: GenerationResult | None = None  # set when the request leaves its batch
    failure: RowFailure | None = None  # set when a step failed for this request alone (it left the batch)

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


@dataclass(eq=False)
class Ticket:
    """A request given to a batch (`Batch.submit`): `request` is its decoding state once a step has
    admitted it, `error` what its admission raised (it alone fails), `result` set once it has left."""

    inputs: dict[str, torch.Tensor]
    config: GenerationConfig
    prompt_tokens: int
    request: _Request | None = None
    error: Exception | None = None

    @property
    def waiting(self) -> bool:
        return self.request is None and self.error is None

    @property
    def result(self) -> GenerationResult | None:
        return self.request.result if self.request is not None else None


class Batch:
    """Requests decoded together, each in a slot of one KV cache (`vlmspec.cache.slot_cache`): the one
    place requests are admitted.

    `submit` queues a request; `step` prefills (`prefill`: the next piece of each long prompt, then
    waiting requests admitted under the step's budget), then runs one draft -> verify -> commit round
    over every request whose prompt is in, in ONE target forward (`decode`), and returns each request's events.
    Requests leave (EOS, max tokens, full context, `cancel`) between steps; their slot is free at
    once. Each keeps its own sampling parameters, generator, tree shape and controller.

    slots: requests at once; capacity: cache entries per slot (None: each slot grows as its request
    needs, the batch of one `SpecEngine.generate` runs); with one the memory is fixed at the first
    write and never grows, and `submit` refuses a request that could outgrow its slot.
    prefill_chunk: the longest piece a prompt enters its slot in (chunked prefill, `vlmspec.engine.prefill`;
    None: whole prompts). prefill_budget: prompt tokens a step prefills, pieces and new requests
    together, at least one piece (None: `prefill_chunk`, and without it every waiting request that has a slot).
    prefill_first: a step that leaves requests waiting for a free slot's prefill runs no decode round
    (`decode_due`), so a burst of arrivals gets its first tokens before the running rows step on: time to
    first token for the many, at the price of a pause in the running rows' tokens while a burst enters.
    """

    def __init__(self, engine: Any, slots: int = 1, capacity: int | None = None,
                 prefill_budget: int | None = None, prefill_chunk: int | None = None, prefill_first: bool = False) -> None:
        # engine: the `SpecEngine` (vlmspec.engine.spec) whose target, drafter and `_open` the batch uses
        if slots < 1:
            raise ValueError(f"a batch needs at least one slot, got {slots}")
        if prefill_budget is not None and prefill_budget < 1:
            raise ValueError(f"prefill_budget must be at least 1 token (or None), got {prefill_budget}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 token (or None), got {prefill_chunk}")
        if slots > 1:
            engine.target.check_batching()  # e.g. a model that counts positions its own way: one at a time
        self.engine = engine
        self.capacity = capacity
        self.cache = engine.target.new_cache(slots, capacity or 256)
        if capacity is not None:
            self.cache.fix(capacity)  # memory fixed at the first write: a request that could outgrow its slot is refused
        self.free = list(range(slots))
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget if prefill_budget is not None else prefill_chunk
        self.prefill_first = prefill_first
        self.waiting: deque[Ticket] = deque()  # submitted, not yet admitted (first come, first served)
        self.requests: list[_Request] = []  # live ones, by slot
        self.timings = dict.fromkeys(TIMING_KEYS, 0.0)  # the batch's own seconds by phase (prefills included)
        self.rounds = 0  # target forwards run by `step` (prefills not counted)
        self.cost_timing = BatchTiming()  # its steps' measured / modelled seconds (goodput over the batch)

    @property
    def full(self) -> bool:
        return not self.free

    @property
    def decode_due(self) -> bool:
        """Whether this step's decode round runs after its prefill: always, unless `prefill_first` and a
        waiting request could take a free slot (the budget stopped its admission: the next step's)."""
        return not (self.prefill_first and self.waiting and self.free)

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing running: a `step` would do nothing."""
        return not self.waiting and not self.requests

    def context_limit(self, config: GenerationConfig) -> int:
        """The longest prompt + answer a request with `config` may have here: the model's context,
        and with a fixed `capacity` what a slot holds beside the tree."""
        limit = self.engine.target.max_positions
        return limit if self.capacity is None else min(limit, self.capacity - self.engine.tree_room(config))

    def need(self, inputs: dict[str, torch.Tensor], config: GenerationConfig) -> int:
        """Cache entries a request may take: prompt, answer, and the last step's tree."""
        return int(inputs["input_ids"].shape[1]) + config.max_new_tokens + self.engine.tree_room(config)

    def submit(self, inputs: dict[str, torch.Tensor], config: GenerationConfig) -> Ticket:
        """Queue a request; a `step` admits it when a slot is free and its turn comes. Raises
        ContextLengthError at once when it could never fit a slot."""
        need = self.need(inputs, config)
        if self.capacity is not None and need > self.capacity:
            raise ContextLengthError(f"the request may need {need} cache entries (prompt + max_tokens + a draft tree) but a slot "
                                     f"holds {self.capacity}: lower max_tokens or shorten the prompt")
        ticket = Ticket(inputs, config, int(inputs["input_ids"].shape[1]))
        self.waiting.append(ticket)
        return ticket

    def prefill(self) -> list[tuple["_Request", StepEvent]]:
        """The step's prefill, up to `prefill_budget` prompt tokens (at least one piece): the next piece
        of each request whose prompt is entering its slot, all in one forward, then waiting tickets
        admitted into free slots, first come first served, each prefilled alone (its first piece).
        Returns the first token of each request whose whole prompt is now in. A request whose
        prefill raises fails alone: an admitted one leaves with its `failure` (stage "prefill"), a
        ticket gets the exception as its `error` and gives its slot back."""
        events: list[tuple[_Request, StepEvent]] = []
        spent = self._run_pieces(events)
        while self.waiting and self.free:
            ticket = self.waiting[0]
            end = self.engine.first_piece(ticket.inputs, self.prefill_chunk)
            if spent and self.prefill_budget is not None and spent + end > self.prefill_budget:
                break
            self.waiting.popleft()
            spent += end
            try:
                ticket.request = req = self._admit(ticket, end)
            except Exception as exc:  # noqa: BLE001  (one request's prefill fails that request alone: its ticket says why)
                ticket.error = exc
                continue
            if req.pieces is None:
                events.append((req, _emit(req, [req.root], 0, 0)))
        return events

    def _admit(self, ticket: Ticket, end: int) -> "_Request":
        slot = self.free.pop(0)
        try:
            if self.capacity is None:
                self.cache.reserve(self.need(ticket.inputs, ticket.config))
            with decoding_sdpa(self.engine.target.device):
                req = self.engine._open(ticket.inputs, ticket.config, self.cache, slot, end)
        except BaseException:
            self.free.insert(0, slot)
            raise
        for key, sec in req.timings.items():
            self.timings[key] += sec
        self.requests.append(req)
        self.requests.sort(key=lambda r: r.state.slot)  # consecutive slots read as views
        return req

    def _run_pieces(self, events: list[tuple["_Request", StepEvent]]) -> int:
        """The next piece of each request still entering its slot, first come first served within the
        budget (at least one), in one forward; their first tokens to `events`. Returns tokens spent."""
        budget = self.prefill_budget if self.prefill_budget is not None else 1 << 62
        chunk = self.prefill_chunk or 1 << 62
        reqs, sizes, spent = [], [], 0
        for r in sorted((r for r in self.requests if r.pieces is not None and not r.done), key=lambda r: r.t_start):
            n = min(r.pieces.left, chunk, budget - spent) if reqs else min(r.pieces.left, chunk)
            if n < 1:
                break
            reqs.append(r)
            sizes.append(n)
            spent += n
        if not reqs:
            return 0
        t0 = time.perf_counter()
        try:
            with decoding_sdpa(self.engine.target.device):
                run_pieces(self.engine.target, reqs, sizes, feature_layers(self.engine.drafter))
        except Exception as exc:  # noqa: BLE001  the forward of these pieces: their requests fail, no decoding row is touched
            for r in reqs:
                self._fail(r, "prefill", exc)
            return spent
        seconds = time.perf_counter() - t0
        self.timings["prefill"] += seconds
        for r in reqs:
            r.timings["prefill"] += seconds
            if r.pieces.left == 0:
                with self._isolated(r, "prefill"):
                    for key, sec in self.engine._begin(r).items():
                        self.timings[key] += sec
                    events.append((r, _emit(r, [r.root], 0, 0)))
        return spent

    @property
    def draft_waits(self) -> int:
        """Steps whose goodput rows would have drafted but waited (`BatchTiming.waits`): a counter."""
        return self.cost_timing.waits

    def step(self) -> list[tuple["_Request", StepEvent]]:
        """One round: the step's prefill (`prefill`: pieces, admissions, their first tokens), then
        `decode`. Requests that finished have left when it returns (their `result` set), and so have
        requests the step failed for alone (their `failure` set, none of their events returned).
        What it raises belongs to the batch as a whole: the batch cannot go on."""
        events = self.prefill()
        return events + self.decode() if self.decode_due else events

    def decode(self) -> list[tuple["_Request", StepEvent]]:
        """One draft -> verify -> commit over every request whose prompt is in (ONE target forward);
        then the requests that are done leave."""
        live = []
        for r in self.requests:
            if r.pieces is not None:
                continue
            if not r.done and r.max_depth(self.engine.target.max_positions) < 0:
                r.done = True  # the context is full
            if not r.done:
                live.append(r)
        events = []
        if live:
            with decoding_sdpa(self.engine.target.device):
                events = self._round(live)
        for r in [r for r in self.requests if r.done]:
            self._leave(r)
        return events

    def cancel(self, item: "Ticket | _Request") -> None:
        """Take a request out between steps: a waiting ticket leaves the queue, an admitted request its
        slot (free at once); the others are not touched."""
        if isinstance(item, Ticket):
            if item in self.waiting:
                self.waiting.remove(item)
                return
            if item.request is None:
                return
            item = item.request
        if item in self.requests:
            item.done = True
            self._leave(item)

    def _leave(self, req: "_Request") -> None:
        self.requests.remove(req)
        self.free.append(req.state.slot)
        self.free.sort()
        req.result = GenerationResult(req.emitted, req.finish, req.prompt_tokens, req.stats, time.perf_counter() - req.t_start,
                                      dict(req.timings), req.policy, req.depths)
        finish = getattr(req.session, "finish", None)  # a drafter that learns from traffic keeps the answer
        if finish is not None and req.failure is None:
            finish(req.emitted)

    def _round(self, reqs: list["_Request"]) -> list[tuple["_Request", StepEvent]]:
        """Draft for every row, verify every row in one target forward, commit, emit."""
        target = self.engine.target
        clock = Clock(target.device, any(r.config.sync_timings for r in reqs))
        t_step = time.perf_counter()
        batch_cost = self.engine.speculation.batch_cost
        controls = [r.control for r in reqs]
        depths = choose_depths(controls, [r.max_depth(target.max_positions) for r in reqs], batch_cost, self.cost_timing)
        chains = batch_chains(controls, batch_cost)  # goodput rows of a batch draft a chain
        failed: dict[int, Exception] = {}
        proposed = propose_all(self.engine.drafter, [r.session for r in reqs], [r.root for r in reqs], depths, chains, failed)
        trees = [t.truncate_depth(d) for t, d in zip(proposed, depths)]
        if failed:  # rows whose drafter session failed leave before the forward; the others go on as drafted
            for b, exc in failed.items():
                self._fail(reqs[b], "draft", exc)
            kept = [b for b in range(len(reqs)) if b not in failed]
            reqs, trees, depths, chains = ([xs[b] for b in kept] for xs in (reqs, trees, depths, chains))
        clock.lap("draft")
        if not reqs:  # every row's drafter failed
            for key, sec in clock.t.items():
                self.timings[key] += sec
            return []
        out = target.forward_batch([r.state for r in reqs], trees, feature_layers(self.engine.drafter))  # logits [B, N, V]
        verdicts = verify_rows(trees, out.logits, [r.config.sampling for r in reqs], [r.rng for r in reqs])
        clock.lap("verify")
        target.commit_batch([r.state for r in reqs], [v.path for v in verdicts])
        clock.lap("commit")
        paths = [torch.tensor(v.path, dtype=torch.long) for v in verdicts]
        for b, (r, t, path) in enumerate(zip(reqs, trees, paths)):
            with self._isolated(r):
                r.session.commit(t.tokens[path], out.features[b][to_device(path, out.features.device)])
        clock.lap("draft")
        seconds = time.perf_counter() - t_step
        if batch_cost is not None and len(reqs) > 1:
            drafted = [int(t.depth.max()) for t in trees]
            self.cost_timing.observe(batch_cost, len(reqs), max(drafted), seconds, sum(v.num_accepted for v in verdicts) + len(reqs),
                                     batch_cost.step_seconds(drafted))
        events = []
        for r, t, v, path, depth, chain in zip(reqs, trees, verdicts, paths, depths, chains):
            if r.failure is not None:
                continue
            with self._isolated(r):
                drafted_depth = int(t.depth.max())
                r.stats.observe(t.size - 1, v.num_accepted, drafted_depth)
                r.control.observe(drafted_depth, v.num_accepted, seconds if len(reqs) == 1 else None,  # a batch's time is not the row's own
                                  t.first_chain_run(v.path), chain)
                if r.policy != "plain":  # plain decoding chooses no depth
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

    @contextlib.contextmanager
    def _isolated(self, req: "_Request", stage: str = "commit") -> Iterator[None]:
        """A row's own part of the step after the forward (its session, controller, tokens; its
        drafter's start after its last piece: "prefill"): what it raises ends that request alone."""
        try:
            yield
        except Exception as exc:  # one row's own state: no other row's is touched by it
            self._fail(req, stage, exc)

    @staticmethod
    def _fail(req: "_Request", stage: str, exc: Exception) -> None:
        """The step failed for `req` alone: it leaves the batch at the end of the step, its `failure` set."""
        req.failure, req.done = RowFailure(stage, exc), True


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
