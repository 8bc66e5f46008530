"""Traces with OpenTelemetry, configured only by the standard `OTEL_*` variables.

Nothing is set up unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) or `OTEL_TRACES_EXPORTER`
is set (and `OTEL_SDK_DISABLED` is not true, and the exporter is not `none`): then `configure` installs the
SDK's tracer provider with a batch span processor and the OTLP/HTTP exporter (`otlp`, which reads the
endpoint, headers, timeout and compression from the environment itself) or `console`. Otherwise every
helper here returns at its first line: no exporter, no thread, no span object, only an `if`.

The sampler is `OTEL_TRACES_SAMPLER`'s (and its `_ARG`) when set; by default a parent-based sampler whose
root, and whose remote parents sampled or not, are sampled by trace-id ratio (`OTEL_TRACES_SAMPLER_ARG`,
default 1.0): a caller's sampled flag in `traceparent` cannot make every request traced, and since the
ratio looks at the trace id only, the worker that continues a job's trace decides as the API did.
References: the OpenTelemetry specification's SDK environment variables and W3C Trace Context.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACER_NAME = "bertserve"
PROTOCOLS = ("http/protobuf",)  # the exporter installed (opentelemetry-exporter-otlp-proto-http)
_PROPAGATOR = TraceContextTextMapPropagator()
_enabled = False
_provider: Any = None  # the SDK's TracerProvider once configured


class TracingConfigError(ValueError):
    """An OTEL_* variable this build cannot honour (a protocol or exporter it lacks)."""


def wanted(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces to be sent somewhere."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters == "none":
        return False
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return bool(exporters or endpoint)


def enabled() -> bool:
    return _enabled


def configure(service_name: str, env: Mapping[str, str] = os.environ) -> bool:
    """Install the SDK tracer provider when the environment asks for traces (once per process); True if on.
    `service_name` is the default for OTEL_SERVICE_NAME. A protocol or exporter this build lacks raises
    TracingConfigError."""
    global _enabled, _provider
    if _enabled or not wanted(env):
        return _enabled
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [_exporter(name.strip(), env) for name in (env.get("OTEL_TRACES_EXPORTER") or "otlp").split(",")]
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    sampler = None if env.get("OTEL_TRACES_SAMPLER") else _sampler(env)
    _provider = TracerProvider(resource=resource, sampler=sampler, id_generator=_system_ids())
    for exporter in exporters:
        _provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(_provider)
    _enabled = True
    return True


def _exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={name!r}: this build exports 'otlp' or 'console'")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or PROTOCOLS[0]
    if protocol not in PROTOCOLS:
        raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: this build sends 'http/protobuf' only")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _system_ids() -> Any:
    """Trace and span ids from the operating system's randomness. The SDK's default draws them from the `random`
    module, which a training run seeds (model/training/trainer.py): every run of one seed would then make the
    same span ids, and a collector would keep one of each."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    system = random.SystemRandom()

    class SystemIds(IdGenerator):
        def generate_span_id(self) -> int:
            return system.getrandbits(64) or 1

        def generate_trace_id(self) -> int:
            return system.getrandbits(128) or 1

    return SystemIds()


def _sampler(env: Mapping[str, str]) -> Any:
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    try:
        ratio = float(env.get("OTEL_TRACES_SAMPLER_ARG") or 1.0)
    except ValueError:
        raise TracingConfigError(
            f"OTEL_TRACES_SAMPLER_ARG={env['OTEL_TRACES_SAMPLER_ARG']!r} is not a number"
        ) from None
    by_id = TraceIdRatioBased(min(max(ratio, 0.0), 1.0))
    return ParentBased(root=by_id, remote_parent_sampled=by_id, remote_parent_not_sampled=by_id)


def flush() -> None:
    """Send what is buffered (a worker's job ends; a process leaves without atexit)."""
    if _provider is not None:
        _provider.force_flush()


def shutdown() -> None:
    """Flush and stop the exporter threads (tests; atexit does it for a process)."""
    global _enabled, _provider
    if _provider is not None:
        _provider.shutdown()
    _enabled, _provider = False, None


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


# -- contexts -------------------------------------------------------------------------------------


