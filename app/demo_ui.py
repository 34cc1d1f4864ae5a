"""A Gradio demo of speculative vs plain decoding, mounted at /ui in the service's FastAPI app.

    runner = ServiceRunner(app.state.service, settings)   # done by create_app when gradio is installed
    mount_ui(app, runner)                                   # -> the app, with the demo at /ui
    build_ui(runner) -> gr.Blocks

Every generation goes through the service's worker thread and bounded queue (the same ones the
REST API uses): the runner submits a `Job` and awaits its events on the event loop, so the model is
only ever touched by the worker. A "Run" submits the speculative job, then the plain one (one
after the other), and streams both answers, their tokens/s, the speedup, and a step-by-step view
where each target forward's emitted tokens (accepted drafts + the bonus token) are highlighted.

The tree-size slider sets the speculative drafter's `TreeConfig.total_tokens` for that one job (the
worker swaps it in and back); it is hidden when the drafter has no TreeConfig.
"""

from __future__ import annotations

import asyncio
import hmac
import html
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

from vlmspec.assets import SAMPLE_IMAGES

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
DEFAULT_PROMPT = "Describe the image."


def sample_images(folder: Path = SAMPLE_IMAGES) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


class RunError(Exception):
    """A generation the service refused or failed (queue full, timeout, bad input, ...)."""


# ------------------------------------------------------------------------------------------ runner


@dataclass
class RunState:
    """One generation as it streams: the UI renders it after every event."""

    mode: str  # "speculative" | "plain"
    text: str = ""
    steps: list[tuple[str, int, int, int]] = field(default_factory=list)  # (text, tokens, accepted, drafted) per forward
    tokens: int = 0
    t0: float = field(default_factory=time.monotonic)
    result: Any = None  # GenerationResult once done
    error: str | None = None
    waiting: bool = True  # queued, not started yet

    @property
    def tokens_per_s(self) -> float:
        if self.result is not None:
            return self.result.tokens_per_s
        dt = time.monotonic() - self.t0
        return self.tokens / dt if dt > 0 else 0.0


@dataclass
class Comparison:
    spec: RunState | None
    plain: RunState | None

    @property
    def speedup(self) -> float | None:
        s, p = self.spec, self.plain
        if s is None or p is None or s.result is None or p.result is None or p.result.tokens_per_s <= 0:
            return None
        return s.result.tokens_per_s / p.result.tokens_per_s

    @property
    def identical(self) -> bool | None:
        if self.spec is None or self.plain is None or self.spec.result is None or self.plain.result is None:
            return None
        return self.spec.result.token_ids == self.plain.result.token_ids

    def summary(self) -> dict[str, Any]:
        def one(r: RunState | None) -> dict[str, Any] | None:
            if r is None:
                return None
            res = r.result
            return {"text": r.text, "error": r.error, "tokens": r.tokens, "tokens_per_s": r.tokens_per_s,
                    "target_forwards": res.num_target_forwards if res else None,
                    "mean_accepted_length": res.mean_accepted_length if res else None,
                    "steps": [n for _, n, _, _ in r.steps]}

        return {"speculative": one(self.spec), "plain": one(self.plain), "speedup": self.speedup, "identical": self.identical}


