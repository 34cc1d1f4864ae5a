"""User inputs -> model inputs: the one image loader and the one prompt encoder.

Images: bytes, files, data URLs and (opt-in) http(s) URLs -> RGB PIL images, with limits; every path into the model
goes through `decode_image` (the demo's uploads through `checked_rgb`): non-images, truncated files, decompression
bombs and extreme aspect ratios raise an `InputError` naming the field (`param`) with a short `code`. Prompts: chat
messages, each keeping its role, its content a list of ``{"type": "text", "text": ...}`` / ``{"type": "image"}``
parts in order, through the target's own chat template (``add_generation_prompt=True``), then its processor.

    load_image_file("photo.jpg")                             # -> RGB PIL image, or InputError
    load_image(pil_image | path | b"..." | "data:..." | "https://...", limits)   # whatever the caller holds
    chat_messages(openai_or_hf_messages)                    # -> template messages + each image's source
    encode_prompt(target, "Describe the image.", [image])   # one user turn: images first, then the text
    encode_messages(target, messages, images)               # a whole conversation (the server)
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
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from vlmspec.errors import InputError, TargetLoadError


# ---------------------------------------------------------------------------------------- images
# formats PIL may decode for us: the common web formats only
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP")
# what every caller (API, demo, CLI, training data) says about bytes that are no image it can read
NOT_AN_IMAGE = f"the data is not an image in a supported format ({', '.join(IMAGE_FORMATS)})"
_DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)$", re.DOTALL)


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
    except Exception:  # noqa: BLE001  (UnidentifiedImageError, a KeyError from a plugin, a broken header: any failure is bad input)
        raise InputError(NOT_AN_IMAGE, param=param, code="invalid_image") from None
    check_size(im, limits, param)
    try:
        im.load()  # decodes the first frame; a truncated or corrupt file raises here
        return im.convert("RGB")
    except Exception as exc:  # noqa: BLE001  (decoders raise OSError, ValueError, SyntaxError, zlib.error, ...)
        raise InputError(f"the image could not be decoded (truncated or corrupt): {exc.__class__.__name__}: {exc}",
                         param=param, code="invalid_image") from None


def check_size(im: Image.Image, limits: ImageLimits, param: str | None = None) -> None:
    """Refuse an image with no pixels, too many, or an extreme aspect ratio (header sizes suffice)."""
    width, height = im.size
    if width < 1 or height < 1:
        raise InputError("the image has no pixels", param=param, code="invalid_image")
    if width * height > limits.max_pixels:
        raise InputError(f"the image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_pixels}",
                         param=param, code="image_too_large")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise InputError(f"the image is {width}x{height}: aspect ratio over {limits.max_aspect_ratio:g}",
                         param=param, code="invalid_image")


def checked_rgb(im: Image.Image, limits: ImageLimits, param: str | None = None) -> Image.Image:
    """An already decoded image (e.g. from the demo UI) through the same limits, as RGB."""
    check_size(im, limits, param)
    return im.convert("RGB")


def load_image_file(path: str | Path, limits: ImageLimits = ImageLimits(), param: str | None = None) -> Image.Image:
    """A local image file -> RGB, with the same checks as an uploaded one."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"image not found: {path}", param=param, code="image_not_found")
    return decode_image(p.read_bytes(), limits, param or str(path))


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


def load_image(source: Any, limits: ImageLimits = ImageLimits(), param: str | None = None) -> Image.Image:
    """Any image a caller holds -> RGB, through the loaders above: a PIL image (`checked_rgb`), bytes
    (`decode_image`), a data URL or an http(s) URL (`load_image_url`; http only with
    `limits.allow_remote`), or a file path (`load_image_file`)."""
    if isinstance(source, Image.Image):
        return checked_rgb(source, limits, param)
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), limits, param)
    if isinstance(source, str) and re.match(r"^(data|https?):", source, flags=re.IGNORECASE):
        return load_image_url(source, limits, param)
    if isinstance(source, (str, Path)):
        return load_image_file(source, limits, param)
    raise InputError(f"an image is a PIL image, bytes, a file path, or a data or http(s) URL; got {type(source).__name__}",
                     param=param, code="invalid_image")


