"""A Gradio demo of speculative vs plain decoding, mounted at /ui in the service's FastAPI app.

    mount_ui(app, ServiceRunner(app.state.service, settings))   # done by create_app when gradio is installed
    build_ui(runner) -> gr.Blocks

A "Run" submits the speculative job, then the plain one (one after the other, through the same
worker and queue as the API; see ui_runner.py), and streams both answers, their tokens/s, the
speedup, and a step-by-step view where each target forward's emitted tokens (accepted drafts + the
bonus token) are highlighted, and the steps where the controller drafted nothing are marked. The
speculation controls (policy, max depth, tree size) become the speculative job's
`GenerationConfig.speculation`; they are hidden when the drafter has no tree. The page is also one
Gradio API endpoint, /run (``Client(url).predict(image=..., prompt=..., api_name="/run")``): its
inputs carry the page's names and defaults, its outputs the page's HTML and a JSON record of the runs.
"""

from __future__ import annotations

import html
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from vlmspec.assets import SAMPLE_IMAGES
from vlmspec.policy.control import POLICIES, SpeculationOptions, depth_summary

from .ui_runner import Comparison, ImageSource, RunError, RunState, ServiceRunner

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
DEFAULT_PROMPT = "Describe the picture."
TITLE = "# vlmspec: lossless speculative decoding for VLMs"
# what the default model knows, shown under the title
MODEL_NOTE = ("The default model (SmolLM2-135M-Instruct + EfficientNet-Lite0) was aligned on ToyWorld only: it reads shapes, "
              "colours, counts, places and one-word signs like the `toyworld_*` samples (bar charts poorly); on photos it guesses. "
              "Any Hugging Face VLM folder can be served instead: `vlmspec serve --model DIR`.")

TOY_NOTE = ("The toy model (4 M parameters, trained from scratch on ToyWorld) reads shapes, colours, counts, one-word signs "
            "and bar charts like the `toyworld_*` samples; on photos it writes nonsense. "
            "Any Hugging Face VLM folder can be served instead: `vlmspec serve --model DIR`.")


DEFAULT_SAMPLE = "toyworld_scene.png"  # the page opens on it: a scene the default model can describe


# the gallery's captions for a model aligned on ToyWorld only (the page's note above says what it reads)
READS, GUESSES = "✓ reads it", "✗ guesses"


def sample_captions(samples: list[Path], reads_toyworld_only: bool) -> list[tuple[str, str]]:
    """The gallery's (image, caption) pairs: for a model aligned on ToyWorld only, which samples it
    reads (the ToyWorld ones) and on which it guesses (the photos); else the file names."""
    if not reads_toyworld_only:
        return [(str(p), p.stem) for p in samples]
    return [(str(p), READS if p.name.startswith("toyworld") else GUESSES) for p in samples]


def sample_images(folder: Path = SAMPLE_IMAGES) -> list[Path]:
    """The sample images: the default scene, the other ToyWorld samples (what the default model
    was aligned on), then the photos."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES]
    return sorted(found, key=lambda p: (p.name != DEFAULT_SAMPLE, not p.name.startswith("toyworld"), p.name))


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
            padding: .6em; border-radius: 10px; border: 1px solid var(--border-color-primary); min-height: 4em;
            max-width: 100%; box-sizing: border-box; overflow-wrap: anywhere; max-height: 24em; overflow-y: auto; }
.vs-step { border-radius: 4px; padding: 2px 1px; margin: 0 1px; -webkit-box-decoration-break: clone; box-decoration-break: clone; }
#samples .grid-container { grid-template-columns: repeat(auto-fill, minmax(64px, 1fr)) !important; }
#samples .caption-label { max-width: 94%; font-size: .7em; padding: 1px 4px; opacity: .92; }
.vs-step sub { font-size: .65em; color: #334155; font-family: var(--font); margin-left: 1px; }
.vs-t1 { background: #e2e8f0; } .vs-t2 { background: #bbf7d0; } .vs-t3 { background: #86efac; }
.vs-t4 { background: #4ade80; } .vs-t5 { background: #22c55e; } .vs-t6 { background: #15803d; color: white; }
.vs-t6 sub { color: #f0fdf4; }  /* 4.8:1 on its green (#334155 was 3.1:1 on #16a34a) */
.vs-alt { outline: 1px solid #94a3b8; }
.vs-d0 { outline: 1px dashed #b45309; }
.vs-legend span { display: inline-block; padding: 0 .5em; margin-right: .3em; border-radius: 4px; font-size: .85em; }
"""


