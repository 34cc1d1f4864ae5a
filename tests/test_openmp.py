"""A thread gives its OpenMP workers back (vlmspec.runtime.openmp), and the service does so where it hands
the engine over: the caller after building it, the worker when its batch is empty."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from vlmspec.runtime.openmp import release_thread_pool

# torch's Linux wheels ship libgomp beside libtorch; a build on another OpenMP runtime is left alone (vlmspec.runtime.openmp)
LIBGOMP = any(p.name.startswith("libgomp") for p in (Path(torch.__file__).parent / "lib").glob("*.so*"))
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2 or not LIBGOMP,
                                reason="counts the process's threads in /proc (Linux, torch on libgomp, 2+ cores)")


@pytest.fixture(autouse=True)
def _two_threads():
    """A pool to count: two torch threads here, whatever the suite runs with (one per process under `make test`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _pool_counts(release: bool) -> tuple[int, int, int, bool | None]:
    """On a fresh thread: (threads before any operator, after one, after the release or not, what it returned)."""
    out: list = []

    def run() -> None:
        lin, x = torch.nn.Linear(576, 1536), torch.randn(4, 576)
        before = _threads()
        with torch.inference_mode():
            lin(x)
        during = _threads()
        released = release_thread_pool() if release else None
        out.extend([before, during, _threads(), released])

    th = threading.Thread(target=run)
    th.start()
    th.join()
    return tuple(out)  # type: ignore[return-value]


def test_release_gives_the_threads_pool_back():
    before, during, after, released = _pool_counts(release=True)
    assert during > before, "the operator ran on an OpenMP team of its own threads"
    assert released is True and after == before
    before, during, after, _ = _pool_counts(release=False)  # negative control: kept without the call
    assert during > before and after == during


def test_service_releases_where_it_hands_the_engine_over(monkeypatch):
    """The service releases on the caller's thread when handed an engine built there (as serving()
    is); the worker releases whenever its batch is empty and it waits for work."""
    httpx = pytest.importorskip("httpx")
    from vlmspec import factory
    from vlmspec.app import ServerSettings
    serve_module = importlib.import_module("vlmspec.app.serve")  # the module (the package exports a function of its name)
    worker = importlib.import_module("vlmspec.app.worker")

    calls: list[str] = []

    def record() -> bool:
        calls.append(threading.current_thread().name)
        return release_thread_pool()

    monkeypatch.setattr(worker, "release_thread_pool", record)
    engine = factory.build_engine(factory.EngineSpec(model="toy", policy="fixed", max_batch=2))
    caller = threading.current_thread().name
    with serve_module.serving(engine, ServerSettings(model="bench", max_batch=2, ui=False)) as url:
        body = {"model": "bench", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert calls[0] == caller
    # the worker: idle before the request came (and again after it left, unless the service closed first)
    assert calls.count("vlmspec-worker") >= 1 and calls.index("vlmspec-worker") > 0
