"""`LLM`: vlmspec from Python in a few lines, a thin facade over the composition root.

    from vlmspec import LLM
    llm = LLM()                      # the default model and its drafter; LLM(model="toy"), LLM(model=DIR, drafter="ngram")
    out = llm.chat([{"role": "user", "content": [{"type": "image", "image": "assets/images/cat.jpg"},
                                                 {"type": "text", "text": "What is in the picture?"}]}])
    print(out.text, out.tau)         # the answer; tokens per target forward (drafted, accepted: the counts)
    outs = llm.generate(["Describe a cat.", {"prompt": "What is in it?", "images": [pil_image]}], max_new_tokens=64)

`vlmspec.factory` builds the engine (`EngineSpec`: model, drafter, dtype, ...); `vlmspec.inputs` reads the images
(PIL images, paths, bytes, data and http(s) URLs) and encodes the prompts (OpenAI- or Hugging Face-shaped messages);
one `Batch` of the engine decodes the requests together, at most `max_batch` at once; `vlmspec.text.TextStream`
detokenizes each, cut at its stop strings. One request gives one `Output`, a list a list; `llm.engine`: the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vlmspec.engine import GenerationConfig, GenerationResult, SpecEngine
from vlmspec.errors import ConfigError, InputError
from vlmspec.factory import EngineSpec, build_engine
from vlmspec.inputs import ImageLimits, chat_messages, encode_messages, load_image, user_turn
from vlmspec.sampling import SamplingParams
from vlmspec.text import TextStream


@dataclass
class Request:
    """One request to `LLM.generate`: a prompt (one user turn) or a conversation, its images, and
    its own options (None: the call's)."""

    prompt: str | None = None  # one user turn: its images first, then this text
    messages: list[dict[str, Any]] | None = None  # or a whole conversation (OpenAI's or HF's shape)
    images: list[Any] = field(default_factory=list)  # the prompt's images, or the conversation's bare {"type": "image"} ones, in order
    max_new_tokens: int | None = None
    sampling: SamplingParams | None = None
    stop: tuple[str, ...] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InputError("a request has either a prompt or messages (one of the two)", code="invalid_request")


@dataclass
class Output:
    """One answer: its text and tokens, why it ended, and what speculation did for it."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_new_tokens or the context)
    prompt_tokens: int
    tau: float  # mean accepted length: tokens per verify forward, the target's own token included (1.0: plain decoding)
    drafted: int  # tokens the drafter proposed, all steps together
    accepted: int  # of them, the ones the target accepted
    result: GenerationResult  # the engine's record: timings, acceptance by position, depths chosen


class LLM:
    """An engine built by `vlmspec.factory.build_engine` (`model`, `drafter`, `dtype`, `max_batch`,
    `device`; `options`: any other `EngineSpec` field, e.g. policy="fixed", tree_depth=4) and the
    calls that answer with it. `image_limits`: what images are accepted (http(s) URLs are fetched)."""

    def __init__(self, model: str | None = None, drafter: str = "auto", dtype: str = "auto", max_batch: int = 1,
                 device: str | None = None, image_limits: ImageLimits = ImageLimits(allow_remote=True), **options: Any) -> None:
        names = {f.name for f in dataclasses.fields(EngineSpec)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(f"LLM() has no option {', '.join(unknown)}: its options are the fields of EngineSpec ({', '.join(sorted(names))})")
        spec = EngineSpec(model=model, drafter=drafter, dtype=dtype, max_batch=max_batch, device=device, **options)
        self._use(build_engine(spec), max_batch, image_limits)

    @classmethod
    def from_engine(cls, engine: SpecEngine, max_batch: int = 1, image_limits: ImageLimits = ImageLimits(allow_remote=True)) -> "LLM":
        """An LLM over an engine built already (tests, or an engine of your own)."""
        llm = cls.__new__(cls)
        llm._use(engine, max_batch, image_limits)
        return llm

    def _use(self, engine: SpecEngine, max_batch: int, image_limits: ImageLimits) -> None:
        if max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1, got {max_batch}")
        self.engine, self.max_batch, self.image_limits = engine, max_batch, image_limits

    def generate(self, requests: Any, sampling: SamplingParams | None = None, *, max_new_tokens: int = 128,
                 stop: tuple[str, ...] = (), seed: int | None = None) -> Output | list[Output]:
        """Prompts or requests -> answers. A request is a str (a prompt, text only), a dict of `Request`'s
        fields ({"prompt": ..., "images": [...]} or {"messages": [...]}), or a `Request`; a list of them
        is decoded together and gives a list. sampling None: greedy."""
        many = isinstance(requests, (list, tuple))
        jobs = [self._job(as_request(r), sampling, max_new_tokens, stop, seed) for r in (requests if many else [requests])]
        outputs = self._run(jobs)
        return outputs if many else outputs[0]

    def chat(self, messages: list, images: list[Any] | None = None, sampling: SamplingParams | None = None, *,
             max_new_tokens: int = 128, stop: tuple[str, ...] = (), seed: int | None = None) -> Output | list[Output]:
        """A conversation (a list of messages, OpenAI's or HF's shape; images in the parts, or as bare
        {"type": "image"} parts filled from `images` in order) -> its answer. A list of conversations
        gives a list of answers (then `images` is not used: put them in the parts)."""
        if messages and all(isinstance(m, (list, tuple)) for m in messages):
            return self.generate([Request(messages=list(m)) for m in messages], sampling, max_new_tokens=max_new_tokens, stop=stop, seed=seed)
        return self.generate(Request(messages=list(messages), images=list(images or [])), sampling,
                             max_new_tokens=max_new_tokens, stop=stop, seed=seed)

    def encode(self, request: Request) -> dict[str, Any]:
        """A request -> the target's model inputs (its images read, its conversation through the chat template)."""
        if request.prompt is not None:
            messages, sources = user_turn(request.prompt, len(request.images)), [(f"images.{i}", s) for i, s in enumerate(request.images)]
        else:
            messages, sources = chat_messages(request.messages or [])
            bare = [i for i, (_, s) in enumerate(sources) if s is None]
            if len(bare) != len(request.images):
                raise InputError(f"the messages have {len(bare)} image part(s) without an image and images= gives {len(request.images)}: "
                                 "give one image per bare {'type': 'image'} part, or put each image in its part", param="images",
                                 code="invalid_request")
            for i, image in zip(bare, request.images):
                sources[i] = (sources[i][0], image)
        images = [load_image(source, self.image_limits, param) for param, source in sources]
        return encode_messages(self.engine.target, messages, images)

    def _job(self, request: Request, sampling: SamplingParams | None, max_new_tokens: int, stop: tuple[str, ...],
             seed: int | None) -> tuple[dict[str, Any], GenerationConfig, tuple[str, ...]]:
        mine = request.max_new_tokens is not None
        config = GenerationConfig(max_new_tokens=request.max_new_tokens if mine else max_new_tokens,
                                  sampling=request.sampling or sampling or SamplingParams(), seed=request.seed if request.seed is not None else seed)
        return self.encode(request), config, tuple(request.stop if request.stop is not None else stop)

    def _run(self, jobs: list[tuple[dict[str, Any], GenerationConfig, tuple[str, ...]]]) -> list[Output]:
        """Every job through one batch of the engine (at most max_batch at once), each row's text cut
        at its stop strings (the row leaves the batch there)."""
        slots = min(len(jobs), self.max_batch)
        try:
            batch = self.engine.batch(slots)
        except ConfigError:  # a model that decodes one request at a time (Target.check_batching says why)
            batch = self.engine.batch(1)
        tickets = [batch.submit(inputs, config) for inputs, config, _ in jobs]
        texts = [TextStream(self.engine.target.tokenizer, stop) for _, _, stop in jobs]
        while not batch.idle:
            events = batch.step()  # (a request it admitted has its ticket's `request` now)
            rows = {id(t.request): i for i, t in enumerate(tickets) if t.request is not None}
            for req, event in events:
                text = texts[rows[id(req)]]
                if text.stopped:
                    continue
                text.push(event)
                if text.stopped:
                    batch.cancel(req)
        outputs = []
        for ticket, text in zip(tickets, texts):
            if ticket.error is not None:
                raise ticket.error
            result = ticket.result
            assert result is not None
            _, done = text.finish(result)
            outputs.append(Output(done.text, result.token_ids, done.finish_reason, result.prompt_tokens, result.mean_accepted_length,
                                  result.num_drafted, result.num_accepted, result))
        return outputs


def as_request(item: Any) -> Request:
    """A str (a prompt), a dict of Request's fields, or a Request -> a Request."""
    if isinstance(item, Request):
        return item
    if isinstance(item, str):
        return Request(prompt=item)
    if isinstance(item, dict):
        unknown = sorted(set(item) - {f.name for f in dataclasses.fields(Request)})
        if unknown:
            raise InputError(f"a request dict has the fields of vlmspec.llm.Request (prompt, messages, images, max_new_tokens, sampling, "
                             f"stop, seed), not {', '.join(unknown)}; a conversation goes to llm.chat", code="invalid_request")
        return Request(**item)
    raise InputError(f"a request is a str, a dict or a vlmspec.llm.Request, got {type(item).__name__}", code="invalid_request")


__all__ = ["LLM", "Output", "Request"]
