"""The text layer around the token-level engine: incremental detokenization, stop strings, hold-back.

    gen = stream_text(engine, inputs, config, stop=("\\n\\n",))
    for event in gen:                 # TextEvent: the new text + the engine's StepEvent
        print(event.text, end="")
    gen.completion.text, gen.completion.finish_reason, gen.completion.result  # the engine's GenerationResult

A batch row keeps a `TextStream` fed with its StepEvents; `TextGeneration` is the same TextStream
around a generation of its own, so both give the same text, stop and finish reason. Each step
decodes only a short window of tokens, so the cost per token does not grow with the output. What
is streamed, concatenated, equals the final text, which equals the tokenizer's decode of all the
emitted tokens (skip_special_tokens=True) cut before the first stop string. Text is held back while
it could still be the start of a stop string or ends in half a UTF-8 character.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from vlmspec.engine import GenerationConfig, GenerationResult, SpecEngine, StepEvent

REPLACEMENT = "\ufffd"  # what a decoder returns for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Token ids in, new text out. Keeps two offsets into the ids (as vLLM does): the text of
    ids[prefix:] minus the text of ids[prefix:read] is the new text, so a tokenizer's handling of a
    window's first token (a dropped leading space) cancels out. Text that ends in a replacement
    character waits for the next token (a character split across byte-level tokens)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still pending (an incomplete character is decoded as the tokenizer does)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return ""  # nothing printable yet: wait for more tokens
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]


class StopStringFilter:
    """Text in, visible text out: cuts at the first stop string and holds back a tail that could
    still be the start of one."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text so far, cut at a stop string once one is found
        self._sent = 0  # characters of `text` already returned
        self.stopped = False

    def push(self, new: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self._hold)  # a stop string may straddle old and new text
        self.text += new
        cuts = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if cuts:
            self.text, self.stopped, final = self.text[: min(cuts)], True, True
        visible = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        out, self._sent = self.text[self._sent : visible], visible
        return out


@dataclass
class TextEvent:
    text: str  # new visible text since the previous event (possibly "")
    step: StepEvent | None  # the engine step behind it (None for the final flush)


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    result: GenerationResult  # token ids, counters, timings

    def to_dict(self) -> dict[str, Any]:
        return {**self.result.to_dict(), "text": self.text, "finish_reason": self.finish_reason}


class TextStream:
    """One request's text, fed its engine steps one by one (what `TextGeneration` runs for a
    generation of its own, and the service's worker for each row of a batch):

        text = TextStream(tokenizer, stop)
        event = text.push(step)            # a TextEvent; once `stopped`, stop feeding it steps
        tail, completion = text.finish(result)   # the held-back text (a TextEvent or None), the Completion
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = StopStringFilter(stop)

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been found (the engine should stop this request)."""
        return self._stop.stopped

    def push(self, step: StepEvent) -> TextEvent:
        return TextEvent("".join(self._stop.push(self._detok.push(t)) for t in step.token_ids), step)

    def finish(self, result: GenerationResult) -> tuple[TextEvent | None, Completion]:
        """After the last step: the text still held back (None when there is none) and the Completion."""
        tail = self._stop.push(self._detok.flush(), final=True)
        finish = "stop" if self._stop.stopped else result.finish_reason
        return (TextEvent(tail, None) if tail else None), Completion(self._stop.text, finish, result)


class TextGeneration:
    """`engine.stream` with text: iterate TextEvents; `completion` is set once it ends.
    `close()` stops the engine (e.g. a client went away)."""

    def __init__(self, engine: SpecEngine, inputs: dict[str, Any], config: GenerationConfig, stop: tuple[str, ...] = ()) -> None:
        self.completion: Completion | None = None
        self._gen = engine.stream(inputs, config)
        self._text = TextStream(engine.target.tokenizer, stop)
        self._it = self._run()

    def __iter__(self) -> Iterator[TextEvent]:
        return self._it

    def close(self) -> None:
        self._it.close()
        self._gen.close()

    def _run(self) -> Iterator[TextEvent]:
        for step in self._gen:
            yield self._text.push(step)
            if self._text.stopped:
                self._gen.close()
                break
        result = self._gen.result
        assert result is not None
        tail, self.completion = self._text.finish(result)
        if tail is not None:
            yield tail


def stream_text(engine: SpecEngine, inputs: dict[str, Any], config: GenerationConfig, stop: tuple[str, ...] = ()) -> TextGeneration:
    return TextGeneration(engine, inputs, config, stop)


def generate_text(engine: SpecEngine, inputs: dict[str, Any], config: GenerationConfig, stop: tuple[str, ...] = ()) -> Completion:
    gen = stream_text(engine, inputs, config, stop)
    for _ in gen:
        pass
    assert gen.completion is not None
    return gen.completion


def decode(tokenizer: Any, token_ids: list[int]) -> str:
    """The whole text of `token_ids` at once, as the text layer's stream adds up to."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)
