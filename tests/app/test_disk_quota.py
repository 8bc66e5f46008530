"""A key's disk quota (`disk_gb`) over real ASGI: a dataset upload or a job that would take the key past it
is a 507 naming what it holds, what the request needs and the quota, and nothing is written; another key and
an admin are not held to it."""

from __future__ import annotations

import re

import pytest

from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from datadir import JobRecords
from tests.app.conftest import serve_app, settings_for
from tests.helpers import BASE_MODEL, finetune_request, labelled_csv, make_data_dir

pytestmark = pytest.mark.anyio

SECRETS = {name: new_secret() for name in ("tight", "roomy")}
QUOTA_GB = 2e-6  # 2,147 bytes: one small dataset, not a second one nor a job's checkpoints
KEYS = {
    "tight": Key("tight", hash_secret(SECRETS["tight"]), frozenset({"jobs"}), disk_gb=QUOTA_GB),
    "roomy": Key("roomy", hash_secret(SECRETS["roomy"]), frozenset({"jobs"})),
}


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


async def test_a_key_over_its_disk_quota_gets_a_507_with_the_numbers(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    keys_file = tmp_path / "keys.toml"
    write_keys(keys_file, dict(KEYS))
    settings = settings_for(data_dir, keys_file=keys_file, default_model=BASE_MODEL)
    async with serve_app(settings) as c:

        async def upload(key: str, name: str, rows: int):
            files = {"file": ("d.csv", labelled_csv(rows))}
            return await c.post("/datasets", files=files, data={"name": name}, headers=auth(key))

        assert (await upload("tight", "small", 10)).status_code == 201
        r = await upload("tight", "big", 100)
        assert r.status_code == 507 and r.json()["error_type"] == "insufficient_storage"
        error = r.json()["error"]
        assert error.startswith("key 'tight' holds ") and "(jobs 0.0 KB, datasets " in error
        assert re.search(
            r"and this dataset needs about 2\.\d KB: more than its disk quota of 2e-06 GB \(disk_gb\)", error
        )
        assert not (data_dir / "datasets" / "big").exists()
        assert not [p for p in (data_dir / "datasets").iterdir() if p.name.startswith(".tmp")]

        r = await c.post("/jobs", json=finetune_request("mine", dataset="small"), headers=auth("tight"))
        assert r.status_code == 507 and "this job's checkpoints and model needs about" in r.json()["error"]
        assert JobRecords(data_dir).list() == []  # nothing queued

        assert (await upload("roomy", "other", 100)).status_code == 201  # no quota: not held to one
        r = await c.post("/jobs", json=finetune_request("theirs", dataset="other"), headers=auth("roomy"))
        assert r.status_code == 503  # past every check: no broker listens in this test


async def test_a_retrieval_archive_counts_what_it_unpacks_to(tmp_path):
    """A small .tar.gz under the quota whose unpacked files are over it: a 507 once the check has unpacked it, and
    nothing is installed (the quota counts what the dataset holds on disk, not the upload)."""
    import io
    import json
    import tarfile

    documents = "".join(json.dumps({"_id": f"d{i}", "text": "the same words again " * 4}) + "\n" for i in range(60))
    files = {
        "corpus.jsonl": documents.encode(),
        "queries.jsonl": b'{"_id": "q1", "text": "words"}\n',
        "qrels/test.tsv": b"query-id\tcorpus-id\tscore\nq1\td1\t1\n",
    }
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert len(archive.getvalue()) < QUOTA_GB * 1e9 / 2 < QUOTA_GB * 1e9 < sum(map(len, files.values()))
    data_dir = make_data_dir(tmp_path / "data")
    keys_file = tmp_path / "keys.toml"
    write_keys(keys_file, dict(KEYS))
    settings = settings_for(data_dir, keys_file=keys_file, default_model=BASE_MODEL)
    async with serve_app(settings) as c:
        files_ = {"file": ("set.tar.gz", archive.getvalue())}
        r = await c.post("/datasets", files=files_, data={"name": "set"}, headers=auth("tight"))
        assert r.status_code == 507 and r.json()["error_type"] == "insufficient_storage", r.text
        assert re.search(r"and this dataset needs about [5-9]\.\d KB: more than its disk quota", r.json()["error"])
        assert [p.name for p in (data_dir / "datasets").iterdir()] == []
        r = await c.post("/datasets", files=files_, data={"name": "set"}, headers=auth("roomy"))
        assert (r.status_code, r.json()["documents"]) == (201, 60)
