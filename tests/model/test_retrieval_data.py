"""Tests for model/data/retrieval_data.py: BEIR folders and single JSONL files read into what
sentence-transformers' InformationRetrievalEvaluator takes (checked against a straight re-implementation of
BEIR's GenericDataLoader, and by building the evaluator itself), the exact text of every refusal, and
archives unpacked under the caps of model/sources.py."""

from __future__ import annotations

import csv
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from model.data.retrieval_data import (
    RetrievalSet,
    default_split,
    load_retrieval,
    load_retrieval_splits,
    retrieval_splits,
    unpack_retrieval,
)
from model.errors import UserError

CORPUS = [
    {"_id": "d1", "title": "Passwords", "text": "Open Settings and choose Reset password."},
    {"_id": "d2", "title": "", "text": "We are open from 9 to 5."},
    {"_id": 3, "text": "Gifts can be returned within 30 days."},
    {"_id": "d4", "title": "Shipping only"},
]
QUERIES = [
    {"_id": "q1", "text": "reset my password"},
    {"_id": "q2", "text": "when are you open"},
    {"_id": "q3", "text": "can i return a gift"},
    {"_id": "q4", "text": "a training query"},
]
TEST_QRELS = [("q1", "d1", 1), ("q2", "d2", 2), ("q2", "d1", 0), ("q3", "3", 1)]
TRAIN_QRELS = [("q4", "d4", 1)]


def lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def qrels(rows) -> str:
    return "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{c}\t{s}\n" for q, c, s in rows)


def beir(root: Path, corpus=CORPUS, queries=QUERIES, splits=None, top: str | None = None) -> Path:
    """A BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv (or qrels.tsv, with `top`)."""
    root.mkdir(parents=True)
    (root / "corpus.jsonl").write_text(corpus if isinstance(corpus, str) else lines(corpus))
    (root / "queries.jsonl").write_text(queries if isinstance(queries, str) else lines(queries))
    if top is not None:
        (root / "qrels.tsv").write_text(top)
    for split, body in (
        splits if splits is not None else {"test": qrels(TEST_QRELS), "train": qrels(TRAIN_QRELS)}
    ).items():
        (root / "qrels").mkdir(exist_ok=True)
        (root / "qrels" / f"{split}.tsv").write_text(body)
    return root


def beir_reference(folder: Path, split: str) -> RetrievalSet:
    """What BEIR's GenericDataLoader.load(split) gives, in the evaluator's mappings: queries those the split's
    qrels name, a document's title and text joined, the documents judged above 0 relevant."""
    corpus, queries, judged = {}, {}, {}
    with open(folder / "corpus.jsonl") as f:
        for line in f:
            doc = json.loads(line)
            corpus[str(doc["_id"])] = (doc.get("title", "") + " " + doc.get("text", "")).strip()
    with open(folder / "queries.jsonl") as f:
        for line in f:
            query = json.loads(line)
            queries[query["_id"]] = query["text"]
    with open(folder / "qrels" / f"{split}.tsv") as f:
        reader = csv.reader(f, delimiter="\t")
        next(reader)
        for qid, cid, score in reader:
            judged.setdefault(qid, {})[cid] = int(score)
    relevant = {qid: {c for c, s in docs.items() if s > 0} for qid, docs in judged.items()}
    return RetrievalSet({qid: queries[qid] for qid in judged}, corpus, relevant)


def test_a_beir_folder_reads_as_beir_s_own_loader_reads_it(tmp_path):
    folder = beir(tmp_path / "set")
    assert retrieval_splits(folder) == {"test": folder / "qrels" / "test.tsv", "train": folder / "qrels" / "train.tsv"}
    test = load_retrieval(folder)
    assert test == beir_reference(folder, "test") == load_retrieval(folder, "test")
    assert test.queries == {"q1": "reset my password", "q2": "when are you open", "q3": "can i return a gift"}
    assert (
        test.corpus["d1"] == "Passwords Open Settings and choose Reset password."
        and test.corpus["d4"] == "Shipping only"
    )
    assert test.relevant == {"q1": {"d1"}, "q2": {"d2"}, "q3": {"3"}}  # q2-d1 scored 0: judged, not relevant
    assert load_retrieval(folder, "train") == beir_reference(folder, "train")
    every = load_retrieval_splits(folder)
    assert every == {"test": test, "train": beir_reference(folder, "train")}
    assert every["test"].corpus is every["train"].corpus  # read once


def test_sentence_transformers_evaluator_keeps_every_query(tmp_path):
    evaluation = pytest.importorskip("sentence_transformers.sentence_transformer.evaluation")
    queries, corpus, relevant = load_retrieval(beir(tmp_path / "set"))
    evaluator = evaluation.InformationRetrievalEvaluator(queries, corpus, relevant, name="set")
    assert evaluator.queries_ids == list(queries) and evaluator.corpus_ids == list(corpus)