class ServiceRunner:
    """Runs UI generations through the service's worker (app.server.Service) as ordinary Jobs."""

    def __init__(self, service: Any, settings: Any) -> None:
        self.service = service
        self.settings = settings

    def info(self) -> dict[str, Any]:
        return {"model": self.settings.model, "drafter": self.service.drafter_name,
                "tree_total_tokens": self.service.tree_total_tokens, "max_tokens_cap": self.settings.max_tokens_cap}

    def _check_image(self, image: Image.Image) -> Image.Image:
        w, h = image.size
        if w < 1 or h < 1 or w * h > self.settings.max_image_pixels:
            raise RunError(f"the image is {w}x{h}: over the limit of {self.settings.max_image_pixels} pixels")
        if max(w, h) / min(w, h) > self.settings.max_image_aspect_ratio:
            raise RunError(f"the image is {w}x{h}: aspect ratio over {self.settings.max_image_aspect_ratio:g}")
        return image.convert("RGB")

    async def stream(self, image: Image.Image | None, prompt: str, *, speculative: bool, max_tokens: int = 64,
                     temperature: float = 0.0, seed: int | None = 0, tree_total_tokens: int | None = None,
                     ) -> AsyncIterator[RunState]:
        """Submit one job and yield its RunState after each engine step (and once when it is done)."""
        from app.server import APIError, Job, QueueFull, ShuttingDown
        from vlmspec.engine import GenerationConfig
        from vlmspec.sampling import SamplingParams

        prompt = (prompt or "").strip()
        if not prompt:
            raise RunError("the prompt is empty")
        parts: list[dict[str, Any]] = [{"type": "text", "text": prompt}]
        images = []
        if image is not None:
            images = [self._check_image(image)]
            parts.insert(0, {"type": "image"})
        max_tokens = max(1, min(int(max_tokens), self.settings.max_tokens_cap))
        config = GenerationConfig(max_new_tokens=max_tokens, sampling=SamplingParams(temperature=float(temperature)), seed=seed)
        loop = asyncio.get_running_loop()
        job = Job([{"role": "user", "content": parts}], images, config, speculative,
                  time.monotonic() + self.settings.request_timeout_s, loop, asyncio.Queue(),
                  tree_total_tokens=tree_total_tokens if speculative else None)
        try:
            self.service.submit(job)
        except QueueFull:
            raise RunError(f"the server is busy: retry in {self.service.retry_after_s()} s") from None
        except ShuttingDown:
            raise RunError("the server is shutting down") from None
        state = RunState("speculative" if speculative else "plain")
        try:
            while True:
                remaining = job.deadline - time.monotonic() + 0.5
                try:
                    kind, payload = await asyncio.wait_for(job.inbox.get(), timeout=max(remaining, 0.01))
                except asyncio.TimeoutError:
                    job.cancel("timeout")
                    raise RunError(f"the generation did not finish within {self.settings.request_timeout_s:g} s") from None
                if kind == "start":
                    state.waiting = False
                    state.t0 = time.monotonic()
                elif kind == "event":
                    state.text += payload.text
                    state.tokens += len(payload.token_ids)
                    if payload.token_ids or payload.text:
                        state.steps.append((payload.text, len(payload.token_ids), payload.num_accepted, payload.num_drafted))
                    yield state
                elif kind == "done":
                    state.result = payload
                    state.text = payload.text
                    yield state
                    return
                else:
                    err: APIError = payload
                    raise RunError(err.message)
        finally:
            job.cancel("disconnect")  # the UI went away mid-stream: a no-op once the job finished

    async def compare(self, image: Image.Image | None, prompt: str, *, max_tokens: int = 64, temperature: float = 0.0,
                      seed: int | None = 0, speculative: bool = True, plain: bool = True,
                      tree_total_tokens: int | None = None) -> AsyncIterator[Comparison]:
        """The speculative run, then the plain run (each through the worker); yields the pair as it fills."""
        cmp = Comparison(RunState("speculative") if speculative else None, RunState("plain") if plain else None)
        kw: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
        if speculative:
            try:
                async for st in self.stream(image, prompt, speculative=True, tree_total_tokens=tree_total_tokens, **kw):
                    cmp.spec = st
                    yield cmp
            except RunError as exc:
                cmp.spec.error = str(exc)
                yield cmp
                return
        if plain:
            try:
                async for st in self.stream(image, prompt, speculative=False, **kw):
                    cmp.plain = st
                    yield cmp
            except RunError as exc:
                cmp.plain.error = str(exc)
                yield cmp

    async def compare_final(self, *args: Any, **kwargs: Any) -> Comparison:
        cmp = None
        async for cmp in self.compare(*args, **kwargs):
            pass
        return cmp


# ------------------------------------------------------------------------------------------ rendering

CSS = """
#vlmspec-header h1 { margin-bottom: 0; }
#speedup { min-height: 3.2em; }
.vs-banner { display: flex; gap: 1.2em; align-items: baseline; flex-wrap: wrap; padding: .6em .9em;
             border-radius: 10px; background: var(--block-background-fill); border: 1px solid var(--border-color-primary); }
.vs-big { font-size: 1.9em; font-weight: 700; color: #15803d; }
.vs-big.slow { color: #b45309; }
.vs-muted { color: var(--body-text-color-subdued); }
.vs-ok { color: #15803d; font-weight: 600; }
.vs-bad { color: #b91c1c; font-weight: 600; }
.vs-steps { line-height: 2.0; white-space: pre-wrap; font-family: var(--font-mono); font-size: .92em;
            padding: .6em; border-radius: 10px; border: 1px solid var(--border-color-primary); min-height: 4em; }
.vs-step { border-radius: 4px; padding: 2px 1px; margin: 0 1px; }
.vs-step sub { font-size: .65em; color: #334155; font-family: var(--font); margin-left: 1px; }
.vs-t1 { background: #e2e8f0; } .vs-t2 { background: #bbf7d0; } .vs-t3 { background: #86efac; }
.vs-t4 { background: #4ade80; } .vs-t5 { background: #22c55e; } .vs-t6 { background: #16a34a; color: white; }
.vs-alt { outline: 1px solid #94a3b8; }
.vs-legend span { display: inline-block; padding: 0 .5em; margin-right: .3em; border-radius: 4px; font-size: .85em; }
"""


def _tier(n: int) -> int:
    return max(1, min(n, 6))


