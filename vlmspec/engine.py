"""The speculative decoding loop, on token ids: draft a tree, verify it in one target forward, commit.

    prefill -> first token (root)
    loop:  depth   = control.choose(max_depth)          # how deep to draft this step (vlmspec.control)
           tree    = session.propose(root, depth)       # drafter
           out     = target.forward_tree(state, tree)   # ONE target forward over all N nodes
           verdict = verify(tree, out.logits)           # accepted path + recovered/bonus token
           target.commit(state, path); session.commit(...)  # keep the accepted KV entries
           control.observe(tree depth, accepted, s)    # the request's acceptance history and step time
           emit accepted tokens + next token; root = next token

With the `none` drafter every tree is the root alone and this is plain autoregressive decoding,
which is the oracle every other drafter is tested against. The engine knows token ids only:
detokenization, stop strings and hold-back live in `vlmspec.text`, wrapped around it. Everything
one request needs travels in its `GenerationConfig` and its `_Request` state, never on the engine.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from vlmspec.control import Controller, Policy, Speculation, SpeculationOptions
from vlmspec.draft.base import Drafter, NoDrafter, PromptContext, TreeConfig
from vlmspec.sampling import SamplingParams, next_token
from vlmspec.stats import SpecStats
from vlmspec.target import Target, TargetState
from vlmspec.transfer import to_device
from vlmspec.verify.acceptance import verify

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
    policy: str = "fixed"  # the speculation policy that ran
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
    """An iterable of StepEvents; `result` is set once iteration ends. `close()` stops it early."""

    def __init__(self, engine: "SpecEngine", inputs: dict[str, torch.Tensor], config: GenerationConfig) -> None:
        self.result: GenerationResult | None = None
        self._it = engine._run(inputs, config, self)

    def __iter__(self) -> Iterator[StepEvent]:
        return self._it

    def close(self) -> None:
        self._it.close()


@dataclass
class _Request:
    """One request's decoding state (nothing of it lives on the engine)."""

    config: GenerationConfig
    state: TargetState
    session: Any  # DraftSession
    control: Controller  # this request's speculation controller
    policy: str  # its policy's name
    tree: TreeConfig | None  # this request's tree shape (None: a drafter without one)
    rng: torch.Generator | None
    eos: set[int]
    clock: Clock
    prompt_tokens: int
    root: int = -1  # last emitted token, not yet in the target's KV cache
    emitted: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    depths: list[int] = field(default_factory=list)  # the controller's choice per step
    finish: str = "length"
    done: bool = False


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

    # ---------------------------------------------------------------- the loop
    def _run(self, inputs: dict[str, torch.Tensor], config: GenerationConfig, gen: Generation) -> Iterator[StepEvent]:
        t_start = time.perf_counter()
        req = self._start(inputs, config)  # raises before anything was emitted (e.g. ContextLengthError)
        try:
            yield self._emit(req, [req.root], 0, 0)
            while not req.done:
                event = self._step(req)
                if event is None:
                    break
                yield event
        finally:
            gen.result = GenerationResult(req.emitted, req.finish, req.prompt_tokens, req.stats,
                                          time.perf_counter() - t_start, dict(req.clock.t), req.policy, req.depths)

    def _start(self, inputs: dict[str, torch.Tensor], config: GenerationConfig) -> _Request:
        """Prefill, open the drafter's session, pick the first token."""
        target = self.target
        clock = Clock(target.device, config.sync_timings)
        state, out = target.prefill(inputs, visual=self.drafter.needs_visual)
        clock.lap("prefill")
        prompt = PromptContext(inputs["input_ids"][0].cpu(), out.features, inputs, out.image_mask, out.image_embeds, out.attention,
                               kv=state.cache)
        tree = self.request_tree(config)
        session = self.drafter.start(prompt, tree)
        clock.lap("draft")
        rng = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
        policy = config.policy or self.speculation.policy(config.speculation.policy)
        req = _Request(config, state, session, policy.start(), policy.name, tree, rng,
                       set() if config.ignore_eos else target.eos_token_ids, clock, state.seq_len)
        req.root = next_token(out.logits[0], config.sampling, rng)
        return req

    def _step(self, req: _Request) -> StepEvent | None:
        """One draft -> verify -> commit round. None when the context is full."""
        target, clock, state = self.target, req.clock, req.state
        t_step = time.perf_counter()
        room = target.max_positions - state.seq_len - 1  # the deepest node's position must stay in context
        if room < 0:
            return None
        max_depth = min(req.config.max_new_tokens - len(req.emitted) - 1, room)
        if req.tree is not None:  # the controller chooses within the request's tree
            max_depth = min(max_depth, req.tree.depth)
        if req.config.speculation.max_depth is not None:
            max_depth = min(max_depth, req.config.speculation.max_depth)
        depth = req.control.choose(max_depth)
        req.depths.append(depth)
        tree = req.session.propose(req.root, depth).truncate_depth(depth)
        clock.lap("draft")
        out = target.forward_tree(state, tree)
        verdict = verify(tree, out.logits, req.config.sampling, req.rng)
        clock.lap("verify")
        target.commit(state, verdict.path)
        path = torch.tensor(verdict.path, dtype=torch.long)
        clock.lap("commit")
        req.session.commit(tree.tokens[path], out.features[to_device(path, out.features.device)])
        clock.lap("draft")
        drafted_depth = int(tree.depth.max())
        req.stats.observe(tree.size - 1, verdict.num_accepted, drafted_depth)
        req.control.observe(drafted_depth, verdict.num_accepted, time.perf_counter() - t_step)  # the step's own time
        req.root = verdict.next_token
        event = self._emit(req, tree.tokens[path[1:]].tolist() + [verdict.next_token], tree.size - 1, verdict.num_accepted, depth)
        if not req.done and state.seq_len >= target.max_positions:
            req.done = True
        return event

    def _emit(self, req: _Request, new: list[int], num_drafted: int, num_accepted: int, depth: int = 0) -> StepEvent:
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
        req.clock.lap("other")
        return StepEvent(keep, num_drafted, num_accepted, depth)


__all__ = ["SpecEngine", "GenerationConfig", "GenerationResult", "StepEvent", "Generation", "Clock"]