def test_a_lone_qrels_tsv_is_the_test_split(tmp_path):
    folder = beir(tmp_path / "set", splits={}, top=qrels(TEST_QRELS))
    assert retrieval_splits(folder) == {"test": folder / "qrels.tsv"}
    assert load_retrieval(folder).relevant == {"q1": {"d1"}, "q2": {"d2"}, "q3": {"3"}}


def test_the_default_split(tmp_path):
    assert default_split("f", ["train", "test"]) == "test"
    assert default_split("f", ["dev"]) == "dev"
    with pytest.raises(ValueError, match="^f: no test split among dev, train: name the split to use$"):
        default_split("f", ["dev", "train"])


def refusal(folder_or_file: Path, split: str | None = None) -> str:
    with pytest.raises(ValueError) as e:
        load_retrieval(folder_or_file, split)
    return str(e.value).replace(str(folder_or_file), "F")


BAD_FOLDERS = [
    (
        dict(queries=lines(QUERIES + [{"_id": "q1", "text": "again"}])),
        "queries.jsonl, line 5: duplicate query _id 'q1'",
    ),
    (
        dict(corpus=lines(CORPUS + [{"_id": "d1", "text": "again"}])),
        "corpus.jsonl, line 5: duplicate document _id 'd1'",
    ),
    (dict(corpus=lines(CORPUS + [{"_id": "3", "text": "again"}])), "corpus.jsonl, line 5: duplicate document _id '3'"),
    (
        dict(corpus=lines(CORPUS + [{"_id": "d9", "title": " ", "text": ""}])),
        "corpus.jsonl, line 5: the document has no text (its 'text' and 'title' are empty)",
    ),
    (dict(queries=lines([{"_id": "q1", "text": ""}])), "queries.jsonl, line 1: 'text' is empty or not text: ''"),
    (dict(queries=lines([{"text": "who"}])), "queries.jsonl, line 1: '_id' is None, not an id (a non-empty string)"),
    (
        dict(splits={"test": qrels([("q1", "d1", 1), ("q9", "d1", 1)])}),
        "qrels/test.tsv, line 3: query-id 'q9' is not an _id of queries.jsonl",
    ),
    (
        dict(splits={"test": qrels([("q1", "d9", 1)])}),
        "qrels/test.tsv, line 2: corpus-id 'd9' is not an _id of corpus.jsonl",
    ),
    (
        dict(splits={"test": qrels([("q1", "d1", 1), ("q2", "d1", 0), ("q3", "d2", 0)])}),
        "qrels/test.tsv: 2 judged queries have no relevant document (every score 0), the first 'q2': "
        "give each at least one score above 0",
    ),
    (dict(splits={"test": qrels([])}), "qrels/test.tsv: no judgements"),
    (
        dict(splits={"test": "q1\td1\t1\n"}),
        "qrels/test.tsv, line 1: expected the header query-id<TAB>corpus-id<TAB>score, got ['q1', 'd1', '1']",
    ),
    (
        dict(splits={"test": "query-id\tcorpus-id\tscore\nq1\td1\n"}),
        "qrels/test.tsv, line 2: expected 3 tab-separated fields (query-id, corpus-id, score), got ['q1', 'd1']",
    ),
    (
        dict(splits={"test": "query-id\tcorpus-id\tscore\nq1\td1\thigh\n"}),
        "qrels/test.tsv, line 2: score 'high' is not a number",
    ),
    (dict(splits={}), "F: no relevance judgements: expected qrels.tsv or qrels/<split>.tsv"),
    (dict(top=qrels(TEST_QRELS)), "F: both qrels.tsv and qrels/*.tsv: keep one"),
]


@pytest.mark.parametrize("parts, message", BAD_FOLDERS, ids=[m[:50] for _, m in BAD_FOLDERS])
def test_bad_beir_folders(tmp_path, parts, message):
    folder = beir(tmp_path / "set", **parts)
    assert refusal(folder) == message


def test_a_missing_file_or_split(tmp_path):
    folder = beir(tmp_path / "set")
    assert refusal(folder, "dev") == "F: no qrels for split 'dev'; it has test, train"
    (folder / "queries.jsonl").unlink()
    assert refusal(folder) == "F: no queries.jsonl"


