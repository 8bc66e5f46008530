"""POST /datasets with a Hub repo id: an import job (202, run by the API through the runner) that makes a dataset
from one split of a dataset repo of the fake Hub (tests/hub_server.py): each id the documentation imports gives a
dataset its fine-tune accepts, an import equals the upload of the same rows, GET /datasets shows its card, and the
failures (gated, no such repo, no split named, labels hidden, past the download cap or the key's quota, a cancel)
end the job saying why, leaving no dataset and no staging folder behind."""

from __future__ import annotations

import csv
import io
import json

import pytest

from app.jobs.dataset_imports import DatasetImport
from app.jobs.imports import Imports
from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from app.keys.keyring import ANONYMOUS
from datadir import JobRecords
from model.data import hub_rows
from tests import hub_server as H
from tests.app.conftest import serve_app, settings_for
from tests.helpers import BASE_MODEL, finetune_request, make_data_dir
from tests.model.test_hub_datasets import DATASET_INSTEAD_OFFLINE

pytestmark = pytest.mark.anyio

QUEUED = {  # POST /jobs' answer for a job that passed every check (no broker here: nothing is queued)
    "error": "the job queue (broker) cannot be reached, nothing was queued; retry later (the service log has the "
    "details)",
    "error_type": "unavailable",
}


def settings(tmp_path, **overrides):
    return settings_for(make_data_dir(tmp_path / "data"), default_model=BASE_MODEL, load="lazy", **overrides)


async def imported(client, body: dict) -> dict:
    """POST /datasets with `body`; the finished job."""
    r = await client.post("/datasets", json=body)
    assert r.status_code == 202, r.text
    client.app.state.imports.wait(timeout=120)
    return (await client.get(f"/jobs/{r.json()['id']}")).json()


def leftovers(tmp_path) -> list[str]:
    """Staging folders left: hidden ones beside the datasets, and the import jobs' own."""
    data = tmp_path / "data"
    return [p.name for p in (data / "datasets").glob(".tmp*")] + [str(p) for p in data.glob("jobs/*/dataset")]


async def test_each_id_of_the_documentation_gives_a_dataset_its_fine_tune_accepts(hub, hub_env, tmp_path):
    imports = [
        ({"name": "imdb", "source": H.IMDB_REPO, "split": "train"}, "labelled", "sequence-classification"),
        ({"name": "conll", "source": H.CONLL_REPO, "split": "train"}, "token-labelled", "token-classification"),
        ({"name": "squad", "source": H.SQUAD_REPO, "split": "train"}, "qa", "question-answering"),
        ({"name": "nli", "source": H.NLI_REPO, "subset": "triplet", "split": "train"}, "pairs", None),
        ({"name": "sts", "source": H.NLI_REPO, "subset": "pair-score", "split": "dev"}, "scored-pairs", None),
        ({"name": "nq", "source": H.NQ_REPO, "kind": "pairs"}, "pairs", None),
    ]
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        for body, kind, task in imports:
            r = await client.post("/datasets", json=body)
            assert r.status_code == 202, r.text
            job = r.json()
            assert r.headers["location"] == f"/jobs/{job['id']}"
            assert (job["kind"], job["model_name"], job["dataset"], job["state"]) == (
                "import",
                None,
                body["name"],
                "queued",
            )
            assert job["params"] == {
                "source": body["source"],
                "revision": None,
                "subset": body.get("subset"),
                "split": body.get("split"),
                "columns": None,
                "kind": body.get("kind"),
            }
            client.app.state.imports.wait(timeout=120)
            done = (await client.get(f"/jobs/{job['id']}")).json()
            assert done["state"] == "succeeded", done["error"]
            assert done["downloaded_bytes"] == done["total_bytes"] > 0
            meta = (await client.get(f"/datasets/{body['name']}")).json()
            assert done["result"] == {"dataset": body["name"], "kind": kind, "source": meta["source"]}
            assert meta["kind"] == kind
            if task is not None:
                fits = {"max_query_length": 16} if task == "question-answering" else {}  # the tiny model's 64 positions
                job = finetune_request(f"ft-{body['name']}", dataset=body["name"], task=task, max_seq_len=64, **fits)
                r = await client.post("/jobs", json=job)
                assert (r.status_code, r.json()) == (503, QUEUED), r.json()
        listed = {d["name"]: d for d in (await client.get("/datasets")).json()["datasets"]}
    assert listed["imdb"]["source"] == {
        "kind": "hub",
        "repo": H.IMDB_REPO,
        "revision": "main",
        "sha": hub.datasets[H.IMDB_REPO].refs["main"],
        "subset": "plain_text",
        "split": "train",
        "license": "other",
        "rows": 40,
        "columns": None,
        "files": ["plain_text/train-00000-of-00001.parquet"],
    }
    assert (listed["imdb"]["labels"], listed["imdb"]["label_counts"]) == (["neg", "pos"], {"pos": 20, "neg": 20})
    assert listed["imdb"]["original_filename"] == "plain_text/train-00000-of-00001.parquet"
    assert listed["conll"]["source"]["revision"] == H.PARQUET_EXPORT and listed["conll"]["source"]["columns"] == {
        "ner_tags": "tags"
    }
    assert listed["conll"]["labels"] == sorted(H.CONLL_TAGS)
    squad = listed["squad"]
    assert (squad["questions"], squad["impossible"], squad["source"]["license"]) == (48, 0, "cc-by-sa-4.0")
    assert (listed["nli"]["rows"], listed["nli"]["negatives"]) == (8, 1)
    assert listed["nq"]["source"]["columns"] == {"query": "anchor", "answer": "positive"}
    assert leftovers(tmp_path) == []


