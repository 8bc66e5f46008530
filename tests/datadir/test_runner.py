"""datadir/runner.py: one attempt at a job under its lease (take, begin, heartbeat, end, release), for a
blocking body and a coroutine, and the one resume rule."""

from __future__ import annotations

import asyncio
import threading

import pytest

from datadir import JobRecords, jobs, lease_is_free, runner
from tests.helpers import LeaseHolder, finetune_spec


@pytest.fixture
def records(tmp_path):
    return JobRecords(tmp_path / "data")


def new_job(records: JobRecords, kind: str = "finetune", **params) -> str:
    return records.create({**finetune_spec("m", **params), "kind": kind})["id"]


def events(records: JobRecords, job_id: str) -> list[str]:
    return [e["event"] for e in records.read(job_id)["events"]]


def test_a_body_runs_once_holding_the_lease_and_ends_the_job(records):
    job_id = new_job(records)
    seen = []

    def body(attempt: runner.Attempt) -> str:
        seen.append((attempt.record["state"], attempt.record["attempts"], lease_is_free(records, job_id)))
        return attempt.succeed({"ok": 1}, "done", runtime_s=1.5)

    assert runner.run(records, job_id, body) == "succeeded"
    assert seen == [("running", 1, False)]
    record = records.read(job_id)
    assert (record["state"], record["result"], record["runtime_s"]) == ("succeeded", {"ok": 1}, 1.5)
    assert events(records, job_id) == ["created", "started", "succeeded"]
    assert lease_is_free(records, job_id)


def test_a_lease_held_elsewhere_runs_nothing(records, tmp_path):
    job_id = new_job(records)
    holder = LeaseHolder(tmp_path / "data", job_id)
    try:
        assert runner.run(records, job_id, lambda attempt: pytest.fail("ran")) == runner.RUNNING_ELSEWHERE
    finally:
        holder.kill()
    assert records.read(job_id)["state"] == "queued"


def test_an_exception_the_body_lets_out_fails_the_job_with_its_traceback(records):
    job_id = new_job(records)

    def body(attempt: runner.Attempt) -> str:
        raise ValueError("the disk said no")

    assert runner.run(records, job_id, body) == "failed"
    record = records.read(job_id)
    assert (record["state"], record["error"]) == ("failed", "ValueError: the disk said no")
    assert "the disk said no" in (records.job_dir(job_id) / runner.ERROR_LOG).read_text()
    assert lease_is_free(records, job_id)


def test_a_message_stands_for_an_error_a_user_can_fix(records):
    job_id = new_job(records)
    assert runner.run(records, job_id, lambda a: a.fail(KeyError("x"), "column 'label' is missing")) == "failed"
    assert records.read(job_id)["error"] == "column 'label' is missing"


@pytest.mark.parametrize(
    "prepare, outcome, last_event",
    [
        (lambda r, j: r.move(j, jobs.ask_to_cancel), "already cancelled", "cancelled"),
        (lambda r, j: (r.job_dir(j) / jobs.CANCEL).touch(), "cancelled", "cancelled before it could run"),
        (lambda r, j: r.update(j, lambda x: x.update(attempts=3)), "failed", "too many attempts"),
        (lambda r, j: r.update(j, lambda x: x.update(runtime_s=60)), "failed", "time limit"),
    ],
)
def test_begin_decides_what_an_attempt_does(records, prepare, outcome, last_event):
    job_id = new_job(records, max_runtime=60)
    prepare(records, job_id)
    assert runner.run(records, job_id, lambda a: pytest.fail("ran"), max_attempts=3) == outcome
    assert events(records, job_id)[-1] == last_event


def test_a_running_record_whose_lease_is_free_lost_its_attempt(records):
    job_id = new_job(records)
    records.move(job_id, jobs.start, "a-dead-host:1")
    assert runner.run(records, job_id, lambda a: a.cancel("enough")) == "cancelled"
    record = records.read(job_id)
    assert record["attempts"] == 2
    assert events(records, job_id)[-3:] == ["attempt did not finish", "started", "cancelled"]


