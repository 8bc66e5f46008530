"""A Hub dataset's subsets, splits and label names (model/data/hub_layout.py) and its rows written as an upload's
file (model/data/hub_rows.py): the card's configs in each of their forms, the Parquet export's folders, splits
named by push_to_hub and by split words, each refusal's words, ClassLabel names from the card and from a
Parquet file, slices over shards and row groups, column maps, sentence-transformers' columns by position, SQuAD
from datasets' answers, and the bounds. Through the fake Hub: fetch_split's choice, bounds and cache."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from model.data.finetune import load_classification_data
from model.data.hub_layout import (
    ClassLabel,
    SplitRequest,
    card_labels,
    choose,
    parquet_labels,
    parse_split,
    read_layout,
)
from model.data.hub_rows import SourceFile, lines_as_rows, write_split
from model.data.pairs import load_pairs, load_scored_pairs
from model.data.question_answering import read_squad
from model.data.token_classification import read_tagged
from model.errors import UserError
from tests import hub_server as H
from tests.helpers import free_port

# -- subsets and splits ----------------------------------------------------------------------------

NLI_FILES = [f"{s}/{split}-00000-of-00001.parquet" for s in ("pair", "triplet") for split in ("train", "dev", "test")]

# where else a dataset may come from, when HF_HUB_OFFLINE is set and the cache lacks it
DATASET_INSTEAD_OFFLINE = (
    "upload the data file instead (bert datasets upload FILE, or the file sent to POST /datasets), or unset "
    "HF_HUB_OFFLINE to download it"
)


def test_the_cards_configs_in_each_form():
    files = [
        "README.md",
        "plain_text/train-00000-of-00002.parquet",
        "plain_text/train-00001-of-00002.parquet",
        "plain_text/test-00000-of-00001.parquet",
        "extra/all.jsonl",
        "extra/more.csv",
        "listed/a.tsv",
        "folder/x/one.jsonl.gz",
        "folder/y/two.csv",
    ]
    card = {
        "configs": [
            {
                "config_name": "plain_text",
                "data_files": [
                    {"split": "train", "path": "plain_text/train-*"},
                    {"split": "test", "path": ["plain_text/test-*"]},
                ],
                "default": True,
            },
            {"config_name": "one", "data_files": "extra/all.jsonl"},
            {"config_name": "many", "data_files": ["extra/*", "listed/a.tsv"]},
            {"config_name": "mapped", "data_files": {"validation": "extra/more.csv"}},
            {"config_name": "dir", "data_files": "folder/"},
            {"config_name": "deep", "data_files": "**/*.csv"},
            {"config_name": "inside", "data_dir": "folder", "data_files": "x/*"},
        ]
    }
    layout = read_layout(files, card)
    assert (layout.declared, layout.default) == ("card", "plain_text")
    assert layout.subsets == {
        "plain_text": {
            "train": ("plain_text/train-00000-of-00002.parquet", "plain_text/train-00001-of-00002.parquet"),
            "test": ("plain_text/test-00000-of-00001.parquet",),
        },
        "one": {"train": ("extra/all.jsonl",)},
        "many": {"train": ("extra/all.jsonl", "extra/more.csv", "listed/a.tsv")},
        "mapped": {"validation": ("extra/more.csv",)},
        "dir": {"train": ("folder/x/one.jsonl.gz", "folder/y/two.csv")},
        "deep": {"train": ("extra/more.csv", "folder/y/two.csv")},
        "inside": {"train": ("folder/x/one.jsonl.gz",)},
    }


def test_the_default_subset():
    files = ["a/train.csv", "b/train.csv"]
    configs = [{"config_name": "a", "data_files": "a/*"}, {"config_name": "b", "data_files": "b/*"}]
    assert read_layout(files, {"configs": configs}).default is None
    assert read_layout(files, {"configs": configs[:1]}).default == "a"
    named = [{"config_name": "default", "data_files": "a/*"}, configs[1]]
    assert read_layout(files, {"configs": named}).default == "default"


def test_splits_named_by_push_to_hub_and_by_split_words():
    layout = read_layout(
        [
            "README.md",
            "data/train-00000-of-00001-0123abcd.parquet",
            "data/unsupervised-00000-of-00001.parquet",
            "script.py",
        ],
        None,
    )
    assert layout.subsets == {
        "default": {
            "train": ("data/train-00000-of-00001-0123abcd.parquet",),
            "unsupervised": ("data/unsupervised-00000-of-00001.parquet",),
        }
    }
    words = ["data/train.jsonl", "data/dev.csv", "data/my_test_2.jsonl", "data/holdout-eval.tsv", "data/notes.csv"]
    assert read_layout(words, None).subsets == {
        "default": {
            "train": ("data/train.jsonl",),
            "validation": ("data/dev.csv",),
            "test": ("data/holdout-eval.tsv", "data/my_test_2.jsonl"),
        }
    }
    assert read_layout(["trainer.csv", "attest.csv"], None).subsets == {  # no split word: all train
        "default": {"train": ("attest.csv", "trainer.csv")}
    }
    assert read_layout(["README.md"], None).subsets == {}


def test_top_level_folders_name_subsets():
    layout = read_layout(NLI_FILES, None)
    assert (layout.declared, layout.default) == ("folders", None)
    assert set(layout.subsets) == {"pair", "triplet"}
    assert layout.subsets["pair"] == {
        "train": ("pair/train-00000-of-00001.parquet",),
        "dev": ("pair/dev-00000-of-00001.parquet",),
        "test": ("pair/test-00000-of-00001.parquet",),
    }
    assert set(read_layout(["train/a.csv", "test/b.csv"], None).subsets) == {"default"}  # split folders
    assert set(read_layout(["data/a.csv", "extra/b.csv"], None).subsets) == {"default"}


def test_the_parquet_export():
    files = ["conll2003/train/0000.parquet", "conll2003/train/0001.parquet", "big/partial-train/0000.parquet"]
    layout = read_layout(files, {"configs": [{"config_name": "x", "data_files": "nothing/*"}]}, parquet_export=True)
    assert layout.subsets == {
        "conll2003": {"train": ("conll2003/train/0000.parquet", "conll2003/train/0001.parquet")},
        "big": {"train": ("big/partial-train/0000.parquet",)},
    }
    assert layout.default is None


def test_a_missing_or_wrong_subset_or_split_lists_what_there_is():
    nli = read_layout(NLI_FILES, None)
    with pytest.raises(UserError) as e:
        choose(nli, "st/all-nli", None, "train")
    assert str(e.value) == (
        "st/all-nli has several subsets and none is its default; name one as the subset: "
        "pair (train, dev, test), triplet (train, dev, test)"
    )
    with pytest.raises(UserError) as e:
        choose(nli, "st/all-nli", "pairs", "train")
    assert (
        str(e.value)
        == "st/all-nli has no subset 'pairs'; its subsets: pair (train, dev, test), triplet (train, dev, test)"
    )
    with pytest.raises(UserError) as e:
        choose(nli, "st/all-nli", "pair", None)
    assert str(e.value) == "st/all-nli (subset pair) has splits train, dev, test; name one as the split"
    with pytest.raises(UserError) as e:
        choose(nli, "st/all-nli", "pair", "validation")
    assert str(e.value) == "st/all-nli (subset pair) has no split 'validation'; its splits: train, dev, test"
    assert choose(nli, "st/all-nli", "triplet", "dev") == ("triplet", "dev", ("triplet/dev-00000-of-00001.parquet",))
    one = read_layout(["data/train.csv"], None)
    assert choose(one, "a/b", None, None) == ("default", "train", ("data/train.csv",))
    with pytest.raises(UserError, match=r"^a/b holds no data files this import reads \(Parquet, JSON Lines, CSV"):
        choose(read_layout(["README.md", "x.py"], None), "a/b", None, None)


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("train", SplitRequest("train")),
        ("train[:1000]", SplitRequest("train", 0, 1000)),
        ("validation_matched[10:20]", SplitRequest("validation_matched", 10, 20)),
        ("test[5:]", SplitRequest("test", 5, None)),
    ],
)
def test_a_split_and_its_slice(text, parsed):
    assert parse_split(text) == parsed
    assert str(parsed) == text


@pytest.mark.parametrize("text", ["train[:10%]", "train[]", "../x", "train[3:3]", "train[a:b]"])
def test_a_split_that_is_not_one(text):
    with pytest.raises(UserError):
        parse_split(text)


# -- label names ------------------------------------------------------------------------------------

CARD_FEATURES = {
    "dataset_info": [
        {
            "config_name": "plain_text",
            "features": [
                {"name": "text", "dtype": "string"},
                {"name": "label", "dtype": {"class_label": {"names": {"0": "neg", "1": "pos"}}}},
            ],
        },
        {
            "config_name": "tagged",
            "features": [
                {"name": "tokens", "sequence": "string"},
                {"name": "ner_tags", "sequence": {"class_label": {"names": {"0": "O", "1": "B-PER", "2": "I-PER"}}}},
                {"name": "pos_tags", "list": {"class_label": {"names": ["NN", "VB"]}}},
                {"name": "answers", "sequence": [{"name": "text", "dtype": "string"}]},
            ],
        },
    ]
}


def test_class_label_names_from_the_card():
    assert card_labels(CARD_FEATURES, "plain_text") == {"label": ClassLabel(("neg", "pos"))}
    assert card_labels(CARD_FEATURES, "tagged") == {
        "ner_tags": ClassLabel(("O", "B-PER", "I-PER"), sequence=True),
        "pos_tags": ClassLabel(("NN", "VB"), sequence=True),
    }
    assert card_labels(CARD_FEATURES, "other") == {}
    single = {"dataset_info": CARD_FEATURES["dataset_info"][0] | {"config_name": None}}
    del single["dataset_info"]["config_name"]
    assert card_labels(single, "anything") == {"label": ClassLabel(("neg", "pos"))}
    assert card_labels(None, "x") == {}
    with pytest.raises(UserError, match=r"ids are \[0, 2\], not 0 .. 1"):
        card_labels(
            {"dataset_info": {"features": [{"name": "l", "dtype": {"class_label": {"names": {0: "a", 2: "b"}}}}]}}, "x"
        )


def test_class_label_names_from_a_parquet_file():
    features = {
        "label": {"names": ["neg", "pos"], "_type": "ClassLabel"},
        "tags": {"feature": {"names": ["O", "B-X"], "_type": "ClassLabel"}, "_type": "Sequence"},
        "more": {"feature": {"names": ["a"], "_type": "ClassLabel"}, "_type": "List"},
        "text": {"dtype": "string", "_type": "Value"},
    }
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    assert parquet_labels(metadata) == {
        "label": ClassLabel(("neg", "pos")),
        "tags": ClassLabel(("O", "B-X"), True),
        "more": ClassLabel(("a",), True),
    }
    assert parquet_labels(None) == {} and parquet_labels({b"huggingface": b"not json"}) == {}


def test_a_label_outside_its_names_is_refused():
    label = ClassLabel(("neg", "pos"))
    assert (label.name(1, "label", 0), label.name("0", "label", 0), label.name("pos", "label", 0)) == (
        "pos",
        "neg",
        "pos",
    )
    with pytest.raises(UserError) as e:
        label.name(-1, "label", 7)
    assert str(e.value) == (
        "row 7: label is -1, not one of the 2 labels its ClassLabel names (neg, pos); a split whose labels are "
        "hidden (-1, as test splits often have) cannot be trained on"
    )


# -- rows written as an upload's file ------------------------------------------------------------------


def parquet(path, rows, row_group_size=None, features=None):
    table = pa.Table.from_pylist(rows)
    if features is not None:
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    pq.write_table(table, path, row_group_size=row_group_size)
    return SourceFile(path, f"data/{path.name}")


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


REVIEWS = [{"text": f"review {i}", "label": i % 2} for i in range(10)]


def test_labelled_rows_with_their_names_as_an_upload_reads_them(tmp_path):
    features = {"label": {"names": ["neg", "pos"], "_type": "ClassLabel"}}
    source = parquet(tmp_path / "train.parquet", REVIEWS, features=features)
    written = write_split([source], tmp_path, max_bytes=1 << 20)
    assert (written.kind, written.path.name, written.rows, written.columns) == ("labelled", "data.jsonl", 10, {})
    assert lines(written.path)[:2] == [{"text": "review 0", "label": "neg"}, {"text": "review 1", "label": "pos"}]
    data = load_classification_data(written.path, written.path)
    assert data.id2label == {0: "neg", 1: "pos"} and len(data.train) == 10


def test_a_slice_over_shards_and_row_groups(tmp_path):
    """Rows 7 .. 23 of three shards of 10 rows in row groups of 3: the rows, in order, and the skipped row groups
    never read (a broken group before the slice does not matter)."""
    shards = []
    for s in range(3):
        rows = [{"text": f"row {10 * s + i}", "label": "x" if i % 2 else "y"} for i in range(10)]
        shards.append(parquet(tmp_path / f"train-{s}.parquet", rows, row_group_size=3))
    written = write_split(shards, tmp_path, start=7, stop=23, max_bytes=1 << 20)
    assert [r["text"] for r in lines(written.path)] == [f"row {i}" for i in range(7, 23)]
    assert (written.rows, written.first_row) == (16, 7)
    assert lines_as_rows("the file, line 3: 'text' is empty", written.first_row) == "row 9: 'text' is empty"
    with pytest.raises(UserError, match=r"^the split has no rows from row 40 on$"):
        write_split(shards, tmp_path, start=40, max_bytes=1 << 20)


def test_text_files_and_a_column_map(tmp_path):
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"premise": f"p{i}", "hypothesis": f"h{i}", "label": i % 3}) + "\n" for i in range(6))
    )
    labels = {"label": ClassLabel(("entailment", "neutral", "contradiction"))}
    written = write_split(
        [SourceFile(jsonl, "train.jsonl")],
        tmp_path,
        columns={"premise": "text", "hypothesis": "text_pair"},
        labels=labels,
        max_bytes=1 << 20,
    )
    assert written.columns == {"premise": "text", "hypothesis": "text_pair"}
    assert lines(written.path)[2] == {"text": "p2", "text_pair": "h2", "label": "contradiction"}
    csv_file = tmp_path / "dev.tsv"
    csv_file.write_text("sentence1\tsentence2\tscore\na\tb\t0.5\nc\td\t1.0\n")
    written = write_split([SourceFile(csv_file, "dev.tsv")], tmp_path, max_bytes=1 << 20)
    assert written.kind == "scored-pairs"
    assert [p.score for p in load_scored_pairs(written.path)] == [0.5, 1.0]


@pytest.mark.parametrize(
    "columns, error",
    [
        ({"sentence": "text"}, "columns: the split has no column 'sentence'; its columns: text, label"),
        ({"text": "body"}, "columns: 'body' is no column of a dataset kind; they are anchor, answers"),
        ({"label": "text"}, "columns: text and label would both be 'text'; rename one, or the other away"),
    ],
)
def test_a_column_map_that_cannot_be(tmp_path, columns, error):
    source = parquet(tmp_path / "train.parquet", REVIEWS)
    with pytest.raises(UserError) as e:
        write_split([source], tmp_path, columns=columns, max_bytes=1 << 20)
    assert str(e.value).startswith(error)


def test_pairs_by_position_as_sentence_transformers_takes_them(tmp_path):
    rows = [{"query": f"q{i}", "answer": f"a{i}", "id": i, "hard": f"n{i}", "other": f"o{i}"} for i in range(4)]
    source = parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(UserError, match=r"^cannot tell what the columns query, answer, id, hard, other hold"):
        write_split([source], tmp_path, max_bytes=1 << 20)
    written = write_split([source], tmp_path, kind="pairs", max_bytes=1 << 20)
    assert written.columns == {"query": "anchor", "answer": "positive", "hard": "negative_1", "other": "negative_2"}
    assert [(p.anchor, p.positive, p.negatives, p.id) for p in load_pairs(written.path)][1] == (
        "q1",
        "a1",
        ("n1", "o1"),
        "1",
    )
    named = write_split([source], tmp_path, columns={"query": "anchor", "answer": "positive"}, max_bytes=1 << 20)
    assert (named.kind, lines(named.path)[0]) == ("pairs", {"anchor": "q0", "positive": "a0", "id": 0})
    scored = parquet(tmp_path / "sts.parquet", [{"a": "x", "b": "y", "label": 0.25}])
    assert lines(write_split([scored], tmp_path, kind="scored-pairs", max_bytes=1 << 20).path) == [
        {"sentence1": "x", "sentence2": "y", "score": 0.25}
    ]


def test_tags_as_names_and_squad_from_datasets_answers(tmp_path):
    conll = parquet(
        tmp_path / "train.parquet",
        [{"id": "0", "tokens": ["Ann", "sings"], "pos_tags": [0, 1], "ner_tags": [1, 0]}],
    )
    labels = {"ner_tags": ClassLabel(("O", "B-PER"), True), "pos_tags": ClassLabel(("NN", "VB"), True)}
    written = write_split([conll], tmp_path, labels=labels, max_bytes=1 << 20)
    assert (written.kind, written.columns) == ("token-labelled", {"ner_tags": "tags"})
    assert [(s.tokens, s.tags) for s in read_tagged(written.path)] == [(["Ann", "sings"], ["B-PER", "O"])]
    context = "Ann lives in Oslo."
    squad = parquet(
        tmp_path / "squad.parquet",
        [
            {
                "id": "a",
                "title": "t",
                "context": context,
                "question": "Who?",
                "answers": {"text": ["Ann"], "answer_start": [0]},
            },
            {
                "id": "b",
                "title": "t",
                "context": context,
                "question": "Where?",
                "answers": {"text": ["Oslo"], "answer_start": [13]},
            },
            {
                "id": "c",
                "title": "u",
                "context": "No.",
                "question": "Why?",
                "answers": {"text": [], "answer_start": []},
            },
        ],
    )
    written = write_split([squad], tmp_path, max_bytes=1 << 20)
    assert (written.kind, written.path.name, written.rows) == ("qa", "data.json", 3)
    doc = json.loads(written.path.read_text())
    assert [len(a["paragraphs"]) for a in doc["data"]] == [1, 1]  # a and b share their paragraph
    examples = read_squad(written.path)
    assert [(e.id, e.answers, e.answer_starts, e.is_impossible) for e in examples] == [
        ("a", ["Ann"], [0], False),
        ("b", ["Oslo"], [13], False),
        ("c", [], [], True),
    ]


def test_the_bounds(tmp_path):
    rows = [{"text": f"{i} " + "x" * 1000, "label": 1} for i in range(20)]  # distinct: no dictionary makes them small
    source = parquet(tmp_path / "train.parquet", rows, row_group_size=10)
    with pytest.raises(UserError) as e:
        write_split([source], tmp_path, max_bytes=15_000, limit="the most (LIMIT)")
    assert str(e.value) == (
        "the rows take more than 15,000 bytes as a labelled file, the most (LIMIT); import fewer rows (a slice of the "
        "split, such as train[:10000])"
    )
    with pytest.raises(
        UserError, match=r"^data/train.parquet: row group 0 holds [\d,]+ bytes uncompressed, more than the 5,000"
    ):
        write_split([source], tmp_path, max_bytes=5_000)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match=r"^data/bad.parquet is not a readable Parquet file"):
        write_split([SourceFile(bad, "data/bad.parquet")], tmp_path, max_bytes=1 << 20)


# -- through the fake Hub ----------------------------------------------------------------------------------


def fetch(**kwargs):
    from model.dataset_sources import fetch_split

    return fetch_split(**{"max_bytes": 1 << 30, **kwargs})


def test_fetch_a_split_with_its_card(hub, hub_env):
    before = len(hub.requests)
    fetched = fetch(repo=H.IMDB_REPO, split="test[:5]")
    assert [f.name for f in fetched.files] == ["plain_text/test-00000-of-00001.parquet"]
    assert fetched.labels == {"label": ClassLabel(("neg", "pos"))}
    assert fetched.request == SplitRequest("test", 0, 5)
    assert fetched.source == {
        "kind": "hub",
        "repo": H.IMDB_REPO,
        "revision": "main",
        "sha": hub.datasets[H.IMDB_REPO].refs["main"],
        "subset": "plain_text",
        "split": "test[:5]",
        "license": "other",
        "files": ["plain_text/test-00000-of-00001.parquet"],
    }
    touched = {p.rsplit("/", 1)[-1] for _, p in hub.requests[before:] if f"/datasets/{H.IMDB_REPO}/resolve/" in p}
    assert touched == {"README.md", "test-00000-of-00001.parquet"}  # the card and the split's file, no other


def test_a_loading_scripts_repo_is_read_from_the_parquet_export(hub, hub_env):
    fetched = fetch(repo=H.CONLL_REPO, split="validation")
    assert (fetched.source["revision"], fetched.source["subset"], fetched.source["sha"]) == (
        H.PARQUET_EXPORT,
        "conll2003",
        hub.datasets[H.CONLL_REPO].refs[H.PARQUET_EXPORT],
    )
    assert fetched.labels["ner_tags"] == ClassLabel(tuple(H.CONLL_TAGS), True)  # the main branch's card
    with pytest.raises(UserError) as e:
        fetch(repo=H.SCRIPT_DATASET)
    assert str(e.value) == (
        f"{H.SCRIPT_DATASET} holds no data files this import reads (Parquet, JSON Lines, CSV or TSV): it has a "
        "loading script (loader.py), which this import does not run, and no Parquet export (refs/convert/parquet)"
    )


def test_refused_before_any_file_downloads(hub, hub_env):
    before = len(hub.requests)
    with pytest.raises(UserError) as e:
        fetch(repo=H.SQUAD_REPO, split="train", max_bytes=100, limit="LIMIT")
    assert str(e.value).startswith(f"{H.SQUAD_REPO} (subset plain_text, split train) is ")
    assert str(e.value).endswith(" bytes in 1 file(s), more than the 100 LIMIT")
    rooms = []

    def no_room(n):
        rooms.append(n)
        raise UserError("no room")

    with pytest.raises(UserError, match="^no room$"):
        fetch(repo=H.SQUAD_REPO, split="train", check_room=no_room)
    assert rooms and rooms[0] > 100
    assert not [p for _, p in hub.requests[before:] if p.endswith(".parquet")]


def test_offline_from_the_cache(hub, hub_env, monkeypatch):
    """What an import downloaded imports again with HF_HUB_OFFLINE, the Hub unasked; what it did not is refused."""
    from huggingface_hub import constants

    online = fetch(repo=H.CONLL_REPO, split="train")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = len(hub.requests)
    offline = fetch(repo=H.CONLL_REPO, split="train")
    assert (offline.source, offline.labels) == (online.source, online.labels)
    assert [f.path.read_bytes() for f in offline.files] == [f.path.read_bytes() for f in online.files]
    with pytest.raises(UserError) as e:
        fetch(repo=H.CONLL_REPO, split="test")  # the Parquet export's folders: the cache holds train's alone
    assert str(e.value) == (
        "HF_HUB_OFFLINE is set and the Hugging Face cache (HF_HOME) holds only what earlier imports downloaded: "
        f"{H.CONLL_REPO} (subset conll2003) has no split 'test'; its splits: train; {DATASET_INSTEAD_OFFLINE}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    fetch(repo=H.IMDB_REPO, split="train")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as e:
        fetch(repo=H.IMDB_REPO, split="test")  # the card declares test; its file is not in the cache
    assert str(e.value) == (
        f"HF_HUB_OFFLINE is set and split test of {H.IMDB_REPO} (subset plain_text) is not in the Hugging Face "
        f"cache (HF_HOME); {DATASET_INSTEAD_OFFLINE}"
    )
    before = len(hub.requests)
    with pytest.raises(UserError) as e:
        fetch(repo=H.SQUAD_REPO, split="train")
    assert str(e.value) == (
        f"HF_HUB_OFFLINE is set and {H.SQUAD_REPO} is not in the Hugging Face cache (HF_HOME); {DATASET_INSTEAD_OFFLINE}"
    )
    assert hub.requests[before:] == []


def test_an_unreachable_hub_names_what_to_do_instead(hub_env, monkeypatch):
    from huggingface_hub import constants

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    with pytest.raises(UserError) as e:
        fetch(repo=H.IMDB_REPO, split="train")
    assert str(e.value) == (
        f"cannot reach the Hub at {dead} for {H.IMDB_REPO}: ConnectError: [Errno 111] Connection refused; upload the "
        "data file instead (bert datasets upload FILE, or the file sent to POST /datasets), or set HF_ENDPOINT to a "
        "Hub mirror this machine can reach"
    )


def test_a_gated_repo_with_a_token(hub, hub_env, monkeypatch):
    with pytest.raises(UserError, match=f"^{H.GATED_DATASET} is a gated repo: accept its terms on the Hub"):
        fetch(repo=H.GATED_DATASET, split="train")
    monkeypatch.setenv("HF_TOKEN", H.TOKEN)
    fetched = fetch(repo=H.GATED_DATASET, split="train")
    assert [f.name for f in fetched.files] == ["data/train.jsonl"]
