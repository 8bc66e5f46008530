"""datadir/scheduling.py's preemption rule on records moved through the named transitions: the
lowest-priority running job makes way for a higher one that waited past the grace, and only one does."""

from __future__ import annotations

import time

from datadir import JobRecords, jobs
from datadir.scheduling import make_way_for
from tests.helpers import finetune_spec


def job(store: JobRecords, priority: int, running: bool = False) -> str:
    time.sleep(0.002)  # distinct created_at
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
    from datadir.scheduling import delivery_order, over_share, waiting

    store = JobRecords(tmp_path / "data")

    def submit(owner: str, priority: int = 0, share: float | None = 0.5) -> str:
        time.sleep(0.002)
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
