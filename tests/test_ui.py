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

from vlmspec.policy.control import SpeculationOptions, depth_summary

from vlmspec.app import ServerSettings, create_app
from vlmspec.app.ui_runner import ServiceRunner
from vlmspec.app.live_server import LiveServer
from vlmspec.assets import SAMPLE_IMAGES
from vlmspec.draft import NgramDrafter, TreeConfig
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
def engine():
    return SpecEngine(tiny_target("llava"), NgramDrafter(TreeConfig(depth=4, top_k=2, total_tokens=8)))


def settings(**kw) -> ServerSettings:
    return ServerSettings(model=MODEL, max_queue=4, request_timeout_s=60, **kw)


# ------------------------------------------------------------------------------------------ (1) no browser


def test_ui_mounted_and_runner_side_by_side(engine, tmp_path):
    from fastapi.testclient import TestClient

    app = create_app(engine, settings())
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
        assert engine.drafter.tree.total_tokens == 8
        summary = cmp.summary()
        assert summary["speedup"] is not None and summary["identical"] is True
        # stats rendering the page shows
        from vlmspec.app.ui import render_stats, render_steps, render_summary

        assert "tok/s" in render_stats(s, "speculative") and "speedup" in render_summary(cmp)
        assert f"policy fixed, depths chosen {depth_summary(s.result.depths)}" in render_stats(s, "speculative")
        assert f"2x{s.result.depths.count(2)}" in depth_summary(s.result.depths)
        assert render_steps(s).count('class="vs-step ') == len(s.steps)


def test_ui_opens_on_a_toyworld_scene_and_says_what_the_default_model_knows(engine):
    """#22 item 2: the page opened on a photo the model cannot describe, and nothing said what it knows."""
    from vlmspec import assets
    from vlmspec.app.ui import MODEL_NOTE, TOY_NOTE, _Handlers, sample_images

    samples = sample_images()
    assert samples[0].name == "toyworld_scene.png"
    assert [p.name.startswith("toyworld") for p in samples] == sorted((p.name.startswith("toyworld") for p in samples), reverse=True)
    app = create_app(engine, settings(model_aliases=(str(assets.DEFAULT_TARGET),)))
    header, *_ = _Handlers(ServiceRunner(app.state.service, app.state.settings), samples).on_load()
    assert MODEL_NOTE in header and "aligned on ToyWorld" in header
    toy = create_app(engine, settings(model_aliases=(str(assets.BUNDLED_TARGET),)))  # the toy says what it knows
    header, *_ = _Handlers(ServiceRunner(toy.state.service, toy.state.settings), samples).on_load()
    assert TOY_NOTE in header and MODEL_NOTE not in header
    other = create_app(engine, settings(model_aliases=("/some/other/vlm",)))  # negative control: another model, no note
    header, *_ = _Handlers(ServiceRunner(other.state.service, other.state.settings), samples).on_load()
    assert MODEL_NOTE not in header and TOY_NOTE not in header


def test_gradio_api_is_one_named_endpoint_with_the_pages_names_defaults_and_json(engine, tmp_path):
    """#22 item 4: view_api() listed /on_run_1 with outputs value_20...; #48 item 8: the inputs had
    internal names (img, n_tokens, tree_n, spec_on: `image=` raised TypeError), the image's default
    read as a photo on GitHub, max_depth 5 where the page shows the tree's depth, and the speedup
    came back as HTML only."""
    from gradio_client import Client, handle_file

    from vlmspec.app.ui import _Handlers

    with LiveServer(create_app(engine, settings())) as srv:
        client = Client(f"{srv.url}/ui/", verbose=False)
        api = client.view_api(print_info=False, return_format="dict")
        assert set(api["named_endpoints"]) == {"/run"} and not api["unnamed_endpoints"]
        run = api["named_endpoints"]["/run"]
        params = {p["parameter_name"]: p for p in run["parameters"]}
        assert list(params) == ["image", "prompt", "max_tokens", "temperature", "speculative", "plain", "tree_size", "policy",
                                "max_depth"]
        assert [p["label"] for p in run["parameters"]][:2] == ["image (upload, paste, or pick a sample below)", "prompt"]
        outputs = [r["label"] for r in run["returns"]]
        assert "speculative decoding" in outputs and "speedup summary" in outputs and outputs[-1] == "runs"
        assert not [o for o in outputs + [p["label"] for p in run["parameters"]] if not o or o.startswith("value_")]
        # the defaults are what the page shows once loaded: the served drafter's tree and policy
        tree = engine.drafter.tree
        _, size, policy, depth = _Handlers(ServiceRunner(srv.app.state.service, srv.app.state.settings), []).on_load()
        assert params["max_depth"]["parameter_default"] == depth["value"] == tree.depth
        assert params["tree_size"]["parameter_default"] == size["value"] == tree.total_tokens
        assert params["policy"]["parameter_default"] == policy["value"]
        assert params["max_tokens"]["parameter_default"] == MAX_TOKENS and params["prompt"]["parameter_default"] == "Describe the picture."
        image = params["image"]
        assert image["parameter_default"]["url"].endswith("/toyworld_scene.png"), image
        assert "github" not in str(image) and Path(image["example_input"]["path"]) == SAMPLE_IMAGES / "toyworld_scene.png"

        *_, runs = client.predict(image=handle_file(str(cat_png(tmp_path))), prompt=PROMPT, max_tokens=12, api_name="/run")
        assert isinstance(runs, dict) and runs["identical"] is True and runs["speedup"] > 0 and runs["message"] is None
        spec, plain = runs["speculative"], runs["plain"]
        assert spec["text"] and spec["text"] == plain["text"] and spec["tokens"] == plain["tokens"] == 12
        assert spec["target_forwards"] >= 1 and plain["target_forwards"] == 12 and plain["policy"] == "plain"
        *_, default = client.predict(prompt=PROMPT, max_tokens=4, speculative=False, api_name="/run")
        assert default["plain"]["text"] and default["message"] is None  # the default image was used (no "no image" note)


