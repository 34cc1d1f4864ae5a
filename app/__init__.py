"""The vlmspec service (installed as `vlmspec.app`): an OpenAI-compatible REST API over one
engine (plain requests are rows of its batch that never draft), and a Gradio demo.

    from vlmspec.app import ServerSettings, create_app, serve
    app = create_app(engine, ServerSettings(...))     # -> FastAPI; nothing is loaded at import time
    serve(engine, settings, host, port)               # prints the URLs, runs uvicorn (what `vlmspec serve` calls)

Layering: app -> vlmspec, never the reverse (the CLI's `serve` command imports this package lazily);
app never imports vlmspec.cli. Engines are built by vlmspec.factory.

Files
-----
``settings.py``   ServerSettings (and the ImageLimits they imply)
``protocol.py``   the wire format: request schemas, OpenAI-shaped errors, request -> ChatInputs, response shapes
``job.py``        Job: one request's options and its messages from the worker thread to its handler
``rows.py``       Row: a request in the batch (joining: encode, fit the context, prefill; its text; its finish)
``worker.py``     Service: the bounded queue and the worker thread that owns the engine; fault isolation, the drain
``metrics.py``    Prometheus metrics (acceptance figures from vlmspec.stats.SpecStats)
``routes.py``     create_app: the edge middleware (API key, request metrics), routes, error handlers, lifespan
``site.py``       the site's files for browsers: the OpenAPI 3.0 document /docs renders, /favicon.ico
``serve.py``      serve(): print the URLs and run uvicorn
``drain.py``      DrainingServer: uvicorn whose SIGTERM / SIGINT drain the service before it stops (exit 0)
``ui_runner.py``  the demo's runs through the worker (ServiceRunner, RunState, Comparison)
``ui.py``         the Gradio Blocks of the demo, mounted at /ui
``ray_config.py`` RayConfig: replicas or an autoscaling range, where Ray runs -> Serve deployment options
``ray_serve.py``  the same app as a Ray Serve deployment of N replicas (`vlmspec serve --replicas N`; imports
                  Ray, the optional extra, so nothing here imports it)

A request's walk from HTTP to tokens (``POST /v1/chat/completions``, the EAGLE drafter)
------------------------------------------------------------------------------------------
1. ``app/routes.py``           EdgeMiddleware (API key, request metrics) -> chat_completions reads the body
                               (size limit) and hands it, in a thread, to
2. ``app/protocol.py``         prepare_chat: strict schema, n/logprobs/tools/model/max-token checks ->
                               (GenerationConfig, stop strings); OpenAI messages -> HF chat messages; each
                               image through
3. ``vlmspec/inputs.py``       load_image_url -> decode_image, with settings.image_limits()
                               -- back in routes.py: Job.on_loop, Service.submit, await the job's messages --
4. ``app/worker.py``           the worker thread: Service._admit / _step; ``app/rows.py`` Row.join, the conversation
                               through ``vlmspec/inputs.py`` encode_messages (the target's chat template + processor)
5. ``vlmspec/text.py``         TextStream: incremental detokenization, stop strings, hold-back, per request, around
6. ``vlmspec/engine/batch.py`` Batch.submit (queued), Batch.step: admit (prefill into a free slot), draft -> verify -> commit for every request
7. ``vlmspec/target/model.py`` prefill / forward_batch / commit_batch (KV gather-commit in ``vlmspec/kv_cache.py``)
8. ``vlmspec/draft/eagle/session.py``  the drafter's session: start / propose (a ``vlmspec/tree.py`` DraftTree) / commit
9. ``vlmspec/verify/acceptance.py`` verify (greedy or lossless rejection sampling, ``vlmspec/sampling.py``)
Token ids flow back: engine StepEvent -> text.TextEvent -> Job message -> routes.py, which shapes the
answer with protocol.Reply. The app's part is three files in one direction (routes -> protocol ->
worker).

Routes
------
``POST /v1/chat/completions``  OpenAI chat completions (stream or not) with images as data URLs;
                                extensions: ``speculative`` (bool, default true), ``speculation``
                                ({"policy": "goodput"|"fixed", "max_depth": int, "tree_tokens": int}),
                                ``top_k``, ``ignore_eos``; the response's ``speculative`` block says
                                what ran (policy, the chosen depth per forward).
``GET  /v1/models``            the served model (``/v1/models/{model}``: one).
``GET  /healthz``              liveness (never needs the API key): 503 with a ``reason`` while draining or
                                once the worker thread died.
``GET  /metrics``              Prometheus text (a per-app registry).
``GET  /docs``                 OpenAPI UI (Swagger UI, offline; it reads ``/docs/openapi.json``, the
                                schema in OpenAPI 3.0 terms; ``/openapi.json`` is the 3.1 original).
``GET  /favicon.ico``          the site's icon.
``GET  /ui``                   Gradio demo (app/ui.py) when gradio is installed and ``ServerSettings.ui``;
                                it runs its generations through the same worker and queue as the API.

Status codes: 200; 400 bad input (also for what FastAPI would answer 422); 401 missing/wrong API key;
404 unknown model or route; 405; 413 body too large; 429 queue full (with Retry-After);
503 shutting down (or the worker gone); 504 request timeout; 500 only for a genuine internal failure,
which ends that request alone and names it (``error.request_id``, the ``x-request-id`` header; the
server log's traceback carries the same id). Every error body is
``{"error": {"message", "type", "param", "code"}}``. A stream that fails after it started gets an
``data: {"error": ...}`` chunk and then ``data: [DONE]``.

Concurrency: one worker thread owns the engine and decodes up to ``max_batch`` requests together
(continuous batching: requests join and leave between engine steps; plain requests are rows that
never draft); the rest wait in a bounded queue. The worker checks each request's cancel flag (client
gone, timeout, shutdown) between engine steps.

Metrics (all prefixed ``vlmspec_``): see ``metrics.METRIC_NAMES``.
"""

from .routes import create_app
from .serve import serve
from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "serve"]
