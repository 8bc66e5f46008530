"""The embedded, server-less brokers: the same app and worker code with only BERT_BROKER_URL changed
(kombu's SQLAlchemy transport on a sqlite file, and its filesystem transport)."""

from __future__ import annotations

import pytest

from tests.app.test_jobs_api import make_client
from tests.helpers import ROOT, finetune_request, labelled_csv, make_data_dir, start_worker, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("scheme", ["sqla+sqlite", "filesystem"])
def test_a_job_runs_without_redis(tmp_path, scheme):
    control_before = (ROOT / "control").exists()
    data_dir = make_data_dir(tmp_path / "data")
    url = f"sqla+sqlite:///{data_dir}/broker.sqlite" if scheme == "sqla+sqlite" else "filesystem://"
    worker = start_worker(data_dir, url, f"embedded-{scheme.replace('+', '-')}", tmp_path)
    try:
        with make_client(data_dir, broker_url=url) as client:
            assert (
                client.post("/datasets", files={"file": ("r.csv", labelled_csv())}, data={"name": "r"}).status_code
                == 201
            )
            r = client.post("/jobs", json=finetune_request("local", dataset="r", max_steps=10))
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            job = wait_for(
                lambda: (
                    (b := client.get(f"/jobs/{job_id}").json())["state"] in ("succeeded", "failed", "cancelled") and b
                ),
                60,
                "the job",
                interval=0.1,
            )
            assert job["state"] == "succeeded", job
            assert client.post("/classify", json={"inputs": "a good film", "model": "local"}).status_code == 200
        wait_for(lambda: "'outcome': 'succeeded'" in worker.log(), 10, "the task's return (and ack)")
    finally:
        worker.kill()  # Celery's warm shutdown polls these transports for seconds; nothing is running
    assert (ROOT / "control").exists() == control_before  # broker files stay in DATA_DIR (kombu: ./control)