def _tier(n: int) -> int:
    return max(1, min(n, 6))


NO_RUN = "no run yet: press Run, and each target forward of the speculative run shows here"
SPEC_OFF = "speculative decoding is off"


def render_steps(state: RunState | None, idle: str = NO_RUN) -> str:
    """The step view: one highlighted span per target forward (its text, subscript: tokens emitted);
    `idle` where there is no speculative run."""
    legend = ('<div class="vs-legend vs-muted">tokens per target forward: '
              + "".join(f'<span class="vs-t{k}">{k if k < 6 else "6+"}</span>' for k in range(1, 7))
              + " &nbsp;(the subscript: tokens this forward emitted = accepted drafts + 1; "
              + '<span class="vs-d0">dashed</span>: the controller drafted nothing)</div>')
    if state is None:
        return legend + f'<div class="vs-steps vs-muted" id="vs-steps-idle">{html.escape(idle)}</div>'
    if not state.steps:
        body = ("no steps: the run failed" if state.error else "waiting for the worker ..." if state.waiting
                else "starting ...")
        return legend + f'<div class="vs-steps vs-muted" id="vs-steps-idle">{body}</div>'
    spans = []
    for i, (text, n, acc, drafted, depth) in enumerate(state.steps):
        what = "prefill" if i == 0 else f"forward {i}"
        title = f"{what}: {n} token(s) emitted, {acc} of {drafted} drafted accepted" + (f", depth {depth} chosen" if i else "")
        shown = html.escape(text) if text else "&#8203;"
        alt = " vs-d0" if i and depth == 0 and state.mode == "speculative" else " vs-alt" if i % 2 else ""
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
            + (f" · policy {res.policy}, depths chosen {depth_summary(res.depths)}" if state.mode == "speculative" and res.depths else "")
            + f" · finish: {res.finish_reason}")



def _pending_banner(cmp: Comparison) -> str:
    failed = next((r for r in (cmp.spec, cmp.plain) if r is not None and r.error), None)
    if failed is not None:
        msg = f"{failed.mode} decoding failed: {failed.error}"
        return f'<div class="vs-banner"><span class="vs-bad" id="vs-message">{html.escape(msg)}</span></div>'
    running = [r.mode for r in (cmp.spec, cmp.plain) if r is not None and r.result is None and not r.error]
    msg = f"running {running[0]} decoding ..." if running else "done"
    if cmp.spec is not None and cmp.spec.result is not None and cmp.plain is None:
        msg = f"speculative: {cmp.spec.result.tokens_per_s:.1f} tok/s (plain decoding not run: no speedup)"
    return f'<div class="vs-banner"><span class="vs-muted">{html.escape(msg)}</span></div>'


NO_IMAGE_NOTE = "no image: the answer comes from the prompt alone (pick a sample or upload one)"
NO_MODE = "Tick speculative decoding, plain decoding, or both, then press Run."


def _speed_label(sp: float) -> str:
    """2.1 -> '2.10× speedup'; 0.43 -> '2.33× slower' (a slowdown is not a speedup below 1)."""
    return f"{sp:.2f}× speedup" if sp >= 1 else f"{1 / sp:.2f}× slower"


