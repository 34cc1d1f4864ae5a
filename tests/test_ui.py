"""The Gradio demo at /ui (app/ui.py, app/ui_runner.py) on a tiny random LLaVA.

(1) without a browser: the app serves /ui, and the runner (through the service's worker) returns a
    side-by-side speculative/plain result;
(2) @pytest.mark.browser: Debian's chromium driven by Playwright against a live loopback server:
    upload an image, type a prompt, click Run, read the answers; also writes docs/demo_ui.png.
    Skipped when /usr/bin/chromium or the playwright package is missing (never `playwright install`).
"""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import pytest

pytest.importorskip("gradio")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from conftest import tiny_target
from PIL import Image

from vlmspec.app import ServerSettings, create_app
from vlmspec.app.ui_runner import ServiceRunner
from vlmspec.testing.live_server import LiveServer
from vlmspec.assets import SAMPLE_IMAGES
from vlmspec.draft import NgramDrafter, NoDrafter, TreeConfig
from vlmspec.engine import SpecEngine


ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
MODEL = "tiny-llava"
# with this image and prompt the tiny random model soon repeats itself: the n-gram drafter gets hits
PROMPT = "the cat sat on the mat. the cat sat on the"
MAX_TOKENS = 128  # the UI's default "max tokens"




def cat_png(tmp_path: Path) -> Path:
    """A sample image as PNG (lossless: the UI upload and the API data URL decode to the same pixels)."""
    path = tmp_path / "cat.png"
    Image.open(SAMPLE_IMAGES / "cat.jpg").convert("RGB").save(path)
    return path


@pytest.fixture(scope="module")
def engines():
    target = tiny_target("llava")
    spec = SpecEngine(target, NgramDrafter(TreeConfig(depth=4, top_k=2, total_tokens=8)))
    return spec, SpecEngine(target, NoDrafter())


def settings(**kw) -> ServerSettings:
    return ServerSettings(model=MODEL, max_queue=4, request_timeout_s=60, **kw)


# ------------------------------------------------------------------------------------------ (1) no browser


def test_ui_mounted_and_runner_side_by_side(engines, tmp_path):
    from fastapi.testclient import TestClient

    app = create_app(engines, settings())
    assert app.state.ui_path == "/ui"
    with TestClient(app) as client:
        for path in ("/ui", "/ui/"):
            r = client.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert "gradio" in r.text.lower()
        assert client.get("/healthz").status_code == 200  # the API is still there

        runner = ServiceRunner(app.state.service, app.state.settings)
        assert runner.info()["drafter"] == "ngram" and runner.info()["tree_total_tokens"] == 8
        image = Image.open(cat_png(tmp_path))
        cmp = asyncio.run(runner.compare_final(image, PROMPT, max_tokens=32, temperature=0.0, tree_total_tokens=3))
        s, p = cmp.spec, cmp.plain
        assert s.error is None and p.error is None
        assert s.result is not None and p.result is not None
        assert s.text and s.text == p.text and cmp.identical  # lossless: greedy answers are identical
        assert s.result.tokens_per_s > 0 and p.result.tokens_per_s > 0
        assert cmp.speedup == pytest.approx(s.result.tokens_per_s / p.result.tokens_per_s)
        assert p.result.mean_accepted_length == 1.0 and p.result.num_target_forwards == len(p.result.token_ids)
        # the step view: one entry per target forward, tokens = accepted + 1 (bonus), covering the answer
        assert sum(n for _, n, _, _ in s.steps) == len(s.result.token_ids)
        assert all(n == acc + 1 for _, n, acc, _ in s.steps[1:-1])
        # the tree-size knob reached the drafter for that job only
        assert max(d for _, _, _, d in s.steps) <= 3
        assert engines[0].drafter.tree.total_tokens == 8
        summary = cmp.summary()
        assert summary["speedup"] is not None and summary["identical"] is True
        # stats rendering the page shows
        from vlmspec.app.ui import render_stats, render_steps, render_summary

        assert "tok/s" in render_stats(s, "speculative") and "speedup" in render_summary(cmp)
        assert render_steps(s).count('class="vs-step ') == len(s.steps)