def test_the_serving_docs_gradio_client_example_runs(engine):
    """docs/serving.md's gradio_client example, run against a live demo (#48 item 8's names and JSON)."""
    import re
    import subprocess
    import sys

    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "serving.md").read_text(), flags=re.DOTALL)
              if "gradio_client" in b]
    assert len(blocks) == 1, blocks
    with LiveServer(create_app(engine, settings())) as srv:
        code = blocks[0].replace("http://127.0.0.1:8000", srv.url)
        assert srv.url in code
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith(" True"), run.stdout  # greedy: identical outputs


def _run_page(handlers, image, speculative=True, plain=True):
    """The page's Run handler to completion: its last outputs."""
    async def go():
        last = None
        async for out in handlers.on_run(image, PROMPT, 16, 0.0, speculative, plain, None, "goodput", 3):
            last = out
        return last
    return asyncio.run(go())


def test_page_says_slower_names_a_missing_image_and_handles_no_mode(engine, tmp_path):
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

    app = create_app(engine, settings())
    handlers = _Handlers(ServiceRunner(app.state.service, app.state.settings), [])
    with TestClient(app):  # the worker runs
        summary, spec, spec_stats, plain, plain_stats, steps, runs = _run_page(handlers, Image.open(cat_png(tmp_path)), False, False)
        assert NO_MODE in summary and "vs-speedup" not in summary  # a message, not the previous run's speedup
        assert spec == plain == "" and "off" in spec_stats and "off" in plain_stats and runs["message"] == NO_MODE
        summary, spec, *_ = _run_page(handlers, None)  # no image: a text-only answer, and the page says so
        assert spec and NO_IMAGE_NOTE in summary, (summary, spec)
        summary, *_ = _run_page(handlers, Image.open(cat_png(tmp_path)))  # negative control: with an image, no note
        assert "vs-speedup" in summary and NO_IMAGE_NOTE not in summary


def _bad_images(tmp_path: Path) -> dict[str, Path]:
    """A file that is no image, and a decompression bomb (a PNG header claiming 30000 x 30000 pixels)."""
    import struct
    import zlib

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)

    bomb = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))
    files = {"not_an_image": b"hello, this is not an image at all", "bomb": bomb}
    for name, data in files.items():
        (tmp_path / f"{name}.png").write_bytes(data)
    return {name: tmp_path / f"{name}.png" for name in files}