def render_steps(state: RunState | None) -> str:
    legend = ('<div class="vs-legend vs-muted">tokens per target forward: '
              + "".join(f'<span class="vs-t{k}">{k if k < 6 else "6+"}</span>' for k in range(1, 7))
              + " &nbsp;(the subscript: tokens this forward emitted = accepted drafts + 1)</div>")
    if state is None:
        return legend + '<div class="vs-steps vs-muted">speculative decoding is off</div>'
    if not state.steps:
        body = "waiting for the worker ..." if state.waiting else ""
        return legend + f'<div class="vs-steps vs-muted">{body}</div>'
    spans = []
    for i, (text, n, acc, drafted) in enumerate(state.steps):
        what = "prefill" if i == 0 else f"forward {i}"
        title = f"{what}: {n} token(s) emitted, {acc} of {drafted} drafted accepted"
        shown = html.escape(text) if text else "&#8203;"
        alt = " vs-alt" if i % 2 else ""
        spans.append(f'<span class="vs-step vs-t{_tier(n)}{alt}" title="{html.escape(title)}">{shown}<sub>{n}</sub></span>')
    return legend + '<div class="vs-steps" id="vs-steps">' + "".join(spans) + "</div>"


def render_stats(state: RunState | None, label: str) -> str:
    if state is None:
        return f"*{label}: off*"
    if state.error:
        return f"**error:** {state.error}"
    if state.waiting and not state.tokens:
        return "*queued ...*"
    res = state.result
    if res is None:
        return f"**{state.tokens_per_s:.1f} tok/s** · {state.tokens} tokens · *running ...*"
    return (f"**{res.tokens_per_s:.1f} tok/s** · {len(res.token_ids)} tokens in {res.elapsed_s:.2f} s · "
            f"{res.num_target_forwards} target forwards · {res.mean_accepted_length:.2f} tokens/forward"
            + (f" · {res.num_accepted}/{res.num_drafted} drafts accepted" if res.num_drafted else "")
            + f" · finish: {res.finish_reason}")


def render_summary(cmp: Comparison | None, temperature: float = 0.0) -> str:
    if cmp is None:
        return '<div class="vs-banner vs-muted">Pick an image, type a prompt and press Run.</div>'
    sp = cmp.speedup
    if sp is None:
        running = [r.mode for r in (cmp.spec, cmp.plain) if r is not None and r.result is None and not r.error]
        msg = f"running {running[0]} decoding ..." if running else "done"
        if cmp.spec is not None and cmp.spec.result is not None and cmp.plain is None:
            msg = f"speculative: {cmp.spec.result.tokens_per_s:.1f} tok/s (plain decoding not run: no speedup)"
        return f'<div class="vs-banner"><span class="vs-muted">{html.escape(msg)}</span></div>'
    same = cmp.identical
    if same:
        check = '<span class="vs-ok">identical outputs ✓</span>'
    elif temperature > 0:
        check = '<span class="vs-muted">outputs differ (sampling at temperature > 0: both are exact samples)</span>'
    else:
        check = '<span class="vs-bad">outputs differ at temperature 0!</span>'
    s, p = cmp.spec.result, cmp.plain.result
    return (f'<div class="vs-banner"><span class="vs-big{"" if sp >= 1 else " slow"}" id="vs-speedup">{sp:.2f}× speedup</span>'
            f'<span>{s.tokens_per_s:.1f} vs {p.tokens_per_s:.1f} tok/s</span>'
            f'<span>{s.num_target_forwards} vs {p.num_target_forwards} target forwards</span>{check}</div>')


# ------------------------------------------------------------------------------------------ the Blocks