def upload_csv(rows: list[dict]) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().encode()


SAME = ("kind", "rows", "num_labels", "labels", "label_counts", "is_pair", "sentences", "tokens", "entity_counts")


async def test_an_import_is_the_upload_of_the_same_rows(hub, hub_env, tmp_path):
    """The file an import writes, uploaded, is the same dataset (meta.json but its name, dates and source), and
    the rows of the Hub's split uploaded as a CSV of names count the same."""
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        for body in (
            {"name": "imdb", "source": H.IMDB_REPO, "split": "train"},
            {"name": "conll", "source": H.CONLL_REPO, "split": "train"},
            {"name": "squad", "source": H.SQUAD_REPO, "split": "validation"},
        ):
            assert (await imported(client, body))["state"] == "succeeded"
            meta = (await client.get(f"/datasets/{body['name']}")).json()
            path = tmp_path / "data" / "datasets" / body["name"] / meta["file"]
            r = await client.post("/datasets", files={"file": (path.name, path.read_bytes())}, data={"name": "up"})
            assert r.status_code == 201, r.text
            uploaded = r.json()
            varying = {"name", "created_at", "original_filename", "source", "disk_bytes"}  # meta.json holds the source
            assert {k: v for k, v in uploaded.items() if k not in varying} == {
                k: v for k, v in meta.items() if k not in varying
            }
            await client.delete("/datasets/up")
        rows = [{"text": r["text"], "label": H.IMDB_LABELS[r["label"]]} for r in H.imdb_rows()["train"]]
        r = await client.post("/datasets", files={"file": ("imdb.csv", upload_csv(rows))}, data={"name": "by-hand"})
        by_hand = r.json()
        imdb = (await client.get("/datasets/imdb")).json()
    assert {k: by_hand.get(k) for k in SAME} == {k: imdb.get(k) for k in SAME}


