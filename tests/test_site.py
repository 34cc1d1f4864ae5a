"""What a new user meets around the API (#48): /docs renders in a browser, /favicon.ico, the
validation messages of the HTTP API, and docs/serving.md's streaming example, on a tiny random LLaVA."""

from __future__ import annotations

import base64
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from conftest import browser_page, needs_browser, tiny_target
from PIL import Image

from vlmspec.app import ServerSettings, create_app
from vlmspec.app.site import DOCS_OPENAPI_URL, openapi_30
from vlmspec.draft import NgramDrafter, TreeConfig
from vlmspec.engine import SpecEngine
from vlmspec.inputs import IMAGE_FORMATS
from vlmspec.app.live_server import LiveServer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-llava"


@pytest.fixture(scope="module")
def engine():
    return SpecEngine(tiny_target("llava"), NgramDrafter(TreeConfig(depth=3, top_k=2, total_tokens=6)))


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(create_app(engine, ServerSettings(model=MODEL, ui=False, request_timeout_s=60))) as srv:
        yield srv


# ------------------------------------------------------------------------------------------ /docs


def _schemas(doc: dict):
    """Every schema object of an OpenAPI document (components and inline), depth first."""
    def walk(s):
        if isinstance(s, dict):
            yield s
            for key in ("items", "not", "additionalProperties"):
                yield from walk(s.get(key))
            for sub in (s.get("properties") or {}).values():
                yield from walk(sub)
            for key in ("anyOf", "oneOf", "allOf"):
                for sub in s.get(key, []):
                    yield from walk(sub)

    for schema in doc["components"]["schemas"].values():
        yield from walk(schema)
    for item in doc["paths"].values():
        for op in item.values():
            for body in [op.get("requestBody", {}), *op.get("responses", {}).values()]:
                for media in body.get("content", {}).values():
                    yield from walk(media.get("schema"))


def test_docs_read_an_openapi_30_copy_of_the_schema(server):
    """#48 item 1: the bundled Swagger UI (4.15) refuses OpenAPI 3.1; /docs now reads a 3.0 copy."""
    original = httpx.get(f"{server.url}/openapi.json").json()
    assert original["openapi"].startswith("3.1")  # what the page could not render; tools still get it
    page = httpx.get(f"{server.url}/docs").text
    assert f"url: '{DOCS_OPENAPI_URL}'" in page or f'"url": "{DOCS_OPENAPI_URL}"' in page, page
    doc = httpx.get(f"{server.url}{DOCS_OPENAPI_URL}").json()
    assert doc == openapi_30(original) and doc["openapi"].startswith("3.0.")
    assert set(doc["paths"]) == set(original["paths"])
    schemas = list(_schemas(doc))
    assert len(schemas) > 50
    for s in schemas:  # nothing of JSON Schema 2020-12 that OpenAPI 3.0 lacks
        assert s.get("type") != "null" and not isinstance(s.get("type"), list) and "const" not in s and "examples" not in s, s
        assert all(isinstance(s.get(bound, True), bool) for bound in ("exclusiveMinimum", "exclusiveMaximum")), s
        assert not ("$ref" in s and len(s) > 1), s  # a $ref's siblings are ignored in 3.0
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["top_p"] == {"type": "number", "minimum": 0.0, "exclusiveMinimum": True, "maximum": 1.0, "nullable": True,
                              "default": None, "title": "Top P"}
    assert props["speculation"]["nullable"] and props["speculation"]["allOf"] == [{"$ref": "#/components/schemas/SpeculationParams"}]
    assert props["stop"]["nullable"] and [m.get("type") for m in props["stop"]["anyOf"]] == ["string", "array"]
    assert doc["components"]["schemas"]["TextPart"]["properties"]["type"]["enum"] == ["text"]


