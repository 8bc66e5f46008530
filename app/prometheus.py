"""Prometheus metrics (prometheus_client), one registry per app so tests can build many apps.

Requests and latency are counted per route template (not per raw path, which would let clients
create unbounded label values) and status; the engine reports batch sizes, padded batch tokens,
queue depth and tokens processed; each key's requests, tokens, rate-limit refusals and job-seconds;
the model registry, model loads, unloads, load time and the
memory it counts against its budget; how long requests wait for their first pass; each key's 429s and
5xx answers; whether this replica is ready.

Jobs by state and each running job's heartbeat age are read from the shared job records at each scrape
(`observe_jobs`), so every replica exports the same values: a dashboard or an alert takes max() over the
replicas, never sum(), which would count a job once per replica.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DISCONNECTED = "bertserve.disconnected"  # scope key: the client left before its answer (counted as 499)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

if TYPE_CHECKING:
    import torch


class Batch(Protocol):
    """What a batch metric reads of the engine's padded batch (app/serving/engine.py's Batch)."""

    input_ids: torch.Tensor  # (rows, longest)
    tokens: int  # real tokens, padding excluded


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "bert_requests_total", "HTTP requests answered.", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "bert_request_duration_seconds",
            "Time to answer an HTTP request.",
            ["route", "method", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "bert_batch_size", "Sequences per forward pass.", ["model", "task"], buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "bert_batch_padded_tokens",
            "Padded tokens (rows x longest) per forward pass.",
            ["model", "task"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "bert_tokens_processed_total", "Real (unpadded) tokens run through a model.", ["model", "task"], registry=r
        )
        self.forward_seconds = Histogram(
            "bert_forward_duration_seconds",
            "Time of one forward pass (with its post-processing on the device).",
            ["model", "task"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("bert_queue_depth", "Requests waiting for the inference thread.", registry=r)
        self.queue_wait = Histogram(
            "bert_queue_wait_seconds",
            "Time a request's work waits in the engine's queue before its first forward pass.",
            ["model", "task"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.ready = Gauge("bert_ready", "1 while this replica is ready (GET /ready answers 200), else 0.", registry=r)
        self.jobs = Gauge(
            "bert_jobs",
            "Jobs by state and kind, from the shared job records (every replica exports the same: take max()).",
            ["state", "kind"],
            registry=r,
        )
        self.job_heartbeat_age = Gauge(
            "bert_job_heartbeat_age_seconds",
            "Seconds since each running job's last lease heartbeat, from its record (every replica exports the same).",
            ["job_id", "kind"],  # not "job": Prometheus's own label for the scrape target's job
            registry=r,
        )
        self.models_loaded = Gauge("bert_models_loaded", "Models in memory.", registry=r)
        self.model_loads = Counter(
            "bert_model_loads_total", "Models loaded (and warmed up) into memory.", ["model"], registry=r
        )
        self.model_unloads = Counter(
            "bert_model_unloads_total", "Models unloaded to make room under the memory budget.", ["model"], registry=r
        )
        self.model_load_seconds = Histogram(
            "bert_model_load_duration_seconds",
            "Time to load and warm up a model.",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.model_memory = Gauge(
            "bert_model_memory_bytes",
            "Estimated memory of the loaded models and one forward pass's working set (counted against the budget).",
            registry=r,
        )
        self.model_memory_budget = Gauge(
            "bert_model_memory_budget_bytes", "The model memory budget (BERT_MODEL_MEMORY_GB).", registry=r
        )

        # per key, named by the key's name (app/keys): never a secret
        self.key_requests = Counter(
            "bert_key_requests_total", "Requests made with each key (refused ones included).", ["key"], registry=r
        )
        self.key_tokens = Counter(
            "bert_key_tokens_total",
            "Tokens charged to each key: its inference requests' tokens, counted after tokenising, and the model "
            "loads its requests caused.",
            ["key"],
            registry=r,
        )
        self.key_rate_limited = Counter(
            "bert_key_rate_limited_total",
            "Requests refused (429) by a key's own limit (requests, tokens or loads).",
            ["key", "limit"],
            registry=r,
        )
        self.key_errors = Counter(
            "bert_key_errors_total",
            "Answers of status 429 or 5xx to each key's requests (anonymous: no key), by status.",
            ["key", "status"],
            registry=r,
        )
        self.key_job_seconds = Gauge(
            "bert_key_job_seconds",
            "Worker time of each key's jobs, in seconds (from the job records).",
            ["key"],
            registry=r,
        )

    def observe_batch(self, model: str, task: str, batch: Batch) -> None:
        rows, longest = batch.input_ids.shape
        self.batch_size.labels(model, task).observe(rows)
        self.batch_tokens.labels(model, task).observe(rows * longest)
        self.tokens.labels(model, task).inc(batch.tokens)

    def observe_jobs(self, records: Iterable[Mapping[str, Any]], now: dt.datetime | None = None) -> None:
        """Jobs by state and kind, and each running job's heartbeat age, as the records have them now."""
        now = now or dt.datetime.now(dt.UTC)
        counts: dict[tuple[str, str], int] = {}
        self.job_heartbeat_age.clear()  # a job that ended leaves the gauge
        for record in records:
            state, kind = record.get("state", "unknown"), record.get("kind", "unknown")
            counts[state, kind] = counts.get((state, kind), 0) + 1
            if state == "running" and (beat := record.get("heartbeat_at") or record.get("started_at")):
                age = (now - dt.datetime.fromisoformat(beat.replace("Z", "+00:00"))).total_seconds()
                self.job_heartbeat_age.labels(record["id"], kind).set(max(age, 0.0))
        self.jobs.clear()
        for (state, kind), n in counts.items():
            self.jobs.labels(state, kind).set(n)

    def per_key(self) -> dict[str, dict[str, float]]:
        """Each key's requests, tokens, rate-limit refusals and job-seconds, as the counters have them."""
        usage: dict[str, dict[str, float]] = {}
        fields = (
            (self.key_requests, "bert_key_requests_total", "requests"),
            (self.key_tokens, "bert_key_tokens_total", "tokens"),
            (self.key_rate_limited, "bert_key_rate_limited_total", "rate_limited"),
            (self.key_job_seconds, "bert_key_job_seconds", "job_seconds"),
        )
        for metric, sample_name, field in fields:
            for family in metric.collect():
                for sample in family.samples:
                    if sample.name == sample_name:
                        entry = usage.setdefault(
                            sample.labels["key"], {"requests": 0, "tokens": 0, "rate_limited": 0, "job_seconds": 0.0}
                        )
                        entry[field] += sample.value
        return usage

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI: time every HTTP request and count it by route template and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, key_of: Callable[[Scope], str | None] = lambda scope: None):
        self.app = app
        self.metrics = metrics
        self.key_of = key_of  # the name of the request's key, once the key middleware has checked it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client sees if the app raises before answering

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if scope.get(DISCONNECTED):
                status = 499  # nginx's "client closed request": no answer was sent
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            labels = (path, scope["method"], str(status))
            self.metrics.requests.labels(*labels).inc()
            self.metrics.latency.labels(*labels).observe(time.perf_counter() - start)
            if status == 429 or 500 <= status < 600:
                self.metrics.key_errors.labels(self.key_of(scope) or "anonymous", str(status)).inc()
