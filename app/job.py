"""A request as the worker sees it: what to generate, and its messages from the worker thread to
the request's handler on the event loop.

    job = Job.on_loop(messages, images, config, speculative=True, timeout_s=60, stop=("\\n\\n",))
    service.submit(job)              # APIError 429 (queue full) / 503 (shutting down)
    kind, payload = await job.receive(timeout_s)

A job's messages, in order: ``("start", prompt_tokens: int)`` once it has joined the batch (prefill
done), ``("event", TextEvent)`` per engine step, then ``("done", Completion)`` or ``("error",
APIError)`` (an error may also come first). ``job.id`` names the request: the completion's id, and
the request id of a 500 and of the server log's lines about it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from vlmspec.engine import GenerationConfig

from .protocol import APIError, cancelled


@dataclass
class Job:
    messages: list[dict[str, Any]]  # HF chat-template messages
    images: list[Image.Image]
    config: GenerationConfig
    speculative: bool
    deadline: float  # time.monotonic()
    loop: asyncio.AbstractEventLoop
    inbox: asyncio.Queue
    stop: tuple[str, ...] = ()  # stop strings
    max_tokens_given: bool = True  # False: config.max_new_tokens is the server's default (clamped to the context left)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    submitted: float = field(default_factory=time.monotonic)
    cancel_reason: str | None = None  # "disconnect" | "timeout" | "shutdown"
    finished: bool = False

    @classmethod
    def on_loop(cls, messages: list[dict[str, Any]], images: list[Image.Image], config: GenerationConfig, *,
                speculative: bool, timeout_s: float, stop: tuple[str, ...] = (), max_tokens_given: bool = True) -> "Job":
        """A job whose messages arrive on the running event loop (call it from a coroutine)."""
        return cls(messages, images, config, speculative, time.monotonic() + timeout_s, asyncio.get_running_loop(),
                   asyncio.Queue(), stop=stop, max_tokens_given=max_tokens_given)

    @property
    def mode(self) -> str:
        return "speculative" if self.speculative else "plain"

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None and not self.finished:
            self.cancel_reason = reason

    def expired(self) -> bool:
        """Whether the job must stop now (cancelled, or past its deadline: then cancelled as "timeout")."""
        if self.cancel_reason is None and time.monotonic() > self.deadline:
            self.cancel("timeout")
        return self.cancel_reason is not None

    def post(self, kind: str, payload: Any = None) -> None:
        """From the worker thread to the request's handler on the event loop."""
        if kind in ("done", "error"):
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server stopped): nobody is listening any more
            pass

    def fail(self, err: APIError) -> None:
        self.post("error", err)

    async def receive(self, timeout_s: float) -> tuple[str, Any]:
        """The next message; ("error", a 504 APIError) once the deadline has passed (`timeout_s` is
        what the message says the limit was)."""
        remaining = self.deadline - time.monotonic() + 0.5  # the worker enforces the deadline first
        try:
            return await asyncio.wait_for(self.inbox.get(), timeout=max(remaining, 0.01))
        except asyncio.TimeoutError:
            self.cancel("timeout")
            return "error", cancelled("timeout", timeout_s)


@dataclass
class Inbox:
    """The jobs the service accepted, waiting for its worker, and whether it is closing (under `cond`)."""

    cond: threading.Condition = field(default_factory=threading.Condition)  # also guards the worker's rows
    queue: deque[Job] = field(default_factory=deque)
    closing: bool = False
