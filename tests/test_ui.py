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
import contextlib
from pathlib import Path

import pytest

pytest.importorskip("gradio")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from conftest import browser_page, needs_browser, tiny_target
from PIL import Image

from vlmspec.control import SpeculationOptions, depth_summary

from vlmspec.app import ServerSettings, create_app
from vlmspec.app.ui_runner import ServiceRunner
from vlmspec.testing.live_server import LiveServer
from vlmspec.assets import SAMPLE_IMAGES
from vlmspec.draft import NgramDrafter, NoDrafter, TreeConfig
from vlmspec.engine import SpecEngine


ROOT = Path(__file__).resolve().parents[1]
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
        knobs = SpeculationOptions(policy="fixed", max_depth=2, tree_tokens=3)
        cmp = asyncio.run(runner.compare_final(image, PROMPT, max_tokens=32, temperature=0.0, speculation=knobs))
        s, p = cmp.spec, cmp.plain
        assert s.error is None and p.error is None
        assert s.result is not None and p.result is not None
        assert s.text and s.text == p.text and cmp.identical  # lossless: greedy answers are identical
        assert s.result.tokens_per_s > 0 and p.result.tokens_per_s > 0
        assert cmp.speedup == pytest.approx(s.result.tokens_per_s / p.result.tokens_per_s)
        assert p.result.mean_accepted_length == 1.0 and p.result.num_target_forwards == len(p.result.token_ids)
        # the step view: one entry per target forward, tokens = accepted + 1 (bonus), covering the answer
        assert sum(step[1] for step in s.steps) == len(s.result.token_ids)
        assert all(n == acc + 1 for _, n, acc, _, _ in s.steps[1:-1])
        # the knobs reached that job only: at most 3 drafted nodes, 2 levels, under the fixed policy
        assert max(step[3] for step in s.steps) <= 3 and s.result.depths and max(s.result.depths) == 2
        assert s.result.policy == "fixed" and [step[4] for step in s.steps[1:]] == s.result.depths
        assert engines[0].drafter.tree.total_tokens == 8
        summary = cmp.summary()
        assert summary["speedup"] is not None and summary["identical"] is True
        # stats rendering the page shows
        from vlmspec.app.ui import render_stats, render_steps, render_summary

        assert "tok/s" in render_stats(s, "speculative") and "speedup" in render_summary(cmp)
        assert f"policy fixed, depths chosen {depth_summary(s.result.depths)}" in render_stats(s, "speculative")
        assert f"2x{s.result.depths.count(2)}" in depth_summary(s.result.depths)
        assert render_steps(s).count('class="vs-step ') == len(s.steps)


def test_ui_opens_on_a_toyworld_scene_and_says_what_the_default_model_knows(engines):
    """#22 item 2: the page opened on a photo the model cannot describe, and nothing said what it knows."""
    from vlmspec import assets
    from vlmspec.app.ui import MODEL_NOTE, TOY_NOTE, _Handlers, sample_images

    samples = sample_images()
    assert samples[0].name == "toyworld_scene.png"
    assert [p.name.startswith("toyworld") for p in samples] == sorted((p.name.startswith("toyworld") for p in samples), reverse=True)
    app = create_app(engines, settings(model_aliases=(str(assets.DEFAULT_TARGET),)))
    header, *_ = _Handlers(ServiceRunner(app.state.service, app.state.settings), samples).on_load()
    assert MODEL_NOTE in header and "aligned on ToyWorld" in header
    toy = create_app(engines, settings(model_aliases=(str(assets.BUNDLED_TARGET),)))  # the toy says what it knows
    header, *_ = _Handlers(ServiceRunner(toy.state.service, toy.state.settings), samples).on_load()
    assert TOY_NOTE in header and MODEL_NOTE not in header
    other = create_app(engines, settings(model_aliases=("/some/other/vlm",)))  # negative control: another model, no note
    header, *_ = _Handlers(ServiceRunner(other.state.service, other.state.settings), samples).on_load()
    assert MODEL_NOTE not in header and TOY_NOTE not in header


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


