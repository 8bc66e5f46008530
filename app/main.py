"""The FastAPI app: `create_app(settings)` (factory) and `app` (settings from the environment).

Middleware, outermost first: tracing (the request id, its span, the trace-id header, its log fields),
metrics (times everything), keys (401 or 403 from the headers, and
each key's request rate, before the body is read), body limit (413 before the body is read), deadline (inference routes: 503 past
BERT_REQUEST_TIMEOUT, work dropped when the client goes). Routers: operations (open: /health,
/ready; /metrics too when BERT_METRICS_PUBLIC); inference and /models need the scope inference, /metrics
the scope metrics, /info any key; /jobs the scope jobs; /datasets, /v1/files, /v1/batches, /usage and
the management of /models the scope admin, which their routers demand themselves (app/keys); /console (the web
console's static files, app/api/routes/console.py) open, as it carries no data. No trailing-slash
redirects: `/info/` is a 404, not a redirect built from the client's Host header.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import Depends, FastAPI

from app.api.deps import CALLER_KEY, require_inference, require_key, require_metrics
from app.api.middleware import BodyLimitMiddleware, DeadlineMiddleware, KeyMiddleware, deadline_paths, key_guards
from app.api.request_context import TracingMiddleware
from app.api.routes import (
    classify,
    console,
    datasets,
    embed_multi,
    embeddings,
    fill_mask,
    jobs,
    models,
    nsp,
    openai_batches,
    openai_models,
    ops,
    tei,
    token_tasks,
    usage,
)
from app.api.routes.ops import version
from app.errors import install_handlers
from app.jobs.imports import Imports
from app.jobs.mining import Mining
from app.keys.keyring import Keyring
from app.prometheus import Metrics, MetricsMiddleware
from app.serving.batch_jobs import Batches
from app.serving.embed_pipeline import BackgroundEmbedder
from app.serving.service import Service
from app.settings import Settings
from datadir import JobRecords
from worker.telemetry import logs, tracing

DESCRIPTION = """Self-hosted BERT inference: fill-mask, next-sentence prediction, embeddings
(also in OpenAI's format), fine-tuned classifiers, token classification and extractive question
answering (as transformers' pipelines answer), from models in `DATA_DIR/models/`; /embed,
/predict, /rerank, /similarity and /tokenize answer as text-embeddings-inference does.

Every error answers `{"error": message, "error_type": kind}`, except on /v1/* (OpenAI's API:
/v1/embeddings, /v1/models, /v1/files, /v1/batches), where it answers OpenAI's `{"error": {"message", "type", "param",
"code"}}`. When the service has keys, send `Authorization: Bearer <key>` to every route except /health, /ready and /console (static
files, no data), and /metrics when BERT_METRICS_PUBLIC is true. A key without the scope a route needs
(inference, jobs, batch, admin, metrics) gets a 403 that names it; a key over its own rate gets a 429 with
Retry-After.
"""

log = logging.getLogger("bertserve")

# How often a replica looks for imports and batches left unfinished by a process that died.
RESUME_EVERY_S = 10.0
# How often a replica removes what its retention settings let go (batch files, failed jobs' checkpoints).
TIDY_EVERY_S = 3600.0


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    if settings.log_format == "json":  # `bert serve` installs either format; uvicorn --factory has its own
        logs.install("json")
    tracing.configure("bertserve")  # only when OTEL_* asks for traces (worker/telemetry/tracing.py)
    metrics = Metrics()
    service = Service(settings, metrics)

    keyring = Keyring(settings)  # a keys file that cannot be read: KeyFileError, the service does not start
    # the memory budget is known once the service started; a dataset import's owner's disk quota when it runs
    imports = Imports(settings.data_dir, lambda: service.registry.memory_budget, settings, keyring.named)
    batch_jobs = Batches(service)
    mining = Mining(settings, lambda: BackgroundEmbedder(service), keyring.named)

    def tidy() -> None:
        """Batch files past BERT_BATCH_RETENTION_DAYS, checkpoints past BERT_CHECKPOINT_RETENTION_DAYS."""
        batch_jobs.expire_files()
        days = settings.checkpoint_retention_days
        freed = JobRecords(settings.data_dir).expire_checkpoints(days * 86400) if days > 0 else {}
        if freed:
            log.info("removed the checkpoints of %d ended job(s), %d bytes", len(freed), sum(freed.values()))

    async def keep_resuming() -> None:
        """Every RESUME_EVERY_S: the imports and batches whose process died (another replica, killed)
        go on here; a lease held elsewhere leaves them to their holder. Every TIDY_EVERY_S: tidy()."""
        tidied = time.monotonic()
        while True:
            await asyncio.sleep(RESUME_EVERY_S)
            if service.draining:
                return
            try:
                await asyncio.to_thread(imports.resume, True)
                await batch_jobs.resume(quiet=True)
                await mining.resume(quiet=True)
                if time.monotonic() - tidied >= TIDY_EVERY_S:
                    tidied = time.monotonic()
                    await asyncio.to_thread(tidy)
            except Exception:  # a full disk, a torn record: logged whole, the next round tries again
                log.exception("resuming unfinished imports and batches failed")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("%s", keyring.describe())
        await service.start()
        await asyncio.to_thread(imports.resume)  # imports a stopped API left unfinished
        await asyncio.to_thread(tidy)
        await batch_jobs.resume()  # batches a stopped API left unfinished
        await mining.resume()  # and mining jobs
        sweep = asyncio.create_task(keep_resuming(), name="resume-imports-and-batches")
        try:
            yield
        finally:
            sweep.cancel()
            await asyncio.gather(sweep, return_exceptions=True)
            await batch_jobs.stop()  # before the engine: a line in flight is not answered "unavailable"
            await mining.stop()
            await service.stop()

    app = FastAPI(
        title="bertserve",
        version=version(),
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # /docs, /openapi.json: routes/ops.py
        redirect_slashes=False,
        # FastAPI's own spans and metrics off: a request's span is app/api/tracing.py's, with the engine's below it
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.settings = settings
    app.state.service = service
    app.state.imports = imports
    app.state.keyring = keyring
    app.state.batches = batch_jobs
    app.state.mining = mining
    install_handlers(app)
    keyed = [Depends(require_inference)]
    routers = [
        (ops.router, []),
        (ops.metrics_router, [] if settings.metrics_public else [Depends(require_metrics)]),
        (ops.protected, [Depends(require_key)]),
        *(
            (module.router, keyed)
            for module in (
                fill_mask,
                nsp,
                embeddings,
                classify,
                token_tasks,
                tei,
                embed_multi,
                models,
                openai_models,
            )
        ),
        # their routers demand their scopes themselves (app/api/deps.py): jobs, admin
        *((module.router, []) for module in (jobs, datasets, openai_batches, usage)),
        (models.admin, []),
        (console.router, []),
    ]  # open: static files that carry no data
    for router, dependencies in routers:
        app.include_router(router, dependencies=dependencies)
    app.state.routes = [route for router, _ in routers for route in router.routes]  # for 405's Allow (errors.py)

    app.add_middleware(DeadlineMiddleware, seconds=settings.request_timeout, paths=deadline_paths(routers))
    # POST /datasets streams to disk under its own, larger limit (BERT_MAX_DATASET_BYTES).
    # POST /models streams an archive under BERT_MAX_MODEL_UPLOAD_BYTES (and reads JSON up to its own limit).
    # POST /v1/files streams a batch input under BERT_BATCH_MAX_FILE_BYTES.
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=settings.max_body_bytes, exempt=("/datasets", "/models", "/v1/files")
    )
    app.add_middleware(KeyMiddleware, keyring=keyring, guards=key_guards(routers), metrics=metrics)
    app.add_middleware(
        MetricsMiddleware, metrics=metrics, key_of=lambda scope: getattr(scope.get(CALLER_KEY), "name", None)
    )
    app.add_middleware(TracingMiddleware)  # added last = outermost: the request's id, span and log fields
    return app


def __getattr__(name: str):
    # `app.main:app` builds the app from the environment on first access, so importing this
    # module (tests, the CLI) does not read BERT_* variables or touch the data directory.
    if name == "app":
        globals()["app"] = create_app()
        return globals()["app"]
    raise AttributeError(name)