def extract(traceparent: str | None, tracestate: str | None = None) -> otel_context.Context | None:
    """The context a W3C `traceparent` (and `tracestate`) names; None when there is none, or it is malformed."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent, **({"tracestate": tracestate} if tracestate else {})}
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent() -> str | None:
    """The current span's W3C traceparent (None when tracing is off or no span is current)."""
    if not _enabled:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def job_fields() -> dict[str, str]:
    """What a new job's record keeps of the request that submits it: {"trace": its traceparent} (tracing on),
    so the job's run, however much later and wherever it starts, continues the request's trace."""
    tp = traceparent()
    return {"trace": tp} if tp else {}


def current() -> SpanContext | None:
    """The current span's context (None when tracing is off): what a work item keeps to link to."""
    if not _enabled:
        return None
    ctx = trace.get_current_span().get_span_context()
    return ctx if ctx.is_valid else None


def ids() -> tuple[str | None, str | None]:
    """(trace id, span id) of the current span in hex, for log lines; (None, None) without one."""
    if not _enabled:
        return None, None
    ctx = trace.get_current_span().get_span_context()
    return (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}") if ctx.is_valid else (None, None)


def trace_id_of(traceparent: str | None) -> str:
    """A response's trace id with tracing off: the caller's, when its traceparent is well formed, else a new one."""
    ctx = extract(traceparent)
    if ctx is not None:
        return f"{trace.get_current_span(ctx).get_span_context().trace_id:032x}"
    return secrets.token_hex(16)


# -- spans ----------------------------------------------------------------------------------------


_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()  # what span() and job_span() give with tracing off


def span(
    name: str, parent: otel_context.Context | None = None, /, **attributes: Any
) -> contextlib.AbstractContextManager[Span | None]:
    """A span, current inside the block (None and nothing else when tracing is off). An exception marks it
    failed and is recorded on it."""
    if not _enabled:
        return _OFF
    return tracer().start_as_current_span(name, context=parent, attributes=_clean(attributes))


def start(name: str, /, **attributes: Any) -> Span | None:
    """A child of the current span that the caller ends (`.end()`), never made current (None when off)."""
    return tracer().start_span(name, attributes=_clean(attributes)) if _enabled else None


def job_span(
    record: Mapping[str, Any], name: str, parent: str | None = None
) -> contextlib.AbstractContextManager[Span | None]:
    """An attempt at a job, in the trace of the request that submitted it (its record's `trace`; `parent`: a
    traceparent that overrides it, a data-parallel rank's)."""
    if not _enabled:
        return _OFF
    attributes = {"bertserve.job_id": record.get("id"), "bertserve.job_kind": record.get("kind")}
    attributes |= {"bertserve.attempt": record.get("attempts"), "bertserve.model": record.get("model_name")}
    return span(name, extract(parent or record.get("trace")), **attributes)


def annotate(**attributes: Any) -> None:
    """Add attributes to the current span (nothing when tracing is off)."""
    if _enabled:
        trace.get_current_span().set_attributes(_clean(attributes))


def fail(s: Span | None, message: str) -> None:
    if s is not None:
        s.set_status(Status(StatusCode.ERROR, message))


def ended_span(
    name: str, parent: SpanContext | None, start_ns: int, end_ns: int | None = None, /, **attributes: Any
) -> None:
    """A span that already happened (waiting in the queue, an evaluation): started at `start_ns`, ended at
    `end_ns` or now, as a child of `parent` (a span context kept from another thread; None: the current span)."""
    if not _enabled:
        return
    ctx = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent is not None else None
    s = tracer().start_span(name, context=ctx, start_time=start_ns, attributes=_clean(attributes))
    s.end(end_time=end_ns)


def linked_span(name: str, parents: Sequence[SpanContext], /, **attributes: Any) -> Span:
    """A span of work shared by many requests (one forward pass): a child of the first, linked to each."""
    ctx = trace.set_span_in_context(trace.NonRecordingSpan(parents[0]))
    links = [Link(p) for p in {(p.trace_id, p.span_id): p for p in parents}.values()]
    return tracer().start_span(name, context=ctx, links=links, attributes=_clean(attributes))


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds spans are stamped in."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}