def _run_page(handlers, image, speculative=True, plain=True):
    """The page's Run handler to completion: its last outputs."""
    async def go():
        last = None
        async for out in handlers.on_run(image, PROMPT, 16, 0.0, speculative, plain, None, "goodput", 3):
            last = out
        return last
    return asyncio.run(go())


def test_page_says_slower_names_a_missing_image_and_handles_no_mode(engines, tmp_path):
    """#22 item 3: a slowdown read "0.43x speedup"; unticking both modes stamped Error badges on
    every panel and kept the old speedup; a run without an image gave no hint."""
    from types import SimpleNamespace

    from vlmspec.app.ui import NO_IMAGE_NOTE, NO_MODE, _Handlers, render_summary

    def fake(spec_tps, plain_tps):
        res = lambda tps: SimpleNamespace(tokens_per_s=tps, num_target_forwards=10)  # noqa: E731
        return SimpleNamespace(speedup=spec_tps / plain_tps, identical=True, spec=SimpleNamespace(result=res(spec_tps)),
                               plain=SimpleNamespace(result=res(plain_tps)))

    assert "2.00× speedup" in render_summary(fake(20.0, 10.0))
    slow = render_summary(fake(4.3, 10.0))
    assert "2.33× slower" in slow and "speedup<" not in slow and "vs-big slow" in slow

    from fastapi.testclient import TestClient

    app = create_app(engines, settings())
    handlers = _Handlers(ServiceRunner(app.state.service, app.state.settings), [])
    with TestClient(app):  # the worker runs
        summary, spec, spec_stats, plain, plain_stats, steps = _run_page(handlers, Image.open(cat_png(tmp_path)), False, False)
        assert NO_MODE in summary and "vs-speedup" not in summary  # a message, not the previous run's speedup
        assert spec == plain == "" and "off" in spec_stats and "off" in plain_stats
        summary, spec, *_ = _run_page(handlers, None)  # no image: a text-only answer, and the page says so
        assert spec and NO_IMAGE_NOTE in summary, (summary, spec)
        summary, *_ = _run_page(handlers, Image.open(cat_png(tmp_path)))  # negative control: with an image, no note
        assert "vs-speedup" in summary and NO_IMAGE_NOTE not in summary


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


@needs_browser
def test_browser_upload_prompt_run(engines, tmp_path):
    from playwright.sync_api import expect

    png = cat_png(tmp_path)
    with LiveServer(create_app(engines, settings())) as srv:
        # the API's greedy answer for the same image and prompt
        url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
        body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]}]}
        api = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).json()
        expected = api["choices"][0]["message"]["content"]
        assert expected

        with browser_page() as (_, page):
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
            # item 3: the step chips wrap inside their panel (they overflowed it on long answers)
            assert page.evaluate("() => { const e = document.querySelector('#vs-steps');"
                                 " return e.scrollWidth <= e.clientWidth + 1 }")
            page.screenshot(path=str(tmp_path / "demo_ui.png"), full_page=True)  # docs/: the slow test below


@contextlib.contextmanager
def _ui_page(app, timeout_ms: int = 30_000):
    """(server, browser, a 1440 x 1000 page on /ui/) for `app`, closed afterwards."""
    with LiveServer(app) as srv, browser_page(timeout_ms=timeout_ms) as (browser, page):
        page.goto(f"{srv.url}/ui/", wait_until="domcontentloaded")
        yield srv, browser, page


