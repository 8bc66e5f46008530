"""The outermost middleware: each HTTP request's id, trace and log fields.

A request gets a request id (its X-Request-ID when that is a plain one, else a new one: auditing reads it
back), and, with tracing on (worker/telemetry/tracing.py), a server span named by its method and route template,
a child of the caller's `traceparent` when it sends one, with a child span `write` for sending the
answer; the pipelines add the model, version, precision and tokens, the engine its queue wait and the
forward pass it shared. Every answer carries `trace-id` (with tracing off: the caller's trace id, else a
new one, for the log lines), and every log line of the request its ids (worker/telemetry/logs.py).
"""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.auditing import REQUEST_ID, REQUEST_ID_KEY
from app.api.deps import CALLER_KEY
from app.prometheus import DISCONNECTED
from worker.telemetry import logs, tracing

TRACE_ID_HEADER = "trace-id"


class TracingMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get("x-request-id", "")
        scope[REQUEST_ID_KEY] = rid = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        if not tracing.enabled():
            trace_id = tracing.trace_id_of(headers.get("traceparent"))
            with logs.bound(request_id=rid, trace_id=trace_id):
                await self.app(scope, receive, _sending(send, trace_id, {}))
            return
        parent = tracing.extract(headers.get("traceparent"), headers.get("tracestate"))
        method = scope["method"]
        with tracing.span(method, parent, **{"http.request.method": method}) as span, logs.bound(request_id=rid):
            assert span is not None
            answered: dict = {}
            try:
                await self.app(scope, receive, _sending(send, f"{span.get_span_context().trace_id:032x}", answered))
            finally:
                if (write := answered.get("write")) is not None:
                    write.end()  # the answer's last part never went out
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                status = 499 if scope.get(DISCONNECTED) else answered.get("status", 500)
                span.update_name(f"{method} {route}")
                key = scope.get(CALLER_KEY)
                span.set_attributes(
                    {"http.route": route, "http.response.status_code": status, "bertserve.request_id": rid}
                )
                if key is not None:
                    span.set_attribute("bertserve.key", key.name)
                if status >= 500:
                    tracing.fail(span, f"answered {status}")


def _sending(send: Send, trace_id: str, answered: dict) -> Send:
    """`send`, adding the trace-id header; with tracing on, the answer is sent inside a `write` span."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            MutableHeaders(scope=message).append(TRACE_ID_HEADER, trace_id)
            answered["status"] = message["status"]
            answered["write"] = tracing.start("write", **{"http.response.status_code": message["status"]})
        try:
            await send(message)
        finally:
            last = message["type"] == "http.response.body" and not message.get("more_body")
            if last and (write := answered.pop("write", None)) is not None:
                write.end()

    return sending