def render_summary(cmp: Comparison | None, temperature: float = 0.0, note: str = "") -> str:
    extra = f'<span class="vs-muted" id="vs-note">{html.escape(note)}</span>' if note else ""
    if cmp is None:
        return '<div class="vs-banner vs-muted">Pick an image, type a prompt and press Run.</div>'
    sp = cmp.speedup
    if sp is None:
        return _pending_banner(cmp).replace("</div>", extra + "</div>")
    if cmp.identical:
        check = '<span class="vs-ok">identical outputs ✓</span>'
    elif temperature > 0:
        check = '<span class="vs-muted">outputs differ (sampling at temperature > 0: both are exact samples)</span>'
    else:
        check = '<span class="vs-bad">outputs differ at temperature 0!</span>'
    s, p = cmp.spec.result, cmp.plain.result
    slow = "" if sp >= 1 else ' slow" title="speculative decoding was slower than plain decoding on this prompt'
    return (f'<div class="vs-banner"><span class="vs-big{slow}" id="vs-speedup">{_speed_label(sp)}</span>'
            f'<span>{s.tokens_per_s:.1f} vs {p.tokens_per_s:.1f} tok/s</span>'
            f'<span>{s.num_target_forwards} vs {p.num_target_forwards} target forwards</span>{check}{extra}</div>')


Outputs = tuple[str, str, str, str, str, str, dict[str, Any]]  # what the page and /run show, in _output_column's order


def render_message(message: str, modes_off: bool = False) -> Outputs:
    """The page's outputs cleared, with `message` in the summary (no run was made; `modes_off`: because
    both modes were unticked, which their stats say)."""
    banner = f'<div class="vs-banner"><span class="vs-bad" id="vs-message">{html.escape(message)}</span></div>'
    details = {"message": message, "speculative": None, "plain": None, "speedup": None, "identical": None}
    spec_stats, plain_stats = ((render_stats(None, "speculative decoding"), render_stats(None, "plain decoding")) if modes_off
                               else ("", ""))
    return banner, "", spec_stats, "", plain_stats, render_steps(None), details


def render_outputs(cmp: Comparison, temperature: float, note: str = "") -> Outputs:
    """(summary, speculative answer, its stats, plain answer, its stats, step view, the runs as JSON)."""
    return (render_summary(cmp, temperature, note),
            cmp.spec.text if cmp.spec else "", render_stats(cmp.spec, "speculative decoding"),
            cmp.plain.text if cmp.plain else "", render_stats(cmp.plain, "plain decoding"),
            render_steps(cmp.spec, SPEC_OFF), {"message": note or None, **cmp.summary()})


# ------------------------------------------------------------------------------------------ the Blocks


def image_input(sample: str | None, **kwargs: Any) -> gr.Image:
    """A gr.Image whose value reaches the handler undecoded: the uploaded file's path (or a pasted data
    URL; Gradio has checked the path is an upload or a sample), which the runner decodes with the API's
    checks and messages. Gradio's own decoding answered a non-image with its internals and the server's
    temporary path. Its API example is `sample`, the image it opens on (Gradio's is a photo on GitHub).

    The two methods are set on the instance: a gr.Image subclass would make Gradio write a .pyi stub
    of this module beside it at import."""
    image = gr.Image(value=sample, type="filepath", **kwargs)

    def undecoded(payload: Any) -> str | None:
        if payload is None:
            return None
        return payload.url if payload.url and payload.url.startswith("data:") else payload.path

    def example() -> Any:
        if sample is None:
            return gr.Image.example_payload(image)
        return {"path": sample, "url": sample, "orig_name": Path(sample).name, "meta": {"_type": "gradio.FileData"}}

    image.preprocess = undecoded  # type: ignore[method-assign]
    image.example_payload = example  # type: ignore[method-assign]
    return image


@dataclass
class _Inputs:
    image: gr.Image
    gallery: gr.Gallery
    prompt: gr.Textbox
    max_tokens: gr.Slider
    temperature: gr.Slider
    speculative: gr.Checkbox
    plain: gr.Checkbox
    tree_size: gr.Slider
    policy: gr.Radio
    max_depth: gr.Slider
    run: gr.Button

    def run_args(self) -> list[Any]:  # in the order of _Handlers.on_run's parameters (named alike: /run's names)
        return [self.image, self.prompt, self.max_tokens, self.temperature, self.speculative, self.plain, self.tree_size,
                self.policy, self.max_depth]


