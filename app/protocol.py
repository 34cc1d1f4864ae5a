"""The wire format: OpenAI request schemas, OpenAI-shaped errors, and request -> what the worker runs.

    inputs = prepare_chat(body, settings)   # bytes -> ChatInputs (or APIError), in this order: JSON and
                                            # types, n/logprobs/tools, model, max tokens, a user turn,
                                            # image count, then the images themselves
    completion_body(...) / chunk(...)       # the response shapes (non-stream / server-sent events)

Every error body is ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vlmspec.policy.control import SpeculationOptions
from vlmspec.engine import GenerationConfig
from vlmspec.errors import InputError
from vlmspec.inputs import chat_messages, load_image_url
from vlmspec.sampling import SamplingParams
from vlmspec.text import Completion

from .settings import ServerSettings

# ------------------------------------------------------------------------------------------ schemas


class _Strict(BaseModel):
    # strict: "8" is not an int, 1 is not a bool; unknown fields inside messages are ignored (clients
    # echo back assistant turns with tool_calls, refusal, ...); the request itself forbids them
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)]
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = None


MAX_TREE_TOKENS = 256  # drafted nodes one request may ask to verify per forward


class SpeculationParams(_Strict):
    """Extension: how this request speculates (every field optional; the server's defaults otherwise)."""

    policy: Literal["goodput", "fixed"] | None = None  # goodput: per step by expected tokens/s; fixed: full depth
    max_depth: int | None = Field(None, ge=0, le=64)  # drafted levels per step at most (0: never draft); capped by the tree
    tree_tokens: int | None = Field(None, ge=1, le=MAX_TREE_TOKENS)  # drafted nodes per step at most

    model_config = ConfigDict(strict=True, extra="forbid")

    def options(self) -> SpeculationOptions:
        return SpeculationOptions(self.policy, self.max_depth, self.tree_tokens)


_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class ChatCompletionRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)  # OpenAI default: 1
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)  # extension (vLLM-style)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    speculative: bool = True  # extension: false = plain autoregressive decoding
    speculation: SpeculationParams | None = None  # extension: policy, max depth, tree budget
    ignore_eos: bool = False  # extension (vLLM-style)
    logprobs: bool | None = None
    tools: list[Any] | None = None
    # known OpenAI / vLLM fields: accepted at their no-op values only (_unsupported answers 400
    # otherwise: a penalty changes the target distribution, and silently ignoring it is a lie)
    response_format: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    top_logprobs: int | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # bookkeeping fields that do not change the answer
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    model_config = ConfigDict(strict=True, extra="forbid")


# ------------------------------------------------------------------------------------------ errors


