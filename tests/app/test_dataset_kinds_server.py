"""The retrieval-training dataset kinds (pairs, scored-pairs, retrieval) through POST /datasets on a real
uvicorn: each kind's good upload and its meta.json, each refusal with its exact 422 body and nothing left
behind, listing and deleting them as any dataset, and a job refused on a kind its task does not train on."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path

import httpx
import pytest

from app.jobs.dataset_checks import MAX_EXAMPLE_CHARS, MAX_NEGATIVES
from tests.helpers import ROOT, finetune_request, make_data_dir, start_server

pytestmark = pytest.mark.slow  # a uvicorn process

NO_BROKER = "redis://127.0.0.1:1/0"
MAX_BYTES = 3_000_000
EXAMPLES = ROOT / "examples" / "data"
PAIRS_RULE = "columns anchor, positive and optionally negative or negative_1 .. negative_n"
SCORED_RULE = "columns sentence1, sentence2 and score"
RETRIEVAL_RULE = (
    "a BEIR folder's corpus.jsonl, queries.jsonl and qrels, in a .zip or .tar.gz; or one JSONL of documents and queries"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    data_dir = make_data_dir(root / "data")
    process, url = start_server(data_dir, NO_BROKER, root, BERT_MAX_DATASET_BYTES=str(MAX_BYTES))
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client, data_dir
    finally:
        process.stop()


def upload(client: httpx.Client, filename: str, body: bytes, **fields: str) -> httpx.Response:
    return client.post("/datasets", files={"file": (filename, body)}, data=fields)


def jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def beir_archive(files: dict[str, bytes], kind: str = "tar.gz", top: str = "mini") -> bytes:
    """A .tar.gz (or .zip) of a BEIR folder named `top` holding `files` (relative path -> bytes)."""
    out = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in files.items():
                zf.writestr(f"{top}/{name}" if top else name, data)
        return out.getvalue()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}" if top else name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def example_beir() -> dict[str, bytes]:
    folder = EXAMPLES / "beir-mini"
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*.*"))}


def example_rows(filename: str) -> list[dict]:
    with open(EXAMPLES / filename, newline="") as f:
        return list(csv.DictReader(f))


def mean_chars(filename: str, columns: list[str]) -> dict[str, float]:
    rows = example_rows(filename)
    return {c: round(sum(len(r[c]) for r in rows) / len(rows), 1) for c in columns}


def qrels(rows) -> bytes:
    return ("query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{c}\t{s}\n" for q, c, s in rows)).encode()


def described(r: httpx.Response, filename: str, body: bytes) -> dict:
    """The upload's answer less what every dataset has (checked here): its own counts and format."""
    assert r.status_code == 201, r.text
    meta = r.json()
    common = {
        "original_filename": filename,
        "bytes": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "owner": "anonymous",  # no keys: the open service's caller
        "shared": True,
    }
    assert {k: meta[k] for k in common} == common and meta["created_at"] and meta["disk_bytes"] > 0
    return {
        k: v for k, v in meta.items() if k not in common and k not in ("created_at", "disk_bytes") and v is not None
    }


def test_good_uploads_of_each_kind(server):
    client, data_dir = server
    body = (EXAMPLES / "pairs.csv").read_bytes()
    assert described(upload(client, "pairs.csv", body), "pairs.csv", body) == {
        "name": "pairs",
        "kind": "pairs",
        "format": "csv",
        "file": "data.csv",
        "rows": 8,
        "negatives": 1,
        "ids": False,
        "distinct_anchors": 8,
        "mean_chars": mean_chars("pairs.csv", ["anchor", "positive", "negative"]),
    }
    rows = [
        {"id": i, "anchor": f"q{i % 3}", "positive": "yes", "negative_1": "no", "negative_2": "never"} for i in range(4)
    ]
    body = jsonl(rows)
    assert described(upload(client, "hard.jsonl", body), "hard.jsonl", body) == {
        "name": "hard",
        "kind": "pairs",
        "format": "jsonl",
        "file": "data.jsonl",
        "rows": 4,
        "negatives": 2,
        "ids": True,
        "distinct_anchors": 3,
        "mean_chars": {"anchor": 2.0, "positive": 3.0, "negative": 3.5},
    }
    body = (EXAMPLES / "stsb.csv").read_bytes()
    assert described(upload(client, "stsb.csv", body), "stsb.csv", body) == {
        "name": "stsb",
        "kind": "scored-pairs",
        "format": "csv",
        "file": "data.csv",
        "rows": 8,
        "mean_score": round(sum(float(r["score"]) for r in example_rows("stsb.csv")) / 8, 4),
        "mean_chars": mean_chars("stsb.csv", ["sentence1", "sentence2"]),
    }
    body = (EXAMPLES / "retrieval.jsonl").read_bytes()
    assert described(upload(client, "retrieval.jsonl", body), "retrieval.jsonl", body) == {
        "name": "retrieval",
        "kind": "retrieval",
        "format": "jsonl",
        "file": "data.jsonl",
        "queries": 3,
        "documents": 4,
        "judgements": 3,
        "split": "test",
        "splits": ["test"],
    }
    beir = {"format": "beir", "file": "data", "queries": 5, "documents": 6, "judgements": 5, "split": "test"}
    for filename, archive in (
        ("beir-mini.tar.gz", beir_archive(example_beir())),
        ("beir-flat.zip", beir_archive(example_beir(), "zip", top="")),
    ):
        name = filename.split(".")[0]
        meta = described(upload(client, filename, archive), filename, archive)
        assert meta == {"name": name, "kind": "retrieval", **beir, "splits": ["test"]}
        stored = data_dir / "datasets" / name / "data"
        assert sorted(p.relative_to(stored).as_posix() for p in stored.rglob("*")) == [
            "corpus.jsonl",
            "qrels",
            "qrels/test.tsv",
            "queries.jsonl",
        ]
        assert not (data_dir / "datasets" / name / f"data{filename[len(name) :]}").exists()  # the archive is not kept

    listed = {d["name"]: d["kind"] for d in client.get("/datasets").json()["datasets"]}
    assert listed == {
        "pairs": "pairs",
        "hard": "pairs",
        "stsb": "scored-pairs",
        "retrieval": "retrieval",
        "beir-mini": "retrieval",
        "beir-flat": "retrieval",
    }
    r = client.delete("/datasets/beir-mini")
    assert r.status_code == 200 and r.json()["freed_bytes"] > 0
    assert not (data_dir / "datasets" / "beir-mini").exists()