def _input_column(samples: list[Path], cap: int, reads_toyworld_only: bool) -> _Inputs:
    first = str(samples[0]) if samples else None
    with gr.Column(scale=2, min_width=320):
        image = image_input(first, label="image (upload, paste, or pick a sample below)", sources=["upload", "clipboard"],
                            height=260, elem_id="image-input")
        gallery = gr.Gallery(value=sample_captions(samples, reads_toyworld_only), label="sample images", columns=4, height=230,
                             allow_preview=False, object_fit="cover", elem_id="samples", visible=bool(samples))
        prompt = gr.Textbox(value=DEFAULT_PROMPT, label="prompt", lines=2, elem_id="prompt")
        with gr.Row():
            max_tokens = gr.Slider(1, min(cap, 512), value=min(128, cap), step=1, label="max tokens", elem_id="max-tokens")
            temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature", elem_id="temperature")
        with gr.Row():
            speculative = gr.Checkbox(value=True, label="speculative decoding", elem_id="speculative")
            plain = gr.Checkbox(value=True, label="also run plain decoding (speedup)", elem_id="compare")
        with gr.Row():
            policy = gr.Radio(list(POLICIES), value=POLICIES[0], label="speculation policy", visible=False, elem_id="policy",
                              info="goodput: drafts as deep as pays, from the acceptance so far (0 when nothing is accepted); fixed: always the full depth")
            max_depth = gr.Slider(0, 16, value=0, step=1, label="max draft depth (0: never draft)", visible=False, elem_id="max-depth")
        tree_size = gr.Slider(1, 128, value=16, step=1, label="draft tree size (drafted tokens per forward)",
                              visible=False, elem_id="tree-size")
        run = gr.Button("Run", variant="primary", elem_id="run")
    return _Inputs(image, gallery, prompt, max_tokens, temperature, speculative, plain, tree_size, policy, max_depth, run)


def _output_column() -> list[Any]:
    """The output components, in the order of render_outputs."""
    with gr.Column(scale=3, min_width=420):
        # every output has a label (hidden where the page does not show one): gradio_client's
        # view_api() names the outputs by them instead of value_20
        summary = gr.HTML(render_summary(None), elem_id="speedup", label="speedup summary", show_label=False)
        with gr.Row(equal_height=True):
            with gr.Column():
                spec_text = gr.Textbox(label="speculative decoding", lines=7, max_lines=14, interactive=False,
                                       elem_id="spec-answer")
                spec_stats = gr.Markdown("", elem_id="spec-stats", label="speculative decoding stats", show_label=False)
            with gr.Column():
                plain_text = gr.Textbox(label="plain decoding", lines=7, max_lines=14, interactive=False,
                                        elem_id="plain-answer")
                plain_stats = gr.Markdown("", elem_id="plain-stats", label="plain decoding stats", show_label=False)
        gr.Markdown("#### step by step: what each target forward emitted (speculative run; hover a step for details)")
        steps = gr.HTML(render_steps(None), elem_id="steps", label="steps of the speculative run", show_label=False)
        with gr.Accordion("the runs as JSON (what the API endpoint /run returns last)", open=False):
            details = gr.JSON(None, label="runs", elem_id="runs-json")
    return [summary, spec_text, spec_stats, plain_text, plain_stats, steps, details]


def controls(info: dict[str, Any]) -> dict[str, Any]:
    """The speculation controls' values for the served drafter (its tree's size and depth, the
    engine's policy): what the page shows on load and /run's API defaults."""
    n, depth = info["tree_total_tokens"], info["tree_depth"]
    return {"tree_size": n or 16, "policy": info["policy"] if info["policy"] in POLICIES else POLICIES[0], "max_depth": depth or 0}


