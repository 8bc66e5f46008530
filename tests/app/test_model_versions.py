"""Model versions over HTTP: GET /models(/{name}) with versions and disk use, POST /models/{name}/promote,
DELETE of models, versions, datasets and jobs (exact codes and bodies), and a promote under load against
a real uvicorn."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from datadir import JobRecords, publish_model
from datadir.cards import update_card
from model.modeling import BertModel
from tests.app.conftest import save_tiny
from tests.app.test_inference import embed_reference
from tests.app.test_jobs_api import NO_BROKER, make_client, post_job, upload
from tests.app.test_server import free_port, start_server
from tests.helpers import finetune_request, finetune_spec, labelled_csv

ADMIN_KEY, API_KEY = "versions-admin-key-0123456789", "versions-api-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def err(error_type: str, message: str) -> dict:
    return {"error": message, "error_type": error_type}


def _tree_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture
def data(tmp_path):
    """DATA_DIR with `enc` in two versions (v2 promoted, with a card), a flat `tiny` (the default) and
    a dataset."""
    root = tmp_path / "data"
    save_tiny(root / "models" / "tiny", BertModel, seed=0)
    for version in (1, 2):
        save_tiny(tmp_path / f"out{version}", BertModel, seed=version)
        publish_model(root, f"job-{version}", tmp_path / f"out{version}", "enc")
    update_card(root / "models" / "enc" / "v2", source={"kind": "job", "job_id": "job-2"})
    return root


def client_for(data_dir, **settings):
    client = make_client(data_dir, admin_key=ADMIN_KEY, **settings)  # default_model: tiny
    client.headers.update(ADMIN)
    return client


def test_listing_and_detail_show_versions_and_disk_use(data):
    with client_for(data) as client:
        listed = {m["name"]: m for m in client.get("/models").json()["models"]}
        enc_bytes = _tree_bytes(data / "models" / "enc")
        assert (listed["enc"]["version"], listed["enc"]["num_versions"], listed["enc"]["disk_bytes"]) == (
            2,
            2,
            enc_bytes,
        )
        assert (listed["tiny"]["version"], listed["tiny"]["num_versions"]) == (1, 1)
        detail = client.get("/models/enc").json()
        versions = detail.pop("versions")
        assert detail == listed["enc"]
        assert [(v["version"], v["promoted"], v["made_by"], v["card"]) for v in versions] == [
            (1, False, "job-1", {}),
            (2, True, "job-2", {"source": {"kind": "job", "job_id": "job-2"}}),
        ]
        assert [v["disk_bytes"] for v in versions] == [_tree_bytes(data / "models" / "enc" / f"v{n}") for n in (1, 2)]
        assert all(v["created_at"].endswith("Z") for v in versions)


def test_promote_switches_versions_and_names_the_ones_there_are(data, tokenizer):
    v1 = BertModel.from_pretrained(data / "models" / "enc" / "v1")
    v2 = BertModel.from_pretrained(data / "models" / "enc" / "v2")
    with client_for(data) as client:

        def embedding():
            r = client.post("/embeddings", json={"inputs": "the cat", "model": "enc"})
            assert r.status_code == 200
            return torch.tensor(r.json())

        assert torch.allclose(embedding(), embed_reference(v2, tokenizer, "the cat"), atol=1e-5)
        r = client.post("/models/enc/promote", json={"version": 1}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["version"] == 1
        assert [v["promoted"] for v in r.json()["versions"]] == [True, False]
        assert torch.allclose(embedding(), embed_reference(v1, tokenizer, "the cat"), atol=1e-5)
        assert json.loads((data / "models" / "enc" / "model.json").read_text()) == {
            "promoted": 1,
            "owner": "admin",
            "shared": True,
        }

        r = client.post("/models/enc/promote", json={"version": 9}, headers=ADMIN)
        assert (r.status_code, r.json()) == (404, err("not_found", "model 'enc' has no version 9 (versions: 1, 2)"))
        r = client.post("/models/ghost/promote", json={"version": 1}, headers=ADMIN)
        assert (r.status_code, r.json()) == (404, err("not_found", "model 'ghost' not found"))
        r = client.post("/models/enc/promote", json={"version": 0}, headers=ADMIN)
        assert (r.status_code, r.json()) == (
            422,
            err("validation", "version: Input should be greater than or equal to 1"),
        )
        r = client.post("/models/enc/promote", json={"version": 2}, headers={"Authorization": "Bearer wrong"})
        assert (r.status_code, r.json()) == (
            401,
            err("unauthorized", "missing or wrong key: send 'Authorization: Bearer <BERT_ADMIN_KEY>'"),
        )


def test_management_takes_the_admin_key_and_reading_the_api_key(data):
    with client_for(data, api_key=API_KEY) as client:
        assert client.get("/models/enc", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert client.get("/models/enc", headers=ADMIN).status_code == 401
        assert (
            client.delete("/models/enc/versions/1", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
        )
        assert client.delete("/models/enc/versions/1", headers=ADMIN).status_code == 200
        # GET and DELETE /models/{name} share a path: the key check before the body goes by method too
        assert client.delete("/models/enc", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
        assert client.delete("/models/enc", headers=ADMIN).status_code == 200


def test_model_deletion_rules(data):
    with client_for(data) as client:
        r = client.delete("/models/tiny", headers=ADMIN)
        assert (r.status_code, r.json()) == (
            409,
            err("conflict", "model 'tiny' is the default model (BERT_DEFAULT_MODEL): set another before deleting it"),
        )
        r = client.delete("/models/enc/versions/2", headers=ADMIN)
        assert (r.status_code, r.json()) == (
            409,
            err(
                "conflict",
                "version 2 of model 'enc' is the promoted one; promote another (1) before deleting it, "
                "or delete the whole model",
            ),
        )
        r = client.delete("/models/enc/versions/3", headers=ADMIN)
        assert (r.status_code, r.json()) == (404, err("not_found", "model 'enc' has no version 3 (versions: 1, 2)"))
        freed = _tree_bytes(data / "models" / "enc" / "v1")
        r = client.delete("/models/enc/versions/1", headers=ADMIN)
        assert (r.status_code, r.json()) == (
            200,
            {"deleted": "version", "name": "enc", "version": 1, "freed_bytes": freed},
        )
        assert [v["version"] for v in client.get("/models/enc").json()["versions"]] == [2]

        job = JobRecords(data).create({**finetune_spec("clf"), "base_model": "enc"})
        r = client.delete("/models/enc/versions/2", headers=ADMIN)  # the last version: the whole model
        assert (r.status_code, r.json()) == (
            409,
            err(
                "conflict",
                f"model 'enc' is in use by job {job['id']} (queued); delete it once the job has finished "
                "(or cancel the job)",
            ),
        )
        JobRecords(data).update(job["id"], lambda rec: rec.update(state="cancelled"))
        freed = _tree_bytes(data / "models" / "enc")
        r = client.delete("/models/enc/versions/2", headers=ADMIN)
        assert (r.status_code, r.json()) == (
            200,
            {"deleted": "version", "name": "enc", "version": 2, "freed_bytes": freed},
        )
        assert client.get("/models/enc").status_code == 404
        assert not (data / "models" / "enc").exists()
        r = client.delete("/models/enc", headers=ADMIN)
        assert (r.status_code, r.json()) == (404, err("not_found", "model 'enc' not found"))


def test_deleting_a_whole_model(data):
    with client_for(data) as client:
        assert client.post("/embeddings", json={"inputs": "x", "model": "enc"}).status_code == 200  # loaded
        freed = _tree_bytes(data / "models" / "enc")
        r = client.delete("/models/enc", headers=ADMIN)
        assert (r.status_code, r.json()) == (
            200,
            {"deleted": "model", "name": "enc", "version": None, "freed_bytes": freed},
        )
        r = client.post("/embeddings", json={"inputs": "x", "model": "enc"})
        assert (r.status_code, r.json()) == (404, err("not_found", "model 'enc' not found (available: tiny)"))
        assert [m["name"] for m in client.get("/models").json()["models"]] == ["tiny"]


def test_dataset_and_job_deletion(data):
    with client_for(data) as client:
        meta = upload(client, "reviews.csv", labelled_csv(), name="reviews").json()
        assert meta["disk_bytes"] == _tree_bytes(data / "datasets" / "reviews")
        r = upload(client, "again.csv", labelled_csv(), name="reviews")
        assert (r.status_code, r.json()) == (
            409,
            err(
                "conflict",
                "name: dataset 'reviews' already exists (datasets are never replaced; "
                "upload under another name, or delete it first)",
            ),
        )
        job = JobRecords(data).create(finetune_spec("clf", dataset="reviews"))
        (data / "jobs" / job["id"] / "checkpoints").mkdir()
        (data / "jobs" / job["id"] / "checkpoints" / "weights").write_bytes(b"w" * 500)
        listed = client.get("/jobs").json()["jobs"]
        assert [j["disk_bytes"] for j in listed] == [_tree_bytes(data / "jobs" / job["id"])]
        r = client.delete("/datasets/reviews", headers=ADMIN)
        assert (r.status_code, r.json()) == (
            409,
            err(
                "conflict",
                f"dataset 'reviews' is in use by job {job['id']} (queued); delete it once the job has finished "
                "(or cancel the job)",
            ),
        )
        r = client.delete(f"/jobs/{job['id']}", headers=ADMIN)
        assert (r.status_code, r.json()) == (
            409,
            err("conflict", f"job '{job['id']}' is queued: only a finished job can be deleted (cancel it first)"),
        )
        JobRecords(data).update(job["id"], lambda rec: rec.update(state="succeeded"))
        freed = _tree_bytes(data / "jobs" / job["id"])
        r = client.delete(f"/jobs/{job['id']}", headers=ADMIN)
        assert (r.status_code, r.json()) == (
            200,
            {"deleted": "job", "name": job["id"], "version": None, "freed_bytes": freed},
        )
        r = client.get(f"/jobs/{job['id']}", headers=ADMIN)
        assert (r.status_code, r.json()) == (404, err("not_found", f"job '{job['id']}' not found"))
        freed = _tree_bytes(data / "datasets" / "reviews")
        r = client.delete("/datasets/reviews", headers=ADMIN)
        assert (r.status_code, r.json()) == (
            200,
            {"deleted": "dataset", "name": "reviews", "version": None, "freed_bytes": freed},
        )
        r = client.delete("/datasets/reviews", headers=ADMIN)
        assert (r.status_code, r.json()) == (404, err("not_found", "dataset 'reviews' not found"))
        assert upload(client, "reviews.csv", labelled_csv(), name="reviews").status_code == 201  # the name is free


def test_a_job_may_train_a_new_version_of_an_existing_model_but_not_two_at_once(data):
    with client_for(data, broker_url=NO_BROKER) as client:
        assert upload(client, "reviews.csv", labelled_csv(), name="reviews").status_code == 201
        status, body = post_job(client, {**finetune_request("enc"), "base_model": "tiny"})
        assert status == 503 and body["error"].startswith("the job queue (broker) cannot be reached")  # validated
        busy = JobRecords(data).create(finetune_spec("enc"))
        status, body = post_job(client, {**finetune_request("enc"), "base_model": "tiny"})
        assert (status, body) == (
            409,
            err("conflict", f"model_name: job {busy['id']} (queued) is already training a model named 'enc'"),
        )


def test_promoting_under_load_fails_no_request(data, tokenizer):
    """Several threads embed in a tight loop against a real uvicorn while the main thread promotes back
    and forth: every answer is 200 and is exactly one version's embedding; after each promote returns,
    the next request gets the promoted version."""
    references = {
        n: embed_reference(BertModel.from_pretrained(data / "models" / "enc" / f"v{n}"), tokenizer, "the cat")
        for n in (1, 2)
    }
    port = free_port()
    proc = start_server(data, port, BERT_DEFAULT_MODEL="enc", BERT_ADMIN_KEY=ADMIN_KEY, BERT_BROKER_URL=NO_BROKER)
    url = f"http://127.0.0.1:{port}"
    answers: list[tuple[int, list[float] | str]] = []
    stop = threading.Event()

    def load():
        with httpx.Client(base_url=url, timeout=30) as c:
            while not stop.is_set():
                r = c.post("/embeddings", json={"inputs": "the cat", "model": "enc"})
                answers.append((r.status_code, r.json() if r.status_code == 200 else r.text))

    threads = [threading.Thread(target=load) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        with httpx.Client(base_url=url, timeout=30, headers=ADMIN) as admin:
            for version in (1, 2) * 4:
                assert admin.post("/models/enc/promote", json={"version": version}).status_code == 200
                r = admin.post("/embeddings", json={"inputs": "the cat", "model": "enc"})
                assert torch.allclose(torch.tensor(r.json()), references[version], atol=1e-5)
    finally:
        stop.set()
        for t in threads:
            t.join()
        proc.terminate()
        proc.wait(timeout=30)
    assert answers and all(status == 200 for status, _ in answers), [a for a in answers if a[0] != 200][:3]
    unmatched = [
        body
        for _, body in answers
        if not any(torch.allclose(torch.tensor(body), ref, atol=1e-5) for ref in references.values())
    ]
    assert unmatched == []  # each answer is one version's, never a mix
