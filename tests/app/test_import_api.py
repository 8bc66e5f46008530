"""POST /models: imports from the (fake) Hub and from uploaded archives, run by the API as job records of
kind "import"; their lease, resume at start, cancel, 409, and the worker's sweep leaving them alone."""

from __future__ import annotations

import io
import pickle
import tarfile

import pytest
import torch
from safetensors.torch import load_file

from app.jobs.imports import ImportCancelled, Imports
from datadir import JobRecords
from datadir import jobs as transitions
from datadir.cards import read_card
from model.sources import valid_revision
from tests import hub_server as H
from tests.app.conftest import serve_app, settings_for
from tests.helpers import free_port
from tests.model.test_sources import MODEL_INSTEAD

pytestmark = pytest.mark.anyio


def spec(name: str, repo: str = H.TINY_REPO) -> dict:
    source = {"kind": "hub", "repo": repo, "revision": None}
    return {"kind": "import", "model_name": name, "base_model": None, "dataset": None, "params": {}, "source": source}


def settings(tmp_path, **overrides):
    return settings_for(tmp_path / "data", default_model=None, load="lazy", **overrides)


async def finished(client, job_id: str) -> dict:
    client.app.state.imports.wait(timeout=60)
    return (await client.get(f"/jobs/{job_id}")).json()


async def test_import_from_the_hub(hub, hub_env, tmp_path):
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        r = await client.post("/models", json={"name": "tiny", "source": H.TINY_REPO, "revision": "v2"})
        assert r.status_code == 202, r.text
        job = r.json()
        assert (job["kind"], job["model_name"], job["dataset"]) == ("import", "tiny", None)
        assert job["params"] == {"source": H.TINY_REPO, "revision": "v2"}
        assert r.headers["location"] == f"/jobs/{job['id']}"
        done = await finished(client, job["id"])
        assert done["state"] == "succeeded", done["error"]
        assert done["downloaded_bytes"] == done["total_bytes"] > 0
        sha = hub.repos[H.TINY_REPO].refs["v2"]
        assert done["result"]["model"] == "tiny" and done["result"]["version"] == 1
        assert done["result"]["source"] == {
            "kind": "hub",
            "repo": H.TINY_REPO,
            "revision": "v2",
            "sha": sha,
            "license": "apache-2.0",
        }
        assert [e["event"] for e in done["events"]] == ["created", "started", "succeeded"]
        assert (await client.get("/models/tiny")).json()["architecture"] == "BertForPreTraining"
        assert (await client.post("/fill-mask", json={"model": "tiny", "inputs": "the [MASK] sat"})).status_code == 200


async def test_failures_are_in_the_record(hub, hub_env, tmp_path):
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        job = (await client.post("/models", json={"name": "g", "source": H.GATED_REPO})).json()
        done = await finished(client, job["id"])
        assert done["state"] == "failed"
        assert done["error"] == (
            f"{H.GATED_REPO} is a gated repo: accept its terms on the Hub, then set HF_TOKEN to a token with access"
        )
        assert not (tmp_path / "data" / "models" / "g").exists()


async def test_an_unreachable_hub_fails_the_import_naming_what_to_do_instead(hub_env, tmp_path, monkeypatch):
    from huggingface_hub import constants

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        job = (await client.post("/models", json={"name": "t", "source": H.TINY_REPO})).json()
        done = await finished(client, job["id"])
    assert (done["state"], done["error"]) == (
        "failed",
        f"cannot reach the Hub at {dead} for {H.TINY_REPO}: ConnectError: [Errno 111] Connection refused; "
        f"{MODEL_INSTEAD}, or set HF_ENDPOINT to a Hub mirror this machine can reach",
    )


@pytest.mark.parametrize(
    "body, message",
    [
        ({"name": "x", "source": "/etc/passwd"}, "source: String should match pattern"),
        ({"name": "x", "source": "../models/x"}, "source: String should match pattern"),
        ({"name": "tmp1", "source": H.TINY_REPO}, None),
        ({"name": "x", "source": H.TINY_REPO, "path": "/data"}, "path: Extra inputs are not permitted"),
        (
            {"name": "x", "sorce": H.TINY_REPO},
            "source: Field required; sorce: Extra inputs are not permitted (did you mean 'source'?)",
        ),
    ],
)
async def test_bad_requests(hub_env, tmp_path, body, message):
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        r = await client.post("/models", json=body)
        assert r.status_code == 422
        assert r.json()["error_type"] == "validation"
        if message:
            assert message in r.json()["error"]
        assert not (tmp_path / "data" / "jobs").exists() or not list((tmp_path / "data" / "jobs").iterdir())


