"""Chat requests -> model inputs: images from data URLs (or, opt-in, http(s) URLs) and multi-turn prompts.

Prompt building
---------------
The whole conversation goes through the target's own chat template
(``target.processor.apply_chat_template``) with ``add_generation_prompt=True``:

* every message keeps its role (``system``, ``developer`` is sent as ``system``, ``user``, ``assistant``);
* a message's content becomes a list of parts in the order the client sent them: ``{"type": "text"}``
  for text, ``{"type": "image"}`` for each image (a plain string content is one text part);
* the images are handed to the processor in the order they appear in the conversation.

A conversation that is a single user turn with its images first and then one text part is
exactly what ``Target.encode(prompt, images)`` builds, and goes through that method.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from typing import Any

from PIL import Image

# formats PIL may decode for us: the common web formats only
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP")
_DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)$", re.DOTALL)


class InputError(Exception):
    """A bad request: becomes a 4xx OpenAI-shaped error."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type = type


@dataclass(frozen=True)
class ImageLimits:
    max_pixels: int = 4096 * 4096  # decompression-bomb cap, checked on the header before decoding
    max_aspect_ratio: float = 100.0  # long thin strips blow up when processors resize the short side
    allow_remote: bool = False
    remote_max_bytes: int = 20 * 1024 * 1024
    remote_timeout_s: float = 10.0


def decode_image(data: bytes, limits: ImageLimits, param: str | None = None) -> Image.Image:
    """Bytes -> an RGB PIL image, refusing non-images, truncated files and oversized images."""
    if not data:
        raise InputError("the image is empty", param=param, code="invalid_image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InputError("the image has too many pixels", param=param, code="image_too_large") from None
    except Exception as exc:  # noqa: BLE001  (UnidentifiedImageError, or a broken header: any failure is bad input)
        raise InputError(f"the bytes are not a supported image ({', '.join(IMAGE_FORMATS)}): {exc.__class__.__name__}",
                         param=param, code="invalid_image") from None
    width, height = im.size
    if width < 1 or height < 1:
        raise InputError("the image has no pixels", param=param, code="invalid_image")
    if width * height > limits.max_pixels:
        raise InputError(f"the image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_pixels}",
                         param=param, code="image_too_large")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise InputError(f"the image is {width}x{height}: aspect ratio over {limits.max_aspect_ratio:g}",
                         param=param, code="invalid_image")
    try:
        im.load()  # decodes the first frame; a truncated or corrupt file raises here
        return im.convert("RGB")
    except Exception as exc:  # noqa: BLE001  (decoders raise OSError, ValueError, SyntaxError, zlib.error, ...)
        raise InputError(f"the image could not be decoded (truncated or corrupt): {exc.__class__.__name__}: {exc}",
                         param=param, code="invalid_image") from None


def decode_data_url(url: str, limits: ImageLimits, param: str | None = None) -> Image.Image:
    m = _DATA_URL.match(url)
    if m is None:
        raise InputError("malformed data URL: expected data:image/<type>;base64,<data>", param=param, code="invalid_image_url")
    mime = m.group("mime").strip().lower()
    params = [p.strip().lower() for p in m.group("params").split(";") if p.strip()]
    if "base64" not in params:
        raise InputError("only base64 data URLs are supported (data:image/<type>;base64,...)", param=param, code="invalid_image_url")
    if mime and not mime.startswith("image/"):
        raise InputError(f"data URL media type {mime!r} is not an image", param=param, code="invalid_image_url")
    payload = re.sub(r"\s+", "", m.group("data"))
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError("the data URL's base64 payload is invalid", param=param, code="invalid_base64") from None
    return decode_image(data, limits, param)


def _opener() -> urllib.request.OpenerDirector:
    # http(s) only: no file:, ftp: or data: handlers, also not through a redirect
    od = urllib.request.OpenerDirector()
    for handler in (urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(), urllib.request.HTTPRedirectHandler(),
                    urllib.request.HTTPErrorProcessor(), urllib.request.HTTPDefaultErrorHandler()):
        od.add_handler(handler)
    return od


def fetch_remote_image(url: str, limits: ImageLimits, param: str | None = None) -> Image.Image:
    """Fetch an http(s) image with a size limit and a timeout (only when allow_remote is set)."""
    if not limits.allow_remote:
        raise InputError("remote image URLs are disabled on this server: send the image as a data URL "
                         "(data:image/png;base64,...)", param=param, code="remote_images_disabled")
    req = urllib.request.Request(url, headers={"User-Agent": "vlmspec-server", "Accept": "image/*"})
    try:
        with _opener().open(req, timeout=limits.remote_timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limits.remote_max_bytes:
                raise InputError(f"the remote image is over {limits.remote_max_bytes} bytes", param=param, code="image_too_large")
            data = resp.read(limits.remote_max_bytes + 1)
    except InputError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise InputError(f"could not fetch the image: {exc}", param=param, code="image_fetch_failed") from None
    if len(data) > limits.remote_max_bytes:
        raise InputError(f"the remote image is over {limits.remote_max_bytes} bytes", param=param, code="image_too_large")
    return decode_image(data, limits, param)


def load_image_url(url: str, limits: ImageLimits, param: str | None = None) -> Image.Image:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_url(url, limits, param)
    if scheme in ("http", "https"):
        return fetch_remote_image(url, limits, param)
    raise InputError("image_url.url must be a data URL (data:image/png;base64,...) or an http(s) URL",
                     param=param, code="invalid_image_url")


def to_hf_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """OpenAI messages (plain dicts) -> HF chat-template messages and the image URLs in order
    (as (param, url) pairs). Images become {"type": "image"} placeholders where they were."""
    hf: list[dict[str, Any]] = []
    urls: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        role = "system" if msg["role"] == "developer" else msg["role"]
        content = msg["content"]
        parts: list[dict[str, Any]] = []
        if isinstance(content, str):
            parts.append({"type": "text", "text": content})
        else:
            for j, part in enumerate(content):
                if part["type"] == "text":
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    parts.append({"type": "image"})
                    urls.append((f"messages.{i}.content.{j}.image_url.url", part["image_url"]["url"]))
        hf.append({"role": role, "content": parts})
    return hf, urls


def encode_conversation(target: Any, hf_messages: list[dict[str, Any]], images: list[Image.Image]) -> dict[str, Any]:
    """The conversation through the target's chat template and processor -> model inputs."""
    if len(hf_messages) == 1 and hf_messages[0]["role"] == "user":
        parts = hf_messages[0]["content"]
        n_img = sum(p["type"] == "image" for p in parts)
        if len(parts) == n_img + 1 and parts[-1]["type"] == "text":  # images first, then the text
            return target.encode(parts[-1]["text"], images)
    processor = target.processor
    if getattr(processor, "chat_template", None) is None and getattr(target.tokenizer, "chat_template", None) is None:
        from vlmspec.target import TargetLoadError

        raise TargetLoadError(f"{target.name}: the processor has no chat template; cannot build a prompt")
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = [im.convert("RGB") for im in images]
    inputs = processor(**kwargs)
    import torch

    return {k: v.to(target.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