@pytest.mark.parametrize(
    "body, error",
    [
        (
            {"source": H.GATED_DATASET, "split": "train"},
            f"{H.GATED_DATASET} is a gated repo: accept its terms on the Hub, then set HF_TOKEN to a token with access",
        ),
        ({"source": "acme/no-such-dataset"}, "no dataset repo acme/no-such-dataset on "),
        (
            {"source": H.IMDB_REPO},
            f"{H.IMDB_REPO} (subset plain_text) has splits train, test, unsupervised; name one as the split",
        ),
        (
            {"source": H.NLI_REPO, "split": "train"},
            f"{H.NLI_REPO} has several subsets and none is its default; name one as the subset: pair (train, dev, "
            "test), pair-class (train, dev, test), pair-score (train, dev, test), triplet (train, dev, test)",
        ),
        (
            {"source": H.IMDB_REPO, "subset": "plain", "split": "train"},
            f"{H.IMDB_REPO} has no subset 'plain'; its subsets: plain_text (train, test, unsupervised)",
        ),
        (
            {"source": H.IMDB_REPO, "split": "unsupervised"},
            f"{H.IMDB_REPO} (subset plain_text, split unsupervised): row 0: label is -1, not one of the 2 labels its "
            "ClassLabel names (neg, pos); a split whose labels are hidden (-1, as test splits often have) cannot be "
            "trained on",
        ),
        (
            {"source": H.NQ_REPO},
            f"{H.NQ_REPO} (subset pair, split train): cannot tell what the columns query, answer hold: name the kind",
        ),
        (
            {"source": H.JSONL_DATASET, "split": "train", "kind": "scored-pairs"},
            f"{H.JSONL_DATASET} (subset default, split train): scored-pairs need two text columns at least; the "
            "split's columns: text, label",
        ),
        (
            {"source": H.JSONL_DATASET, "split": "train", "columns": {"text": "sentence1", "label": "sentence2"}},
            f"{H.JSONL_DATASET} (subset default, split train): cannot tell what the columns text, label hold",
        ),
        (
            {"source": H.JSONL_DATASET, "split": "train", "revision": "broken"},
            f"{H.JSONL_DATASET} (subset default, split train) as labelled: not a usable labelled table (columns text, "
            "label and optionally text_pair): row 3: 'text' is empty or not text: ''",
        ),
    ],
)
async def test_a_failed_import_says_why_in_its_record(hub, hub_env, tmp_path, body, error):
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        done = await imported(client, {"name": "x", **body})
        assert (await client.get("/datasets/x")).status_code == 404
    assert done["state"] == "failed"
    assert done["error"].startswith(error), done["error"]
    assert str(tmp_path) not in done["error"]
    assert leftovers(tmp_path) == []


async def test_past_the_download_cap_nothing_downloads(hub, hub_env, tmp_path):
    before = len(hub.requests)
    async with serve_app(settings(tmp_path, max_dataset_import_bytes=1000), wait_ready=False) as client:
        done = await imported(client, {"name": "x", "source": H.SQUAD_REPO, "split": "train"})
    assert done["state"] == "failed"
    assert done["error"].startswith(f"{H.SQUAD_REPO} (subset plain_text, split train) is ")
    assert done["error"].endswith(
        " bytes in 1 file(s), more than the 1,000 an import may download (BERT_MAX_DATASET_IMPORT_BYTES)"
    )
    assert not [p for _, p in hub.requests[before:] if p.endswith(".parquet") or p.startswith("/cdn/")]


async def test_past_the_dataset_cap_the_written_file_stops(hub, hub_env, tmp_path):
    async with serve_app(settings(tmp_path, max_dataset_bytes=2000), wait_ready=False) as client:
        done = await imported(client, {"name": "x", "source": H.IMDB_REPO, "split": "train"})
    assert (done["state"], done["error"]) == (
        "failed",
        f"{H.IMDB_REPO} (subset plain_text, split train): the rows take more than 2,000 bytes as a labelled file, the "
        "most a dataset may hold (BERT_MAX_DATASET_BYTES); import fewer rows (a slice of the split, such as "
        "train[:10000])",
    )
    assert leftovers(tmp_path) == []


