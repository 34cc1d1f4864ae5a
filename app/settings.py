"""The service's settings: one object, read per request (a test may change a field on a live app)."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from vlmspec.inputs import ImageLimits


DEFAULT_MAX_MODEL_LEN = 2048  # without --max-model-len: 16 slots of the default model hold 1.4 GiB in fp32 (46 KB a token)


@dataclass
class ServerSettings:
    model: str = "vlmspec"  # the name clients pass as `model`
    model_aliases: tuple[str, ...] = ()  # other accepted names (e.g. the model's full path)
    api_keys: tuple[str, ...] = ()  # any one opens every route but /healthz; each key is a tenant (below); () = open
    allow_remote_images: bool = False
    max_batch: int = 16  # requests decoded together (continuous batching; docs/serving.md: why 16); the rest wait in the queue
    max_queue: int = 16  # requests waiting for a free slot of the batch (the running ones excluded)
    request_timeout_s: float = 120.0  # from arrival to the last token
    max_tokens_cap: int = 1024
    default_max_tokens: int = 256  # when the request gives no max_tokens (clamped to the cap)
    max_images: int = 4
    max_image_pixels: int = 4096 * 4096
    max_image_aspect_ratio: float = 100.0
    max_body_bytes: int = 20 * 1024 * 1024
    remote_image_timeout_s: float = 10.0
    max_model_len: int | None = None  # the longest prompt + answer a request may have; the KV pool is sized from it once
    # (every slot: this + the draft tree), at start-up (None: the model's context, at most DEFAULT_MAX_MODEL_LEN)
    prefill_chunk: int | None = 512  # prompts longer than this enter their slot in pieces of at most this many
    # tokens, one step's budget each, so decoding rows wait at most one piece (None: whole prompts; docs/serving.md)
    prefill_first: bool = True  # joining prompts are prefilled before the running rows' next decode round (Batch)
    shutdown_grace_s: float = 30.0  # the drain on SIGTERM / SIGINT (--drain-seconds): how long the accepted requests may finish
    ui: bool = True  # mount the Gradio demo at /ui when gradio is importable (with API keys: a login page)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 0 or self.max_tokens_cap < 1 or self.max_images < 0 or self.max_body_bytes < 1:
            raise ValueError(f"invalid server settings: {self}")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2 (a prompt token and an answer token)")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1 (or None: whole prompts)")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        if isinstance(self.api_keys, str) or any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError("api_keys must be a tuple of non-empty keys without surrounding spaces")

    @property
    def open(self) -> bool:
        """No API key is set: every route is open, and every request is of one tenant (None)."""
        return not self.api_keys

    def tenant(self, key: str) -> str | None:
        """The tenant of the API key `key` (None when no key matches; every key is compared, in constant
        time). A tenant is the key's digest, never the key: the suffix drafter keeps one pool of earlier
        answers per tenant and never drafts one tenant's answers for another."""
        found = None
        for known in self.api_keys:
            if hmac.compare_digest(key.encode(), known.encode()):
                found = "key-" + hashlib.sha256(known.encode()).hexdigest()[:16]
        return found

    def serves(self, model: str) -> bool:
        """Whether `model` names the served model (its name or an alias)."""
        return model in (self.model, *self.model_aliases)

    def image_limits(self) -> ImageLimits:
        """The limits every image (API data URL, remote URL, demo upload) is checked against."""
        return ImageLimits(max_pixels=self.max_image_pixels, max_aspect_ratio=self.max_image_aspect_ratio,
                           allow_remote=self.allow_remote_images, remote_max_bytes=self.max_body_bytes,
                           remote_timeout_s=self.remote_image_timeout_s)
