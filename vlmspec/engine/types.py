"""What a request asks of the engine and what it gets back: `GenerationConfig`, `StepEvent`,
`GenerationResult`, and the phase `Clock` the batch times its steps with."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmspec.policy.control import Policy, SpeculationOptions
from vlmspec.draft.base import TreeConfig
from vlmspec.sampling import SamplingParams
from vlmspec.stats import SpecStats

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
    policy: str = "fixed"  # the speculation policy that ran ("plain": plain decoding, no depths)
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
