"""Two API replicas on one data directory, as behind a load balancer (real uvicorn processes): what one
replica or a job changes, the other serves or refuses at its next request; submissions that race on
two replicas make nothing twice; a batch whose replica is killed goes on in the other."""

from __future__ import annotations

import concurrent.futures
import io
import json
import time

import httpx
import pytest

from app.main import RESUME_EVERY_S
from datadir import JobRecords, publish_model
from model.modeling import BertModel
from tests.app.conftest import WORDS, save_tiny
from tests.helpers import (
    REDIS_URL,
    finetune_request,
    flush_redis,
    labelled_csv,
    make_data_dir,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.slow

ADMIN_KEY = "replicas-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
NO_BROKER = "redis://127.0.0.1:1/0"  # nothing listens there: models and batches need no worker


def two_replicas(data_dir, root, broker: str = NO_BROKER, **env: str):
    replicas = []
    for name in ("a", "b"):
        (root / name).mkdir(exist_ok=True)
        replicas.append(start_server(data_dir, broker, root / name, BERT_ADMIN_KEY=ADMIN_KEY, **env))
    return replicas


def embed(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/embeddings", json={"inputs": ["the cat sat"], "model": model}, timeout=60)


def test_a_published_promoted_or_deleted_model_is_seen_by_every_replica_at_once(tmp_path):
    data = tmp_path / "data"
    save_tiny(data / "models" / "tiny", BertModel, seed=0)
    (a, url_a), (b, url_b) = two_replicas(data, tmp_path)
    try:
        for url in (url_a, url_b):
            assert embed(url, "enc").status_code == 404
        # A job publishes (the worker's rename into DATA_DIR/models): both serve it at their next request.
        answers = {}
        for version in (1, 2):
            save_tiny(tmp_path / f"out{version}", BertModel, seed=version)
            publish_model(data, f"job-{version}", tmp_path / f"out{version}", "enc")
            got = [embed(url, "enc") for url in (url_a, url_b)]
            assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
            assert got[0].json() == got[1].json()
            answers[version] = got[0].json()
        assert answers[1] != answers[2]
        # Promoted back on one replica: the other answers with that version too.
        r = httpx.post(f"{url_a}/models/enc/promote", json={"version": 1}, headers=ADMIN, timeout=30)
        assert r.status_code == 200, r.text
        assert embed(url_b, "enc").json() == answers[1]
        # Deleted on one replica: the other refuses it.
        r = httpx.delete(f"{url_b}/models/enc", headers=ADMIN, timeout=30)
        assert r.status_code == 200, r.text
        r = embed(url_a, "enc")
        assert r.status_code == 404 and "model 'enc' not found" in r.json()["error"], r.text
    finally:
        a.stop()
        b.stop()


def test_jobs_submitted_to_two_replicas_at_once_make_one_job_per_model(tmp_path):
    """Eight POST /jobs training one model name, four to each replica at once: one is queued, seven
    are 409 (the check and the record's creation hold the data directory's lock, not a process's)."""
    flush_redis()
    data = make_data_dir(tmp_path / "data")
    (a, url_a), (b, url_b) = two_replicas(data, tmp_path, broker=REDIS_URL)
    try:
        r = httpx.post(
            f"{url_a}/datasets",
            headers=ADMIN,
            files={"file": ("reviews.csv", labelled_csv())},
            data={"name": "reviews"},
            timeout=30,
        )
        assert r.status_code == 201, r.text
        # The lock is the data directory's: held here (as another replica would), a submission waits.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with JobRecords(data).submitting():
                waiting = pool.submit(
                    httpx.post, f"{url_b}/jobs", headers=ADMIN, json=finetune_request("clf-held"), timeout=60
                )
                time.sleep(1.5)
                assert not waiting.done(), waiting.result().text
            assert waiting.result().status_code == 202, waiting.result().text
        for round_ in range(3):
            name = f"clf-{round_}"
            urls = [url_a, url_b] * 4
            with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
                answers = list(
                    pool.map(
                        lambda url, n=name: httpx.post(
                            f"{url}/jobs", headers=ADMIN, json=finetune_request(n), timeout=60
                        ),
                        urls,
                    )
                )
            codes = sorted(r.status_code for r in answers)
            assert codes == [202] + [409] * 7, [r.text for r in answers]
        jobs = httpx.get(f"{url_b}/jobs", headers=ADMIN, timeout=30).json()["jobs"]
        assert sorted(j["model_name"] for j in jobs) == ["clf-0", "clf-1", "clf-2", "clf-held"]
    finally:
        a.stop()
        b.stop()
        flush_redis()


def test_a_batch_whose_replica_is_killed_goes_on_in_another(tmp_path):
    data = tmp_path / "data"
    save_tiny(data / "models" / "tiny", BertModel, seed=1)
    env = {"BERT_BATCH_CHUNK_LINES": "20", "BERT_BATCH_CONCURRENCY": "1"}
    (a, url_a), (b, url_b) = two_replicas(data, tmp_path, **env)
    n = 1200
    rows = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "tiny", "input": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 5))},
        }
        for i in range(n)
    ]
    body = "".join(json.dumps(row) + "\n" for row in rows).encode()
    try:
        up = httpx.post(
            f"{url_a}/v1/files",
            headers=ADMIN,
            files={"file": ("in.jsonl", io.BytesIO(body))},
            data={"purpose": "batch"},
            timeout=60,
        ).json()
        batch = httpx.post(
            f"{url_a}/v1/batches",
            headers=ADMIN,
            json={"input_file_id": up["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"},
            timeout=60,
        ).json()

        def counts(url: str) -> dict:
            return httpx.get(f"{url}/v1/batches/{batch['id']}", headers=ADMIN, timeout=30).json()

        wait_for(lambda: counts(url_b)["request_counts"]["completed"] >= 100, 60, "progress")
        runner = httpx.get(f"{url_b}/jobs/{batch['id']}", headers=ADMIN, timeout=30).json()["worker"]
        # (replica a took the request and runs it, unless b's look for orphans came first)
        (victim, _), (survivor, url) = sorted(
            [(a, url_a), (b, url_b)], key=lambda r: r[0].proc.pid != int(runner.split(":")[-1])
        )
        assert runner.endswith(f":{victim.proc.pid}"), runner
        victim.kill()  # SIGKILL, mid-batch
        wait_for(  # a hang check: the survivor looks for orphans every RESUME_EVERY_S
            lambda: httpx.get(f"{url}/jobs/{batch['id']}", headers=ADMIN, timeout=30).json()["worker"] != runner,
            RESUME_EVERY_S + 90,
            "the other replica to take the batch over",
        )
        done = wait_for(lambda: (c := counts(url))["status"] in ("completed", "failed") and c, 120, "the batch")
        assert done["status"] == "completed" and done["request_counts"]["completed"] == n, done
        out = httpx.get(f"{url}/v1/files/{done['output_file_id']}/content", headers=ADMIN, timeout=60).text
    finally:
        a.stop()
        b.stop()
    assert [json.loads(x)["custom_id"] for x in out.splitlines()] == [f"r{i}" for i in range(n)]
