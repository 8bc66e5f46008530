"""Chaos, with real processes: a worker SIGKILLed mid-job, the same message delivered twice, and the
broker killed and restarted. Every accepted job finishes, once, at the requested number of steps.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from types import SimpleNamespace

import httpx
import pytest
from celery import Celery

from datadir.files import read_jsonl
from datadir.jobs import SUBMIT_LOCK
from model.training.checkpoint import checkpoint_step, is_complete, latest_checkpoint
from tests.helpers import (
    REDIS_URL,
    RedisServer,
    finetune_request,
    flush_redis,
    labelled_csv,
    make_data_dir,
    read_metrics,
    read_record,
    start_server,
    start_worker,
    train_steps,
    wait_for,
    wait_state,
)

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def stack(tmp_path, broker_url: str = REDIS_URL, server_env: dict[str, str] | None = None):
    """A data dir with a base model and the "reviews" dataset, served by a real uvicorn."""
    data_dir = make_data_dir(tmp_path / "data")
    server, url = start_server(data_dir, broker_url, tmp_path, **(server_env or {}))
    client = httpx.Client(base_url=url, timeout=30)
    workers = []
    try:
        r = client.post("/datasets", files={"file": ("reviews.csv", labelled_csv())}, data={"name": "reviews"})
        assert r.status_code == 201, r.text
        yield SimpleNamespace(client=client, data_dir=data_dir, workers=workers, tmp=tmp_path, broker=broker_url)
    finally:
        client.close()
        for worker in workers:
            worker.kill()
        server.stop()


def submit(s, request: dict) -> str:
    r = s.client.post("/jobs", json=request)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def step_dirs(data_dir, job_id):
    return sorted((data_dir / "jobs" / job_id / "checkpoints").glob("step-*"))


def test_worker_deaths_neither_lose_nor_repeat_steps(tmp_path):
    """One job, three workers: the first is stopped (SIGTERM) and hands the job back at a step with a
    checkpoint; the second is SIGKILLed mid-step; the third finishes it from the last checkpoint."""
    flush_redis()
    with stack(tmp_path) as s:
        job_dir = s.data_dir / "jobs"
        s.workers.append(start_worker(s.data_dir, REDIS_URL, "leaving", tmp_path))
        job_id = submit(s, finetune_request("survivor", max_steps=240, save_every=40))
        job_dir = job_dir / job_id
        wait_for(lambda: read_record(s.data_dir, job_id)["progress"].get("step", 0) >= 15, 60, "training")

        # 1. Warm shutdown: the loop stops at its next step, checkpoints there, and the job is queued again.
        s.workers[0].stop(timeout=30)
        assert s.workers[0].proc.returncode == 0
        record = read_record(s.data_dir, job_id)
        assert (record["state"], record["attempts"]) == ("queued", 0)
        handed_at = record["progress"]["step"]
        assert record["latest_checkpoint"] == f"checkpoints/step-{handed_at}"
        assert [e["event"] for e in record["events"]][-2:] == ["handed back", "re-enqueued"]

        # 2. SIGKILL to the next worker's whole process group, mid-step (or mid-checkpoint).
        s.workers.append(start_worker(s.data_dir, REDIS_URL, "doomed", tmp_path))

        def past_a_new_checkpoint():
            record = read_record(s.data_dir, job_id)
            newer = record["latest_checkpoint"] != f"checkpoints/step-{handed_at}"
            return newer and record["progress"].get("step", 0) >= 100

        wait_for(past_a_new_checkpoint, 60, "a new checkpoint and some steps beyond it")
        s.workers[1].kill()
        record = read_record(s.data_dir, job_id)
        assert (record["state"], record["attempts"]) == ("running", 1)
        # The last step it finished: metrics.jsonl gets every step's line before that step's checkpoint
        # (job.json's progress is written at most every BERT_JOB_PROGRESS_INTERVAL_S, so it may lag).
        killed_at = max(r["step"] for r in read_jsonl(job_dir / "metrics.jsonl") if r["type"] == "train")
        resumed_from = checkpoint_step(latest_checkpoint(job_dir))
        assert all(is_complete(d) for d in step_dirs(s.data_dir, job_id))  # a torn write stays a hidden .tmp-*

        # 3. A new worker's start-up sweep finds the job running with its lease free, and resumes it.
        s.workers.append(start_worker(s.data_dir, REDIS_URL, "rescuer", tmp_path))
        job = wait_state(s.client, job_id, {"succeeded", "failed", "cancelled"}, timeout=90)
        assert job["state"] == "succeeded", job
        assert (job["step"], job["attempts"]) == (240, 2)
        assert {"attempt did not finish", "re-enqueued", "resumed"} <= {e["event"] for e in job["events"]}

        resumes = [(r["step"], r["attempt"]) for r in read_metrics(s.data_dir, job_id) if r["type"] == "resume"]
        assert resumes == [(handed_at, 1), (resumed_from, 2)] and resumed_from <= killed_at
        assert train_steps(s.data_dir, job_id) == list(range(1, 241))  # redone steps replace, not repeat
        assert all(is_complete(d) for d in step_dirs(s.data_dir, job_id))
        assert not list((job_dir / "checkpoints").glob(".tmp-*"))
        assert (s.data_dir / "models" / "survivor" / "v1" / "config.json").is_file()


def test_a_pool_process_killed_like_the_oom_killer_does_shows_why(tmp_path):
    """SIGKILL to the pool process only (what the OOM killer does), not the worker's main process: the
    main process sees the signal, records it on the job, and Celery requeues the message; with one
    attempt allowed the job fails, and says why."""
    flush_redis()
    with stack(tmp_path) as s:
        s.workers.append(start_worker(s.data_dir, REDIS_URL, "oom", tmp_path, BERT_JOB_MAX_ATTEMPTS="1"))
        job_id = submit(s, finetune_request("doomed", max_steps=100_000, save_every=0))
        wait_for(lambda: read_record(s.data_dir, job_id)["progress"].get("step", 0) >= 1, 60, "training")
        pid = int(read_record(s.data_dir, job_id)["worker"].rsplit(":", 1)[1])
        assert pid != s.workers[0].proc.pid  # the pool process, not the main one
        os.kill(pid, signal.SIGKILL)
        job = wait_state(s.client, job_id, {"succeeded", "failed", "cancelled"}, timeout=60)
        reason = "the worker process was killed (SIGKILL; likely out of memory: the kernel's OOM killer sends SIGKILL)"
        assert job["state"] == "failed" and job["attempts"] == 1
        assert (
            job["error"]
            == f"gave up after 1 attempts (BERT_JOB_MAX_ATTEMPTS); last: attempt 1 did not finish: {reason}"
        )
        events = [(e["event"], e.get("detail")) for e in job["events"]]
        assert ("worker process lost", reason) in events
        assert ("attempt did not finish", f"attempt 1 did not finish: {reason}") in events
        assert s.workers[0].proc.poll() is None  # the worker itself lives on


def test_a_duplicate_delivery_never_trains_twice(tmp_path):
    flush_redis()
    with stack(tmp_path) as s:
        for name in ("first", "second"):
            s.workers.append(start_worker(s.data_dir, REDIS_URL, name, tmp_path))
        job_id = submit(s, finetune_request("once", max_steps=600, save_every=200))
        # Once it trains, the same message again, as a broker redelivery would bring it, to the other
        # (idle) worker, which must find the lease held and do nothing.
        wait_for(lambda: read_record(s.data_dir, job_id)["progress"].get("step", 0) >= 1, 60, "training")
        publisher = Celery(broker=REDIS_URL, set_as_current=False)
        publisher.conf.update(task_serializer="json", accept_content=["json"])
        publisher.send_task("bert.finetune", args=[job_id], queue="training")  # an earlier version's task name
        wait_for(lambda: any("running elsewhere" in w.log() for w in s.workers), 60, "the duplicate's no-op")
        assert read_record(s.data_dir, job_id)["state"] == "running", "the job must still run: make it longer"

        job = wait_state(s.client, job_id, {"succeeded", "failed", "cancelled"}, timeout=120)
        assert job["state"] == "succeeded", job
        events = [e["event"] for e in job["events"]]
        assert events.count("started") == 1 and job["attempts"] == 1
        assert "duplicate delivery ignored" in events
        assert train_steps(s.data_dir, job_id) == list(range(1, 601))
        # One worker trained it, the other acked its copy and did nothing.
        wait_for(lambda: any("'outcome': 'succeeded'" in w.log() for w in s.workers), 10, "the task's return")
        logs = [w.log() for w in s.workers]
        assert sorted("'outcome': 'succeeded'" in log for log in logs) == [False, True]
        assert sorted("'outcome': 'running elsewhere'" in log for log in logs) == [False, True]
        assert not any("'outcome': 'running elsewhere'" in log and "'outcome': 'succeeded'" in log for log in logs)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary")
def test_every_accepted_job_finishes_across_a_broker_restart(tmp_path):
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    try:
        with stack(tmp_path, redis.url) as s:
            s.workers.append(start_worker(s.data_dir, redis.url, "steady", tmp_path))
            jobs = [submit(s, finetune_request(f"model-{i}", max_steps=120, save_every=40)) for i in range(3)]
            wait_for(lambda: read_record(s.data_dir, jobs[0])["progress"].get("step", 0) >= 10, 60, "training")
            redis.kill()

            # Without a broker: nothing is accepted (and nothing half-written), the rest still answers.
            r = s.client.post("/jobs", json=finetune_request("refused"))
            assert r.status_code == 503 and r.json()["error_type"] == "unavailable", r.text
            assert len(s.client.get("/jobs").json()["jobs"]) == 3
            assert len([p for p in (s.data_dir / "jobs").iterdir() if p.name != SUBMIT_LOCK]) == 3
            # The running job trains on without the broker; its ack and the next fetch then fail.
            wait_for(lambda: read_record(s.data_dir, jobs[0])["state"] == "succeeded", 60, "the first job")
            time.sleep(3)

            redis.start()  # same port and directory: the append-only file brings the queue back
            for job_id in jobs:
                job = wait_state(s.client, job_id, {"succeeded", "failed", "cancelled"}, timeout=120)
                assert job["state"] == "succeeded", job
                assert job["step"] == 120
                assert train_steps(s.data_dir, job_id) == list(range(1, 121))
            models = {m["name"] for m in s.client.get("/models").json()["models"]}
            assert {"model-0", "model-1", "model-2"} <= models
    finally:
        redis.kill()
