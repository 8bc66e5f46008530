"""Mining hard negatives as a job of the API, against a real uvicorn (no worker, no broker: the API runs it):
the published pairs dataset's negatives are what sentence-transformers' mine_hard_negatives gives on the same
rows with the served model's directory and the same options (its own corpus, a retrieval set as corpus,
random sampling with a seed); its meta is an upload's, owned by the job's key; another key may neither mine
from the dataset nor see the job or what it made; a cancel publishes nothing; a server killed (-9) mid-run
resumes and publishes what a straight run does. The bounds are refused with exact bodies (an in-process app
with small limits)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest

from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from app.keys.ownership import DATASET_RULE
from model.modeling import BertModel
from model.sentence_modules import SentenceModules, write_sentence_modules
from tests.app.conftest import WORDS, save_tiny, serve_app, settings_for
from tests.helpers import start_server, wait_for

pytestmark = pytest.mark.slow
NO_BROKER = "redis://127.0.0.1:1/0"  # nothing listens there: mining needs no worker
MODEL = "tiny-st"
# sentence-transformers mines with "query" and "document" prompts (never "passage", nor the default): the
# anchors get the query prompt, the corpus no prompt at all
PROMPTS = {"prompts": {"query": "the big dog ", "passage": "a red car "}, "default_prompt_name": "passage"}
SECRETS = {name: new_secret() for name in ("alice", "bob", "boss")}
KEYS = {
    "alice": Key("alice", hash_secret(SECRETS["alice"]), frozenset({"inference", "jobs"})),
    "bob": Key("bob", hash_secret(SECRETS["bob"]), frozenset({"inference", "jobs"})),
    "boss": Key("boss", hash_secret(SECRETS["boss"]), frozenset({"inference", "jobs", "admin"})),
}
DONE = ("succeeded", "failed", "cancelled")


def save_model(models: Path) -> Path:
    """A tiny encoder with mean pooling, Normalize and "query"/"passage" prompts (and the latter its default),
    as sentence-transformers saves one."""
    save_tiny(models / MODEL, BertModel, seed=3)
    write_sentence_modules(models / MODEL, SentenceModules())
    (models / MODEL / "config_sentence_transformers.json").write_text(json.dumps(PROMPTS))
    return models / MODEL


def texts(rng: random.Random, n: int) -> list[str]:
    words = [w for w in WORDS if w.isalpha()]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 7))) for _ in range(n)]


def pairs(n: int, seed: int = 0) -> list[dict]:
    """n anchors with a positive and a negative; the first also paired with a second positive, the second with
    the third anchor (an anchor that is a corpus text)."""
    rng = random.Random(seed)
    anchors, positives, negatives = texts(rng, n), texts(rng, n + 1), texts(rng, n + 2)
    rows = [{"anchor": a, "positive": p, "negative": q} for a, p, q in zip(anchors, positives, negatives)]
    return [
        *rows,
        {"anchor": anchors[0], "positive": positives[n], "negative": negatives[n]},
        {"anchor": anchors[1], "positive": anchors[2], "negative": negatives[n + 1]},
    ]


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def upload(client: httpx.Client, name: str, body: bytes, kind: str = "pairs") -> dict:
    r = client.post("/datasets", files={"file": (f"{name}.jsonl", body)}, data={"name": name, "kind": kind})
    assert r.status_code == 201, r.text
    return r.json()


def mine_job(model: str = MODEL, dataset: str = "faq", name: str = "faq-hard", **params) -> dict:
    corpus = params.pop("corpus", None)
    return {
        "kind": "mine-negatives",
        "model": model,
        "dataset": dataset,
        "name": name,
        "corpus": corpus,
        "params": params,
    }


def finished(client: httpx.Client, job_id: str, timeout: float = 120) -> dict:
    return wait_for(lambda: (j := client.get(f"/jobs/{job_id}").json())["state"] in DONE and j, timeout, job_id)


def mined_rows(data_dir: Path, name: str) -> list[tuple[str, str, list[str]]]:
    rows = [json.loads(line) for line in (data_dir / "datasets" / name / "data.jsonl").read_text().splitlines()]
    return [(r["anchor"], r["positive"], [v for k, v in r.items() if k.startswith("negative_")]) for r in rows]


def reference_rows(model_dir: Path, rows: list[dict], corpus: list[str], **options) -> list:
    """sentence-transformers' mine_hard_negatives on the same rows, model directory and options."""
    pytest.importorskip("datasets", reason="mine_hard_negatives takes a datasets.Dataset (the test extra)")
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    seed = options.pop("seed", None)
    if seed is not None:
        random.seed(seed)  # the reference draws from the global generator
    dataset = Dataset.from_dict({"anchor": [r["anchor"] for r in rows], "positive": [r["positive"] for r in rows]})
    model = SentenceTransformer(str(model_dir), device="cpu")
    found = mine_hard_negatives(dataset, model, corpus=corpus, output_format="n-tuple", verbose=False, **options)
    columns = [c for c in found.column_names if c.startswith("negative_")]
    return [(r["anchor"], r["positive"], [r[c] for c in columns]) for r in found]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("mining")
    model_dir = save_model(root / "models")
    keys_file = root / "keys.toml"
    write_keys(keys_file, dict(KEYS))
    server, url = start_server(root, NO_BROKER, root, BERT_KEYS_FILE=str(keys_file), BERT_BATCH_CONCURRENCY="1")
    clients = {
        name: httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {secret}"})
        for name, secret in SECRETS.items()
    }
    try:
        yield clients, root, model_dir
    finally:
        for client in clients.values():
            client.close()
        server.stop()


