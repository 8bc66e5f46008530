"""model/datadir/scheduling.py's preemption rule on records moved through the named transitions: the
lowest-priority running job makes way for a higher one that waited past the grace, and only one does."""

from __future__ import annotations

import time

from model.datadir import JobRecords, jobs
from model.datadir.scheduling import make_way_for
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