class APIError(Exception):
    """An OpenAI-shaped error response: HTTP `status`, the body's fields, extra response headers."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, request_id: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.request_id = request_id  # the request the server log's lines about this error name (a 500's)
        self.headers = {**(headers or {}), **({"x-request-id": request_id} if request_id else {})}

    @classmethod
    def from_input(cls, exc: InputError) -> "APIError":
        return cls(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)

    def body(self) -> dict[str, Any]:
        body = error_body(self.message, self.type, self.param, self.code)
        if self.request_id is not None:
            body["error"]["request_id"] = self.request_id
        return body


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# pydantic's union-member tags in an error's location -> what that member takes, in the client's words
_KINDS = (("str", "a string"), ("list", "an array"), ("int", "an integer"), ("float", "a number"), ("bool", "a boolean"),
          ("dict", "an object"))


def _is_kind_error(err: dict[str, Any]) -> bool:
    """The value is of another JSON type than this (union member) takes: "Input should be a valid string"."""
    return err["type"].endswith("_type")


def _param(loc: tuple[Any, ...]) -> str | None:
    """An error location -> the parameter as the client wrote it (pydantic's union tags dropped)."""
    parts = [str(p) for p in loc if p not in ("function-after", "union")]
    parts = [p for p in parts if p.isidentifier() or p.isdigit()]
    parts = [p for p in parts if p not in ("str", "TextPart", "ImagePart") and not p.startswith("list")]
    # and the discriminated union's tag: messages.0.content.1.image_url.image_url.url -> ...content.1.image_url.url
    return re.sub(r"(content\.\d+)\.(?:text|image_url)\.", r"\1.", ".".join(parts)) or None


def _kind(tag: str) -> str:
    return next((words for prefix, words in _KINDS if tag == prefix or tag.startswith(prefix + "[")), tag)


def _problem(err: dict[str, Any]) -> str:
    """What is wrong with the value, in one clause (pydantic's message where it is already plain)."""
    ctx = err.get("ctx") or {}
    if err["type"] == "too_long" and "max_length" in ctx:
        return f"at most {ctx['max_length']} items are allowed, got {ctx.get('actual_length', 'more')}"
    if err["type"] == "too_short" and "min_length" in ctx:
        got = ctx.get("actual_length")
        need = f"at least {ctx['min_length']} item{'s' if ctx['min_length'] != 1 else ''} needed"
        return f"the array is empty ({need})" if got == 0 else f"{got} items, {need}"
    return err["msg"]


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic error on the request body -> a 400 naming the parameter as the client wrote it.

    Of a union (``str | list of parts``, ``str | list[str]``), the member the client meant is the one
    whose JSON type the value has: its error is reported ("at most 4 items"), not the other member's
    "Input should be a valid string"; a value of neither type gets "expected a string or an array"."""
    errors = exc.errors(include_url=False)
    if not errors:
        return APIError(400, f"invalid request: {exc}", code="invalid_value")
    if errors[0]["type"] == "json_invalid":
        err = errors[0]
        return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", code="invalid_json")
    meant = [e for e in errors if not _is_kind_error(e)] or errors
    err = max(meant, key=lambda e: len(e.get("loc", ())))  # the deepest: inside the member the client meant
    param = _param(err.get("loc", ()))
    if err["type"] == "model_type" and param is None:
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if err["type"] == "missing":
        return APIError(400, f"missing required parameter: {param}", param=param, code="missing_required_parameter")
    members = [e for e in errors if _is_kind_error(e) and _param(e["loc"]) == param]
    if meant is errors and len(members) > 1 and len({len(e["loc"]) for e in members}) == 1:
        # no member took the value's type: say what the parameter takes
        kinds = [_kind(str(e["loc"][-1])) for e in members]
        return APIError(400, f"invalid value for {param}: expected {' or '.join(dict.fromkeys(kinds))}", param=param,
                        code="invalid_value")
    return APIError(400, f"invalid value for {param or 'the request'}: {_problem(err)}", param=param, code="invalid_value")


def model_not_found(model: str, settings: ServerSettings) -> APIError:
    return APIError(404, f"the model {model!r} does not exist (this server serves {settings.model!r})",
                    param="model", code="model_not_found")


def queue_full(max_queue: int, retry_after_s: int) -> APIError:
    return APIError(429, f"the server is busy ({max_queue} requests queued): retry after {retry_after_s} s",
                    type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after_s)})


def shutting_down(retry_after: bool = False) -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                    headers={"Retry-After": "5"} if retry_after else None)


def unavailable(why: str) -> APIError:
    """The 503 of a server whose worker is not serving though nobody stopped it (GET /healthz says the same)."""
    return APIError(503, f"the server cannot serve requests: {why}", type="server_error", code="unavailable")


def cancelled(reason: str, timeout_s: float) -> APIError:
    """Why a generation stopped early: "timeout" (504), "disconnect" (499), "shutdown" (503)."""
    if reason == "timeout":
        return APIError(504, f"the request did not finish within {timeout_s:g} s", type="timeout", code="timeout")
    if reason == "disconnect":
        return APIError(499, "the client disconnected", type="cancelled", code="client_disconnected")
    return shutting_down()


# where serving one request failed (the `stage` label of vlmspec_failed_requests_total) -> what its 500 says
FAILURE_STAGES = {
    "prefill": "while preparing it (encoding the prompt, the prefill, starting its drafter)",
    "draft": "in its drafter, while drafting",
    "commit": "while committing its accepted tokens (its drafter session, its speculation controller)",
    "output": "while turning its tokens into text (detokenization, stop strings, the result)",
    "step": "in a batched engine step: every request of that step got this error and the batch was reset",
    "worker": "when the worker thread stopped (this server serves no more requests: GET /healthz says why)",
}


def internal(stage: str, request_id: str) -> APIError:
    """The 500 of a request whose serving failed at `stage` (a key of FAILURE_STAGES); the server
    log has the traceback under `request_id`."""
    return APIError(500, f"internal error {FAILURE_STAGES[stage]}; the server log has the details under request id {request_id}",
                    type="server_error", code="internal_error", request_id=request_id)


# ------------------------------------------------------------------------------------------ request -> inputs


@dataclass
class ChatInputs:
    """A validated chat request, ready for the worker."""

    request: ChatCompletionRequest
    messages: list[dict[str, Any]]  # HF chat-template messages ({"type": "image"} placeholders in place)
    images: list[Image.Image]  # RGB, in the order of the placeholders
    config: GenerationConfig
    stop: tuple[str, ...]  # stop strings (the text layer cuts at them)


def prepare_chat(body: bytes, settings: ServerSettings) -> ChatInputs:
    """The raw body -> ChatInputs, or APIError. Blocking (may fetch remote images): run it in a thread."""
    try:
        req = ChatCompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    config, stop = generation_config(req, settings)
    messages, urls = to_hf_messages([m.model_dump() for m in req.messages])
    if len(urls) > settings.max_images:
        raise APIError(400, f"too many images: {len(urls)} (at most {settings.max_images} per request)",
                       param="messages", code="too_many_images")
    limits = settings.image_limits()
    try:
        images = [load_image_url(url, limits, param) for param, url in urls]
    except InputError as exc:
        raise APIError.from_input(exc) from None
    return ChatInputs(req, messages, images, config, stop)


def _unsupported(req: ChatCompletionRequest) -> APIError | None:
    def no(param: str, why: str) -> APIError:
        return APIError(400, f"{param} is not supported: {why}", param=param, code="unsupported_parameter")

    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        return no("response_format", "only {\"type\": \"text\"} (structured outputs are not implemented)")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            return no(name, "penalties are not implemented (only 0)")
    if req.repetition_penalty not in (None, 1, 1.0):
        return no("repetition_penalty", "penalties are not implemented (only 1)")
    if req.logit_bias:
        return no("logit_bias", "logit biases are not implemented")
    if req.top_logprobs:
        return no("top_logprobs", "logprobs are not implemented")
    if req.tool_choice not in (None, "none", "auto"):
        return no("tool_choice", "tools are not implemented")
    if req.n is not None and req.n != 1:
        return APIError(400, "only n=1 is supported", param="n", code="unsupported_value")
    if req.logprobs:
        return APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")
    if req.tools:
        return APIError(400, "tools are not supported", param="tools", code="unsupported_value")
    return None


def generation_config(req: ChatCompletionRequest, settings: ServerSettings) -> tuple[GenerationConfig, tuple[str, ...]]:
    """The request's decoding options -> (GenerationConfig, stop strings), checked against the settings."""
    err = _unsupported(req)
    if err is not None:
        raise err
    if req.model is not None and not settings.serves(req.model):
        raise model_not_found(req.model, settings)
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name)
        if value is not None and value > settings.max_tokens_cap:
            raise APIError(400, f"{name} must be <= {settings.max_tokens_cap}, got {value}", param=name, code="invalid_value")
    max_tokens = req.max_completion_tokens or req.max_tokens or min(settings.default_max_tokens, settings.max_tokens_cap)
    if not any(m.role == "user" for m in req.messages):
        raise APIError(400, "messages must contain at least one user message", param="messages", code="invalid_value")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=req.top_k or 0,
        top_p=1.0 if req.top_p is None else req.top_p,
    )
    knobs = req.speculation.options() if req.speculation is not None else SpeculationOptions()
    return GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, seed=req.seed, ignore_eos=req.ignore_eos,
                            speculation=knobs), stop