def test_the_published_negatives_are_sentence_transformers(served):
    clients, root, model_dir = served
    alice = clients["alice"]
    rows = pairs(30)
    upload(alice, "faq", jsonl(rows))
    options = {"num_negatives": 2, "range_min": 2, "max_score": 0.9}
    r = alice.post("/jobs", json=mine_job(**options))
    assert r.status_code == 202, r.text
    job = finished(alice, r.json()["id"])
    assert job["state"] == "succeeded", job["error"]
    expected = reference_rows(model_dir, rows, [r["negative"] for r in rows], **options)
    assert 0 < len(expected) < 32 and mined_rows(root, "faq-hard") == expected  # some dropped: too few left
    assert (job["kind"], job["base_model"], job["dataset"], job["model_name"]) == ("mine-negatives", MODEL, "faq", "")
    corpus = {r["negative"] for r in rows} | {r["positive"] for r in rows}
    assert (job["result"]["anchors"], job["result"]["corpus"]) == (30, len(corpus))
    assert job["step"] == job["total_steps"] == 30 + len(corpus)  # every anchor and corpus text embedded
    prompts = {
        k: job["params"][k] for k in ("query_prompt_name", "query_prompt", "corpus_prompt_name", "corpus_prompt")
    }
    assert prompts == {
        "query_prompt_name": "query",
        "query_prompt": None,
        "corpus_prompt_name": None,
        "corpus_prompt": "",
    }
    assert job["result"]["rows"] == len(expected) and job["result"]["dropped"] == 32 - len(expected)
    assert job["result"]["dataset"] == "faq-hard" and job["result"]["range_max"] == 2 + 2 * 10 + 2
    assert not (root / "jobs" / job["id"] / "embeddings.f32").exists()
    meta = alice.get("/datasets/faq-hard").json()
    assert (meta["kind"], meta["format"], meta["owner"], meta["shared"]) == ("pairs", "jsonl", "alice", False)
    assert (meta["rows"], meta["negatives"], meta["original_filename"]) == (len(expected), 2, "faq-hard.jsonl")


def test_a_retrieval_corpus_and_random_sampling_are_sentence_transformers(served):
    clients, root, model_dir = served
    boss = clients["boss"]
    rows = pairs(20, seed=1)
    documents = texts(random.Random(2), 50)
    retrieval = [{"_id": f"d{i}", "text": t} for i, t in enumerate(documents)]
    retrieval += [{"query": "the cat sat", "positive_ids": ["d0"]}]
    upload(boss, "faq2", jsonl(rows))
    upload(boss, "docs", jsonl(retrieval), kind="retrieval")
    options = {"num_negatives": 3, "range_min": 1, "range_max": 12, "sampling_strategy": "random", "seed": 11}
    job = finished(
        boss, boss.post("/jobs", json=mine_job(dataset="faq2", name="faq2-hard", corpus="docs", **options)).json()["id"]
    )
    assert job["state"] == "succeeded", job["error"]
    assert mined_rows(root, "faq2-hard") == reference_rows(model_dir, rows, documents, **options)
    assert boss.get("/datasets/faq2-hard").json()["shared"] is True  # an admin's, as an admin's upload


