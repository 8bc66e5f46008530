"""Batch inference with OpenAI's own client against a real uvicorn: files.create, batches.create, poll to
completed, and the output equals the online route's answers line for line; bad lines land in the error
file; cancel; and a server killed (-9) twice mid-batch still yields every line exactly once."""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import numpy as np
import pytest

from app.serving.batch_lines import CheckedLines
from model.modeling import BertForPreTraining, BertModel
from tests.app.conftest import WORDS, save_tiny
from tests.helpers import start_server, wait_for

openai = pytest.importorskip("openai")
KEY = "batch-client-key-0123456789"
NO_BROKER = "redis://127.0.0.1:1/0"  # nothing listens there: batches need no worker


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("batches")
    save_tiny(root / "models" / "tiny", BertModel, seed=1)
    save_tiny(root / "models" / "tiny-pt", BertForPreTraining, seed=2)
    server, url = start_server(
        root,
        NO_BROKER,
        root,
        BERT_API_KEY=KEY,
        BERT_BATCH_CHUNK_LINES="4",
        BERT_BATCH_CONCURRENCY="1",
        BERT_BATCH_MAX_LINES="3000",
        BERT_BATCH_MAX_FILE_BYTES="1000000",
    )
    try:
        yield url, root
    finally:
        server.stop()


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def jsonl(rows: list) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def line(custom_id: str, body: dict, url: str = "/v1/embeddings") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def texts(n: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 5)) for i in range(n)]


def run_batch(c, rows: list, endpoint: str = "/v1/embeddings"):
    upload = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")
    return upload, wait_batch(c, batch.id)


def wait_batch(c, batch_id: str, statuses=("completed", "failed", "cancelled")):
    return wait_for(lambda: (b := c.batches.retrieve(batch_id)).status in statuses and b, 30, f"batch {batch_id}")