def to_hf_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """OpenAI messages (plain dicts) -> HF chat-template messages and the image URLs in order, as
    (param, url) pairs (`vlmspec.inputs.chat_messages`: roles kept, ``developer`` sent as ``system``,
    a string content one text part, an image part a ``{"type": "image"}`` placeholder where it was)."""
    return chat_messages(messages)


# ------------------------------------------------------------------------------------------ responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def speculative_block(enabled: bool, drafter: str, completion: Completion) -> dict[str, Any]:
    """The `speculative` extension of a response: what speculation did for this request."""
    result = completion.result
    return {
        "enabled": enabled,
        "drafter": drafter if enabled else "plain",
        "target_forwards": result.num_target_forwards,
        "drafted_tokens": result.num_drafted,
        "accepted_tokens": result.num_accepted,
        "mean_accepted_length": result.mean_accepted_length,
        "acceptance_by_position": result.acceptance_by_position,
        "policy": result.policy if enabled else None,
        "depths": result.depths if enabled else [],  # the controller's chosen depth, per target forward after the prefill
    }


@dataclass
class Reply:
    """What every response of one request shares."""

    id: str
    created: int  # unix seconds
    model: str
    speculative: bool
    drafter: str
    prompt_tokens: int

    def completion_body(self, completion: Completion) -> dict[str, Any]:
        """The non-streaming `chat.completion` object."""
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                         "logprobs": None, "finish_reason": completion.finish_reason}],
            "usage": usage(self.prompt_tokens, len(completion.result.token_ids)),
            "speculative": speculative_block(self.speculative, self.drafter, completion),
        }

    def chunk(self, delta: dict | None, finish: str | None = None, **extra: Any) -> str:
        """One server-sent `chat.completion.chunk` event (delta None: no choices, e.g. the usage chunk)."""
        obj: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                               "model": self.model, "system_fingerprint": None}
        obj["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        obj.update(extra)
        return f"data: {json.dumps(obj)}\n\n"

    def final_chunks(self, completion: Completion, include_usage: bool) -> list[str]:
        """The finish-reason chunk (carrying the `speculative` block), then, when the client asked for
        it (`stream_options.include_usage`, as OpenAI does), the usage chunk, with no choices."""
        spec = speculative_block(self.speculative, self.drafter, completion)
        chunks = [self.chunk({}, completion.finish_reason, speculative=spec)]
        if include_usage:
            chunks.append(self.chunk(None, usage=usage(self.prompt_tokens, len(completion.result.token_ids)), speculative=spec))
        return chunks


def error_event(err: APIError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"


DONE_EVENT = "data: [DONE]\n\n"
