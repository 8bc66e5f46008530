"""Ownership of names on a real server and a real worker (uvicorn over HTTP, the suite's Redis): a key
publishes only new names and the models it owns, trains only from models and datasets it may use, uploads
and deletes its own datasets, and sees neither another key's private models nor its datasets; an admin
shares a model with every key. The refusals name the rule, never the owner."""

from __future__ import annotations

import json

import httpx
import pytest

from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from app.keys.ownership import DATASET_RULE, MODEL_RULE
from datadir.publish import OWNER_RULE
from tests.helpers import (
    BASE_MODEL,
    REDIS_URL,
    finetune_request,
    flush_redis,
    labelled_csv,
    make_data_dir,
    start_server,
    start_worker,
    wait_for,
)

pytestmark = pytest.mark.slow

SECRETS = {name: new_secret() for name in ("alice", "bob", "boss")}
BOTH = frozenset({"inference", "jobs"})
KEYS = {
    "alice": Key("alice", hash_secret(SECRETS["alice"]), BOTH),
    "bob": Key("bob", hash_secret(SECRETS["bob"]), BOTH),
    "boss": Key("boss", hash_secret(SECRETS["boss"]), frozenset({"inference", "jobs", "admin", "metrics"})),
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("owners")
    data_dir = make_data_dir(root / "data")
    keys_file = root / "keys.toml"
    write_keys(keys_file, dict(KEYS))
    flush_redis()
    server, url = start_server(data_dir, REDIS_URL, root, BERT_KEYS_FILE=str(keys_file))
    worker = start_worker(data_dir, REDIS_URL, "owners", root)
    clients = {
        name: httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {s}"})
        for name, s in SECRETS.items()
    }
    try:
        yield clients, data_dir
    finally:
        for client in clients.values():
            client.close()
        worker.stop()
        server.stop()
        flush_redis()


def upload(client: httpx.Client, name: str) -> httpx.Response:
    return client.post("/datasets", files={"file": ("reviews.csv", labelled_csv())}, data={"name": name})


def finished(client: httpx.Client, job_id: str) -> dict:
    def done():
        body = client.get(f"/jobs/{job_id}").json()
        return body if body["state"] in ("succeeded", "failed", "cancelled") else None

    return wait_for(done, 120, f"job {job_id} to finish", interval=0.2)


def refusal(r: httpx.Response) -> tuple[int, dict]:
    return r.status_code, r.json()


def test_keys_publish_train_from_and_see_only_what_is_theirs_or_shared(stack):
    clients, data_dir = stack
    alice, bob, boss = clients["alice"], clients["bob"], clients["boss"]
    assert upload(boss, "reviews").status_code == 201  # an admin's dataset: every key trains on it
    r = upload(alice, "alice-data")  # a jobs key uploads its own
    assert r.status_code == 201 and r.json()["owner"] == "alice"

    assert {d["name"] for d in bob.get("/datasets").json()["datasets"]} == {"reviews"}
    assert {d["name"] for d in alice.get("/datasets").json()["datasets"]} == {"reviews", "alice-data"}
    assert {d["name"] for d in boss.get("/datasets").json()["datasets"]} == {"reviews", "alice-data"}
    gone = (404, {"error": "dataset 'alice-data' not found", "error_type": "not_found"})
    assert refusal(bob.get("/datasets/alice-data")) == gone
    assert refusal(bob.delete("/datasets/alice-data")) == gone
    assert refusal(bob.post("/jobs", json=finetune_request("bob-cls", dataset="alice-data"))) == (
        403,
        {"error": f"dataset: 'alice-data' is not this key's to use: {DATASET_RULE}", "error_type": "forbidden"},
    )

    job = alice.post("/jobs", json=finetune_request("alice-cls", dataset="alice-data", max_steps=10))
    assert job.status_code == 202, job.text
    assert finished(alice, job.json()["id"])["state"] == "succeeded"
    mine = alice.get("/models/alice-cls").json()
    assert (mine["owner"], mine["shared"], mine["version"]) == ("alice", False, 1)

    # bob can neither publish over alice's model nor over the default one an admin owns, nor use them
    not_his = {
        "error": f"model_name: model 'alice-cls' belongs to another key: {OWNER_RULE}",
        "error_type": "forbidden",
    }
    assert refusal(bob.post("/jobs", json=finetune_request("alice-cls"))) == (403, not_his)
    assert refusal(bob.post("/jobs", json=finetune_request(BASE_MODEL))) == (  # the rule, not who owns it
        403,
        {"error": f"model_name: model '{BASE_MODEL}' belongs to another key: {OWNER_RULE}", "error_type": "forbidden"},
    )
    private = f"model 'alice-cls' is not this key's to use: {MODEL_RULE}"
    assert refusal(bob.post("/jobs", json={**finetune_request("bob-cls"), "base_model": "alice-cls"})) == (
        403,
        {"error": f"base_model: {private}", "error_type": "forbidden"},
    )
    assert refusal(bob.post("/classify", json={"inputs": "good", "model": "alice-cls"})) == (
        403,
        {"error": private, "error_type": "forbidden"},
    )
    assert "alice-cls" not in {m["name"] for m in bob.get("/models").json()["models"]}
    assert "alice-cls" not in {m["id"] for m in bob.get("/v1/models").json()["data"]}
    assert bob.get("/models/alice-cls").status_code == 404
    assert bob.post("/embeddings", json={"inputs": "good"}).status_code == 200  # the shared default: allowed

    # alice publishes her next version; an admin shares her model, and then bob uses it and trains from it
    again = alice.post("/jobs", json=finetune_request("alice-cls", dataset="alice-data", max_steps=10))
    assert again.status_code == 202, again.text
    assert finished(alice, again.json()["id"])["state"] == "succeeded"
    assert alice.get("/models/alice-cls").json()["version"] == 2
    shared = boss.patch("/models/alice-cls", json={"shared": True})
    assert shared.status_code == 200 and (shared.json()["owner"], shared.json()["shared"]) == ("alice", True)
    assert bob.post("/classify", json={"inputs": "good", "model": "alice-cls"}).status_code == 200
    assert (
        bob.post("/jobs", json={**finetune_request("bob-cls", max_steps=10), "base_model": "alice-cls"}).status_code
        == 202
    )
    assert refusal(bob.patch("/models/alice-cls", json={"shared": False}))[0] == 403  # sharing is an admin's

    # an admin publishes over any name; the audit log has the share
    assert boss.post("/jobs", json=finetune_request("alice-cls", max_steps=10)).status_code == 202
    audit = [json.loads(line) for line in (data_dir / "audit.jsonl").read_text().splitlines()]
    assert ("boss", "model.share", "model alice-cls", "ok") in {
        (e["key"], e["action"], e["target"], e["outcome"]) for e in audit
    }
    published = {(e["key"], e["target"], e["source"]) for e in audit if e["action"] == "model.publish"}
    assert {
        ("alice", "model alice-cls version 1", "worker"),
        ("alice", "model alice-cls version 2", "worker"),
    } <= published
