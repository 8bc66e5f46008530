"""Prometheus metrics (prometheus_client), one registry per app so tests can build many apps.

Requests and latency are counted per route template (not per raw path, which would let clients
create unbounded label values) and status; the engine reports batch sizes, padded batch tokens,
queue depth and tokens processed; each key's requests, tokens, rate-limit refusals and job-seconds;
the model registry, model loads, unloads, load time and the
memory it counts against its budget.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DISCONNECTED = "bertserve.disconnected"  # scope key: the client left before its answer (counted as 499)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)
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

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

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
