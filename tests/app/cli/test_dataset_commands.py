"""`bert datasets upload | list | show | delete` on a data directory: the checks and meta.json of POST /datasets
(the same refusals, in the command's words), the listing, and a deletion refused while a queued job uses the
dataset. In-process through app.cli.main, and once as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest

from app.cli import main
from datadir import JobRecords, audit, read_meta
from datadir.datasets import dataset_bytes
from tests.helpers import ROOT

EXAMPLES = ROOT / "examples" / "data"


def bert(capsys, *args) -> tuple[int, str, str]:
    code = main([*map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def data(tmp_path, capsys):
    """A data directory holding the four example datasets of the retrieval kinds, added by the command."""
    data_dir = tmp_path / "data"
    archive = tmp_path / "beir-mini.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(EXAMPLES / "beir-mini", arcname="beir-mini")
    printed = []
    for path in (EXAMPLES / "pairs.csv", EXAMPLES / "stsb.csv", EXAMPLES / "retrieval.jsonl", archive):
        code, out, err = bert(capsys, "datasets", "upload", path, "--data-dir", data_dir)
        assert (code, err) == (0, ""), err
        printed.append(out)
    assert printed == [
        "added dataset 'pairs' (pairs, csv): 8 rows, 1 hard negative each\n",
        "added dataset 'stsb' (scored-pairs, csv): 8 rows, mean score 0.640\n",
        "added dataset 'retrieval' (retrieval, jsonl): 3 queries, 4 documents, 3 judgements (split test)\n",
        "added dataset 'beir-mini' (retrieval, beir): 5 queries, 6 documents, 5 judgements (split test)\n",
    ]
    return data_dir


def test_upload_then_list_and_show(data, capsys):
    code, out, _ = bert(capsys, "datasets", "list", "--data-dir", data)
    assert code == 0
    lines = [line.rsplit("  ", 1)[0].split() for line in out.splitlines()]  # the size aside
    assert lines == [
        ["beir-mini", "retrieval", "(beir)", "5", "queries,", "6", "documents,", "5", "judgements", "(split", "test)"],
        ["pairs", "pairs", "(csv)", "8", "rows,", "1", "hard", "negative", "each"],
        ["retrieval", "retrieval", "(jsonl)", "3", "queries,", "4", "documents,", "3", "judgements", "(split", "test)"],
        ["stsb", "scored-pairs", "(csv)", "8", "rows,", "mean", "score", "0.640"],
    ]
    code, out, _ = bert(capsys, "datasets", "list", "--json", "--data-dir", data)
    names = ["beir-mini", "pairs", "retrieval", "stsb"]
    assert json.loads(out) == [{**read_meta(data, n), "disk_bytes": dataset_bytes(data, n)} for n in names]
    code, out, _ = bert(capsys, "datasets", "show", "beir-mini", "--data-dir", data)
    meta = json.loads(out)
    assert meta == {**read_meta(data, "beir-mini"), "disk_bytes": dataset_bytes(data, "beir-mini")}
    assert (meta["kind"], meta["file"], meta["original_filename"], meta.get("owner")) == (
        "retrieval",
        "data",
        "beir-mini.tar.gz",
        None,  # the command adds an admin's dataset, shared with every key
    )
    assert bert(capsys, "datasets", "show", "ghost", "--data-dir", data) == (
        2,
        "",
        f"bert datasets: error: dataset 'ghost' not found in {data}\n",
    )
    assert [(e["action"], e["target"], e["source"]) for e in map(json.loads, audit.audit_path(data).open())] == [
        ("dataset.upload", f"dataset {n}", "cli") for n in ("pairs", "stsb", "retrieval", "beir-mini")
    ]


def test_uploads_are_refused_as_post_datasets_refuses_them(data, capsys, tmp_path):
    bad = tmp_path / "scores.csv"
    bad.write_text("sentence1,sentence2,score\na,b,0.5\nc,d,4.2\n")
    assert bert(capsys, "datasets", "upload", bad, "--data-dir", data) == (
        2,
        "",
        "bert datasets: error: file: not a usable scored-pairs file (columns sentence1, sentence2 and score): "
        "the file, line 3: 'score' is '4.2', not a number in 0..1 (scale scores given on another range, such as "
        "STS-B's 0-5, to 0..1)\n",
    )
    unclosed = tmp_path / "reviews.csv"
    unclosed.write_text('text,label\n"a fine film,pos\na dull one,neg\n')
    assert bert(capsys, "datasets", "upload", unclosed, "--data-dir", data) == (
        2,
        "",
        "bert datasets: error: file: not a usable labelled table (columns text, label and optionally text_pair): "
        "the file, line 2: a quoted field opens here and is never closed (the file ends inside it); close the "
        'field with a " (a " inside a quoted field is written "")\n',
    )
    good = EXAMPLES / "pairs.csv"
    assert bert(capsys, "datasets", "upload", good, "--data-dir", data) == (
        2,
        "",
        "bert datasets: error: name: dataset 'pairs' already exists (datasets are never replaced; upload under "
        "another name, or delete it first)\n",
    )
    assert bert(capsys, "datasets", "upload", good, "--name", "p2", "--kind", "scored-pairs", "--data-dir", data) == (
        2,
        "",
        "bert datasets: error: file: not a usable scored-pairs file (columns sentence1, sentence2 and score): the "
        "file: missing column(s) ['sentence1', 'sentence2', 'score']; found ['anchor', 'negative', 'positive']\n",
    )
    assert bert(capsys, "datasets", "upload", tmp_path / "none.csv", "--data-dir", data) == (
        2,
        "",
        f"bert datasets: error: no such file: {tmp_path / 'none.csv'}\n",
    )
    assert sorted(p.name for p in (data / "datasets").iterdir()) == ["beir-mini", "pairs", "retrieval", "stsb"]


def test_delete_is_refused_while_a_queued_job_uses_the_dataset(data, capsys):
    job = JobRecords(data).create({"kind": "finetune", "model_name": "m", "dataset": "pairs", "params": {}})
    assert bert(capsys, "datasets", "delete", "pairs", "--data-dir", data) == (
        2,
        "",
        f"bert datasets: error: dataset 'pairs' is in use by job {job['id']} (queued); delete it once the job has "
        "finished (or cancel the job)\n",
    )
    freed = dataset_bytes(data, "beir-mini")
    code, out, _ = bert(capsys, "datasets", "delete", "beir-mini", "--data-dir", data)
    assert code == 0 and out == f"deleted dataset 'beir-mini' ({freed / 1000:.1f} KB freed)\n"
    assert not (data / "datasets" / "beir-mini").exists() and read_meta(data, "pairs") is not None
    assert bert(capsys, "datasets", "delete", "beir-mini", "--data-dir", data) == (
        2,
        "",
        "bert datasets: error: dataset 'beir-mini' not found\n",
    )
    assert json.loads(audit.audit_path(data).read_text().splitlines()[-1])["action"] == "dataset.delete"


@pytest.mark.slow  # the bert command in a subprocess
def test_the_command_as_a_user_runs_it(tmp_path):
    def run(*args) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "app.cli", "datasets", *map(str, args), "--data-dir", tmp_path / "data"]
        return subprocess.run(
            argv, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
        )

    proc = run("upload", EXAMPLES / "stsb.csv", "--name", "sts")
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0,
        "added dataset 'sts' (scored-pairs, csv): 8 rows, mean score 0.640\n",
        "",
    )
    assert run("list").stdout.startswith("sts  scored-pairs (csv)  8 rows, mean score 0.640  ")
    proc = run("delete", "sts")
    assert proc.returncode == 0 and proc.stdout.startswith("deleted dataset 'sts' (")


def test_import_a_hub_datasets_split(hub, hub_env, tmp_path, capsys):
    """`bert datasets import` makes the dataset POST /datasets' import does (its meta.json and card), at once."""
    from tests import hub_server as H

    data = tmp_path / "data"
    code, out, err = bert(
        capsys, "datasets", "import", H.NLI_REPO, "--name", "nli", "--subset", "pair-class", "--split", "train[:6]",
        "--columns", "premise=text, hypothesis=text_pair", "--data-dir", data,
    )  # fmt: skip
    sha = hub.datasets[H.NLI_REPO].refs["main"]
    assert (code, err) == (0, "")
    assert out == (
        f"imported {H.NLI_REPO} (subset pair-class, split train[:6]) as dataset 'nli' "
        "(labelled, jsonl): 6 rows, 3 labels (text pairs)\n"
    )
    meta = read_meta(data, "nli")
    assert (meta["labels"], meta.get("owner"), meta["shared"]) == (
        ["contradiction", "entailment", "neutral"],
        None,
        True,
    )
    assert meta["source"] == {
        "kind": "hub",
        "repo": H.NLI_REPO,
        "revision": "main",
        "sha": sha,
        "subset": "pair-class",
        "split": "train[:6]",
        "license": None,
        "files": ["pair-class/train-00000-of-00001.parquet"],
        "rows": 6,
        "columns": {"premise": "text", "hypothesis": "text_pair"},
    }
    assert bert(capsys, "datasets", "import", H.NLI_REPO, "--name", "x", "--data-dir", data) == (
        2,
        "",
        f"bert datasets: error: {H.NLI_REPO} has several subsets and none is its default; name one as the subset: "
        "pair (train, dev, test), pair-class (train, dev, test), pair-score (train, dev, test), triplet (train, dev, "
        "test)\n",
    )
    assert bert(
        capsys, "datasets", "import", H.NLI_REPO, "--name", "x", "--columns", "premise", "--data-dir", data
    ) == (
        2,
        "",
        "bert datasets: error: columns: give them as SOURCE=COLUMN pairs, comma-separated (query=anchor,answer=positive), "
        "not 'premise'\n",
    )
    assert bert(capsys, "datasets", "import", H.NLI_REPO, "--name", "nli", "--data-dir", data)[2] == (
        "bert datasets: error: name: dataset 'nli' already exists (datasets are never replaced; upload under another "
        "name, or delete it first)\n"
    )
    entries = [json.loads(line) for line in audit.audit_path(data).open()]
    assert [(e["action"], e["target"], e["source"]) for e in entries] == [
        ("dataset.import", f"dataset nli from {H.NLI_REPO}", "cli")
    ]
    assert sorted(p.name for p in (data / "datasets").iterdir()) == ["nli"]