class Logins:
    """The demo's login with API keys (Gradio's page: a user name, an API key as password) and each
    user name's tenant (`ServerSettings.tenant`): a name belongs to the key it first logged in with
    and another key under that name is refused, so a demo run drafts from its own key's earlier
    answers only, as an API request does."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.tenants: dict[str, str] = {}  # user name -> its key's tenant

    def check(self, username: str, password: str) -> bool:
        tenant = self.settings.tenant(password)
        return tenant is not None and self.tenants.setdefault(username, tenant) == tenant

    def tenant(self, request: gr.Request | None) -> str | None:
        """The logged-in user's tenant; None without a login (an open service: one shared pool)."""
        username = getattr(request, "username", None)
        return self.tenants.get(username) if username else None


class _Handlers:
    """The page's event handlers (bound methods, so Gradio sees their real signatures: on_run's
    parameter names are /run's)."""

    def __init__(self, runner: ServiceRunner, samples: list[Path], logins: Logins | None = None) -> None:
        self.runner, self.samples, self.logins = runner, samples, logins or Logins(runner.settings)

    def on_load(self) -> tuple[str, Any, Any, Any]:
        info = self.runner.info()
        n, depth = info["tree_total_tokens"], info["tree_depth"]
        text = (f"{TITLE}\nmodel **{info['model']}** · drafter **{info['drafter']}**"
                + (f" · tree of {n} drafted tokens, {depth} deep · policy **{info['policy']}**" if n else "")
                + " · every run goes through the server's worker queue, like the API"
                + (f"\n\n{MODEL_NOTE}" if info.get("default_model") else f"\n\n{TOY_NOTE}" if info.get("toy_model") else ""))
        values = controls(info)
        slider = gr.update(visible=n is not None, value=values["tree_size"], maximum=max(128, n or 0))
        policy = gr.update(visible=n is not None, value=values["policy"])
        max_depth = gr.update(visible=n is not None, value=values["max_depth"], maximum=max(16, depth or 0))
        return text, slider, policy, max_depth

    def on_pick(self, evt: gr.SelectData) -> Any:
        if evt.index is None or not 0 <= evt.index < len(self.samples):
            return gr.update()
        return str(self.samples[evt.index])

    async def on_run(self, image: ImageSource, prompt: str, max_tokens: float, temperature: float, speculative: bool,
                     plain: bool, tree_size: float | None, policy: str | None = None, max_depth: float | None = None,
                     request: gr.Request = None) -> AsyncIterator[Outputs]:
        if not speculative and not plain:  # not an error: a message where the speedup goes, the old run cleared
            yield render_message(NO_MODE, modes_off=True)
            return
        try:  # bad input (a non-image, a bomb, an empty prompt): the API's one-line message, the old run cleared
            picture, prompt = self.runner.inputs(image, prompt)
        except RunError as exc:
            yield render_message(str(exc))
            return
        note = NO_IMAGE_NOTE if picture is None else ""
        last, cmp = 0.0, None
        knobs = SpeculationOptions(policy=policy if policy in POLICIES else None, tree_tokens=int(tree_size) if tree_size else None,
                                   max_depth=int(max_depth) if max_depth is not None else None)
        async for cmp in self.runner.compare(picture, prompt, max_tokens=int(max_tokens), temperature=float(temperature),
                                             speculative=bool(speculative), plain=bool(plain), speculation=knobs,
                                             tenant=self.logins.tenant(request)):
            now = time.monotonic()
            done = any(r is not None and (r.result is not None or r.error) for r in (cmp.spec, cmp.plain))
            if now - last < 0.05 and not done:  # at most ~20 page updates a second
                continue
            last = now
            yield render_outputs(cmp, float(temperature), note)
        if cmp is not None:
            yield render_outputs(cmp, float(temperature), note)