def test_page_answers_a_bad_upload_with_the_apis_message_and_clears_the_old_run(engine, tmp_path):
    """#48 item 4: a non-image or a bomb showed Gradio's "Could not preprocess input component ...
    UnidentifiedImageError" with the server's temporary path, and the previous answers stayed."""
    from fastapi.testclient import TestClient

    from vlmspec.app.ui import NO_RUN, _Handlers

    app = create_app(engine, settings())
    handlers = _Handlers(ServiceRunner(app.state.service, app.state.settings), [])
    with TestClient(app) as client:
        summary, spec, *_ = _run_page(handlers, str(cat_png(tmp_path)))  # an upload reaches the handler as its path
        assert "vs-speedup" in summary and spec  # the run the bad uploads below must clear
        for name, path in _bad_images(tmp_path).items():
            summary, spec, spec_stats, plain, plain_stats, steps, runs = _run_page(handlers, str(path))
            body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()}},
                {"type": "text", "text": "hi"}]}]}
            api = client.post("/v1/chat/completions", json=body).json()["error"]["message"]
            assert runs["message"] == api and f">{api}<" in summary, (name, summary, api)  # the API's words, one line
            assert str(tmp_path) not in summary and "/tmp" not in summary and "Error" not in summary
            assert spec == plain == spec_stats == plain_stats == "" and NO_RUN in steps, name  # the old run cleared
            assert runs["speculative"] is None and runs["plain"] is None


def test_step_view_idle_text_captions_and_tier_contrast(engine):
    """#48 item 10: the idle step view said "waiting for the worker ..." before any run and after an
    error; nothing said which samples the default model reads; the darkest tier's subscripts were
    dark on dark green (3.1:1)."""
    import re

    from vlmspec import assets
    from vlmspec.app.ui import CSS, GUESSES, NO_RUN, READS, SPEC_OFF, render_steps, sample_captions, sample_images
    from vlmspec.app.ui_runner import RunState

    assert NO_RUN in render_steps(None) and "waiting" not in render_steps(None)
    assert SPEC_OFF in render_steps(None, SPEC_OFF)
    failed = RunState("speculative")
    failed.fail("the server is busy")
    assert "the run failed" in render_steps(failed) and "waiting" not in render_steps(failed)
    assert "waiting for the worker" in render_steps(RunState("speculative"))  # control: true while queued

    samples = sample_images()
    captions = dict(sample_captions(samples, reads_toyworld_only=True))
    assert {captions[str(p)] for p in samples if p.name.startswith("toyworld")} == {READS}
    assert {captions[str(p)] for p in samples if not p.name.startswith("toyworld")} == {GUESSES}
    assert [c for _, c in sample_captions(samples, reads_toyworld_only=False)] == [p.stem for p in samples]
    from fastapi.testclient import TestClient

    with TestClient(create_app(engine, settings(model_aliases=(str(assets.DEFAULT_TARGET),)))) as client:  # on the page
        config = client.get("/ui/config").json()
    gallery = next(c for c in config["components"] if c["props"].get("elem_id") == "samples")
    assert [item["caption"] for item in gallery["props"]["value"]] == [captions[str(p)] for p in samples]

    def colour(selector: str, prop: str) -> str | None:
        m = re.search(rf"{re.escape(selector)}\s*{{[^}}]*?{prop}:\s*(#[0-9a-fA-F]{{6}})", CSS)
        return m.group(1) if m else None

    def contrast(a: str, b: str) -> float:
        def lum(h: str) -> float:
            c = [int(h[i:i + 2], 16) / 255 for i in (1, 3, 5)]
            c = [x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4 for x in c]
            return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]
        hi, lo = sorted((lum(a), lum(b)), reverse=True)
        return (hi + 0.05) / (lo + 0.05)

    default_sub = colour(".vs-step sub", "color")
    for k in range(1, 7):
        background = colour(f".vs-t{k}", "background")
        sub = colour(f".vs-t{k} sub", "color") or default_sub
        assert contrast(sub, background) >= 4.5, (k, sub, background, round(contrast(sub, background), 2))
    assert contrast("#334155", "#16a34a") < 4.5  # control: the old darkest tier fails the check


def test_ui_with_api_keys_has_its_own_login_and_a_name_keeps_its_key(engine):
    from fastapi.testclient import TestClient

    app = create_app(engine, settings(api_keys=("sk-ui", "sk-other")))
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 401  # the API still needs the bearer key
        r = client.get("/ui/")
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]  # Gradio's login page
        assert client.get("/ui/config").status_code == 401  # Gradio's routes need the login
        assert client.post("/ui/login", data={"username": "me", "password": "wrong"}).status_code == 400
        assert client.post("/ui/login", data={"username": "me", "password": "sk-ui"}).status_code == 200
        assert client.get("/ui/config").status_code == 200  # the session cookie
    with TestClient(app) as other:  # a user name is its first key's tenant: another key under it is refused
        assert other.post("/ui/login", data={"username": "me", "password": "sk-other"}).status_code == 400
        assert other.post("/ui/login", data={"username": "you", "password": "sk-other"}).status_code == 200