@pytest.mark.parametrize("revision", ["../../x", "main/../x", "..", "/main", "a//b", "main/", "main\n", "x" * 201])
async def test_a_revision_is_a_plain_branch_tag_or_commit(hub_env, tmp_path, revision):
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        r = await client.post("/models", json={"name": "x", "source": H.TINY_REPO, "revision": revision})
    assert (r.status_code, r.json()) == (
        422,
        {
            "error": "revision: must be a branch, tag or commit: 1-200 letters, digits, '.', '_', '-' or '/', starting "
            "with a letter or digit, without '..' or '//', and not ending in '/'",
            "error_type": "validation",
        },
    )
    assert not (tmp_path / "data" / "jobs").exists() or not list((tmp_path / "data" / "jobs").iterdir())
    assert valid_revision("refs/pr/1") and valid_revision("v1.0") and valid_revision("a1b2c3d" * 5)


async def test_a_name_being_imported_is_a_conflict(hub_env, tmp_path):
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        record = JobRecords(tmp_path / "data").create(spec("busy"))  # queued, and no thread runs it
        r = await client.post("/models", json={"name": "busy", "source": H.TINY_REPO})
        assert r.status_code == 409
        assert r.json() == {"error": f"model 'busy' is being imported by job {record['id']}", "error_type": "conflict"}


async def test_unfinished_imports_resume_at_start(hub, hub_env, tmp_path):
    store = JobRecords(tmp_path / "data")
    queued = store.create(spec("later"))
    running = store.create(spec("again", H.BIN_REPO))
    store.move(running["id"], transitions.start, "a-dead-api:1")  # its process died: the lease is free
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        for job_id, name in ((queued["id"], "later"), (running["id"], "again")):
            done = await finished(client, job_id)
            assert done["state"] == "succeeded", done["error"]
            assert done["result"]["model"] == name
        assert done["attempts"] == 2
        assert "attempt did not finish" in [e["event"] for e in done["events"]]


def _archive(tmp_path) -> bytes:
    model = H.tiny_model_dir(tmp_path, 0)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(model, arcname="tiny")
    return buf.getvalue()


async def test_archive_upload(hub_env, tmp_path):
    body = _archive(tmp_path)
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        r = await client.post("/models", files={"file": ("my-bert.tar.gz", body)}, data={"name": "up"})
        assert r.status_code == 202, r.text
        done = await finished(client, r.json()["id"])
        assert done["state"] == "succeeded", done["error"]
        version = tmp_path / "data" / "models" / "up"
        assert read_card(done["result"]["path"])["source"] == {"kind": "archive", "file": "my-bert.tar.gz"}
        got = load_file(next(version.rglob("model.safetensors")))
        want = load_file(tmp_path / "tiny-0" / "model.safetensors")
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert not list((tmp_path / "data" / "jobs" / done["id"]).glob("upload*"))  # removed once imported


