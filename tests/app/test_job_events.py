"""GET /jobs/{id}/events (app/jobs/events.py): the stream of a finished job over the app, and the
generator of a running one driven while the test plays the worker (appending metrics, rewriting
them on a resume, changing state). The stream against a real worker, with curl, is in
tests/test_console_browser.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from app.errors import ServiceError
from app.jobs import events as job_events_module
from app.jobs.events import MAX_LINE, EventStreams, MetricsTail, job_events
from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from app.settings import Settings
from datadir import JobRecords
from datadir.files import rewrite_jsonl
from tests.app.test_jobs_api import NO_BROKER, make_client
from tests.helpers import finetune_spec, make_data_dir, start_server

pytestmark = pytest.mark.anyio


def parse_sse(text: str) -> list[tuple[str, dict]]:
    """(event, data) of every event; comment lines (keep-alives) are skipped, as clients do."""
    events = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if fields:
            events.append((fields["event"], json.loads(fields["data"])))
    return events


def train(step: int) -> dict:
    return {"type": "train", "step": step, "loss": 1.0 / step, "lr": 1e-3}


def append_text(path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def set_state(store: JobRecords, job_id: str, state: str, step: int = 0) -> dict:
    def change(r):
        r["state"] = state
        r["progress"] = {"step": step, "total_steps": 10, "loss": 0.5}

    return store.update(job_id, change)


@pytest.fixture
def store(tmp_path):
    return JobRecords(make_data_dir(tmp_path / "data"))


def test_a_finished_job_streams_its_whole_curve_then_ends(store):
    job_id = store.create(finetune_spec("clf"))["id"]
    for step in (1, 2, 3):
        store.append_metric(job_id, train(step))
    store.append_metric(job_id, {"type": "eval", "step": 3, "accuracy": 0.75, "macro_f1": 0.5})
    record = set_state(store, job_id, "succeeded", step=3)
    with make_client(store.data_dir) as client:
        r = client.get(f"/jobs/{job_id}/events")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        events = parse_sse(r.text)
        expected_job = client.get(f"/jobs/{job_id}").json()
    assert [name for name, _ in events] == ["metrics"] * 4 + ["progress", "state", "end"]
    assert [data for _, data in events[:4]] == store.metrics(job_id)
    assert events[4][1] == expected_job and events[4][1]["updated_at"] == record["updated_at"]
    assert events[5:] == [("state", {"state": "succeeded", "previous": None}), ("end", {"state": "succeeded"})]


def test_unknown_job_is_404_and_a_wrong_key_401_before_any_stream(store):
    with make_client(store.data_dir, admin_key="admin-key-0123456789") as client:
        r = client.get("/jobs/20240101T000000-0000abcd/events")
        assert (r.status_code, r.json()) == (
            401,
            {
                "error": "missing or wrong key: send 'Authorization: Bearer <BERT_ADMIN_KEY>'",
                "error_type": "unauthorized",
            },
        )
        r = client.get(
            "/jobs/20240101T000000-0000abcd/events", headers={"Authorization": "Bearer admin-key-0123456789"}
        )
        assert (r.status_code, r.json()) == (
            404,
            {"error": "job '20240101T000000-0000abcd' not found", "error_type": "not_found"},
        )
        r = client.get("/jobs/not-a-job/events", headers={"Authorization": "Bearer admin-key-0123456789"})
        assert r.status_code == 422


class Reader:
    """Consumes job_events() in a task, so the test can play the worker meanwhile."""

    def __init__(self, store: JobRecords, job_id: str, **options):
        self.events: list[tuple[str, dict]] = []
        self.gone = False
        self.task = asyncio.create_task(self._run(store, job_id, options))

    async def _run(self, store, job_id, options):
        async def disconnected():
            return self.gone

        async for chunk in job_events(store, job_id, disconnected, poll_s=0.01, **options):
            self.events += parse_sse(chunk)

    async def until(self, predicate, timeout: float = 5.0):
        async def wait():
            while not predicate(self.events):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(wait(), timeout)

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


async def test_a_running_job_streams_records_as_written_and_ends_with_the_job(store):
    job_id = store.create(finetune_spec("clf"))["id"]
    set_state(store, job_id, "running", step=0)
    reader = Reader(store, job_id)
    await reader.until(lambda ev: ("state", {"state": "running", "previous": None}) in ev)
    assert reader.names() == ["progress", "state"]

    store.append_metric(job_id, train(1))
    append_text(store.job_dir(job_id) / "metrics.jsonl", json.dumps(train(2))[:10])  # the writer is mid-line
    await reader.until(lambda ev: ("metrics", train(1)) in ev)
    await asyncio.sleep(0.05)
    assert ("metrics", train(2)) not in reader.events  # never a torn record
    append_text(store.job_dir(job_id) / "metrics.jsonl", json.dumps(train(2))[10:] + "\n")
    await reader.until(lambda ev: ("metrics", train(2)) in ev)

    set_state(store, job_id, "running", step=2)
    await reader.until(lambda ev: [e for e in ev if e[0] == "progress"][-1][1]["step"] == 2)
    assert not reader.task.done()

    # A resumed attempt rewrites the file (only step 1 survives) and continues from there.
    rewrite_jsonl(store.job_dir(job_id) / "metrics.jsonl", lambda r: r["step"] <= 1)
    store.append_metric(job_id, train(2))
    await reader.until(lambda ev: ev.count(("metrics", train(2))) == 2)
    after_reset = reader.events[reader.names().index("reset") + 1 :]
    assert [e for e in after_reset if e[0] == "metrics"] == [("metrics", train(1)), ("metrics", train(2))]

    store.append_metric(job_id, train(3))
    set_state(store, job_id, "cancelled", step=3)
    await asyncio.wait_for(reader.task, 30)
    assert reader.events[-2:] == [
        ("state", {"state": "cancelled", "previous": "running"}),
        ("end", {"state": "cancelled"}),
    ]
    assert ("metrics", train(3)) in reader.events  # the last record arrives before the end


async def test_the_stream_stops_when_the_client_goes(store):
    job_id = store.create(finetune_spec("clf"))["id"]
    set_state(store, job_id, "running")
    reader = Reader(store, job_id)
    await reader.until(lambda ev: len(ev) >= 2)
    reader.gone = True
    await asyncio.wait_for(reader.task, 30)  # the job still runs; the stream does not
    assert "end" not in reader.names()


async def test_a_discarded_job_ends_the_stream(store):
    job_id = store.create(finetune_spec("clf"))["id"]
    reader = Reader(store, job_id)
    await reader.until(lambda ev: len(ev) >= 2)
    assert store.discard_unclaimed(job_id, "the broker could not be reached")
    await asyncio.wait_for(reader.task, 30)
    assert reader.events[-1] == ("end", {"state": None})


def test_metrics_tail_reads_only_whole_new_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == (False, [])  # no file yet
    path.write_text('{"step": 1}\n{"step"')
    assert tail.read() == (False, [{"step": 1}])
    append_text(path, ': 2}\nnot json\n{"step": 3}\n')
    assert tail.read() == (False, [{"step": 2}, {"step": 3}])
    path.write_text('{"step": 1}\n')  # shorter than what was read: rewritten in place
    assert tail.read() == (True, [{"step": 1}])


def sse_ids(text: str) -> list[str | None]:
    """The `id` of each metrics event."""
    return [
        dict(line.split(": ", 1) for line in block.splitlines()).get("id")
        for block in text.split("\n\n")
        if block.startswith("event: metrics")
    ]


def test_since_and_last_event_id_start_the_curve_at_a_step(store):
    job_id = store.create(finetune_spec("clf"))["id"]
    for step in range(1, 11):
        store.append_metric(job_id, train(step))
    store.append_metric(job_id, {"type": "eval", "step": 10, "accuracy": 0.5})
    set_state(store, job_id, "succeeded", step=10)
    with make_client(store.data_dir) as client:
        whole = client.get(f"/jobs/{job_id}/events").text
        assert sse_ids(whole) == [str(step) for step in range(1, 11)] + ["10"]
        since = client.get(f"/jobs/{job_id}/events", params={"since": 8}).text
        assert [data for name, data in parse_sse(since) if name == "metrics"] == store.metrics(job_id)[7:]
        resumed = client.get(f"/jobs/{job_id}/events", headers={"Last-Event-ID": "10"}).text
        assert [data for name, data in parse_sse(resumed) if name == "metrics"] == store.metrics(job_id)[9:]
        assert [name for name, _ in parse_sse(resumed)][-1] == "end"
        assert client.get(f"/jobs/{job_id}/events", params={"since": -1}).status_code == 422


def test_an_overlong_metrics_line_is_skipped_without_being_buffered(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    path.write_text('{"step": 1}\n')
    assert tail.read() == (False, [{"step": 1}])
    for _ in range(12):  # an unterminated line of 12 x 256 KiB, growing while it is read
        append_text(path, "x" * (1 << 18))
        assert tail.read() == (False, []) and len(tail.partial) <= MAX_LINE
    append_text(path, 'x"}\n{"step": 2}\n{"step": 3')
    assert tail.read() == (False, [{"step": 2}])
    append_text(path, "}\n")
    assert tail.read() == (False, [{"step": 3}])


async def test_a_stream_ends_at_its_lifetime_without_an_end_event(store):
    job_id = store.create(finetune_spec("clf"))["id"]
    set_state(store, job_id, "running")

    async def never():
        return False

    started = time.monotonic()
    chunks = [chunk async for chunk in job_events(store, job_id, never, poll_s=0.01, max_seconds=0.3)]
    assert time.monotonic() - started >= 0.3
    assert "end" not in [name for c in chunks for name, _ in parse_sse(c)]
    assert chunks[-1].startswith(": the stream has reached its lifetime (BERT_EVENT_STREAM_MAX_SECONDS)")


async def test_a_long_curve_is_replayed_in_paced_pieces(store, monkeypatch):
    monkeypatch.setattr(job_events_module, "MAX_READ", 1024)
    job_id = store.create(finetune_spec("clf"))["id"]
    for step in range(1, 201):
        store.append_metric(job_id, train(step))
    set_state(store, job_id, "succeeded", step=200)

    async def never():
        return False

    chunks = [chunk async for chunk in job_events(store, job_id, never, poll_s=0.01)]
    events = [e for c in chunks for e in parse_sse(c)]
    assert [data for name, data in events if name == "metrics"] == store.metrics(job_id)
    assert len(chunks) > 10 and max(map(len, chunks)) < 4096  # many pieces, none larger than a read


@pytest.mark.slow
def test_streams_are_capped_per_job_and_in_all_over_a_real_server(tmp_path):
    store = JobRecords(make_data_dir(tmp_path / "data"))
    jobs = [store.create(finetune_spec(f"clf{i}"))["id"] for i in range(3)]
    for job_id in jobs:
        set_state(store, job_id, "running")
    server, url = start_server(
        store.data_dir, NO_BROKER, tmp_path, BERT_MAX_EVENT_STREAMS="2", BERT_MAX_EVENT_STREAMS_PER_JOB="1"
    )
    try:
        with (
            httpx.Client(base_url=url, timeout=10) as a,
            httpx.Client(base_url=url, timeout=10) as b,
            httpx.Client(base_url=url, timeout=10) as c,
        ):
            with a.stream("GET", f"/jobs/{jobs[0]}/events") as first:
                events = first.iter_text()  # kept: dropping the iterator would close the connection
                assert first.status_code == 200 and "event: progress" in next(events)
                r = b.get(f"/jobs/{jobs[0]}/events")
                assert (r.status_code, r.headers["retry-after"], r.json()) == (
                    429,
                    "1",
                    {
                        "error": f"job '{jobs[0]}' has 1 event streams open, the most this service allows for one job "
                        "(BERT_MAX_EVENT_STREAMS_PER_JOB); retry later",
                        "error_type": "overloaded",
                    },
                )
                with b.stream("GET", f"/jobs/{jobs[1]}/events") as second:
                    assert second.status_code == 200
                    r = c.get(f"/jobs/{jobs[2]}/events")
                    assert (r.status_code, r.json()["error"]) == (
                        429,
                        "2 event streams are open, the most this service allows (BERT_MAX_EVENT_STREAMS); retry later",
                    )
            deadline = time.monotonic() + 60  # the closed streams' slots come back once the server sees them go
            while True:
                with c.stream("GET", f"/jobs/{jobs[2]}/events") as again:
                    if again.status_code == 200:
                        break
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        server.stop()


def test_a_key_holds_at_most_its_share_of_the_event_streams(store, tmp_path):
    """BERT_MAX_EVENT_STREAMS_PER_KEY (unset: a quarter of BERT_MAX_EVENT_STREAMS): one key's streams past
    it are a 429 naming the key and the limit, while another key still gets its own."""
    streams = EventStreams(total=8, per_job=4, per_key=2)
    first = streams.open("job-1", "alice")
    streams.open("job-2", "alice")
    with pytest.raises(ServiceError) as e:
        streams.open("job-3", "alice")
    assert (e.value.status_code, e.value.message) == (
        429,
        "key 'alice' has 2 event streams open, its limit (BERT_MAX_EVENT_STREAMS_PER_KEY); close one or retry later",
    )
    streams.open("job-3", "bob")
    first()
    streams.open("job-3", "alice")  # a closed stream gives the key its slot back
    assert Settings(data_dir=tmp_path, max_event_streams=64).event_streams_per_key() == 16

    secrets = {"alice": new_secret(), "bob": new_secret()}
    write_keys(tmp_path / "keys.toml", {n: Key(n, hash_secret(s), frozenset({"jobs"})) for n, s in secrets.items()})
    jobs = {n: store.create({**finetune_spec(f"clf-{n}"), "owner": n})["id"] for n in secrets}
    for job_id in jobs.values():
        set_state(store, job_id, "succeeded", step=1)
    with make_client(store.data_dir, keys_file=tmp_path / "keys.toml", max_event_streams=8) as client:
        assert client.get("/jobs", headers={"Authorization": f"Bearer {secrets['alice']}"}).status_code == 200
        held = [client.app.state.jobs.event_streams.open(jobs["alice"], "alice") for _ in range(2)]  # as if open
        r = client.get(f"/jobs/{jobs['alice']}/events", headers={"Authorization": f"Bearer {secrets['alice']}"})
        assert (r.status_code, r.headers["retry-after"], r.json()) == (
            429,
            "1",
            {
                "error": "key 'alice' has 2 event streams open, its limit (BERT_MAX_EVENT_STREAMS_PER_KEY); "
                "close one or retry later",
                "error_type": "overloaded",
            },
        )
        r = client.get(f"/jobs/{jobs['bob']}/events", headers={"Authorization": f"Bearer {secrets['bob']}"})
        assert r.status_code == 200 and parse_sse(r.text)[-1] == ("end", {"state": "succeeded"})
        held[0]()
        r = client.get(f"/jobs/{jobs['alice']}/events", headers={"Authorization": f"Bearer {secrets['alice']}"})
        assert r.status_code == 200
