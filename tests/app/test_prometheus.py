"""app/prometheus.py's job gauges, read from the shared job records: every replica exports the same counts and
ages (so dashboards take max() over replicas), and a job that ended leaves the heartbeat gauge."""

from __future__ import annotations

import datetime as dt

from app.prometheus import Metrics

NOW = dt.datetime(2026, 12, 5, 12, 0, 0, tzinfo=dt.UTC)
RECORDS = [
    {"id": "j1", "state": "running", "kind": "finetune", "heartbeat_at": "2026-12-05T11:59:50Z"},
    {"id": "j2", "state": "running", "kind": "import", "heartbeat_at": None, "started_at": "2026-12-05T11:58:00Z"},
    {"id": "j3", "state": "queued", "kind": "finetune"},
    {"id": "j4", "state": "succeeded", "kind": "finetune"},
    {"id": "j5", "state": "queued", "kind": "finetune"},
]


def samples(metrics: Metrics, name: str) -> dict[tuple, float]:
    (family,) = [f for f in metrics.registry.collect() if f.name == name]
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples}


def test_jobs_by_state_and_heartbeat_ages_come_from_the_records():
    replicas = [Metrics(), Metrics()]
    for metrics in replicas:
        metrics.observe_jobs(RECORDS, NOW)
    a, b = ({name: samples(m, name) for name in ("bert_jobs", "bert_job_heartbeat_age_seconds")} for m in replicas)
    assert a == b  # the same records, the same values: max() over replicas is the truth, sum() doubles it
    assert a["bert_jobs"] == {
        (("kind", "finetune"), ("state", "running")): 1,
        (("kind", "import"), ("state", "running")): 1,
        (("kind", "finetune"), ("state", "queued")): 2,
        (("kind", "finetune"), ("state", "succeeded")): 1,
    }
    assert a["bert_job_heartbeat_age_seconds"] == {
        (("job_id", "j1"), ("kind", "finetune")): 10.0,
        (("job_id", "j2"), ("kind", "import")): 120.0,  # no heartbeat yet: since it started
    }


def test_a_job_that_ended_leaves_the_gauges():
    metrics = Metrics()
    metrics.observe_jobs(RECORDS, NOW)
    metrics.observe_jobs([{**RECORDS[0], "state": "succeeded"}], NOW)
    assert samples(metrics, "bert_job_heartbeat_age_seconds") == {}
    assert samples(metrics, "bert_jobs") == {(("kind", "finetune"), ("state", "succeeded")): 1}