def _tar_of(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _Code:  # pickles as a call: what torch.load(weights_only=True) refuses
    def __reduce__(self):
        return (print, ("unpickled",))


async def test_a_failed_import_names_no_server_path(hub_env, tmp_path):
    """The record's error names the archive and places in DATA_DIR, never an absolute path on the server
    (the job's directory, the import's temp folder, DATA_DIR)."""
    model = H.tiny_model_dir(tmp_path, 0)
    files = {"config.json": (model / "config.json").read_bytes(), "vocab.txt": (model / "vocab.txt").read_bytes()}
    archives = {
        "no-weights": _tar_of(files),
        "pickled": _tar_of({**files, "pytorch_model.bin": pickle.dumps(_Code(), protocol=2)}),
        "taken": _archive(tmp_path),
    }
    (tmp_path / "data" / "models" / "taken").mkdir(parents=True)
    (tmp_path / "data" / "models" / "taken" / "notes.txt").write_text("not a model")
    errors = {}
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        for name, body in archives.items():
            r = await client.post("/models", files={"file": ("my-bert.tar.gz", body)}, data={"name": name})
            assert r.status_code == 202, r.text
            done = await finished(client, r.json()["id"])
            errors[name] = (done["state"], done["error"])
    assert errors["no-weights"] == ("failed", "no model.safetensors or pytorch_model.bin in my-bert.tar.gz")
    assert errors["pickled"] == (  # refused on its size, before it is unpickled
        "failed",
        "pytorch_model.bin is 0.0 KB (46 bytes), but a BERT of config.json's sizes takes 36,372 to 4,288,456 bytes",
    )
    assert errors["taken"] == (
        "failed",
        "models/taken in the data directory holds something that is not a model (no config.json, no v<N>/ "
        "versions); nothing was imported",
    )
    assert not [e for _, e in errors.values() if str(tmp_path) in e or "/tmp" in e]


@pytest.mark.parametrize(
    "filename, status, error",
    [
        ("model.tar.gz", 413, "archive is larger than the limit of 1000 bytes (BERT_MAX_MODEL_UPLOAD_BYTES)"),
        ("model.rar", 422, "file 'model.rar': expected a .tar, .tar.gz, .tgz, .zip archive"),
    ],
)
async def test_archive_refusals(hub_env, tmp_path, filename, status, error):
    async with serve_app(settings(tmp_path, max_model_upload_bytes=1000), wait_ready=False) as client:
        r = await client.post("/models", files={"file": (filename, b"x" * 5000)}, data={"name": "up"})
        assert r.status_code == status
        assert r.json()["error"] == error
        assert not list((tmp_path / "data" / "datasets").glob(".tmp-*"))


async def test_post_models_needs_the_admin_key(hub_env, tmp_path):
    keys = {"api_key": "inference-key-0123456789", "admin_key": "admin-key-0123456789"}
    async with serve_app(settings(tmp_path, **keys), wait_ready=False) as client:
        inference = {"Authorization": "Bearer inference-key-0123456789"}
        r = await client.post("/models", json={"name": "x", "source": H.TINY_REPO}, headers=inference)
        assert r.status_code == 401
        assert r.json()["error"] == "missing or wrong key: send 'Authorization: Bearer <BERT_ADMIN_KEY>'"
        assert (await client.get("/models", headers=inference)).status_code == 200


def test_cancel_stops_the_download(tmp_path):
    imports = Imports(tmp_path)
    record = imports.records.create(spec("c"))
    imports.records.move(record["id"], transitions.start, "here:1")
    report = imports._progress(record["id"])
    report(10, 100)
    assert imports.records.read(record["id"])["progress"] == {"downloaded_bytes": 10, "total_bytes": 100}
    imports.records.request_cancel(record["id"])
    with pytest.raises(ImportCancelled):
        report(100, 100)


def test_cancelled_before_it_ran(tmp_path):
    imports = Imports(tmp_path)
    record = imports.records.create(spec("c"))
    imports.records.update(record["id"], lambda r: None)
    (imports.records.job_dir(record["id"]) / "cancel").touch()
    imports.run(record["id"])
    assert imports.records.read(record["id"])["state"] == "cancelled"


def test_the_workers_sweep_skips_imports(tmp_path):
    from worker.recovery import sweep

    store = JobRecords(tmp_path)
    store.create(spec("i"))
    sent: list[str] = []
    assert sweep(store, sent.append) == [] and sent == []


async def test_a_hub_import_answers_as_the_same_weights_from_an_archive(hub, hub_env, tmp_path):
    """The acceptance check, through the API: /embeddings of a model imported by Hub id equals that of
    the same weights uploaded as an archive (the Hub's main revision is tiny-0, as _archive's)."""
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        by_id = await client.post("/models", json={"name": "from-hub", "source": H.TINY_REPO})
        by_file = await client.post("/models", files={"file": ("tiny.tar.gz", _archive(tmp_path))}, data={"name": "up"})
        for r in (by_id, by_file):
            assert r.status_code == 202, r.text
            assert (await finished(client, r.json()["id"]))["state"] == "succeeded"
        texts = ["the cat sat on the mat", "a dog"]
        answers = [
            (await client.post("/embeddings", json={"model": name, "inputs": texts})).json()
            for name in ("from-hub", "up")
        ]
        assert len(answers[0]) == 2 and answers[0] == answers[1]


def _hostile_archive(tmp_path, **config) -> bytes:
    """The tiny model's archive with `config` in its config.json."""
    import json

    model = H.tiny_model_dir(tmp_path, 0)
    (model / "config.json").write_text(json.dumps({**json.loads((model / "config.json").read_text()), **config}))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(model, arcname="tiny")
    return buf.getvalue()


@pytest.mark.parametrize(
    "config, error",
    [
        (
            {"num_hidden_layers": 10_000},
            "num_hidden_layers is 10,000, more than the 48 a model may have (BERT-large has 24)",
        ),
        ({"num_labels": 3_000_000}, "num_labels is 3,000,000, more than the 10,000 a model may have (token-"),
    ],
)
async def test_an_archive_beyond_the_bounds_fails_its_job(hub_env, tmp_path, monkeypatch, config, error):
    from model import modeling

    body = _hostile_archive(tmp_path, **config)
    monkeypatch.setattr(modeling.BertPreTrainedModel, "__init__", lambda *a, **k: pytest.fail("built a model"))
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        r = await client.post("/models", files={"file": ("hostile.tar.gz", body)}, data={"name": "up"})
        assert r.status_code == 202, r.text
        done = await finished(client, r.json()["id"])
        assert done["state"] == "failed"
        assert done["error"].startswith(error)
        assert str(tmp_path) not in done["error"]
        assert not (tmp_path / "data" / "models" / "up").exists()
        assert (await client.get("/models")).status_code == 200


async def test_an_import_over_the_memory_budget_fails_naming_both(hub_env, tmp_path):
    async with serve_app(settings(tmp_path, model_memory_gb=0.00005), wait_ready=False) as client:
        r = await client.post("/models", files={"file": ("tiny.tar.gz", _archive(tmp_path))}, data={"name": "up"})
        done = await finished(client, r.json()["id"])
        assert done["state"] == "failed"
        assert done["error"] == (
            "config.json describes a model of 20.5 K parameters: an estimated 80.1 KB of fp32 weights, "
            "more than the 52.4 KB model memory budget"
        )
        assert not (tmp_path / "data" / "models" / "up").exists()