def build_ui(runner: ServiceRunner) -> gr.Blocks:
    samples = sample_images()
    first = str(samples[0]) if samples else None
    cap = int(getattr(runner.settings, "max_tokens_cap", 1024))

    with gr.Blocks(title="vlmspec demo", analytics_enabled=False) as demo:
        header = gr.Markdown("# vlmspec: lossless speculative decoding for VLMs\nloading ...", elem_id="vlmspec-header")
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=320):
                image = gr.Image(value=first, type="pil", label="image (upload, paste, or pick a sample below)",
                                 sources=["upload", "clipboard"], height=260, elem_id="image-input")
                gallery = gr.Gallery(value=[str(p) for p in samples], label="sample images", columns=4, height=230,
                                     allow_preview=False, object_fit="cover", elem_id="samples", visible=bool(samples))
                prompt = gr.Textbox(value=DEFAULT_PROMPT, label="prompt", lines=2, elem_id="prompt")
                with gr.Row():
                    max_tokens = gr.Slider(1, min(cap, 512), value=min(64, cap), step=1, label="max tokens", elem_id="max-tokens")
                    temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature", elem_id="temperature")
                with gr.Row():
                    speculative = gr.Checkbox(value=True, label="speculative decoding", elem_id="speculative")
                    compare = gr.Checkbox(value=True, label="also run plain decoding (speedup)", elem_id="compare")
                tree_size = gr.Slider(1, 128, value=16, step=1, label="draft tree size (drafted tokens per forward)",
                                      visible=False, elem_id="tree-size")
                run = gr.Button("Run", variant="primary", elem_id="run")
            with gr.Column(scale=3, min_width=420):
                summary = gr.HTML(render_summary(None), elem_id="speedup")
                with gr.Row(equal_height=True):
                    with gr.Column():
                        spec_text = gr.Textbox(label="speculative decoding", lines=7, max_lines=14, interactive=False,
                                               elem_id="spec-answer")
                        spec_stats = gr.Markdown("", elem_id="spec-stats")
                    with gr.Column():
                        plain_text = gr.Textbox(label="plain decoding", lines=7,
                                                max_lines=14, interactive=False, elem_id="plain-answer")
                        plain_stats = gr.Markdown("", elem_id="plain-stats")
                gr.Markdown("#### step by step: what each target forward emitted (speculative run; hover a step for details)")
                steps = gr.HTML(render_steps(RunState("speculative")), elem_id="steps")

        def on_load():
            info = runner.info()
            n = info["tree_total_tokens"]
            text = (f"# vlmspec: lossless speculative decoding for VLMs\n"
                    f"model **{info['model']}** · drafter **{info['drafter']}**"
                    + (f" · tree of {n} drafted tokens" if n else "")
                    + " · every run goes through the server's worker queue, like the API")
            slider = gr.update(visible=n is not None, value=n if n else 16, maximum=max(128, n or 0))
            return text, slider

        demo.load(on_load, outputs=[header, tree_size], queue=False)

        def on_pick(evt: gr.SelectData):
            if evt.index is None or not 0 <= evt.index < len(samples):
                return gr.update()
            return str(samples[evt.index])

        gallery.select(on_pick, outputs=image, queue=False)

        async def on_run(img, text, n_tokens, temp, spec_on, plain_on, tree_n):
            if not spec_on and not plain_on:
                raise gr.Error("turn on speculative decoding, plain decoding, or both")
            last = 0.0
            cmp = None
            tree = int(tree_n) if tree_n else None
            try:
                async for cmp in runner.compare(img, text, max_tokens=int(n_tokens), temperature=float(temp),
                                                speculative=bool(spec_on), plain=bool(plain_on), tree_total_tokens=tree):
                    now = time.monotonic()
                    done = any(r is not None and (r.result is not None or r.error) for r in (cmp.spec, cmp.plain))
                    if now - last < 0.05 and not done:  # at most ~20 page updates a second
                        continue
                    last = now
                    yield _outputs(cmp, float(temp))
            except RunError as exc:
                raise gr.Error(str(exc)) from None
            if cmp is not None:
                yield _outputs(cmp, float(temp))

        def _outputs(cmp: Comparison, temp: float):
            return (render_summary(cmp, temp),
                    cmp.spec.text if cmp.spec else "", render_stats(cmp.spec, "speculative decoding"),
                    cmp.plain.text if cmp.plain else "", render_stats(cmp.plain, "plain decoding"),
                    render_steps(cmp.spec))

        outs = [summary, spec_text, spec_stats, plain_text, plain_stats, steps]
        inputs = [image, prompt, max_tokens, temperature, speculative, compare, tree_size]
        run.click(on_run, inputs=inputs, outputs=outs, concurrency_limit=1)
        prompt.submit(on_run, inputs=inputs, outputs=outs, concurrency_limit=1)
    return demo


def _theme() -> gr.themes.Theme:
    # system fonts only: the page must not fetch Google Fonts (offline servers, headless tests)
    return gr.themes.Soft(primary_hue="green", neutral_hue="slate",
                          font=["ui-sans-serif", "system-ui", "Segoe UI", "Helvetica", "Arial", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"])


def mount_ui(app: Any, runner: ServiceRunner, path: str = "/ui") -> Any:
    """Mount the demo at `path` of the FastAPI app. With an API key, Gradio's login page asks for it
    (any user name; the key as password)."""
    key = getattr(runner.settings, "api_key", None)
    auth = None
    if key:
        def auth(username: str, password: str) -> bool:
            return hmac.compare_digest(password.encode(), key.encode())

    blocks = build_ui(runner)
    folder = str(SAMPLE_IMAGES)
    return gr.mount_gradio_app(app, blocks, path=path, auth=auth, allowed_paths=[folder], footer_links=[],
                               theme=_theme(), css=CSS, ssr_mode=False, mcp_server=False,
                               max_file_size=getattr(runner.settings, "max_body_bytes", None))


__all__ = ["Comparison", "RunError", "RunState", "ServiceRunner", "build_ui", "mount_ui", "sample_images"]