def test_another_keys_dataset_job_and_result_are_not_its_to_use(served):
    clients, _, _ = served
    alice, bob = clients["alice"], clients["bob"]
    upload(alice, "alice-pairs", jsonl(pairs(5, seed=3)))
    r = bob.post("/jobs", json=mine_job(dataset="alice-pairs", name="stolen"))
    assert (r.status_code, r.json()) == (
        403,
        {"error": f"dataset: 'alice-pairs' is not this key's to use: {DATASET_RULE}", "error_type": "forbidden"},
    )
    upload(bob, "bob-pairs", jsonl(pairs(5, seed=4)))
    r = bob.post("/jobs", json=mine_job(dataset="bob-pairs", name="stolen", corpus="alice-pairs"))
    assert (r.status_code, r.json()["error"]) == (
        403,
        f"corpus: 'alice-pairs' is not this key's to use: {DATASET_RULE}",
    )
    job_id = alice.post("/jobs", json=mine_job(dataset="alice-pairs", name="alice-hard", range_min=0)).json()["id"]
    assert finished(alice, job_id)["state"] == "succeeded"
    assert bob.get(f"/jobs/{job_id}").json() == {"error": f"job '{job_id}' not found", "error_type": "not_found"}
    assert bob.get("/datasets/alice-hard").status_code == 404  # alice's, not shared
    r = bob.post("/jobs", json=mine_job(dataset="bob-pairs", name="alice-hard"))
    assert r.status_code == 409 and r.json()["error"].startswith("name: dataset 'alice-hard' already exists")


def test_a_cancelled_job_publishes_nothing(served):
    clients, root, _ = served
    alice = clients["alice"]
    upload(alice, "many", jsonl(pairs(3000, seed=5)))
    job_id = alice.post("/jobs", json=mine_job(dataset="many", name="many-hard")).json()["id"]
    queued = alice.post("/jobs", json=mine_job(dataset="many", name="many-hard-2")).json()["id"]  # waits its turn
    wait_for(lambda: alice.get(f"/jobs/{job_id}").json()["step"] > 0, 60, "the first chunk")
    assert alice.post(f"/jobs/{queued}/cancel").json()["state"] == "cancelled"  # at once: it had not started
    assert alice.post(f"/jobs/{job_id}/cancel").status_code == 202
    job = finished(alice, job_id)
    assert job["state"] == "cancelled" and 0 < job["step"] <= job["total_steps"]
    assert alice.get("/datasets/many-hard").status_code == 404 and not (root / "datasets" / "many-hard").exists()
    assert not (root / "jobs" / job_id / "embeddings.f32").exists()
    assert alice.post(f"/jobs/{job_id}/cancel").status_code == 409


def test_kill_9_mid_run_resumes_and_publishes_what_a_straight_run_does(tmp_path):
    save_model(tmp_path / "models")
    env = {"BERT_BATCH_CONCURRENCY": "1"}  # a request's rows pass alone: vectors independent of timing
    server, url = start_server(tmp_path, NO_BROKER, tmp_path, **env)
    client = httpx.Client(base_url=url, timeout=60)
    try:
        upload(client, "many", jsonl(pairs(2500, seed=6)))
        job_id = client.post("/jobs", json=mine_job(dataset="many", name="resumed")).json()["id"]
        wait_for(lambda: client.get(f"/jobs/{job_id}").json()["step"] >= 1024, 60, "two chunks")
        server.kill()  # SIGKILL, mid-embedding
        server, url = start_server(tmp_path, NO_BROKER, tmp_path, **env)
        client = httpx.Client(base_url=url, timeout=60)
        job = finished(client, job_id)
        straight = finished(client, client.post("/jobs", json=mine_job(dataset="many", name="straight")).json()["id"])
    finally:
        server.stop()
    assert (job["state"], job["attempts"], straight["state"]) == ("succeeded", 2, "succeeded")
    assert [e["event"] for e in job["events"]][-3:] == ["attempt did not finish", "started", "succeeded"]
    assert mined_rows(tmp_path, "resumed") == mined_rows(tmp_path, "straight")
    assert job["result"] | {"dataset": "x", "sha256": "x"} == straight["result"] | {"dataset": "x", "sha256": "x"}


