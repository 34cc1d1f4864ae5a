"""The demo UI's generations, run through the service's worker and queue like any API request.

    runner = ServiceRunner(app.state.service, settings)
    async for cmp in runner.compare(image, "Describe the image."):   # the speculative run, then the plain one
        cmp.spec.text, cmp.plain.text, cmp.speedup, cmp.identical

The runner submits a `Job` and awaits its messages on the event loop, so the model is only ever
touched by the worker thread. The image goes through `vlmspec.inputs` with the server's limits, as
the API's do (an uploaded file is decoded there, so a non-image or a bomb gets the API's message);
the speculation knobs (policy, max depth, tree size) become this job's `GenerationConfig.speculation`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

from PIL import Image

from vlmspec import assets
from vlmspec.policy.control import SpeculationOptions
from vlmspec.engine import GenerationConfig, GenerationResult
from vlmspec.errors import InputError
from vlmspec.inputs import checked_rgb, decode_data_url, load_image_file, user_turn
from vlmspec.sampling import SamplingParams
from vlmspec.text import Completion, TextEvent

from .protocol import APIError
from .settings import ServerSettings
from .job import Job
from .service import Service


# what the demo hands the runner: a decoded image, an uploaded file's path or a data URL, or none
ImageSource = Image.Image | str | Path | None


class RunError(Exception):
    """A generation the service refused or failed (queue full, timeout, bad input, ...)."""


NOT_RUN = "not run: the speculative run failed"  # the plain run's error when the speculative one failed first


@dataclass
class RunState:
    """One generation as it streams: the UI renders it after every event."""

    mode: str  # "speculative" | "plain"
    text: str = ""
    steps: list[tuple[str, int, int, int, int]] = field(default_factory=list)  # (text, tokens, accepted, drafted, depth chosen) per forward
    tokens: int = 0
    t0: float = field(default_factory=time.monotonic)
    result: GenerationResult | None = None  # once done
    error: str | None = None
    waiting: bool = True  # queued, not started yet

    @property
    def tokens_per_s(self) -> float:
        if self.result is not None:
            return self.result.tokens_per_s
        dt = time.monotonic() - self.t0
        return self.tokens / dt if dt > 0 else 0.0

    def fail(self, message: str) -> None:
        self.error, self.waiting = message, False

    def apply(self, kind: str, payload: Any) -> None:
        """One worker message: "start" (prompt tokens), "event" (TextEvent) or "done" (Completion)."""
        if kind == "start":
            self.waiting = False
            self.t0 = time.monotonic()
        elif kind == "event":
            self._add_event(payload)
        elif kind == "done":
            completion: Completion = payload
            self.result = completion.result
            self.text = completion.text

    def _add_event(self, event: TextEvent) -> None:
        self.text += event.text
        step = event.step
        if step is None:  # the text layer's final flush: text held back from earlier tokens
            if self.steps:
                text, *rest = self.steps[-1]
                self.steps[-1] = (text + event.text, *rest)
            return
        self.tokens += len(step.token_ids)
        if step.token_ids or event.text:
            self.steps.append((event.text, len(step.token_ids), step.num_accepted, step.num_drafted, step.depth))


@dataclass
class Comparison:
    spec: RunState | None
    plain: RunState | None

    @property
    def speedup(self) -> float | None:
        s, p = self.spec, self.plain
        if s is None or p is None or s.result is None or p.result is None or p.result.tokens_per_s <= 0:
            return None
        return s.result.tokens_per_s / p.result.tokens_per_s

    @property
    def identical(self) -> bool | None:
        if self.spec is None or self.plain is None or self.spec.result is None or self.plain.result is None:
            return None
        return self.spec.result.token_ids == self.plain.result.token_ids

    def summary(self) -> dict[str, Any]:
        return {"speculative": _run_summary(self.spec), "plain": _run_summary(self.plain),
                "speedup": self.speedup, "identical": self.identical}


def _run_summary(r: RunState | None) -> dict[str, Any] | None:
    if r is None:
        return None
    res = r.result
    return {"text": r.text, "error": r.error, "tokens": r.tokens, "tokens_per_s": r.tokens_per_s,
            "target_forwards": res.num_target_forwards if res else None,
            "mean_accepted_length": res.mean_accepted_length if res else None,
            "drafted_tokens": res.num_drafted if res else None, "accepted_tokens": res.num_accepted if res else None,
            "steps": [step[1] for step in r.steps], "policy": res.policy if res else None,
            "depths": res.depths if res else None, "finish_reason": res.finish_reason if res else None}


class ServiceRunner:
    """Runs UI generations through the service's worker (app.service.Service) as ordinary Jobs."""

    def __init__(self, service: Service, settings: ServerSettings) -> None:
        self.service = service
        self.settings = settings

    def info(self) -> dict[str, Any]:
        default = assets.DEFAULT_TARGET.resolve()
        return {"model": self.settings.model, **dataclasses.asdict(self.service.engine_info()), "max_tokens_cap": self.settings.max_tokens_cap,
                "default_model": any(Path(a).resolve() == default for a in self.settings.model_aliases),
                "toy_model": any(Path(a).resolve() == assets.BUNDLED_TARGET.resolve() for a in self.settings.model_aliases)}

    def inputs(self, image: ImageSource, prompt: str | None) -> tuple[Image.Image | None, str]:
        """(the image as RGB, or None; the prompt stripped), or RunError with the one-line message the
        API gives for the same input (no file path in it)."""
        prompt = (prompt or "").strip()
        if not prompt:
            raise RunError("the prompt is empty: type a question or an instruction about the image")
        limits = self.settings.image_limits()
        try:
            if image is None or isinstance(image, Image.Image):
                return (None if image is None else checked_rgb(image, limits, "image")), prompt
            if str(image).startswith("data:"):
                return decode_data_url(str(image), limits, "image"), prompt
            return load_image_file(image, limits, "image"), prompt
        except InputError as exc:
            raise RunError(exc.message) from None

    def _job(self, image: ImageSource, prompt: str, speculative: bool, max_tokens: int, temperature: float,
             seed: int | None, speculation: SpeculationOptions | None, tenant: str | None) -> Job:
        picture, prompt = self.inputs(image, prompt)
        images = [] if picture is None else [picture]
        max_tokens = max(1, min(int(max_tokens), self.settings.max_tokens_cap))
        config = GenerationConfig(max_new_tokens=max_tokens, sampling=SamplingParams(temperature=float(temperature)),
                                  seed=seed, speculation=speculation if speculative and speculation else SpeculationOptions(),
                                  tenant=tenant)
        return Job.on_loop(user_turn(prompt, len(images)), images, config, speculative=speculative,
                           timeout_s=self.settings.request_timeout_s)

    async def stream(self, image: ImageSource, prompt: str, *, speculative: bool, max_tokens: int = 64,
                     temperature: float = 0.0, seed: int | None = 0, speculation: SpeculationOptions | None = None,
                     tenant: str | None = None) -> AsyncIterator[RunState]:
        """Submit one job and yield its RunState after each engine step (and once when it is done)."""
        job = self._job(image, prompt, speculative, max_tokens, temperature, seed, speculation, tenant)
        try:
            self.service.submit(job)
        except APIError as exc:  # queue full, shutting down
            raise RunError(exc.message) from None
        state = RunState(job.mode)
        try:
            while True:
                kind, payload = await job.receive(self.settings.request_timeout_s)
                if kind == "error":
                    raise RunError(payload.message)
                state.apply(kind, payload)
                if kind != "start":
                    yield state
                if kind == "done":
                    return
        finally:
            job.cancel("disconnect")  # the UI went away mid-stream: a no-op once the job finished

    async def compare(self, image: ImageSource, prompt: str, *, max_tokens: int = 64, temperature: float = 0.0,
                      seed: int | None = 0, speculative: bool = True, plain: bool = True,
                      speculation: SpeculationOptions | None = None, tenant: str | None = None) -> AsyncIterator[Comparison]:
        """The speculative run, then the plain run (each through the worker); yields the pair as it fills."""
        cmp = Comparison(RunState("speculative") if speculative else None, RunState("plain") if plain else None)
        kw: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "tenant": tenant}
        if speculative:
            try:
                async for st in self.stream(image, prompt, speculative=True, speculation=speculation, **kw):
                    cmp.spec = st
                    yield cmp
            except RunError as exc:
                cmp.spec.fail(str(exc))
                if cmp.plain is not None:
                    cmp.plain.fail(NOT_RUN)
                yield cmp
                return
        if plain:
            try:
                async for st in self.stream(image, prompt, speculative=False, **kw):
                    cmp.plain = st
                    yield cmp
            except RunError as exc:
                cmp.plain.fail(str(exc))
                yield cmp

    async def compare_final(self, *args: Any, **kwargs: Any) -> Comparison | None:
        """The last Comparison of `compare` (both runs done)."""
        cmp = None
        async for cmp in self.compare(*args, **kwargs):
            pass
        return cmp
