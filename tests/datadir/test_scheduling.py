"""datadir/scheduling.py's preemption rule on records moved through the named transitions: the
lowest-priority running job makes way for a higher one that waited past the grace, and only one does."""

from __future__ import annotations

import datetime as dt

from datadir import JobRecords, jobs
from datadir.scheduling import make_way_for, waiting
from tests.helpers import finetune_spec


def job(store: JobRecords, priority: int, running: bool = False) -> str:
    job_id = store.create({**finetune_spec("m"), "priority": priority})["id"]
    if running:
        store.move(job_id, jobs.start, "host:1")
    return job_id


def free(job_id: str) -> bool:
    return True


def test_only_the_lowest_running_job_makes_way_and_only_once(tmp_path):
    store = JobRecords(tmp_path / "data")
    mid, low, newer_low = job(store, 0, True), job(store, -5, True), job(store, -5, True)
    assert [make_way_for(store.list(), j, 0, free) for j in (mid, low, newer_low)] == [None, None, None]

    high = job(store, 2)
    assert make_way_for(store.list(), high, 60, free) is None  # within the grace an idle worker may take it
    takers = [j for j in (mid, low, newer_low) if make_way_for(store.list(), j, 0, free)]
    assert takers == [newer_low]  # the lowest priority; of equals, the newest
    assert make_way_for(store.list(), newer_low, 0, lambda j: False) is None  # being taken up: no need

    store.move(newer_low, jobs.make_way, high, "for a higher one")
    assert [make_way_for(store.list(), j, 0, free) for j in (mid, low)] == [None, None]  # one slot is enough

    job(store, -5)  # an equal priority waits its turn
    store.move(high, jobs.start, "host:2")
    assert [make_way_for(store.list(), j, 0, free) for j in (mid, low, high)] == [None, None, None]


def test_equal_priorities_go_first_come_first_served_unless_an_owner_is_over_its_share(tmp_path):
    """Two keys' jobs of equal priority: in arrival order while each is within its worker_share; once
    'busy' has taken more than its share (0.5) of the day's worker time, its queued jobs go after the
    others of their priority, and never ahead of a higher priority."""
    from datadir.scheduling import delivery_order, over_share

    store = JobRecords(tmp_path / "data")

    def submit(owner: str, priority: int = 0, share: float | None = 0.5) -> str:
        return store.create({**finetune_spec("m"), "priority": priority, "owner": owner, "worker_share": share})["id"]

    def finish(job_id: str, seconds: float) -> None:
        store.move(job_id, jobs.start, "host:1")
        store.update(job_id, lambda r: r.update(runtime_s=seconds))
        store.move(job_id, jobs.succeed, {}, "done")

    finish(submit("busy"), 300.0)
    finish(submit("calm"), 300.0)
    b1, c1, b2 = submit("busy"), submit("calm"), submit("busy")
    assert over_share(store.list()) == set()  # 50% each: within their shares
    assert [r["id"] for r in waiting(store.list())] == [b1, c1, b2]

    finish(submit("busy"), 400.0)  # busy: 700 of 1000 s
    assert over_share(store.list()) == {"busy"}
    assert [r["id"] for r in waiting(store.list())] == [c1, b1, b2]
    urgent = submit("busy", priority=3)
    assert delivery_order(store.list()) == [urgent, c1, b1, b2]  # a share never outranks a priority

    unshared = submit("open", share=None)  # a key without a share is never over it
    assert delivery_order(store.list()) == [urgent, c1, unshared, b1, b2]


def test_an_owners_jobs_make_others_make_way_at_most_max_per_hour_times():
    """Records as the workers leave them, written here with fixed times: the "made way" events of the
    last hour are counted by the owner of the job each names; an owner at its bound preempts no more
    (its job waits for a free worker), another owner's job still does, and an hour later the bound is
    free again. A job that is gone (deleted after its cancel) still counts, by the owner its event notes."""
    from datadir.scheduling import preemptions

    now = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.UTC)

    def at(minutes_ago: float) -> str:
        return (now - dt.timedelta(minutes=minutes_ago)).isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def record(job_id: str, state: str, priority: int, owner: str, created: float, events=()) -> dict:
        return {
            "id": job_id, "kind": "finetune", "state": state, "priority": priority, "owner": owner,
            "created_at": at(created), "enqueued_at": at(created), "events": list(events),
        }  # fmt: skip

    def made_way(minutes_ago: float, for_job: str, owner: str | None) -> dict:
        noted = {"preempted_for_owner": owner} if owner is not None else {}
        return {"at": at(minutes_ago), "event": "made way", "preempted_for": for_job, **noted}

    history = [made_way(m, f"gone-{i}", "eager") for i, m in enumerate((50, 40, 30, 20, 10))]
    history.append(made_way(70, "old", "eager"))  # more than an hour ago: not counted
    history.append(made_way(5, "calm-1", None))  # an older event without the owner: its job's record says
    victim = record("victim", "running", -5, "calm", 100, history)
    urgent = record("urgent", "queued", 5, "eager", 1)
    calm = record("calm-1", "succeeded", 3, "calm", 90)
    records = [victim, urgent, calm]
    assert preemptions(records, now) == {"eager": 5, "calm": 1}

    def taker(records: list[dict], bound: int | None) -> str | None:
        ahead = make_way_for(records, "victim", 2.0, free, max_per_hour=bound, now=now)
        return ahead["id"] if ahead is not None else None

    assert [taker(records, bound) for bound in (None, 6, 5, 0)] == ["urgent", "urgent", None, None]
    other = record("other", "queued", 4, "patient", 0.5)
    assert taker([*records, other], 5) == "other"  # another owner's job still goes first
    assert taker([*records, other], 6) == "urgent"  # (the higher priority, while eager is within its bound)
    assert preemptions(records, now + dt.timedelta(minutes=15)) == {"eager": 4, "calm": 1}
    later = now + dt.timedelta(minutes=15)  # the oldest of eager's five is past the hour: one more is allowed
    assert make_way_for(records, "victim", 2.0, free, max_per_hour=5, now=later)["id"] == "urgent"


def test_a_job_that_made_way_notes_the_job_and_its_owner(tmp_path):
    store = JobRecords(tmp_path / "data")
    low = job(store, -5, True)
    record = store.move(low, jobs.make_way, "20261204T120000-0a0b0c0d", "for a job of priority 3", "eager")
    assert {k: v for k, v in record["events"][-1].items() if k != "at"} == {
        "event": "made way",
        "detail": "for a job of priority 3",
        "preempted_for": "20261204T120000-0a0b0c0d",
        "preempted_for_owner": "eager",
    }


def test_jobs_submitted_within_one_millisecond_run_in_the_order_they_were_submitted(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "now_iso", lambda: "2026-01-31T12:00:00.000Z")  # a clock that has not moved on
    monkeypatch.setitem(jobs._created, "last", "")  # no job of this process yet
    store = JobRecords(tmp_path / "data")
    submitted = [store.create({**finetune_spec(f"m{i}"), "priority": 1})["id"] for i in range(20)]
    created = [store.read(j)["created_at"] for j in submitted]
    assert created == sorted(set(created)) and created[-1] == "2026-01-31T12:00:00.019Z"
    assert [r["id"] for r in waiting(store.list())] == submitted
