"""datadir: the record on disk, locked updates across processes, the flock lease, the name rule,
publishing (test_versions.py)."""

from __future__ import annotations

import multiprocessing

import pytest

from datadir import (
    JobFinished,
    JobNotFound,
    JobRecords,
    JobUnfinished,
    Lease,
    lease_is_free,
    valid_job_id,
    valid_name,
)
from tests.helpers import LeaseHolder, finetune_spec


@pytest.fixture
def store(tmp_path):
    return JobRecords(tmp_path / "data")


def test_a_new_job_is_queued_and_listed_newest_first(store):
    first = store.create(finetune_spec("a"))
    second = store.create(finetune_spec("b"))
    assert valid_job_id(first["id"]) and first["state"] == "queued" and first["attempts"] == 0
    assert store.read(first["id"]) == first
    assert [r["id"] for r in store.list()] == sorted([first["id"], second["id"]], reverse=True)
    store.update(first["id"], lambda r: r.update(state="running"))
    assert [r["id"] for r in store.list("running")] == [first["id"]]
    assert not list(store.root.glob(".tmp-*"))


@pytest.mark.parametrize("job_id", ["../x", "20240101T000000-0000abcd/../..", "", "x" * 80])
def test_ids_that_are_not_ids_never_reach_the_disk(store, job_id):
    with pytest.raises(JobNotFound):
        store.read(job_id)
    assert not store.exists(job_id)


@pytest.mark.parametrize(
    "name, ok",
    [
        ("bert-tiny_2", True),
        ("x", True),
        ("bert.v2", True),
        ("a..b", True),
        ("../x", False),
        ("a/b", False),
        (".x", False),
        ("..", False),
        ("tmp1", False),
        ("TMP1", False),
        ("x" * 64, True),
        ("x" * 65, False),
        ("", False),
        (None, False),
        ("ab\n", False),
        ("nl\n", False),
        ("a\nb", False),
    ],
)
def test_names_are_single_plain_path_components(name, ok):
    """One rule for models, datasets and job model names: dots allowed, never a path or a temp name."""
    assert valid_name(name) is ok


def _bump(data_dir, job_id, n):
    store = JobRecords(data_dir)
    for _ in range(n):
        store.update(job_id, lambda r: r.update(attempts=r["attempts"] + 1))


def test_updates_from_many_processes_are_never_lost(store):
    job_id = store.create(finetune_spec("a"))["id"]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_bump, args=(store.data_dir, job_id, 25)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert store.read(job_id)["attempts"] == 100


def test_cancel_is_immediate_when_queued_and_a_flag_when_running(store):
    queued = store.create(finetune_spec("a"))["id"]
    assert store.request_cancel(queued)["state"] == "cancelled"
    running = store.create(finetune_spec("b"))["id"]
    store.update(running, lambda r: r.update(state="running"))
    record = store.request_cancel(running)
    assert (record["state"], record["cancel_requested"]) == ("running", True)
    assert store.cancel_requested(running)
    store.update(running, lambda r: r.update(state="succeeded"))
    before = store.read(running)
    with pytest.raises(JobFinished) as finished:  # finished is finished: the record is left as it was
        store.request_cancel(running)
    assert (finished.value.job_id, finished.value.state) == (running, "succeeded")
    assert store.read(running) == before


def test_the_lease_is_exclusive_across_processes_and_dies_with_its_holder(store):
    job_id = store.create(finetune_spec("a"))["id"]
    holder = LeaseHolder(store.data_dir, job_id)
    try:
        assert not Lease(store, job_id).try_acquire(wait_s=0.3)
        assert not lease_is_free(store, job_id)
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs, the kernel drops the lock
    with Lease(store, job_id) as lease:
        assert lease.try_acquire()
        assert not Lease(store, job_id).try_acquire()  # exclusive within a process too (own open file)
    assert lease_is_free(store, job_id)


def test_the_heartbeat_stamps_running_jobs(store):
    job_id = store.create(finetune_spec("a"))["id"]
    store.update(job_id, lambda r: r.update(state="running"))
    with Lease(store, job_id) as lease:
        assert lease.try_acquire()
        lease.start_heartbeat(0.05)
        import time

        time.sleep(0.3)
    assert store.read(job_id)["heartbeat_at"] is not None