class DemoBlocks(gr.Blocks):
    """The demo's Blocks, whose API info gives /run the defaults the page shows: the speculation
    controls' values for the served drafter (`controls`), read when a client asks (the worker has
    loaded the engine by then; the page's components are built before it has)."""

    def __init__(self, runner: ServiceRunner, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.runner = runner

    def get_api_info(self, all_endpoints: bool = False, page: str | None = None) -> Any:
        info = super().get_api_info(all_endpoints=all_endpoints, page=page)
        values = controls(self.runner.info())
        for endpoint in info["named_endpoints"].values():
            for param in endpoint["parameters"]:
                if param.get("parameter_name") in values:
                    param["parameter_default"] = values[param["parameter_name"]]
        return info


def build_ui(runner: ServiceRunner, logins: Logins | None = None) -> gr.Blocks:
    samples = sample_images()
    handlers = _Handlers(runner, samples, logins)
    info = runner.info()
    with DemoBlocks(runner, title="vlmspec demo", analytics_enabled=False) as demo:
        header = gr.Markdown(f"{TITLE}\nloading ...", elem_id="vlmspec-header")
        with gr.Row(equal_height=False):
            inputs = _input_column(samples, int(runner.settings.max_tokens_cap), bool(info["default_model"] or info["toy_model"]))
            outputs = _output_column()
        # one documented API endpoint, /run (gradio_client: Client(url).predict(..., api_name="/run"));
        # the page-only events are kept out of the API
        demo.load(handlers.on_load, outputs=[header, inputs.tree_size, inputs.policy, inputs.max_depth], queue=False,
                  api_visibility="private")
        inputs.gallery.select(handlers.on_pick, outputs=inputs.image, queue=False, api_visibility="private")
        inputs.run.click(handlers.on_run, inputs=inputs.run_args(), outputs=outputs, concurrency_limit=1, api_name="run",
                         api_description="Answer the prompt about the image with speculative and (optionally) plain "
                                         "decoding; streams the outputs as the runs progress (the last one: both runs "
                                         "done). The last output is the runs as JSON: speedup, identical, and per run "
                                         "its text, tokens/s, target forwards, accepted tokens, policy and depths.")
        inputs.prompt.submit(handlers.on_run, inputs=inputs.run_args(), outputs=outputs, concurrency_limit=1,
                             api_visibility="private")
    return demo


def _theme() -> gr.themes.Theme:
    # system fonts only: the page must not fetch Google Fonts (offline servers, headless tests)
    return gr.themes.Soft(primary_hue="green", neutral_hue="slate",
                          font=["ui-sans-serif", "system-ui", "Segoe UI", "Helvetica", "Arial", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"])


def mount_ui(app: Any, runner: ServiceRunner, path: str = "/ui") -> Any:
    """Mount the demo at `path` of the FastAPI app. With API keys, Gradio's login page asks for one
    (`Logins`: a user name, a key as password)."""
    logins = Logins(runner.settings)
    auth = None if runner.settings.open else logins.check

    # root_path: file URLs in event outputs (a picked sample's preview) carry the mount prefix; without it
    # Gradio builds them from the x-gradio-server header, which names the site root (measured: 404)
    demo = build_ui(runner, logins)
    mounted = gr.mount_gradio_app(app, demo, path=path, root_path=path, auth=auth, allowed_paths=[str(SAMPLE_IMAGES)],
                                  footer_links=[], theme=_theme(), css=CSS, ssr_mode=False, mcp_server=False,
                                  max_file_size=runner.settings.max_body_bytes)
    quiet_queue(demo)
    return mounted


# Gradio's queue polls while idle: every 1 ms for new events and every 10 ms for progress (on
# Linux; 50 / 100 ms on Windows): measured 6.5% of a core on an idle server, 0.8% at 50 / 200 ms
# (#22 item 10; /proc rusage over 20 s). A run on the page then starts at most 50 ms later, next to
# seconds of generation; this demo reports no progress through Gradio.
QUEUE_IDLE_POLL_S = 0.05
PROGRESS_IDLE_POLL_S = 0.2


def quiet_queue(demo: gr.Blocks) -> None:
    queue = demo._queue
    assert hasattr(queue, "sleep_when_free") and hasattr(queue, "progress_update_sleep_when_free"), \
        "this Gradio's queue has no idle polling intervals; check quiet_queue against its queueing.py"
    queue.sleep_when_free = QUEUE_IDLE_POLL_S
    queue.progress_update_sleep_when_free = PROGRESS_IDLE_POLL_S