@needs_browser
def test_browser_sample_pick_preview_loads_and_narrow_page_fits(engines):
    """#22 item 1: picking a sample showed a broken preview (its URL lacked the /ui prefix: 404);
    item 3: at 420 px the gallery's last column was cut off."""
    from playwright.sync_api import expect

    with _ui_page(create_app(engines, settings())) as (srv, browser, page):
        expect(page.locator("#vlmspec-header")).to_contain_text("ngram")
        first = page.locator("#image-input img").first.get_attribute("src")
        page.locator("#samples .thumbnail-item").nth(1).click()
        preview = page.locator("#image-input img").first
        expect(preview).not_to_have_attribute("src", first or "")
        src = preview.get_attribute("src")
        assert page.request.get(src if src.startswith("http") else f"{srv.url}{src}").status == 200, src
        page.wait_for_function("() => document.querySelector('#image-input img').naturalWidth > 0")
        page.locator("#run").click()
        expect(page.locator("#vs-speedup")).to_be_visible(timeout=60_000)
        assert page.locator("#spec-answer textarea").input_value().strip()

        narrow = browser.new_page(viewport={"width": 420, "height": 900})
        narrow.goto(f"{srv.url}/ui/", wait_until="domcontentloaded")
        expect(narrow.locator("#samples .thumbnail-item").first).to_be_visible()
        box = narrow.locator("#samples").bounding_box()
        thumbs = narrow.locator("#samples .thumbnail-item")
        for i in range(thumbs.count()):
            t = thumbs.nth(i).bounding_box()
            assert t["x"] >= box["x"] - 1 and t["x"] + t["width"] <= box["x"] + box["width"] + 1, (i, t, box)
        assert narrow.evaluate("() => document.documentElement.scrollWidth") <= 421


def test_idle_ui_queue_does_not_spin(engines):
    """#22 item 10: the idle server used ~5% of a core; Gradio's queue polled every 1 ms."""
    import gradio.queueing

    from vlmspec.app.ui import PROGRESS_IDLE_POLL_S, QUEUE_IDLE_POLL_S

    queues = []
    real_init = gradio.queueing.Queue.__init__

    def spy(self, *a, **kw):
        real_init(self, *a, **kw)
        queues.append(self)

    gradio.queueing.Queue.__init__ = spy
    try:
        create_app(engines, settings())
    finally:
        gradio.queueing.Queue.__init__ = real_init
    assert queues, "the UI's Blocks made no queue"
    q = queues[-1]
    assert q.sleep_when_free == QUEUE_IDLE_POLL_S >= 0.02 and q.progress_update_sleep_when_free == PROGRESS_IDLE_POLL_S


@pytest.mark.slow
def test_idle_server_cpu_figure(engines):
    """The figure behind item 10: the whole idle process (API + UI), CPU time over 20 s of wall
    time from getrusage. Measured 6.5% of a core with Gradio's defaults, 0.8% with quiet_queue."""
    import resource
    import time

    with LiveServer(create_app(engines, settings())):
        time.sleep(3)
        r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(20)
        r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    share = ((r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)) / (w1 - w0)
    print(f"idle server: {100 * share:.2f}% of a core")
    assert share < 0.03


@pytest.mark.slow
@needs_browser
def test_docs_screenshot_default_model_on_the_default_sample():
    """docs/demo_ui.png: the page as a user first sees it after pressing Run: the default model and
    drafter (`make serve`), the default sample and prompt. Rewrites the committed screenshot."""
    from playwright.sync_api import expect

    from vlmspec import factory
    from vlmspec.cli.serve import served_name

    spec = factory.EngineSpec()
    model = factory.resolve_model(spec.model)
    engine = factory.build_engine(spec)
    app = create_app(engine, ServerSettings(model=served_name(model, None), model_aliases=(model,), request_timeout_s=600))
    with _ui_page(app, timeout_ms=60_000) as (_, _, page):
        expect(page.locator("#vlmspec-header")).to_contain_text("drafter")
        page.locator("#run").click()
        expect(page.locator("#vs-speedup")).to_be_visible(timeout=300_000)
        assert page.locator("#spec-answer textarea").input_value().strip()
        expect(page.locator("#speedup")).to_contain_text("identical outputs")
        page.screenshot(path=str(ROOT / "docs" / "demo_ui.png"), full_page=True)
