"""With no OTEL_* variable: no tracer provider, no exporter thread, yet every answer has a trace-id (the
caller's, from its traceparent, else a new one) and its log lines the request's ids (app/api/request_context.py)."""

from __future__ import annotations

import threading

import pytest
from opentelemetry import trace

from worker.telemetry import tracing

pytestmark = pytest.mark.anyio
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_tracing_off_starts_nothing_and_still_answers_a_trace_id(client):
    r = await client.post("/embeddings", json={"inputs": "good day"}, headers={"traceparent": PARENT})
    assert r.status_code == 200, r.text
    assert r.headers["trace-id"] == "0af7651916cd43dd8448eb211c80319c"
    assert not tracing.enabled()
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
    threads = [t.name for t in threading.enumerate()]
    assert not [name for name in threads if "otel" in name.lower() or "span" in name.lower()], threads

    first, second = [(await client.get("/health")).headers["trace-id"] for _ in range(2)]
    assert first != second and len(first) == 32 and int(first, 16)
    r = await client.get("/health", headers={"traceparent": "00-not-a-trace-01"})
    assert len(r.headers["trace-id"]) == 32


async def test_an_error_answer_carries_the_trace_id_too(client):
    r = await client.post("/embeddings", json={"inputs": []}, headers={"traceparent": PARENT})
    assert r.status_code == 422
    assert r.headers["trace-id"] == "0af7651916cd43dd8448eb211c80319c"
