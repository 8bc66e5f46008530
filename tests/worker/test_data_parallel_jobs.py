"""Jobs with "devices": 2 through a real uvicorn, a real `celery worker` and Redis: the worker trains them
through torchrun (two gloo ranks of worker/ddp_job.py), rank 0 reports per-rank throughput, and cancel,
the SIGTERM hand-back and a SIGKILL of the whole worker work as for any job.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ..helpers import (REDIS_URL, finetune_request, flush_redis, read_metrics, read_record, start_worker, wait_for,
                       wait_state)
from .test_recovery import stack, submit, train_steps

pytestmark = pytest.mark.slow

LIMITS = dict(BERT_JOB_MAX_DEVICES="2")


def rank_processes(job_id: str) -> list[int]:
    """Processes still running for the job: torchrun's launcher and ranks name the job id on their command line."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if proc.name.isdigit() and job_id.encode() in cmdline and b"worker.ddp_job" in cmdline:
            found.append(int(proc.name))
    return found


def test_devices_beyond_the_service_limit_are_refused(tmp_path):
    flush_redis()
    with stack(tmp_path, server_env=LIMITS) as s:
        r = s.client.post("/jobs", json=finetune_request("too-wide", devices=3))
        assert r.status_code == 422
        assert r.json() == {"error": "params.devices: 3 is more than this service allows (2, BERT_JOB_MAX_DEVICES)",
                            "error_type": "validation"}


def test_a_two_device_job_hands_back_survives_sigkill_and_finishes(tmp_path):
    flush_redis()
    with stack(tmp_path, server_env=LIMITS) as s:
        s.workers.append(start_worker(s.data_dir, REDIS_URL, "leaving", tmp_path, BERT_WORKER_DEVICES="2"))
        job_id = submit(s, finetune_request("wide", max_steps=200, save_every=40, devices=2))
        wait_for(lambda: (read_record(s.data_dir, job_id).get("progress") or {}).get("step", 0) >= 15, 90,
                 "training on two ranks")
        progress = read_record(s.data_dir, job_id)["progress"]
        assert progress["world_size"] == 2 and len(progress["rank_tokens_per_s"]) == 2
        assert min(progress["rank_tokens_per_s"]) > 0
        assert len(s.client.get(f"/jobs/{job_id}").json()["rank_tokens_per_s"]) == 2

        # 1. Warm shutdown: both ranks stop at the same step, rank 0 checkpoints and hands the job back.
        s.workers[0].stop(timeout=60)
        assert s.workers[0].proc.returncode == 0
        record = read_record(s.data_dir, job_id)
        assert (record["state"], record["attempts"]) == ("queued", 0), record["events"]
        handed_at = record["progress"]["step"]
        assert record["latest_checkpoint"] == f"checkpoints/step-{handed_at}"
        assert [e["event"] for e in record["events"]][-2:] == ["handed back", "re-enqueued"]
        assert not rank_processes(job_id)

        # 2. SIGKILL to the next worker's process group: the launcher and ranks (their own session) die with it.
        s.workers.append(start_worker(s.data_dir, REDIS_URL, "doomed", tmp_path, BERT_WORKER_DEVICES="2"))
        wait_for(lambda: read_record(s.data_dir, job_id)["latest_checkpoint"] != f"checkpoints/step-{handed_at}",
                 90, "a new checkpoint")
        s.workers[1].kill()
        wait_for(lambda: not rank_processes(job_id), 10, "the ranks to die with their worker")

        # 3. The next worker's sweep resumes it from the latest checkpoint and it finishes.
        s.workers.append(start_worker(s.data_dir, REDIS_URL, "rescuer", tmp_path, BERT_WORKER_DEVICES="2"))
        job = wait_state(s.client, job_id, {"succeeded", "failed", "cancelled"}, timeout=120)
        assert job["state"] == "succeeded", job
        assert (job["step"], job["attempts"]) == (200, 2)
        assert train_steps(s.data_dir, job_id) == list(range(1, 201))
        assert all(r["world_size"] == 2 for r in read_metrics(s.data_dir, job_id) if r["type"] == "train")
        assert (s.data_dir / "models" / "wide" / "config.json").is_file()


def test_a_running_two_device_job_is_cancelled_at_a_checkpoint(tmp_path):
    flush_redis()
    with stack(tmp_path, server_env=LIMITS) as s:
        s.workers.append(start_worker(s.data_dir, REDIS_URL, "w", tmp_path, BERT_WORKER_DEVICES="2"))
        job_id = submit(s, finetune_request("cancelled", max_steps=5000, save_every=1000, devices=2))
        wait_for(lambda: (read_record(s.data_dir, job_id).get("progress") or {}).get("step", 0) >= 5, 90, "training")
        r = s.client.post(f"/jobs/{job_id}/cancel")
        assert r.status_code == 202 and r.json()["cancel_requested"] is True
        job = wait_state(s.client, job_id, {"succeeded", "failed", "cancelled"}, timeout=60)
        assert job["state"] == "cancelled", job
        assert job["latest_checkpoint"] == f"checkpoints/step-{job['step']}"
        wait_for(lambda: not rank_processes(job_id), 30, "the ranks to exit")  # rank 0 records, then exits


def test_a_worker_with_fewer_devices_fails_the_job_saying_so(tmp_path):
    flush_redis()
    with stack(tmp_path, server_env=LIMITS) as s:
        s.workers.append(start_worker(s.data_dir, REDIS_URL, "narrow", tmp_path, BERT_WORKER_DEVICES="1"))
        job_id = submit(s, finetune_request("nowhere", max_steps=10, devices=2))
        job = wait_state(s.client, job_id, {"succeeded", "failed", "cancelled"}, timeout=60)
        assert (job["state"], job["error"]) == ("failed", "params.devices is 2, but this worker runs at most 1 "
                                                          "processes (BERT_WORKER_DEVICES)")