def test_metrics_survive_a_torn_last_line(store):
    job_id = store.create(finetune_spec("a"))["id"]
    path = store.job_dir(job_id) / "metrics.jsonl"
    path.write_text('{"type": "train", "step": 1}\n{"type": "train", "step": 2}\n{"type": "tr')
    assert [r["step"] for r in store.metrics(job_id)] == [1, 2]
    store.repair_metrics(job_id)
    assert path.read_text() == '{"type": "train", "step": 1}\n{"type": "train", "step": 2}\n'


def test_only_a_finished_job_is_deleted_and_then_it_is_gone(store):
    job_id = store.create(finetune_spec("a"))["id"]
    (store.job_dir(job_id) / "checkpoints" / "step-1").mkdir(parents=True)
    (store.job_dir(job_id) / "checkpoints" / "step-1" / "model.safetensors").write_bytes(b"w" * 1000)
    with pytest.raises(JobUnfinished, match=f"job {job_id} is queued"):
        store.delete(job_id)
    store.update(job_id, lambda r: r.update(state="failed"))
    size = store.disk_bytes(job_id)
    assert size > 1000
    assert store.delete(job_id) == size
    assert not store.exists(job_id) and store.list() == [] and not list(store.root.iterdir())
    with pytest.raises(JobNotFound):
        store.delete(job_id)


def test_the_checkpoints_of_jobs_that_ended_long_ago_are_removed_and_nothing_else(store):
    import datetime as dt

    from datadir import jobs
    from datadir.jobs import CHECKPOINTS

    def ended(state: str, days_ago: float) -> str:
        job_id = store.create(finetune_spec(state))["id"]
        job_dir = store.job_dir(job_id)
        (job_dir / CHECKPOINTS / "step-5").mkdir(parents=True)
        (job_dir / CHECKPOINTS / "step-5" / "model.safetensors").write_bytes(b"w" * 1000)
        (job_dir / "final_model").mkdir()  # a model trained but not published: never removed
        (job_dir / "final_model" / "model.safetensors").write_bytes(b"f" * 10)
        at = (dt.datetime.now(dt.UTC) - dt.timedelta(days=days_ago)).isoformat().replace("+00:00", "Z")
        store.update(job_id, lambda r: r.update(state=state, finished_at=at, latest_checkpoint="checkpoints/step-5"))
        return job_id

    old_failed, old_cancelled = ended("failed", 4), ended("cancelled", 4)
    recent, succeeded = ended("failed", 1), ended("succeeded", 10)
    assert store.expire_checkpoints(3 * 86400) == {old_failed: 1000, old_cancelled: 1000}
    for job_id in (old_failed, old_cancelled):
        record = store.read(job_id)
        assert not (store.job_dir(job_id) / CHECKPOINTS).exists() and record["latest_checkpoint"] is None
        assert record["events"][-1]["event"] == "checkpoints removed"
        assert (store.job_dir(job_id) / "final_model" / "model.safetensors").is_file()
    for job_id in (recent, succeeded):
        assert (store.job_dir(job_id) / CHECKPOINTS / "step-5").is_dir()
    assert store.expire_checkpoints(3 * 86400) == {}  # nothing left to remove
    store.move(old_failed, jobs.restart)  # a restarted job begins again from scratch
    assert store.read(old_failed)["state"] == "queued"


def test_what_a_key_holds_on_disk(tmp_path):
    from datadir.holdings import holdings
    from datadir.publish import publish_model

    data = tmp_path / "data"
    records = JobRecords(data)
    mine = records.create({**finetune_spec("m"), "owner": "alice", "publish_any": False})
    (records.job_dir(mine["id"]) / "checkpoints").mkdir()
    (records.job_dir(mine["id"]) / "checkpoints" / "w").write_bytes(b"x" * 5000)
    theirs = records.create({**finetune_spec("n"), "owner": "bob", "publish_any": False})
    (records.job_dir(theirs["id"]) / "w").write_bytes(b"x" * 7000)
    model = tmp_path / "out"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"m" * 3000)
    publish_model(data, mine["id"], model, "alices")
    dataset = data / "datasets" / "d"
    dataset.mkdir(parents=True)
    (dataset / "data.csv").write_bytes(b"d" * 2000)
    (dataset / "meta.json").write_text('{"name": "d", "kind": "labelled", "owner": "alice"}')
    held = holdings(data, "alice")
    job_bytes = sum(f.stat().st_size for f in records.job_dir(mine["id"]).rglob("*") if f.is_file())
    assert held.jobs == job_bytes >= 5000
    assert held.datasets >= 2000 and 3000 <= held.models < 5000
    assert held.total == held.jobs + held.datasets + held.models
    assert holdings(data, "carol").total == 0