def test_ui_can_be_turned_off(engine):
    app = create_app(engine, settings(ui=False))
    assert app.state.ui_path is None
    assert not any(getattr(r, "path", "") == "/ui" for r in app.routes)


# ------------------------------------------------------------------------------------------ (2) a real browser


@needs_browser
def test_browser_upload_prompt_run(engine, tmp_path):
    from playwright.sync_api import expect

    png = cat_png(tmp_path)
    with LiveServer(create_app(engine, settings())) as srv:
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
def test_browser_sample_pick_preview_loads_and_narrow_page_fits(engine):
    """#22 item 1: picking a sample showed a broken preview (its URL lacked the /ui prefix: 404);
    item 3: at 420 px the gallery's last column was cut off."""
    from playwright.sync_api import expect

    with _ui_page(create_app(engine, settings())) as (srv, browser, page):
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


@needs_browser
def test_browser_bad_upload_shows_one_line_and_clears_the_old_run(engine, tmp_path):
    """#48 item 4, in a browser: after a run, upload a file that is no image and press Run: one line
    (the API's message, no server path), the old answers and steps cleared, no Gradio error toast."""
    from playwright.sync_api import expect

    from vlmspec.app.ui import NO_RUN
    from vlmspec.inputs import NOT_AN_IMAGE

    bad = _bad_images(tmp_path)["not_an_image"]
    with _ui_page(create_app(engine, settings())) as (_, _, page):
        expect(page.locator("#vlmspec-header")).to_contain_text("ngram")
        page.locator("#run").click()
        expect(page.locator("#vs-speedup")).to_be_visible(timeout=60_000)
        assert page.locator("#spec-answer textarea").input_value().strip()  # the run the bad upload must clear
        page.locator("#image-input button[aria-label='Remove Image']").first.click()
        page.locator("#image-input input[type=file]").set_input_files(str(bad))
        page.locator("#run").click()
        message = page.locator("#vs-message")
        expect(message).to_have_text(NOT_AN_IMAGE)
        assert message.evaluate("e => e.getClientRects().length") == 1  # one line
        expect(page.locator("#spec-answer textarea")).to_have_value("")
        expect(page.locator("#plain-answer textarea")).to_have_value("")
        expect(page.locator("#vs-steps-idle")).to_have_text(NO_RUN)
        text = page.locator("body").inner_text()
        assert "/tmp" not in text and "preprocess" not in text and "UnidentifiedImageError" not in text
        assert page.locator(".toast-body").count() == 0
        page.screenshot(path="/tmp/ui-shots/demo_bad_upload.png", full_page=True)


def test_idle_ui_queue_does_not_spin(engine):
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
        create_app(engine, settings())
    finally:
        gradio.queueing.Queue.__init__ = real_init
    assert queues, "the UI's Blocks made no queue"
    q = queues[-1]
    assert q.sleep_when_free == QUEUE_IDLE_POLL_S >= 0.02 and q.progress_update_sleep_when_free == PROGRESS_IDLE_POLL_S


@pytest.mark.slow
def test_idle_server_cpu_figure(engine):
    """The figure behind item 10: the whole idle process (API + UI), CPU time over 20 s of wall
    time from getrusage. Measured 6.5% of a core with Gradio's defaults, 0.8% with quiet_queue."""
    import resource
    import time

    with LiveServer(create_app(engine, settings())):
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
    drafter (`make serve`), the default sample and prompt. Rewrites the committed screenshot, in 256
    colours (a third of the bytes of the browser's PNG)."""
    import io

    from playwright.sync_api import expect

    from vlmspec import factory
    from vlmspec.cli.serve import served_name

    spec = factory.EngineSpec()
    model = factory.resolve_model(spec.model)
    engine = factory.build_engine(spec)
    app = create_app(engine, ServerSettings(model=served_name(model, None), model_aliases=(model,), request_timeout_s=600))
    with _ui_page(app, timeout_ms=60_000) as (_, _, page):
        expect(page.locator("#vlmspec-header")).to_contain_text(f"{engine.drafter.tree.depth} deep")  # #48: it read 5 deep
        page.locator("#run").click()
        expect(page.locator("#vs-speedup")).to_be_visible(timeout=300_000)
        assert page.locator("#spec-answer textarea").input_value().strip()
        expect(page.locator("#speedup")).to_contain_text("identical outputs")
        shot = Image.open(io.BytesIO(page.screenshot(full_page=True))).convert("RGB")
        shot.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
            ROOT / "docs" / "demo_ui.png", optimize=True)