@pytest.mark.anyio
async def test_the_bounds_are_refused_with_the_numbers(tmp_path):
    save_model(tmp_path / "models")
    settings = settings_for(
        tmp_path,
        default_model=MODEL,
        mine_max_anchors=40,
        mine_max_corpus=200,
        mine_max_negatives=5,
        mine_max_range=100,
        mine_max_memory_gb=0.00005,
    )
    async with serve_app(settings) as c:
        for name, body, kind in [
            ("faq", jsonl(pairs(30)), "pairs"),
            ("wide", jsonl(pairs(88, seed=1)), "pairs"),
            ("labels", b'{"text": "a cat", "label": "x"}\n{"text": "a dog", "label": "y"}\n', "labelled"),
        ]:
            r = await c.post("/datasets", files={"file": (f"{name}.jsonl", body)}, data={"name": name, "kind": kind})
            assert r.status_code == 201, r.text

        async def refused(status: int, message: str, **job) -> None:
            r = await c.post("/jobs", json=mine_job(**job))
            assert (r.status_code, r.json()) == (
                status,
                {"error": message, "error_type": {403: "forbidden", 409: "conflict", 422: "validation"}[status]},
            )

        await refused(
            422,
            "params.num_negatives: 6 is more than this service allows (5, BERT_MINE_MAX_NEGATIVES)",
            num_negatives=6,
        )
        await refused(
            422,
            "params: the job would look 125 ranks deep (range_min 95 + num_negatives 3 x 10, as a filter is set), more "
            "than this service allows (100, BERT_MINE_MAX_RANGE)",
            range_min=95,
            max_score=0.9,
        )
        await refused(
            422,
            "params: the job would look 101 ranks deep (range_max 101), more than this service allows (100, "
            "BERT_MINE_MAX_RANGE)",
            range_max=101,
        )
        await refused(
            422,
            "dataset: 'wide' has 88 distinct anchors, more than a mining job may embed (40, BERT_MINE_MAX_ANCHORS)",
            dataset="wide",
        )
        await refused(
            422,
            "corpus: 212 texts to search (the corpus's texts and the positives), more than a mining job may embed "
            "(200, BERT_MINE_MAX_CORPUS)",
            corpus="wide",
        )
        await refused(
            422,
            "params: the job is too large: an estimated 84.9 KB for its embeddings (94 texts x 32 dimensions, "
            "float32: 11.8 KB) and candidates (30 anchors x 104 candidates: 73.1 KB) is more than the limit of "
            "52.4 KB (BERT_MINE_MAX_MEMORY_GB)",
            range_max=100,
        )
        await refused(
            422,
            "mine-negatives.params: cannot mine 3 negatives per anchor: only 2 candidates remain after skipping "
            "the first range_min=10 of range_max=12",
            range_max=12,
        )
        await refused(
            422,
            "mine-negatives.params: send query_prompt_name or query_prompt, not both",
            query_prompt_name="query",
            query_prompt="q: ",
        )
        await refused(
            422,
            f"params.corpus_prompt_name: 'doc' is not a prompt of model '{MODEL}'; its prompts: passage, query",
            corpus_prompt_name="doc",
        )
        await refused(422, "model: model 'nope' not found in DATA_DIR/models", model="nope")
        await refused(422, "dataset: 'labels' is a labelled dataset; a mining job needs a pairs one", dataset="labels")
        await refused(
            422, "corpus: 'labels' is a labelled dataset; a mining job needs a pairs or retrieval one", corpus="labels"
        )
        await refused(422, "dataset: 'gone' not found (upload it with POST /datasets)", dataset="gone")
        await refused(
            409,
            "name: dataset 'wide' already exists (datasets are never replaced; upload under another name, or delete "
            "it first)",
            name="wide",
        )
        assert list((tmp_path / "jobs").glob("[0-9]*")) == []  # nothing was queued