def test_one_jsonl_of_documents_and_queries(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text(
        lines(
            [
                {"query": "reset my password", "positive_ids": ["d1"]},
                {"_id": "q-open", "query": "when are you open", "positive_ids": ["d2", 3]},
                {"_id": "d1", "title": "Passwords", "text": "Open Settings."},
                {"_id": "d2", "text": "We are open from 9 to 5."},
                {"_id": 3, "text": "Opening hours."},
            ]
        )
    )
    assert load_retrieval(path) == RetrievalSet(
        {"line-1": "reset my password", "q-open": "when are you open"},
        {"d1": "Passwords Open Settings.", "d2": "We are open from 9 to 5.", "3": "Opening hours."},
        {"line-1": {"d1"}, "q-open": {"d2", "3"}},
    )
    assert load_retrieval_splits(path) == {"test": load_retrieval(path, "test")}
    assert refusal(path, "dev") == "F: a JSONL retrieval file has one split, 'test'; not 'dev'"


DOC = {"_id": "d1", "text": "a document"}
BAD_JSONL = [
    (
        [{"query": "q", "positive_ids": []}, DOC],
        "F, line 1: 'positive_ids' is []: a query needs a list of at least one document id",
    ),
    (
        [{"query": "q", "positive_ids": "d1"}, DOC],
        "F, line 1: 'positive_ids' is 'd1': a query needs a list of at least one document id",
    ),
    ([{"query": "q", "positive_ids": ["d9"]}, DOC], "F, line 1: positive id 'd9' is not the _id of any document"),
    (
        [{"query": "q", "text": "t"}],
        'F, line 1: a record is a query ({"query", "positive_ids"}) or a document ({"_id", "text"}): it has both',
    ),
    (
        [{"_id": "x"}],
        'F, line 1: a record is a query ({"query", "positive_ids"}) or a document ({"_id", "text"}): it has neither',
    ),
    ([{"query": " ", "positive_ids": ["d1"]}, DOC], "F, line 1: 'query' is empty or not text: ' '"),
    ([DOC, DOC], "F, line 2: duplicate document _id 'd1'"),
    (
        [{"_id": "a", "query": "q", "positive_ids": ["d1"]}, {"_id": "a", "query": "r", "positive_ids": ["d1"]}, DOC],
        "F, line 2: duplicate query _id 'a'",
    ),
    ([DOC], "F: no queries"),
    ([{"query": "q", "positive_ids": ["d1"]}], "F: no documents"),
]


@pytest.mark.parametrize("records, message", BAD_JSONL, ids=[m[:50] for _, m in BAD_JSONL])
def test_bad_jsonl_sets(tmp_path, records, message):
    path = tmp_path / "set.jsonl"
    path.write_text(lines(records))
    assert refusal(path) == message


# ---------------------------------------------------------------------------- archives


def tar_of(folder: Path, archive: Path, arcname: str = "scifact", extra: dict[str, bytes] | None = None) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname=arcname)
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def test_an_archive_is_unpacked_with_only_its_beir_files_at_the_top(tmp_path):
    folder = beir(tmp_path / "src")
    (folder / "README.md").write_text("notes")
    archive = tar_of(folder, tmp_path / "scifact.tar.gz")
    dest = unpack_retrieval(archive, tmp_path / "staged" / "data", max_bytes=100_000)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == [
        "corpus.jsonl",
        "qrels",
        "qrels/test.tsv",
        "qrels/train.tsv",
        "queries.jsonl",
    ]
    assert load_retrieval(dest) == load_retrieval(folder)
    assert sorted(p.name for p in (tmp_path / "staged").iterdir()) == ["data"]  # the work folder is gone

    zipped = tmp_path / "flat.zip"  # a zip with the files at its top, and a Mac's resource forks
    with zipfile.ZipFile(zipped, "w") as zf:
        for path in folder.rglob("*.*"):
            zf.write(path, path.relative_to(folder).as_posix())
        zf.writestr("__MACOSX/._corpus.jsonl", b"junk")
    assert load_retrieval(unpack_retrieval(zipped, tmp_path / "z" / "data", max_bytes=100_000)) == load_retrieval(
        folder
    )


@pytest.mark.parametrize(
    "extra, max_bytes, max_members, message",
    [
        (
            {"../evil.txt": b"x"},
            100_000,
            100,
            "the archive: refused: member '../evil.txt' would be written outside the dataset's folder",
        ),
        ({}, 200, 100, "the archive: refused: it would extract to more than 200 bytes"),
        ({}, 100_000, 3, "the archive: refused: more than 3 members"),
    ],
)
def test_archive_refusals(tmp_path, extra, max_bytes, max_members, message):
    archive = tar_of(beir(tmp_path / "src"), tmp_path / "a.tar.gz", extra=extra)
    with pytest.raises(UserError) as e:
        unpack_retrieval(archive, tmp_path / "staged" / "data", max_bytes, max_members, label="the archive")
    assert str(e.value) == message
    assert not (tmp_path / "evil.txt").exists() and list((tmp_path / "staged").iterdir()) == []


def test_an_archive_without_a_beir_folder(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for sub in ("a", "b"):
        (tmp_path / sub / "corpus.jsonl").write_text(lines([DOC]))
    archive = tmp_path / "two.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "a", arcname="a")
        tar.add(tmp_path / "b", arcname="b")
    with pytest.raises(UserError) as e:
        unpack_retrieval(archive, tmp_path / "staged" / "data", 100_000)
    assert (
        str(e.value)
        == "two.tar.gz holds no BEIR folder (corpus.jsonl, queries.jsonl and qrels at its top, or in one folder)"
    )
