"""A real OTLP/HTTP trace receiver for the tests: `POST /v1/traces` with an ExportTraceServiceRequest
(protobuf, as opentelemetry-exporter-otlp-proto-http sends it, gzip or not), decoded with opentelemetry-proto;
the spans it got are kept as plain `Span` values to assert on."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    links: list[tuple[str, str]]  # (trace id, span id) of each link
    attributes: dict
    events: list[str] = field(default_factory=list)
    error: bool = False


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._seen: set[tuple[bytes, bytes]] = set()
        self.duplicates = 0
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            # keep-alive, as a collector does: the exporter reuses its connection, and one this server had
            # closed would fail the exporter's next send, which may then be sent twice or dropped
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request, dict(self.headers))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _add(self, request: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        with self._lock:
            self.headers.append(headers)
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        if (s.trace_id, s.span_id) in self._seen:
                            self.duplicates += 1  # an id made twice, or an export sent again
                            continue
                        self._seen.add((s.trace_id, s.span_id))
                        self.spans.append(
                            Span(
                                name=s.name,
                                service=str(resource.get("service.name")),
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_id=s.parent_span_id.hex(),
                                links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                                attributes={a.key: _value(a.value) for a in s.attributes},
                                events=[e.name for e in s.events],
                                error=s.status.code == s.status.STATUS_CODE_ERROR,
                            )
                        )

    def wait_for(self, predicate, timeout: float = 60.0, what: str = "spans") -> list[Span]:
        """The spans once `predicate(spans)` holds (the exporter sends in batches, on its own thread)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} never came; got {[(s.name, s.service) for s in spans]}")
            time.sleep(0.05)