def test_splits_are_each_checked_and_test_is_the_one_evaluated(server):
    client, _ = server
    files = {**example_beir(), "qrels/train.tsv": qrels([("q1", "d2", 1)]), "qrels/dev.tsv": qrels([("q2", "d2", 1)])}
    archive = beir_archive(files)
    meta = described(upload(client, "splits.tgz", archive), "splits.tgz", archive)
    assert (meta["split"], meta["splits"], meta["queries"]) == ("test", ["dev", "test", "train"], 5)


def test_a_job_needs_a_kind_its_task_trains_on(server):
    client, _ = server
    for name, filename in (("p", "pairs.csv"), ("r", "retrieval.jsonl")):
        assert upload(client, filename, (EXAMPLES / filename).read_bytes(), name=name).status_code == 201
    r = client.post("/jobs", json=finetune_request("m", dataset="p"))
    assert (r.status_code, r.json()) == (
        422,
        {
            "error": "dataset: 'p' is a pairs dataset; task sequence-classification needs a labelled one",
            "error_type": "validation",
        },
    )
    r = client.post("/jobs", json=finetune_request("m", dataset="r", task="token-classification"))
    assert r.json() == {
        "error": "dataset: 'r' is a retrieval dataset; task token-classification needs a token-labelled one "
        "(a retrieval dataset is for evaluation only)",
        "error_type": "validation",
    }