def test_ui_opens_on_a_toyworld_scene_and_says_what_the_default_model_knows(engines):
    """#22 item 2: the page opened on a photo the model cannot describe, and nothing said what it knows."""
    from vlmspec import assets
    from vlmspec.app.ui import MODEL_NOTE, _Handlers, sample_images

    samples = sample_images()
    assert samples[0].name == "toyworld_scene.png"
    assert [p.name.startswith("toyworld") for p in samples] == sorted((p.name.startswith("toyworld") for p in samples), reverse=True)
    app = create_app(engines, settings(model_aliases=(str(assets.DEFAULT_TARGET),)))
    header, _ = _Handlers(ServiceRunner(app.state.service, app.state.settings), samples).on_load()
    assert MODEL_NOTE in header and "aligned on ToyWorld" in header
    other = create_app(engines, settings(model_aliases=("/some/other/vlm",)))  # negative control: another model, no note
    header, _ = _Handlers(ServiceRunner(other.state.service, other.state.settings), samples).on_load()
    assert MODEL_NOTE not in header


def test_gradio_api_is_one_named_endpoint_with_named_outputs(engines):
    """#22 item 4: view_api() listed /on_run_1 with outputs value_20...; now it reads like documentation."""
    from gradio_client import Client

    with LiveServer(create_app(engines, settings())) as srv:
        api = Client(f"{srv.url}/ui/", verbose=False).view_api(print_info=False, return_format="dict")
    assert set(api["named_endpoints"]) == {"/run"} and not api["unnamed_endpoints"]
    run = api["named_endpoints"]["/run"]
    params = [p["label"] for p in run["parameters"]]
    assert params[:2] == ["image (upload, paste, or pick a sample below)", "prompt"]
    outputs = [r["label"] for r in run["returns"]]
    assert "speculative decoding" in outputs and "speedup summary" in outputs
    assert not [o for o in outputs + params if not o or o.startswith("value_")], outputs + params


def test_ui_with_api_key_has_its_own_login(engines):
    from fastapi.testclient import TestClient

    app = create_app(engines, settings(api_key="sk-ui"))
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 401  # the API still needs the bearer key
        r = client.get("/ui/")
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]  # Gradio's login page
        assert client.get("/ui/config").status_code == 401  # Gradio's routes need the login
        assert client.post("/ui/login", data={"username": "me", "password": "wrong"}).status_code == 400
        assert client.post("/ui/login", data={"username": "me", "password": "sk-ui"}).status_code == 200
        assert client.get("/ui/config").status_code == 200  # the session cookie


def test_ui_can_be_turned_off(engines):
    app = create_app(engines, settings(ui=False))
    assert app.state.ui_path is None
    assert not any(getattr(r, "path", "") == "/ui" for r in app.routes)


# ------------------------------------------------------------------------------------------ (2) a real browser


def _have_browser() -> bool:
    if not os.path.exists(CHROMIUM):
        return False
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.browser
@pytest.mark.skipif(not _have_browser(), reason=f"needs {CHROMIUM} (apt-get install chromium) and the playwright package")
def test_browser_upload_prompt_run(engines, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    png = cat_png(tmp_path)
    with LiveServer(create_app(engines, settings())) as srv:
        # the API's greedy answer for the same image and prompt
        url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
        body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]}]}
        api = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).json()
        expected = api["choices"][0]["message"]["content"]
        assert expected

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 1000})
                page.set_default_timeout(30_000)
                page.goto(f"{srv.url}/ui/", wait_until="domcontentloaded")
                expect(page.locator("#run")).to_be_visible()
                expect(page.locator("#vlmspec-header")).to_contain_text("ngram")  # the load event ran
                # replace the preselected sample with an uploaded file
                page.locator("#image-input button[aria-label='Remove Image']").first.click()
                page.locator("#image-input input[type=file]").set_input_files(str(png))
                expect(page.locator("#image-input img")).to_be_visible()
                prompt = page.locator("#prompt textarea")
                prompt.fill(PROMPT)
                page.locator("#run").click()
                expect(page.locator("#vs-speedup")).to_be_visible(timeout=60_000)  # both runs done
                spec = page.locator("#spec-answer textarea").input_value()
                plain = page.locator("#plain-answer textarea").input_value()
                assert spec.strip() and spec == plain == expected
                expect(page.locator("#spec-stats")).to_contain_text("tok/s")
                expect(page.locator("#plain-stats")).to_contain_text("tok/s")
                expect(page.locator("#speedup")).to_contain_text("identical outputs")
                assert page.locator("#vs-steps .vs-step").count() >= 2
                (ROOT / "docs").mkdir(exist_ok=True)
                page.screenshot(path=str(ROOT / "docs" / "demo_ui.png"), full_page=True)
            finally:
                browser.close()