@needs_browser
def test_docs_page_renders_the_chat_completions_operation(server):
    """#48 item 1: /docs answered 200 but showed "Unable to render this definition"."""
    from playwright.sync_api import expect

    with browser_page() as (_, page):
        page.goto(f"{server.url}/docs", wait_until="domcontentloaded")
        op = page.locator("#operations-default-chat_completions_v1_chat_completions_post")
        expect(op).to_be_visible()
        expect(op).to_contain_text("/v1/chat/completions")
        op.locator(".opblock-summary").click()  # opened: its request body and schema render too
        expect(op.locator(".opblock-body")).to_contain_text("Request body")
        expect(op.locator(".opblock-body")).to_contain_text("messages")
        assert page.get_by_text("Unable to render this definition").count() == 0
        assert page.locator(".errors-wrapper").count() == 0, page.locator(".errors-wrapper").inner_text()
        page.screenshot(path="/tmp/ui-shots/docs.png", full_page=False)


def test_favicon(server):
    """#48 item 10: /favicon.ico was 404."""
    r = httpx.get(f"{server.url}/favicon.ico")
    assert r.status_code == 200 and r.headers["content-type"] == "image/x-icon"
    icon = Image.open(io.BytesIO(r.content))
    assert icon.format == "ICO" and icon.size[0] >= 16


# ------------------------------------------------------------------------------------------ validation messages


def _chat(**kw) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **kw}


def _image_chat(url: str) -> dict:
    return _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": "hi"}]}])


NOT_PNG = "data:image/png;base64," + base64.b64encode(b"hello, this is not an image at all").decode()
MESSAGES = {
    # (body, param, what the message says, what it must not say)
    "empty content": (_chat(messages=[{"role": "user", "content": []}]), "messages.0.content",
                      "the array is empty (at least 1 item needed)", "valid string"),
    "five stop strings": (_chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4 items are allowed, got 5", "valid string"),
    "stop of neither type": (_chat(stop=5), "stop", "expected a string or an array", "valid string"),
    "content of neither type": (_chat(messages=[{"role": "user", "content": 7}]), "messages.0.content",
                                "expected a string or an array", "valid string"),
    "non-image data URL": (_image_chat(NOT_PNG), "messages.0.content.0.image_url.url",
                           f"the data is not an image in a supported format ({', '.join(IMAGE_FORMATS)})", "Error"),
    # controls: messages that were right stay as they were
    "text part not a string": (_chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
                               "messages.0.content.0.text", "Input should be a valid string", None),
    "stop list of ints": (_chat(stop=[1, 2]), "stop.0", "Input should be a valid string", None),
}


@pytest.mark.parametrize("case", list(MESSAGES))
def test_validation_messages_say_what_is_wrong(server, case):
    """#48 item 7: `"content": []` and five stop strings answered "Input should be a valid string" (the
    other member of the union); a non-image data URL ended in the exception's class name (KeyError)."""
    body, param, says, never = MESSAGES[case]
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err
    assert says in err["message"] and (never is None or never not in err["message"]), err["message"]
    assert "\n" not in err["message"] and not re.search(r"\b[A-Z]\w+Error\b", err["message"]), err["message"]


# ------------------------------------------------------------------------------------------ docs/serving.md


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_the_serving_docs_streaming_example_prints_its_usage(server, tmp_path):
    """#48 item 11: the streaming example's usage line never printed (no usage chunk without
    stream_options.include_usage). Runs the documented example, pointed at this server."""
    pytest.importorskip("openai")
    blocks = [b for b in _python_blocks((ROOT / "docs" / "serving.md").read_text()) if "stream=True" in b]
    assert len(blocks) == 1, blocks
    code = (blocks[0].replace("http://127.0.0.1:8000", server.url).replace('model="smolvlm-toyworld"', f'model="{MODEL}"')
            .replace("max_tokens=128", "max_tokens=8"))
    assert server.url in code and MODEL in code
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert re.search(r"CompletionUsage\(completion_tokens=\d+, prompt_tokens=\d+", run.stdout), run.stdout
