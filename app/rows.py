"""One request in the worker's batch (a row): how it joins, how each engine step's tokens reach its
client, how it finishes. The worker (`worker.Worker`) runs these on its thread, one row at a time,
and decides what a failure of one of them ends: that request alone.

    row = Row.join(job, engine, batch)     # encode, check the context (a 400, never a cut answer), queue it in the batch
    row.failure()                          # after a step: (stage, error) when serving it failed for it alone
    row.emit(event, batch_size, now, metrics)   # a step's tokens -> its TextStream (detokenization, stop strings) -> the job
    row.finish(metrics)                    # its last text and its Completion, once it left the batch with a result

Everything a request asks for travels in its own `GenerationConfig` (sampling, seed, speculation policy, max depth,
tree budget) and stop strings, so requests with different options share a batch; the shared engine and drafter are
never changed. A plain request (``"speculative": false``) is a row of the same batch that never drafts (`PLAIN`):
its tokens are those of plain decoding, and its result says policy "plain" with no depths, as plain decoding reports.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from vlmspec.policy.control import SpeculationOptions
from vlmspec.engine import Batch, GenerationConfig, SpecEngine, StepEvent, Ticket
from vlmspec.errors import ContextLengthError
from vlmspec.inputs import encode_messages
from vlmspec.text import TextStream

from .job import Job
from .metrics import Metrics
from .protocol import APIError

PLAIN = SpeculationOptions(policy="fixed", max_depth=0)  # a plain request's row: never drafts


def context_error(prompt_tokens: int, max_tokens: int, limit: int) -> APIError:
    """The 400 for a request that cannot fit the model's context (as vLLM words it)."""
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                         f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
                         f"Please reduce the length of the messages or the completion (max_tokens).",
                    param="messages" if prompt_tokens >= limit else "max_tokens", code="context_length_exceeded")


def slot_error(exc: ContextLengthError) -> APIError:
    """The 400 for a prompt the engine found too long for a slot or for the model's context."""
    return APIError(400, str(exc), param="messages", code="context_length_exceeded")


def fitted(config: GenerationConfig, prompt_tokens: int, limit: int, max_tokens_given: bool) -> GenerationConfig:
    """`config` if prompt + max tokens fit the context `limit`; a request that gave no max_tokens has
    the server's default lowered to the context left; otherwise the 400 `context_error`."""
    room = limit - prompt_tokens
    if config.max_new_tokens <= room:
        return config
    if not max_tokens_given and room >= 1:
        return dataclasses.replace(config, max_new_tokens=room)
    raise context_error(prompt_tokens, config.max_new_tokens, limit)


@dataclass
class Row:
    """A job given to the batch: its ticket (its engine request once a step has admitted it) and its text."""

    job: Job
    ticket: Ticket
    text: TextStream
    joined: float  # time.monotonic() when it joined the batch
    last_emit: float | None = None  # when it last emitted tokens (None: not yet; its first event carries the prefill's token)

    @property
    def req(self) -> Any:
        """The engine's request (None while it waits for a slot)."""
        return self.ticket.request

    @classmethod
    def join(cls, job: Job, engine: SpecEngine, batch: Batch) -> "Row":
        """The job's request queued in `batch` (a step admits it). APIError 400 when the request
        cannot be served as asked (its input, its context); anything else raised is the server's."""
        target = engine.target
        try:
            inputs = encode_messages(target, job.messages, job.images)
        except ValueError as exc:  # the processor refused this input (an odd image, ...)
            raise APIError(400, f"the input could not be processed: {exc}", param="messages", code="invalid_input") from exc
        config = fitted(job.config, int(inputs["input_ids"].shape[1]), batch.context_limit(job.config), job.max_tokens_given)
        if not job.speculative:  # a row that never drafts: plain decoding's tokens, in the same batch
            config = dataclasses.replace(config, speculation=PLAIN, policy=None, tree=None)
        text = TextStream(target.tokenizer, job.stop)
        try:
            ticket = batch.submit(inputs, config)
        except ContextLengthError as exc:  # it could never fit a slot
            raise slot_error(exc) from exc
        return cls(job, ticket, text, time.monotonic())

    def failure(self) -> tuple[str, Exception] | None:
        """(stage, error) when serving this request failed for it alone: its prefill raised before it
        took a slot (a prompt over the context: a 400 APIError), or a step failed for it ("prefill",
        "draft", "commit"); None otherwise."""
        error = self.ticket.error
        if isinstance(error, ContextLengthError):
            return "prefill", slot_error(error)
        if error is not None:
            return "prefill", error
        req = self.ticket.request
        return (req.failure.stage, req.failure.error) if req is not None and req.failure is not None else None

    def emit(self, event: StepEvent, batch_size: int, now: float, metrics: Metrics) -> None:
        """A step's tokens to the client, through this request's TextStream; their latencies to the metrics."""
        job, n = self.job, len(event.token_ids)
        if self.last_emit is None:  # the prefill's token
            metrics.ttft.labels(job.mode).observe(now - job.submitted)
        else:
            if job.speculative:
                metrics.depth.labels(self.req.policy, str(batch_size)).observe(event.depth)
            if n:
                gap = (now - self.last_emit) / n
                itl = metrics.inter_token_latency.labels(job.mode)
                for _ in range(n):
                    itl.observe(gap)
        if n:
            self.last_emit = now
            metrics.generated_tokens.labels(job.mode).inc(n)
        job.post("event", self.text.push(event))

    def finish(self, metrics: Metrics) -> None:
        """After the request left the batch with a result: its last text and its Completion to the client."""
        job, result = self.job, self.req.result
        if not job.speculative:  # plain decoding chooses no depth
            result = dataclasses.replace(result, policy="plain", depths=[])
        tail, completion = self.text.finish(result)
        if tail is not None:
            job.post("event", tail)
        metrics.record_result(job.mode, completion.finish_reason, result)
        job.post("done", completion)