@pytest.mark.parametrize(
    "args, kind",
    [
        (["stanfordnlp/imdb", "--split", "train"], "labelled"),
        (["eriktks/conll2003", "--split", "train"], "token-labelled"),
        (["rajpurkar/squad", "--split", "train"], "qa"),
        (["sentence-transformers/all-nli", "--subset", "triplet", "--split", "train"], "pairs"),
        (["sentence-transformers/all-nli", "--subset", "pair-score", "--split", "train"], "scored-pairs"),
        (["sentence-transformers/natural-questions", "--kind", "pairs"], "pairs"),
    ],
)
def test_each_id_imports_as_its_fine_tune_reads_it(hub, hub_env, tmp_path, capsys, args, kind):
    """What `bert datasets import` makes of each id the documentation names, read by the reader its training runs."""
    from model.data.finetune import load_classification_data
    from model.data.pairs import load_pairs, load_scored_pairs
    from model.data.question_answering import load_qa_data
    from model.data.token_classification import load_token_classification_data

    data = tmp_path / "data"
    code, out, err = bert(capsys, "datasets", "import", *args, "--name", "d", "--data-dir", data)
    assert (code, err) == (0, ""), err
    meta = read_meta(data, "d")
    assert meta["kind"] == kind and out.startswith(f"imported {args[0]} (subset ")
    path = data / "datasets" / "d" / meta["file"]
    readers = {
        "labelled": lambda: load_classification_data(path).id2label == {0: "neg", 1: "pos"},
        "token-labelled": lambda: len(load_token_classification_data(path).id2label) == 9,
        "qa": lambda: len(load_qa_data(path).train) > 0,
        "pairs": lambda: len(load_pairs(path)) == meta["rows"],
        "scored-pairs": lambda: len(load_scored_pairs(path)) == meta["rows"],
    }
    assert readers[kind]()
