"""Operations shared by the service and the workers: traces (OpenTelemetry, `telemetry.tracing`) and
structured log lines (`telemetry.logs`). It imports nothing of the project but `datadir` (the audit
log's one-line JSON), so `app/` and `worker/` both may import it, and `model/` never does."""
