"""Jobs with "devices": 2 through a real uvicorn, a real `celery worker` and Redis: the worker trains them
through torchrun (two gloo ranks of worker/ddp_job.py), rank 0 reports per-rank throughput, and cancel,
the SIGTERM hand-back and a SIGKILL of the whole worker work as for any job, and a rank killed on its own
costs the job an attempt, not its progress. The limits on params.devices are in tests/app/test_job_devices.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.helpers import (
    REDIS_URL,
    finetune_request,
    flush_redis,
    read_metrics,
    read_record,
    start_worker,
    train_steps,
    wait_for,
    wait_state,
)
from tests.worker.test_recovery import stack, submit

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


def rank_one(job_id: str) -> int | None:
    for pid in rank_processes(job_id):
        try:
            if b"RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def test_a_two_device_job_hands_back_survives_sigkill_and_finishes(tmp_path):
    flush_redis()
    with stack(tmp_path, server_env=LIMITS) as s:
        s.workers.append(start_worker(s.data_dir, REDIS_URL, "leaving", tmp_path, BERT_WORKER_DEVICES="2"))
        job_id = submit(s, finetune_request("wide", max_steps=240, save_every=40, devices=2))
        wait_for(
            lambda: (read_record(s.data_dir, job_id).get("progress") or {}).get("step", 0) >= 15,
            90,
            "training on two ranks",
        )
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
        wait_for(
            lambda: read_record(s.data_dir, job_id)["latest_checkpoint"] != f"checkpoints/step-{handed_at}",
            90,
            "a new checkpoint",
        )
        s.workers[1].kill()
        wait_for(lambda: not rank_processes(job_id), 10, "the ranks to die with their worker")

        # 3. The next worker's sweep resumes it; one of its ranks is SIGKILLed on its own: the attempt ends,
        # the job is sent again, and it resumes from the latest checkpoint and finishes.
        killed = read_record(s.data_dir, job_id)["latest_checkpoint"]
        s.workers.append(start_worker(s.data_dir, REDIS_URL, "rescuer", tmp_path, BERT_WORKER_DEVICES="2"))
        wait_for(
            lambda: read_record(s.data_dir, job_id)["latest_checkpoint"] != killed and rank_one(job_id),
            90,
            "a checkpoint of the resumed attempt",
        )
        os.kill(rank_one(job_id), signal.SIGKILL)
        job = wait_state(s.client, job_id, {"succeeded", "failed", "cancelled"}, timeout=120)
        assert job["state"] == "succeeded", job
        assert (job["step"], job["attempts"]) == (240, 3)
        events = [e["event"] for e in job["events"]]
        assert "training processes lost" in events and events.count("resumed") == 3
        assert train_steps(s.data_dir, job_id) == list(range(1, 241))
        assert all(r["world_size"] == 2 for r in read_metrics(s.data_dir, job_id) if r["type"] == "train")
        assert (s.data_dir / "models" / "wide" / "v1" / "config.json").is_file()


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