async def test_two_revisions_and_a_slice(hub, hub_env, tmp_path):
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        main = await imported(client, {"name": "main", "source": H.JSONL_DATASET, "split": "train"})
        v2 = await imported(client, {"name": "v2", "source": H.JSONL_DATASET, "split": "train", "revision": "v2"})
        part = await imported(client, {"name": "part", "source": H.JSONL_DATASET, "split": "validation[2:7]"})
        metas = {n: (await client.get(f"/datasets/{n}")).json() for n in ("main", "v2", "part")}
    assert [d["state"] for d in (main, v2, part)] == ["succeeded"] * 3
    refs = hub.datasets[H.JSONL_DATASET].refs
    assert [(m["source"]["revision"], m["source"]["sha"], m["rows"]) for m in metas.values()] == [
        ("main", refs["main"], 30),
        ("v2", refs["v2"], 20),
        ("main", refs["main"], 5),
    ]
    assert (metas["part"]["source"]["split"], metas["part"]["source"]["files"]) == ("validation[2:7]", ["data/dev.csv"])
    assert metas["v2"]["sha256"] != metas["main"]["sha256"]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"name": "x", "source": "/etc/passwd"}, "source: String should match pattern"),
        (
            {"name": "x", "source": H.IMDB_REPO, "split": "train[:10%]"},
            "split: split 'train[:10%]' is not a split name",
        ),
        ({"name": "x", "source": H.IMDB_REPO, "revision": "../x"}, "revision: must be a branch, tag or commit"),
        (
            {"name": "x", "source": H.IMDB_REPO, "kind": "retrieval"},
            "kind: Input should be 'labelled', 'token-labelled'",
        ),
        ({"name": "x", "source": H.IMDB_REPO, "columns": {"a": 1}}, "columns.a: Input should be a valid string"),
        ({"name": "x", "source": H.IMDB_REPO, "path": "/data"}, "path: Extra inputs are not permitted"),
        (
            {"name": "x", "source": H.IMDB_REPO, "splt": "train"},
            "splt: Extra inputs are not permitted (did you mean 'split'?)",
        ),
        ({"name": "../x", "source": H.IMDB_REPO}, "name: must be a plain name"),
    ],
)
async def test_bad_requests(hub_env, tmp_path, body, message):
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        r = await client.post("/datasets", json=body)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert message in r.json()["error"], r.json()
    assert not (tmp_path / "data" / "jobs").exists() or not list((tmp_path / "data" / "jobs").iterdir())


async def test_a_name_taken_or_being_imported_is_a_conflict(hub_env, tmp_path):
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        r = await client.post("/datasets", files={"file": ("d.csv", b"text,label\na,x\nb,y\n")}, data={"name": "taken"})
        assert r.status_code == 201
        r = await client.post("/datasets", json={"name": "taken", "source": H.IMDB_REPO})
        assert r.json() == {
            "error": "name: dataset 'taken' already exists (datasets are never replaced; upload under another name, "
            "or delete it first)",
            "error_type": "conflict",
        }
        record = Imports(tmp_path / "data").submit_dataset(DatasetImport("busy", H.IMDB_REPO), ANONYMOUS, start=False)
        r = await client.post("/datasets", json={"name": "busy", "source": H.IMDB_REPO})
        assert (r.status_code, r.json()) == (
            409,
            {"error": f"dataset 'busy' is being imported by job {record['id']}", "error_type": "conflict"},
        )


async def test_an_unfinished_import_resumes_when_the_api_starts(hub, hub_env, tmp_path):
    """A queued import, and one whose process died while writing (its lease free, half a dataset staged in its job's
    folder), run when the API starts: the staged half is dropped, the datasets made whole."""
    from datadir import jobs as transitions

    s = settings(tmp_path)
    imports = Imports(s.data_dir)
    queued = imports.submit_dataset(DatasetImport("later", H.IMDB_REPO, split="test"), ANONYMOUS, start=False)
    died = imports.submit_dataset(DatasetImport("again", H.CONLL_REPO, split="train"), ANONYMOUS, start=False)
    imports.records.move(died["id"], transitions.start, "a-dead-api:1")
    half = imports.records.job_dir(died["id"]) / "dataset"
    half.mkdir()
    (half / "data.jsonl").write_text('{"tokens": ["half"], "tags": ["O"]}\n')
    async with serve_app(s, wait_ready=False) as client:
        client.app.state.imports.wait(timeout=120)
        for record, name, rows in ((queued, "later", 10), (died, "again", 26)):
            done = (await client.get(f"/jobs/{record['id']}")).json()
            assert done["state"] == "succeeded", done["error"]
            assert (await client.get(f"/datasets/{name}")).json()["sentences" if name == "again" else "rows"] == rows
        assert done["attempts"] == 2 and "attempt did not finish" in [e["event"] for e in done["events"]]
    assert leftovers(tmp_path) == []