def test_a_cancel_a_kind_may_refuse_before_it_starts(records):
    job_id = new_job(records)
    (records.job_dir(job_id) / jobs.CANCEL).touch()
    ran = runner.run(records, job_id, lambda a: a.succeed({}, "ran"), may_cancel=lambda record: False)
    assert ran == "succeeded"


def test_the_heartbeat_beats_while_the_body_runs_and_stops_after(records):
    job_id = new_job(records)
    beats = []

    def body(attempt: runner.Attempt) -> str:
        first = records.read(job_id)["heartbeat_at"]
        for _ in range(200):  # up to 10 s on a loaded machine; a beat every 0.02 s
            now = records.read(job_id)["heartbeat_at"]
            if now != first:
                beats.append(now)
                break
            threading.Event().wait(0.05)
        return attempt.succeed({}, "done")

    runner.run(records, job_id, body, heartbeat_s=0.02)
    assert beats, "no heartbeat was written while the body ran"
    assert records.read(job_id)["heartbeat_at"] is None  # a finished job has none


def test_after_release_runs_once_the_lease_is_free(records):
    job_id = new_job(records)
    seen = []
    runner.run(
        records,
        job_id,
        lambda a: a.end(jobs.hand_back, "stopping")["state"],
        after_release=lambda outcome: seen.append((outcome, lease_is_free(records, job_id))),
    )
    assert seen == [("queued", True)]


def test_a_joined_attempt_ends_the_job_without_a_lease(records):
    job_id = new_job(records)
    holder = runner.Attempt(records, job_id)
    assert holder.take() and holder.begin() == "run"
    try:
        rank0 = runner.Attempt.joined(records, records.read(job_id))
        assert rank0.succeed({}, "published") == "succeeded"
    finally:
        holder.release()
    assert lease_is_free(records, job_id)


def test_cancelling_a_coroutine_body_hands_the_job_back(records):
    job_id = new_job(records, kind="batch")
    started = asyncio.Event()

    async def body(attempt: runner.Attempt) -> str:
        started.set()
        await asyncio.sleep(3600)
        return "never"

    async def main() -> None:
        task = asyncio.create_task(runner.run_async(records, job_id, body))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    record = records.read(job_id)
    assert (record["state"], record["attempts"]) == ("queued", 0)
    assert events(records, job_id)[-1] == "handed back"
    assert lease_is_free(records, job_id)


def test_a_coroutine_body_that_raises_fails_the_job(records):
    job_id = new_job(records, kind="batch")

    async def body(attempt: runner.Attempt) -> str:
        raise RuntimeError("engine gone")

    assert asyncio.run(runner.run_async(records, job_id, body)) == "failed"
    assert records.read(job_id)["error"] == "RuntimeError: engine gone"


def test_resumable_names_the_unfinished_jobs_of_its_kinds_that_no_process_runs(records, tmp_path):
    ids = {name: new_job(records, kind) for name, kind in [("train", "finetune"), ("imp", "import"), ("b", "batch")]}
    ids["held"] = new_job(records, "import")
    ids["here"] = new_job(records, "import")
    ids["done"] = new_job(records, "import")
    records.move(ids["done"], jobs.ask_to_cancel)
    records.move(ids["imp"], jobs.start, "a-dead-api:1")
    holder = LeaseHolder(tmp_path / "data", ids["held"])
    try:
        found = runner.resumable(records, {"import"}, here=lambda job_id: job_id == ids["here"])
        assert sorted(r["id"] for r in found) == [ids["imp"]]
        assert [r["id"] for r in runner.resumable(records, jobs.TRAINING_KINDS)] == [ids["train"]]
        assert runner.resumable(records, {"import"}, states=("queued",), here=lambda j: j == ids["here"]) == []
    finally:
        holder.kill()
