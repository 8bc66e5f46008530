"""worker/telemetry/tracing.py without a running service: which OTEL_* variables turn traces on, the default sampler
(a caller's sampled flag cannot force a trace), and traceparent parsing. Nothing here installs a provider."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from worker.telemetry import tracing


@pytest.mark.parametrize(
    ("env", "wanted"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, False),  # naming is not asking
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ],
)
def test_traces_are_on_only_when_the_environment_asks_for_an_exporter(env, wanted):
    assert tracing.wanted(env) is wanted


def test_without_otel_variables_nothing_is_configured():
    assert tracing.configure("bertserve", {}) is False
    assert not tracing.enabled()
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"  # the API's, not the SDK's
    with tracing.span("anything") as span:
        assert span is None
    assert tracing.traceparent() is None and tracing.current() is None and tracing.job_fields() == {}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin': this build exports 'otlp' or 'console'"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL='grpc': this build sends 'http/protobuf' only",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_SAMPLER_ARG": "half"},
            "OTEL_TRACES_SAMPLER_ARG='half' is not a number",
        ),
    ],
)
def test_what_this_build_cannot_do_is_refused_by_name(env, message):
    with pytest.raises(tracing.TracingConfigError) as e:
        tracing.configure("bertserve", env)
    assert str(e.value) == message
    assert not tracing.enabled()


def _remote_parent(sampled: bool) -> object:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    ctx = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True, trace_flags=flags)
    return trace.set_span_in_context(NonRecordingSpan(ctx))


def test_the_default_sampler_gives_a_callers_sampled_flag_no_say():
    never = tracing._sampler({"OTEL_TRACES_SAMPLER_ARG": "0"})
    always = tracing._sampler({})  # ratio 1.0
    trace_id = 0x0AF7651916CD43DD8448EB211C80319C
    for sampled in (True, False):
        parent = _remote_parent(sampled)
        assert never.should_sample(parent, trace_id, "POST /embeddings").decision == Decision.DROP
        assert always.should_sample(parent, trace_id, "POST /embeddings").decision == Decision.RECORD_AND_SAMPLE
    assert never.should_sample(None, trace_id, "POST /embeddings").decision == Decision.DROP


def test_a_traceparent_is_read_or_ignored():
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert tracing.trace_id_of(good) == "0af7651916cd43dd8448eb211c80319c"
    for bad in (None, "", "00-zz-b7ad6b7169203331-01", "00-00000000000000000000000000000000-b7ad6b7169203331-01"):
        assert tracing.extract(bad) is None
        made = tracing.trace_id_of(bad)
        assert len(made) == 32 and int(made, 16) > 0  # a new id, for the answer's header and the log lines


def test_span_ids_do_not_follow_a_seeded_random_module():
    """A training run seeds `random` (model/training/trainer.py); span ids must not repeat run after run."""
    import random

    ids = tracing._system_ids()
    random.seed(0)
    first = [ids.generate_span_id() for _ in range(3)]
    random.seed(0)
    assert [ids.generate_span_id() for _ in range(3)] != first
    assert ids.generate_trace_id() != ids.generate_trace_id()
