"""Which job a delivery runs (worker/training.py: run_delivery, in-process, no Celery): the queue's first by
priority, then age, whichever job the message named; a job another process holds is passed over. And a
cancelled job queued again (JobRecords.restart) resumes from its checkpoint."""

from __future__ import annotations

import socket
import threading

import pytest

from datadir import JobRecords, jobs
from tests.helpers import LeaseHolder, finetune_spec, labelled_csv, make_data_dir, wait_for, write_dataset
from worker.recovery import job_of_process
from worker.settings import WorkerSettings
from worker.training import run_delivery, run_job


@pytest.fixture
def store(tmp_path):
    root = make_data_dir(tmp_path / "data")
    write_dataset(root, "reviews", labelled_csv(), "reviews.csv")
    return JobRecords(root)


@pytest.fixture
def settings(store):
    return WorkerSettings(data_dir=store.data_dir, worker_device="cpu", job_progress_interval_s=0)


def queue(store: JobRecords, *priorities: int) -> list[str]:
    return [
        store.create({**finetune_spec(f"m{i}", max_steps=2), "priority": p})["id"] for i, p in enumerate(priorities)
    ]


def states(store: JobRecords, ids: list[str]) -> list[str]:
    return [store.read(job_id)["state"] for job_id in ids]


def test_a_delivery_runs_the_highest_priority_then_the_oldest(store, settings):
    low, first_high, second_high = queue(store, 0, 3, 3)
    assert run_delivery(low, settings) == {"job": first_high, "outcome": "succeeded"}
    assert states(store, [low, first_high, second_high]) == ["queued", "succeeded", "queued"]
    assert run_delivery(first_high, settings) == {"job": second_high, "outcome": "succeeded"}  # a spent message
    assert run_delivery(second_high, settings) == {"job": low, "outcome": "succeeded"}
    assert run_delivery(low, settings) == {"job": low, "outcome": "already succeeded"}  # nothing waits


def test_a_job_another_process_holds_is_passed_over(store, settings):
    low, high = queue(store, -5, 5)
    holder = LeaseHolder(store.data_dir, high)  # a worker taking it up this instant
    try:
        assert run_delivery(high, settings) == {"job": low, "outcome": "succeeded"}
    finally:
        holder.kill()
    assert states(store, [low, high]) == ["succeeded", "queued"]


def test_a_cancelled_job_queued_again_resumes_from_its_checkpoint(store, settings):
    job_id = store.create(finetune_spec("m", max_steps=300, save_every=1000, log_every=1))["id"]
    training = threading.Thread(target=run_job, args=(job_id, settings))
    training.start()
    wait_for(lambda: store.read(job_id)["progress"].get("step", 0) >= 3, 60, "a few steps")
    store.request_cancel(job_id)
    training.join(timeout=60)
    cancelled = store.read(job_id)
    assert cancelled["state"] == "cancelled" and cancelled["progress"]["step"] < 300
    stopped_at = cancelled["progress"]["step"]
    assert cancelled["latest_checkpoint"] == f"checkpoints/step-{stopped_at}"

    store.restart(job_id)  # what `bert init` does to a cancelled bootstrap job
    assert run_job(job_id, settings) == {"job": job_id, "outcome": "succeeded"}
    metrics = store.metrics(job_id)
    assert [r["step"] for r in metrics if r["type"] == "resume"] == [stopped_at]
    assert [r["step"] for r in metrics if r["type"] == "train"] == list(range(1, 301))


def test_a_running_job_whose_worker_died_waits_at_its_place(store, settings):
    (waiting,) = queue(store, 0)
    (orphan,) = queue(store, 2)
    store.move(orphan, jobs.start, f"{socket.gethostname()}:999999")  # its process is gone: the lease is free
    assert job_of_process(store, 999999, waiting) == orphan  # what the worker notes a pool process's death on
    assert job_of_process(store, 999998, waiting) == waiting
    assert run_delivery(waiting, settings) == {"job": orphan, "outcome": "succeeded"}
    assert [e["event"] for e in store.read(orphan)["events"]][-3:-1] == ["attempt did not finish", "started"]
    assert states(store, [waiting, orphan]) == ["queued", "succeeded"]
