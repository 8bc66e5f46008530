"""A queued job's place in line through GET /jobs/{id} and its event stream (records written through
datadir's transitions, as the workers write them; the real app over ASGI), and the bounds of a job's
priority."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.jobs import events as job_events_module
from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from datadir import JobRecords, jobs
from tests.app.test_job_events import Reader
from tests.app.test_jobs_api import make_client, post_job
from tests.helpers import finetune_request, finetune_spec, labelled_csv, make_data_dir


@pytest.fixture
def env(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    with make_client(data_dir, job_max_priority=5) as client:
        r = client.post("/datasets", files={"file": ("reviews.csv", labelled_csv())}, data={"name": "reviews"})
        assert r.status_code == 201, r.text
        yield client, JobRecords(data_dir)


ALICE = Key("alice", hash_secret("alice's secret"), frozenset({"jobs"}))


def queued(store: JobRecords, name: str, priority: int) -> str:
    time.sleep(0.002)  # created_at has milliseconds: equal priorities are first come, first served
    return store.create({**finetune_spec(name), "priority": priority})["id"]


def place(client, job_id: str) -> tuple:
    job = client.get(f"/jobs/{job_id}").json()
    return job["priority"], job["queue_position"], job["waiting_for"], job["start_estimate_s"]


def test_three_queued_jobs_know_their_place_and_what_they_wait_for(env):
    client, store = env
    running = queued(store, "running", 5)
    store.move(running, jobs.start, "host:1")
    store.update(running, lambda r: r.update(progress={"step": 140, "total_steps": 200, "eta_s": 31.5}))
    first, urgent, last = queued(store, "first", 0), queued(store, "urgent", 3), queued(store, "last", 0)

    ahead = f"job {running} (priority 5, step 140 of 200)"
    assert place(client, urgent) == (3, 1, ahead, 31.5)
    assert place(client, first) == (0, 2, f"1 queued job ahead: job {urgent} (priority 3); {ahead}", None)
    assert place(client, last) == (
        0,
        3,
        f"2 queued jobs ahead: job {urgent} (priority 3), job {first} (priority 0); {ahead}",
        None,
    )
    assert place(client, running) == (5, None, None, None)  # running: no place in line

    # One that outranks the running job goes first, and says that job makes way for it.
    top = queued(store, "top", 7)
    assert place(client, top) == (7, 1, f"{ahead} to hand back at its next step", None)
    assert place(client, urgent)[1:3] == (2, f"1 queued job ahead: job {top} (priority 7); {ahead}")

    # Nothing running: the first waits for a free worker.
    store.move(running, jobs.succeed, {}, "done")
    assert place(client, top) == (7, 1, "a free worker", None)


@pytest.mark.parametrize(
    ("priority", "error"),
    [
        (11, "finetune.priority: Input should be less than or equal to 10"),
        (-11, "finetune.priority: Input should be greater than or equal to -10"),
        ("high", "finetune.priority: Input should be a valid integer"),
        (2.5, "finetune.priority: Input should be a valid integer"),
        (6, "priority: 6 is more than this service allows (5, BERT_JOB_MAX_PRIORITY)"),
    ],
)
def test_a_priority_out_of_bounds_is_422(env, priority, error):
    client, store = env
    assert post_job(client, {**finetune_request("x"), "priority": priority}) == (
        422,
        {"error": error, "error_type": "validation"},
    )
    assert store.list() == []


def places(events: list[tuple[str, dict]]) -> list[tuple]:
    return [(data["queue_position"], data["waiting_for"]) for name, data in events if name == "progress"]


@pytest.mark.anyio
async def test_the_event_stream_of_a_queued_job_follows_its_place(tmp_path, monkeypatch):
    monkeypatch.setattr(job_events_module, "PLACE_S", 0.05)
    store = JobRecords(make_data_dir(tmp_path / "data"))
    waiting = queued(store, "waiting", 0)
    reader = Reader(store, waiting)
    try:
        await reader.until(lambda events: places(events) == [(1, "a free worker")])
        ahead = queued(store, "ahead", 1)  # the waiting job's own record does not change: its place does
        await reader.until(lambda events: len(places(events)) == 2)
        assert places(reader.events)[1] == (2, f"1 queued job ahead: job {ahead} (priority 1)")
    finally:
        reader.gone = True
        store.request_cancel(waiting)
        await asyncio.wait_for(reader.task, 30)


@pytest.mark.anyio
async def test_the_event_stream_names_only_the_jobs_its_reader_may_see(tmp_path, monkeypatch):
    monkeypatch.setattr(job_events_module, "PLACE_S", 0.05)
    store = JobRecords(make_data_dir(tmp_path / "data"))
    waiting = store.create({**finetune_spec("waiting"), "owner": "alice"})["id"]
    reader = Reader(store, waiting, named=lambda record: ALICE.sees_jobs_of(jobs.owner_of(record)))
    try:
        await reader.until(lambda events: places(events) == [(1, "a free worker")])
        time.sleep(0.002)
        store.create({**finetune_spec("ahead"), "priority": 1, "owner": "bob"})
        await reader.until(lambda events: len(places(events)) == 2)
        assert places(reader.events)[1] == (2, "1 queued job ahead: another key's job (priority 1)")
    finally:
        reader.gone = True
        store.request_cancel(waiting)
        await asyncio.wait_for(reader.task, 30)


def test_another_keys_jobs_are_described_without_their_ids(tmp_path):
    """A jobs key reads its job's place, and a 409 for a model name another job trains, without the ids of
    other keys' jobs: their priority and progress only. An admin key sees every id."""
    secrets = {name: new_secret() for name in ("alice", "bob", "boss")}
    scopes = {"alice": {"jobs"}, "bob": {"jobs"}, "boss": {"jobs", "admin"}}
    keys_file = tmp_path / "keys.toml"
    write_keys(keys_file, {n: Key(n, hash_secret(s), frozenset(scopes[n])) for n, s in secrets.items()})
    data_dir = make_data_dir(tmp_path / "data")
    store = JobRecords(data_dir)

    def owned(name: str, owner: str, priority: int) -> str:
        time.sleep(0.002)
        return store.create({**finetune_spec(name), "priority": priority, "owner": owner})["id"]

    running = owned("running", "bob", 5)
    store.move(running, jobs.start, "host:1")
    store.update(running, lambda r: r.update(progress={"step": 140, "total_steps": 200}))
    bobs, mine, alices = owned("bobs", "bob", 3), owned("mine", "alice", 2), owned("last", "alice", 0)
    with make_client(data_dir, keys_file=keys_file) as client:

        def waiting_for(job_id: str, key: str) -> str:
            r = client.get(f"/jobs/{job_id}", headers={"Authorization": f"Bearer {secrets[key]}"})
            assert r.status_code == 200, r.text
            return r.json()["waiting_for"]

        assert waiting_for(alices, "alice") == (
            f"2 queued jobs ahead: another key's job (priority 3), job {mine} (priority 2); "
            "another key's job (priority 5, step 140 of 200)"
        )
        assert waiting_for(alices, "boss") == (
            f"2 queued jobs ahead: job {bobs} (priority 3), job {mine} (priority 2); "
            f"job {running} (priority 5, step 140 of 200)"
        )
        assert waiting_for(bobs, "bob") == f"job {running} (priority 5, step 140 of 200)"

        for key, job in (("alice", "another key's job"), ("boss", f"job {bobs}")):
            r = client.post("/jobs", json=finetune_request("bobs"), headers={"Authorization": f"Bearer {secrets[key]}"})
            assert (r.status_code, r.json()) == (
                409,
                {
                    "error": f"model_name: {job} (queued) is already training a model named 'bobs'",
                    "error_type": "conflict",
                },
            )