def test_a_cancel_stops_the_rows_being_written(hub, hub_env, tmp_path, monkeypatch):
    """A cancel asked for while the rows are written ends the job cancelled, with no dataset and nothing staged."""
    imports = Imports(tmp_path)
    record = imports.submit_dataset(DatasetImport("c", H.IMDB_REPO, split="train"), ANONYMOUS, start=False)
    checked = []
    original = Imports._cancel_point

    def cancel_then_check(self, job_id):
        checked.append(job_id)
        self.records.request_cancel(job_id)
        original(self, job_id)

    monkeypatch.setattr(Imports, "_cancel_point", cancel_then_check)
    monkeypatch.setattr(hub_rows, "REPORT_EVERY", 5)
    assert imports.run(record["id"]) == "cancelled"
    after = imports.records.read(record["id"])
    assert (after["state"], checked) == ("cancelled", [record["id"]])
    assert after["events"][-1]["event"] == "cancelled"
    assert [p.name for p in (tmp_path / "datasets").iterdir()] == []
    assert not (imports.records.job_dir(record["id"]) / "dataset").exists()


async def test_offline_an_import_comes_from_the_cache(hub, hub_env, tmp_path, monkeypatch):
    from huggingface_hub import constants

    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        online = await imported(client, {"name": "online", "source": H.SQUAD_REPO, "split": "train"})
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        before = len(hub.requests)
        offline = await imported(client, {"name": "offline", "source": H.SQUAD_REPO, "split": "train"})
        missing = await imported(client, {"name": "missing", "source": H.SQUAD_REPO, "split": "validation"})
        metas = [(await client.get(f"/datasets/{n}")).json() for n in ("online", "offline")]
    assert (online["state"], offline["state"]) == ("succeeded", "succeeded")
    assert metas[0]["sha256"] == metas[1]["sha256"] and metas[0]["source"] == metas[1]["source"]
    assert (missing["state"], missing["error"]) == (
        "failed",
        f"HF_HUB_OFFLINE is set and split validation of {H.SQUAD_REPO} (subset plain_text) is not in the Hugging "
        f"Face cache (HF_HOME); {DATASET_INSTEAD_OFFLINE}",
    )
    assert hub.requests[before:] == []


SECRETS = {name: new_secret() for name in ("tight", "busy")}
KEYS = {
    "tight": Key("tight", hash_secret(SECRETS["tight"]), frozenset({"jobs"}), disk_gb=2e-6),
    "busy": Key("busy", hash_secret(SECRETS["busy"]), frozenset({"jobs"}), max_jobs=1),
}


async def test_a_keys_quota_and_its_jobs_bound_its_imports(hub, hub_env, tmp_path):
    keys_file = tmp_path / "keys.toml"
    write_keys(keys_file, dict(KEYS))
    async with serve_app(settings(tmp_path, keys_file=keys_file), wait_ready=False) as client:
        auth = {"Authorization": f"Bearer {SECRETS['tight']}"}
        r = await client.post("/datasets", json={"name": "big", "source": H.SQUAD_REPO, "split": "train"}, headers=auth)
        assert r.status_code == 202
        client.app.state.imports.wait(timeout=120)
        done = (await client.get(f"/jobs/{r.json()['id']}", headers=auth)).json()
        assert done["state"] == "failed"
        assert done["error"].startswith("key 'tight' holds ")
        assert "and this dataset needs about " in done["error"] and "disk quota of 2e-06 GB" in done["error"]
        busy = {"Authorization": f"Bearer {SECRETS['busy']}"}
        JobRecords(tmp_path / "data").create({"kind": "finetune", "model_name": "m", "params": {}, "owner": "busy"})
        r = await client.post("/datasets", json={"name": "y", "source": H.IMDB_REPO, "split": "test"}, headers=busy)
        assert (r.status_code, r.json()["error_type"]) == (429, "overloaded")
    assert json.loads((tmp_path / "data" / "jobs" / done["id"] / "job.json").read_text())["owner"] == "tight"