# ---------------------------------------------------------------------------------------- prompts
def chat_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[str, Any]]]:
    """Chat messages in OpenAI's shape or Hugging Face's -> HF chat-template messages, with a
    ``{"type": "image"}`` placeholder where each image was, and the images' sources in order as
    (param, source). Roles are kept (``developer`` is sent as ``system``); a string content is one
    text part. An image part is OpenAI's ``{"type": "image_url", "image_url": {"url": URL}}`` or HF's
    ``{"type": "image", "image" | "url" | "path": SOURCE}``; a bare ``{"type": "image"}`` has source
    None (its image is given apart, in order). `load_image` reads any source."""
    hf: list[dict[str, Any]] = []
    sources: list[tuple[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise InputError("a message is a dict with 'role' and 'content'", param=f"messages.{i}", code="invalid_message")
        content = msg["content"]
        parts: list[dict[str, Any]] = []
        for j, part in enumerate([{"type": "text", "text": content}] if isinstance(content, str) else content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                url = part["image_url"]
                sources.append((f"messages.{i}.content.{j}.image_url.url", url["url"] if isinstance(url, dict) else url))
                parts.append({"type": "image"})
            elif kind == "image":
                sources.append((f"messages.{i}.content.{j}", next((part[k] for k in ("image", "url", "path") if part.get(k) is not None), None)))
                parts.append({"type": "image"})
            else:
                raise InputError(f"a content part is {{'type': 'text' | 'image' | 'image_url', ...}}, got {part!r:.80}",
                                 param=f"messages.{i}.content.{j}", code="invalid_message")
        hf.append({"role": "system" if msg["role"] == "developer" else msg["role"], "content": parts})
    return hf, sources


def user_turn(prompt: str, n_images: int = 0) -> list[dict[str, Any]]:
    """One user message: `n_images` image placeholders, then the text."""
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    content.append({"type": "text", "text": prompt})
    return [{"role": "user", "content": content}]


def encode_messages(target: Any, messages: list[dict[str, Any]], images: list[Image.Image] | None = None) -> dict[str, Any]:
    """Chat-template messages + their images (in order) -> the processor's tensors on the target's
    device, cleaned for the forward (`model_inputs`): input_ids [1, L], attention_mask [1, L], pixel
    tensors, grids, ..."""
    processor, images = target.processor, list(images or [])
    text = render_chat(target, messages)
    kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = [im.convert("RGB") for im in images]
    return model_inputs(target, processor(**kwargs))


def render_chat(target: Any, messages: list[dict[str, Any]]) -> str:
    """The conversation through the target's chat template, wherever it is kept (the processor's,
    else the tokenizer's); a model with none is refused, saying how to give it one."""
    processor = target.processor
    tokenizer = getattr(processor, "tokenizer", processor)
    for owner in (processor, tokenizer):
        if getattr(owner, "chat_template", None):
            return owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    raise TargetLoadError(f"{target.name}: neither its processor nor its tokenizer has a chat template, so no prompt can be "
                          "built: save one as chat_template.jinja in the model folder (transformers reads it from there)")


# processor outputs the forward must not see: `labels` would make the model compute a loss
DROPPED_INPUTS = ("labels",)


def model_inputs(target: Any, inputs: Any) -> dict[str, Any]:
    """A processor's output as the target's forward takes it, cleaned in this one place: keys the
    forward must not see dropped, tensors moved to the target's device, floating tensors (pixels) cast
    to the target's dtype (a processor may return bf16 pixels for an fp32 model, or the reverse)."""
    rows = inputs["input_ids"].shape[0]
    if rows != 1:
        raise InputError(f"{target.name}'s processor made {rows} prompts of one conversation (ShieldGemma 2 makes one per "
                         "policy): vlmspec answers one prompt per request", code="unsupported_prompt")
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if key in DROPPED_INPUTS:
            continue
        if isinstance(value, torch.Tensor):
            value = value.to(target.device, dtype=target.dtype if value.is_floating_point() else None)
        out[key] = value
    return out


def encode_prompt(target: Any, prompt: str, images: list[Image.Image] | None = None) -> dict[str, Any]:
    """A single user turn (its images first, then the text) -> model inputs."""
    images = list(images or [])
    return encode_messages(target, user_turn(prompt, len(images)), images)
