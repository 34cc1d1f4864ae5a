import contextlib
import functools
import os
import time

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the suite in two processes (pytest-xdist): one thread each on a 2-core machine,
    # and the processes they start (servers, Ray, DDP) inherit it
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))

# answers and logits held against their oracles: `make test-kernels` runs these again under other
# kernel paths of the same CPU (docs/batching.md, "Exact on any CPU")
EXACTNESS_MODULES = {"test_attention", "test_batch", "test_coverage", "test_engine_parity", "test_packed_linear", "test_real_target"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module is not None and item.module.__name__ in EXACTNESS_MODULES:
            item.add_marker(pytest.mark.exactness)


@pytest.fixture(autouse=True, scope="session")
def _cost_cache_in_a_temp_dir(tmp_path_factory):
    """Measured cost models go to a folder of the test session, never the user's cache."""
    prev = os.environ.get("VLMSPEC_CACHE_DIR")
    os.environ["VLMSPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("vlmspec-cache"))
    yield
    if prev is None:
        os.environ.pop("VLMSPEC_CACHE_DIR", None)
    else:
        os.environ["VLMSPEC_CACHE_DIR"] = prev


@functools.lru_cache(maxsize=None)
def tiny_target(arch: str, seed: int = 0):
    """A Target over a tiny random HF VLM of `arch` (built once per test session)."""
    from vlmspec.target import Target, set_attention
    from testing.tiny import build_tiny

    model, processor = build_tiny(arch, seed=seed)
    # VLMSPEC_TEST_DEVICE=cuda runs the tiny-model tests on a GPU (scripts/gpu-check.sh does, for the batch tests)
    device = os.environ.get("VLMSPEC_TEST_DEVICE", "cpu")
    model = model.to(device)
    if device == "cpu":
        set_attention(model, "auto")  # the attention `load_target` gives a model on CPU (on CUDA the tests keep SDPA)
    return Target(model, processor, name=f"tiny-{arch}")


@pytest.fixture(params=["llava", "qwen2_5_vl", "idefics3"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny LLaVA saved as a model folder (what the CLI and the trainers load from disk)."""
    from testing.tiny import build_tiny

    d = tmp_path_factory.mktemp("tiny_llava")
    model, processor = build_tiny("llava")
    model.save_pretrained(d)
    processor.save_pretrained(d)
    return d


# ------------------------------------------------------------------------------------------ a real browser
# Debian's chromium driven by Playwright (never `playwright install`); tests that need it are marked
# @needs_browser and skipped where either is missing.
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def have_browser() -> bool:
    if not os.path.exists(CHROMIUM):
        return False
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return True


def needs_browser(test):
    """@pytest.mark.browser, skipped without chromium or playwright."""
    reason = f"needs {CHROMIUM} (apt-get install chromium) and the playwright package"
    return pytest.mark.browser(pytest.mark.skipif(not have_browser(), reason=reason)(test))


@contextlib.contextmanager
def browser_page(width: int = 1440, height: int = 1000, timeout_ms: int = 30_000):
    """(browser, a page of width x height), closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(timeout_ms)
            yield browser, page
        finally:
            browser.close()


# ------------------------------------------------------------ helpers of the service tests
def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of a Prometheus text exposition's samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        metric_name, _, rest = head.partition("{")
        if line.startswith("#") or metric_name != name:
            continue
        got = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv) if rest else {}
        if all(got.get(k, "").strip('"') == v for k, v in (labels or {}).items()):
            total += float(value)
    return total


def wait_for(cond, timeout: float = 20.0) -> bool:
    """Poll `cond` every 10 ms until it holds or `timeout` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def paced(monkeypatch):
    """20 ms an engine step's decode round: the tiny models would finish a request before the next
    client's request arrives; paced, the concurrent requests of a test share steps (and are still
    running when a drain starts)."""
    from vlmspec.engine import Batch

    decode = Batch.decode

    def slow(self):
        time.sleep(0.02)
        return decode(self)

    monkeypatch.setattr(Batch, "decode", slow)