def content(c, file_id: str) -> list[dict]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def test_batch_answers_equal_the_online_routes(served):
    url, _ = served
    c = client(url)
    inputs = texts(10)
    rows = [line(f"r{i}", {"model": "tiny", "input": t, "encoding_format": "float"}) for i, t in enumerate(inputs)]
    upload, batch = run_batch(c, rows)
    assert upload.purpose == "batch" and upload.bytes == len(jsonl(rows)) and upload.filename == "in.jsonl"
    assert (batch.status, batch.request_counts.total, batch.request_counts.completed) == ("completed", 10, 10)
    assert batch.error_file_id is None and batch.completed_at >= batch.in_progress_at >= batch.created_at
    out = content(c, batch.output_file_id)
    online = [
        httpx.post(f"{url}/v1/embeddings", json=r["body"], headers={"Authorization": f"Bearer {KEY}"}).content
        for r in rows
    ]
    assert [o["custom_id"] for o in out] == [r["custom_id"] for r in rows]
    assert [o["response"]["body"] for o in out] == [json.loads(body) for body in online]  # the same floats
    raw = c.files.content(batch.output_file_id).content.splitlines()
    assert all(b'"body": ' + body + b"}" in line for body, line in zip(online, raw))  # the route's very bytes
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in out)
    # our own route, through the same pipeline: /fill-mask on the pretraining model
    masked = [
        line(f"m{i}", {"inputs": f"{t} [MASK]", "model": "tiny-pt"}, "/fill-mask") for i, t in enumerate(inputs[:4])
    ]
    _, batch = run_batch(c, masked, "/fill-mask")
    online = [
        httpx.post(f"{url}/fill-mask", json=r["body"], headers={"Authorization": f"Bearer {KEY}"}).json()
        for r in masked
    ]
    assert [o["response"]["body"] for o in content(c, batch.output_file_id)] == online
    assert c.batches.retrieve(batch.id).id in [b.id for b in c.batches.list().data]
    job = httpx.get(f"{url}/jobs/{batch.id}", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert (job["kind"], job["state"], job["step"], job["total_steps"]) == ("batch", "succeeded", 4, 4)


def test_bad_lines_go_to_the_error_file(served):
    url, _ = served
    c = client(url)
    good = {"model": "tiny", "input": "the cat"}
    rows = [
        line("a", good),
        b"{not json",
        {"method": "POST", "url": "/v1/embeddings", "body": good},
        line("a", good),
        line("b", good, url="/embeddings"),
        line("c", {"model": "tiny"}),
        line("d", {"model": "nope", "input": "x"}),
        line("e", good),
    ]
    _, batch = run_batch(c, rows)
    assert (batch.status, batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        "completed",
        8,
        2,
        6,
    )
    assert [o["custom_id"] for o in content(c, batch.output_file_id)] == ["a", "e"]
    errors = content(c, batch.error_file_id)
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [
        (None, None, "invalid_json"),
        (None, None, "missing_custom_id"),
        ("a", None, "duplicate_custom_id"),
        ("b", None, "mismatched_url"),
        ("c", None, "invalid_body"),
        ("d", None, "not_found"),
    ]
    assert errors[0]["error"]["message"] == "line 2 is not valid JSON"
    assert errors[4]["error"]["message"] == "line 6: body: input: Field required"
    assert errors[5]["error"]["message"].startswith("model 'nope' not found")


def test_a_misspelled_field_of_a_line_is_named_with_the_field_it_looks_like(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([line("a", {"inputs": "the [MASK]", "topk": 3}, url="/fill-mask")]))
    checked = CheckedLines.scan(path, "/fill-mask", 10_000)
    assert [(n, line.error) for n, line in checked.errors.items()] == [
        (0, ("invalid_body", "line 1: body: topk: Extra inputs are not permitted (did you mean 'top_k'?)"))
    ]


def test_file_routes_and_refusals(served):
    url, _ = served
    c = client(url)
    upload = c.files.create(file=("x.jsonl", io.BytesIO(jsonl([line("a", {"input": "x"})]))), purpose="batch")
    assert c.files.retrieve(upload.id).bytes == upload.bytes
    assert upload.id in [f.id for f in c.files.list().data]
    with pytest.raises(openai.NotFoundError) as e:
        c.batches.create(input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body == {
        "message": "no file 'file-nope'",
        "type": "invalid_request_error",
        "param": None,
        "code": "file_not_found",
    }
    with pytest.raises(openai.UnprocessableEntityError):
        c.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert c.files.delete(upload.id).deleted is True
    with pytest.raises(openai.NotFoundError) as e:
        c.files.retrieve(upload.id)
    assert e.value.code == "file_not_found"
    empty = c.files.create(file=("e.jsonl", io.BytesIO(b"\n")), purpose="batch")
    with pytest.raises(openai.UnprocessableEntityError) as e:
        c.batches.create(input_file_id=empty.id, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body["message"] == f"file '{empty.id}' holds no requests"
    over = [line(f"r{i}", {"input": "x"}) for i in range(3001)]
    upload = c.files.create(file=("over.jsonl", io.BytesIO(jsonl(over))), purpose="batch")
    with pytest.raises(openai.APIStatusError) as e:
        c.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.status_code == 413
    assert e.value.body["message"] == "the file holds more than 3000 requests (BERT_BATCH_MAX_LINES)"
    with pytest.raises(openai.APIStatusError) as e:
        c.files.create(file=("big.jsonl", io.BytesIO(b"x" * 1_100_000)), purpose="batch")
    assert e.value.status_code == 413
    assert e.value.body["message"] == "file is larger than the limit of 1000000 bytes (BERT_BATCH_MAX_FILE_BYTES)"
    with pytest.raises(openai.AuthenticationError):  # the admin key's rule; without one, the API key opens it
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).batches.list()
    ids = [run_batch(c, [line("a", {"model": "tiny", "input": "x"})])[1].id for _ in range(2)]
    listed = [b.id for b in c.batches.list(limit=100).data]  # newest first: ids sort by creation time
    assert listed == sorted(listed, reverse=True) and set(ids) <= set(listed)
    first = c.batches.list(limit=1)
    assert [b.id for b in first.data] == listed[:1] and first.has_more
    assert [b.id for b in c.batches.list(limit=1, after=listed[0]).data] == listed[1:2]
    r = httpx.post(
        f"{url}/v1/files",
        files={"file": ("a.jsonl", b"{}")},
        data={"purpose": "fine-tune"},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert (
        r.status_code == 422 and r.json()["error"]["message"] == "purpose: 'fine-tune' is not supported; send 'batch'"
    )


def test_cancel_mid_run_keeps_the_output_so_far(served):
    url, _ = served
    c = client(url)
    rows = [line(f"r{i}", {"model": "tiny", "input": t}) for i, t in enumerate(texts(3000))]
    upload = c.files.create(file=("big.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    wait_for(lambda: c.batches.retrieve(batch.id).request_counts.completed > 0, 30, "first chunk")
    assert c.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_batch(c, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    out = content(c, done.output_file_id)
    assert 0 < len(out) == done.request_counts.completed < 3000
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(len(out))]
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(batch.id)


@pytest.mark.slow
def test_kill_9_twice_mid_batch_loses_and_repeats_nothing(tmp_path):
    save_tiny(tmp_path / "models" / "tiny", BertModel, seed=1)
    rows = [line(f"r{i}", {"model": "tiny", "input": t, "encoding_format": "float"}) for i, t in enumerate(texts(1600))]
    env = {"BERT_BATCH_CHUNK_LINES": "50", "BERT_BATCH_CONCURRENCY": "1"}  # one line a pass: answers exact
    server, url = start_server(tmp_path, NO_BROKER, tmp_path, **env)
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    upload = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    try:
        for _ in range(2):
            seen = c.batches.retrieve(batch.id).request_counts.completed
            wait_for(
                lambda s=seen, c=c: c.batches.retrieve(batch.id).request_counts.completed > s + 100, 30, "progress"
            )
            server.kill()  # SIGKILL, mid-chunk
            server, url = start_server(tmp_path, NO_BROKER, tmp_path, **env)
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        done = wait_batch(c, batch.id)
        assert (done.status, done.request_counts.completed) == ("completed", 1600)
        out = content(c, done.output_file_id)
        job = httpx.get(f"{url}/jobs/{batch.id}").json()
        assert job["attempts"] == 3
        again = c.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
        reference = content(c, wait_batch(c, again.id).output_file_id)
    finally:
        server.stop()
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(1600)]
    assert [o["response"]["body"] for o in out] == [o["response"]["body"] for o in reference]


@pytest.mark.slow
def test_a_stopping_api_hands_its_batch_back_and_the_next_start_finishes_it(tmp_path):
    save_tiny(tmp_path / "models" / "tiny", BertModel, seed=1)
    env = {"BERT_BATCH_CHUNK_LINES": "50", "BERT_BATCH_CONCURRENCY": "1"}
    server, url = start_server(tmp_path, NO_BROKER, tmp_path, **env)
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    rows = [line(f"r{i}", {"model": "tiny", "input": t}) for i, t in enumerate(texts(600))]
    upload = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    wait_for(lambda: c.batches.retrieve(batch.id).request_counts.completed > 0, 30, "first chunk")
    server.stop()  # SIGTERM: the lifespan stops the batch before the engine
    assert json.loads((tmp_path / "jobs" / batch.id / "job.json").read_text())["state"] == "queued"
    server, url = start_server(tmp_path, NO_BROKER, tmp_path, **env)
    try:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        done = wait_batch(c, batch.id)
        out = content(c, done.output_file_id)
        job = httpx.get(f"{url}/jobs/{batch.id}").json()
    finally:
        server.stop()
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 600, 0)
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(600)]
    events = [e["event"] for e in job["events"]]
    assert events == ["created", "enqueued", "started", "handed back", "started", "succeeded"]
    assert job["attempts"] == 1  # a hand-back is not a failed attempt


def test_timestamps_are_unix_seconds():
    from app.serving.batch_jobs import unix

    assert unix("2026-01-31T12:00:00.123Z") == 1769860800 and unix(None) is None
    assert time.time() > unix("2026-01-31T12:00:00.000Z")


def test_a_new_attempt_cuts_what_the_killed_one_wrote_past_its_last_commit(tmp_path):
    """The window a kill -9 rarely hits (after a chunk's write, before its count): forced here."""
    from types import SimpleNamespace

    from app.schemas.openai_batches import CreateBatchRequest
    from app.serving.batch_jobs import ERRORS, OUTPUT, Batches
    from datadir import jobs as transitions
    from datadir import runner
    from tests.app.conftest import settings_for

    batches = Batches(SimpleNamespace(settings=settings_for(tmp_path)))
    (tmp_path / "in").write_bytes(jsonl([line("a", {"input": "x"}), line("b", {"input": "y"})]))
    upload = batches.files.add(tmp_path / "in", "in.jsonl", "batch")
    req = CreateBatchRequest(input_file_id=upload["id"], endpoint="/v1/embeddings", completion_window="24h")
    job_id = batches.create(req)[0]["id"]  # (record, checked lines)
    job_dir = batches.records.job_dir(job_id)
    batches.records.move(job_id, transitions.start, "a killed process")
    batches._commit(job_id, [(True, b'{"custom_id": "a"}\n')])
    committed = (job_dir / OUTPUT).read_bytes()
    with open(job_dir / OUTPUT, "ab") as f:
        f.write(b'{"custom_id": "b"}\n{"custom_id": "c", "to')  # the next chunk, written but never counted
    with open(job_dir / ERRORS, "ab") as f:
        f.write(b'{"custom_id": "d"}\n')
    attempt = runner.Attempt(batches.records, job_id)
    assert attempt.take() and attempt.begin() == "run"
    batches._prepare(attempt)
    attempt.release()
    assert (job_dir / OUTPUT).read_bytes() == committed == b'{"custom_id": "a"}\n'
    assert (job_dir / ERRORS).read_bytes() == b""
    record = batches.records.read(job_id)
    assert (record["state"], record["attempts"], record["progress"]["step"]) == ("running", 2, 1)
    assert [e["event"] for e in record["events"]][-2:] == ["attempt did not finish", "started"]


def test_a_batch_past_its_completion_window_expires_with_the_answers_it_has(tmp_path):
    """24 hours after it was created (here: its record back-dated, as after a day with the API down) a
    batch runs no more lines: those answered stay in the output, every other line is in the error file
    as batch_expired, each custom_id exactly once, and the batch is "expired"."""
    import asyncio
    import datetime as dt
    from types import SimpleNamespace

    from app.schemas.openai_batches import CreateBatchRequest
    from app.serving.batch_jobs import Batches, batch_view
    from datadir import jobs as transitions
    from tests.app.conftest import settings_for

    batches = Batches(SimpleNamespace(settings=settings_for(tmp_path)))  # no engine: nothing may run
    rows = [line(f"r{i}", {"input": "x"}) for i in range(5)] + [b"not json"]
    (tmp_path / "in").write_bytes(jsonl(rows))
    upload = batches.files.add(tmp_path / "in", "in.jsonl", "batch")
    req = CreateBatchRequest(input_file_id=upload["id"], endpoint="/v1/embeddings", completion_window="24h")
    job_id = batches.create(req)[0]["id"]  # (record, checked lines)
    batches.records.move(job_id, transitions.start, "an attempt that answered two lines, then the API went down")
    batches._commit(job_id, [(True, b'{"custom_id": "r0"}\n'), (True, b'{"custom_id": "r1"}\n')])
    batches.records.move(job_id, transitions.hand_back, "the API is stopping")
    a_day_ago = (dt.datetime.now(dt.UTC) - dt.timedelta(hours=24, seconds=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    batches.records.update(job_id, lambda r: r.__setitem__("created_at", a_day_ago))

    asyncio.run(batches.run(job_id))

    record = batches.records.read(job_id)
    view = batch_view(record)
    assert (view["status"], view["request_counts"]) == ("expired", {"total": 6, "completed": 2, "failed": 4})
    assert view["expired_at"] is not None and view["failed_at"] is None and view["errors"] is None
    assert view["expires_at"] == view["created_at"] + 24 * 3600
    assert record["state"] == "failed" and "completion window (24h)" in record["error"]
    out = [json.loads(x) for x in batches.files.content(view["output_file_id"]).read_text().splitlines()]
    errors = [json.loads(x) for x in batches.files.content(view["error_file_id"]).read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["r0", "r1"]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("r2", "batch_expired"),
        ("r3", "batch_expired"),
        ("r4", "batch_expired"),
        (None, "batch_expired"),  # a bad line not yet reached says so too: the window ended first
    ]


@pytest.mark.anyio
async def test_lines_run_together_answer_each_as_its_route(tmp_path):
    """A chunk's lines run by one pipeline call (BERT_BATCH_CONCURRENCY >= BERT_BATCH_CHUNK_LINES), models
    and options mixed: each answer is its route's (usage exact; the vectors to float32 rounding, as their
    rows share forward passes with other lines', as concurrent online requests do), and each failing line
    fails alone, in its place, with its route's message."""
    import anyio

    from tests.app.conftest import serve_app, settings_for

    save_tiny(tmp_path / "models" / "tiny", BertModel, seed=1)
    save_tiny(tmp_path / "models" / "tiny-pt", BertForPreTraining, seed=2)
    long = " ".join(["cat"] * 40)  # 42 tokens: the tiny models take 32
    bodies = [
        {"model": "tiny", "input": "the cat"},
        {"model": "tiny-pt", "input": ["a dog", "the quick brown fox"]},
        {"model": "tiny", "input": long},
        {"model": "tiny", "input": "red car", "dimensions": 8},
        {"model": "nope", "input": "x"},
        {"model": "tiny", "input": long, "long_inputs": "chunk"},
        {"model": "tiny", "input": ["sky", "big sky"], "encoding_format": "base64"},
        {"model": "tiny", "input": "sky", "dimensions": 999},
        {"input": "the dog ran"},
        {"model": "tiny", "input": long, "long_inputs": "truncate"},
        {"model": "tiny-pt", "input": "the cat"},
    ]
    rows = [line(f"r{i}", body) for i, body in enumerate(bodies)]
    settings = settings_for(tmp_path, default_model="tiny", batch_chunk_lines=8, batch_concurrency=64)
    async with serve_app(settings) as c:
        online = [await c.post("/v1/embeddings", json=body) for body in bodies]
        upload = await c.post("/v1/files", files={"file": ("in.jsonl", jsonl(rows))}, data={"purpose": "batch"})
        body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}
        batch = (await c.post("/v1/batches", json=body)).json()
        with anyio.fail_after(30):
            while (batch := (await c.get(f"/v1/batches/{batch['id']}")).json())["status"] != "completed":
                await anyio.sleep(0.05)
        out = [
            json.loads(x) for x in (await c.get(f"/v1/files/{batch['output_file_id']}/content")).content.splitlines()
        ]
        errors = [
            json.loads(x) for x in (await c.get(f"/v1/files/{batch['error_file_id']}/content")).content.splitlines()
        ]
    assert [r.status_code for r in online] == [200, 200, 422, 200, 404, 200, 200, 422, 200, 200, 200]
    answered = [(f"r{i}", r.json()) for i, r in enumerate(online) if r.status_code == 200]
    assert [o["custom_id"] for o in out] == [custom_id for custom_id, _ in answered]
    for (_, expected), got in zip(answered, [o["response"]["body"] for o in out]):
        for g, e in zip(got["data"], expected["data"]):
            assert np.allclose(vector(g["embedding"]), vector(e["embedding"]), rtol=0, atol=1e-6)
        for d in got["data"] + expected["data"]:
            del d["embedding"]
        assert got == expected  # usage, model, indices
    failed = [(f"r{i}", r.json()["error"]["message"]) for i, r in enumerate(online) if r.status_code != 200]
    assert [(e["custom_id"], e["error"]["message"]) for e in errors] == failed
    assert [e["error"]["code"] for e in errors] == ["validation", "not_found", "validation"]


def vector(embedding: list[float] | str) -> list[float]:
    """An embedding as floats, from OpenAI's base64 (little-endian float32) too."""
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4").tolist()
    return embedding


def test_a_batch_holds_its_lines_in_flight_not_its_whole_file(tmp_path):
    """CheckedLines keeps offsets, errors and counts; lines are parsed again from the file a slice at a time,
    the same as the check saw them, and only the first `keep` parsed lines are held from the check."""
    from app.serving.batch_lines import CheckedLines

    rows = [line(f"r{i}", {"input": f"text {i}", "model": "m1" if i % 3 else "m2"}) for i in range(40)]
    rows[7] = b"not json"
    rows[9] = line("r1", {"input": "a duplicate custom_id"})
    (tmp_path / "in").write_bytes(jsonl(rows) + b"\n\n")
    checked = CheckedLines.scan(tmp_path / "in", "/v1/embeddings", 10_000, keep=4)
    assert len(checked) == 40 and len(checked._kept) == 4
    assert {i: e.error[0] for i, e in checked.errors.items()} == {7: "invalid_json", 9: "duplicate_custom_id"}
    assert checked.models == {"m1": 25, "m2": 13}
    checked.refused = {"m2": "model 'm2' is not this key's to use"}
    assert checked.invalid == 2 + 13
    whole = CheckedLines.scan(tmp_path / "in", "/v1/embeddings", 10_000, keep=None)
    whole.refused = checked.refused
    for part in (slice(0, 8), slice(8, 30), slice(30, 40)):
        again, first = checked[part], whole[part]
        assert [(x.index, x.custom_id, x.error, x.request) for x in again] == [
            (x.index, x.custom_id, x.error, x.request) for x in first
        ]
    assert checked._kept == {} and checked[0:1][0].error == ("forbidden", "line 1: model 'm2' is not this key's to use")