NEGATIVES = ",".join(f"negative_{i}" for i in range(1, MAX_NEGATIVES + 2))
BAD = [
    (
        ("a.csv", b"anchor,pos\nhello,hi\n", {"kind": "pairs"}),
        f"file: not a usable pairs file ({PAIRS_RULE}): the file: missing column(s) ['positive']; found ['anchor', 'pos']",
    ),
    (
        ("a.csv", b"anchor,positive\nhello,hi\n ,hi\n", {}),
        f"file: not a usable pairs file ({PAIRS_RULE}): the file, line 3: 'anchor' is empty or not text: ' '",
    ),
    (
        ("a.tsv", b"anchor\tpositive\tnegative_1\tnegative_3\na\tb\tc\td\n", {}),
        f"file: not a usable pairs file ({PAIRS_RULE}): the file: the negative columns are negative_1, negative_3; "
        "they are numbered negative_1 .. negative_n without gaps (here negative_1, negative_2)",
    ),
    (
        (
            "a.jsonl",
            jsonl(
                [
                    {"anchor": "a", "positive": "b", "negative_1": "c", "negative_2": "d"},
                    {"anchor": "e", "positive": "f", "negative_1": "g"},
                ]
            ),
            {},
        ),
        f"file: not a usable pairs file ({PAIRS_RULE}): the file, line 2: no 'negative_2', which line 1 has: "
        "every row needs the same 2 negatives (negative_1, negative_2)",
    ),
    (
        ("a.csv", f"anchor,positive,{NEGATIVES}\n".encode() + b"a,b" + b",n" * (MAX_NEGATIVES + 1) + b"\n", {}),
        f"file: {MAX_NEGATIVES + 1} negatives a row, more than the {MAX_NEGATIVES} a pair may have",
    ),
    (
        ("a.csv", b"anchor,positive\nhello,hi\nhey," + b"x" * MAX_EXAMPLE_CHARS + b"\n", {}),
        f"file: row 2's text is longer than {MAX_EXAMPLE_CHARS} characters, the most one example may hold",
    ),
    (
        ("s.csv", b"sentence1,sentence2,score\na,b,0.5\nc,d,4.2\n", {}),
        f"file: not a usable scored-pairs file ({SCORED_RULE}): the file, line 3: 'score' is '4.2', not a number in "
        "0..1 (scale scores given on another range, such as STS-B's 0-5, to 0..1)",
    ),
    (
        ("s.csv", b"sentence1,sentence2,label\na,b,1\n", {"kind": "scored-pairs"}),
        f"file: not a usable scored-pairs file ({SCORED_RULE}): the file: missing column(s) ['score']; "
        "found ['label', 'sentence1', 'sentence2']",
    ),
    (
        ("r.csv", b"query,positive_ids\n", {"kind": "retrieval"}),
        "kind: a retrieval dataset cannot be a .csv file (corpus: .txt, .jsonl; labelled: .csv, .tsv, .jsonl; "
        "token-labelled: .txt, .tsv, .jsonl, .conll, .iob, .iob2, .bio; qa: .json; pairs: .csv, .tsv, .jsonl; "
        "scored-pairs: .csv, .tsv, .jsonl; retrieval: .jsonl, .tar, .tar.gz, .tgz, .zip)",
    ),
]
EXAMPLE = example_beir()
BAD_RETRIEVAL = [
    (
        {**EXAMPLE, "corpus.jsonl": EXAMPLE["corpus.jsonl"] + b'{"_id": "d1", "text": "again"}\n'},
        "corpus.jsonl, line 7: duplicate document _id 'd1'",
    ),
    (
        {**EXAMPLE, "queries.jsonl": EXAMPLE["queries.jsonl"] + b'{"_id": "q1", "text": "again"}\n'},
        "queries.jsonl, line 6: duplicate query _id 'q1'",
    ),
    (
        {**EXAMPLE, "qrels/test.tsv": qrels([("q1", "d1", 1), ("q7", "d1", 1)])},
        "qrels/test.tsv, line 3: query-id 'q7' is not an _id of queries.jsonl",
    ),
    (
        {**EXAMPLE, "qrels/test.tsv": qrels([("q1", "d9", 1)])},
        "qrels/test.tsv, line 2: corpus-id 'd9' is not an _id of corpus.jsonl",
    ),
    (
        {**EXAMPLE, "qrels/test.tsv": qrels([("q1", "d1", 1), ("q2", "d2", 0)])},
        "qrels/test.tsv: 1 judged query has no relevant document (every score 0), the first 'q2': "
        "give each at least one score above 0",
    ),
    (
        {**EXAMPLE, "queries.jsonl": b'{"_id": "q1", "text": ""}\n'},
        "queries.jsonl, line 1: 'text' is empty or not text: ''",
    ),
    (
        {**EXAMPLE, "corpus.jsonl": b'{"_id": "d1", "title": "", "text": "  "}\n'},
        "corpus.jsonl, line 1: the document has no text (its 'text' and 'title' are empty)",
    ),
    (
        {**EXAMPLE, "../evil.txt": b"x"},
        "the archive: refused: member 'mini/../evil.txt' would be written outside the dataset's folder",
    ),
    ({**EXAMPLE, **{f"extra/{i}.txt": b"x" for i in range(100)}}, "the archive: refused: more than 100 members"),
    (
        {**EXAMPLE, "big.txt": b"x" * MAX_BYTES},
        f"the archive: refused: it would extract to more than {MAX_BYTES:,} bytes",
    ),
    (
        {"notes.txt": b"x"},
        "the archive holds no BEIR folder (corpus.jsonl, queries.jsonl and qrels at its top, or in one folder)",
    ),
    (
        {key: value for key, value in EXAMPLE.items() if key != "qrels/test.tsv"},
        "the file: no relevance judgements: expected qrels.tsv or qrels/<split>.tsv",
    ),
]
CASES = BAD + [
    (("bad.tar.gz", beir_archive(files), {}), f"file: not a usable retrieval set ({RETRIEVAL_RULE}): {message}")
    for files, message in BAD_RETRIEVAL
]
CASES.append(
    (
        ("bad.jsonl", jsonl([{"query": "q", "positive_ids": ["d9"]}, {"_id": "d1", "text": "t"}]), {}),
        f"file: not a usable retrieval set ({RETRIEVAL_RULE}): the file, line 1: positive id 'd9' is not the _id of any document",
    )
)


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize("upload_, message", CASES, ids=[m[:60] for _, m in CASES])
def test_bad_uploads_are_a_422_that_says_why_and_leave_nothing(server, upload_, message):
    client, data_dir = server
    before = tree(data_dir / "datasets") if (data_dir / "datasets").exists() else []
    filename, body, fields = upload_
    r = upload(client, filename, body, **{"name": "bad", **fields})
    assert (r.status_code, r.json()) == (422, {"error": message, "error_type": "validation"})
    assert tree(data_dir / "datasets") == before
    assert not (data_dir.parent / "evil.txt").exists()
