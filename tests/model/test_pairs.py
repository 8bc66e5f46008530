"""Tests for model/data/pairs.py: pairs and scored pairs in sentence-transformers' column conventions, in
each table format, and the exact text of every refusal."""

from __future__ import annotations

import bz2
import gzip
import json

import pytest

from model.data.pairs import Pair, ScoredPair, load_pairs, load_scored_pairs, negative_columns


def write(path, text: str):
    path.write_text(text)
    return path


def jsonl(path, records: list[dict]):
    return write(path, "".join(json.dumps(r) + "\n" for r in records))


def test_anchor_positive_negative_as_all_nli_triplets_have_them(tmp_path):
    path = write(
        tmp_path / "t.csv", "anchor,positive,negative\na man eats,someone eats,a dog sleeps\nsky,blue sky,red car\n"
    )
    assert load_pairs(path) == [
        Pair("a man eats", "someone eats", ("a dog sleeps",)),
        Pair("sky", "blue sky", ("red car",)),
    ]


def test_numbered_hard_negatives_in_order_and_an_id_ride_along(tmp_path):
    rows = [
        {"id": 7, "anchor": "q", "positive": "p", "negative_2": "n2", "negative_1": "n1", "other": "ignored"},
        {"id": "x", "anchor": "q2", "positive": "p2", "negative_1": "m1", "negative_2": "m2"},
    ]
    got = load_pairs(jsonl(tmp_path / "t.jsonl", rows))
    assert got == [Pair("q", "p", ("n1", "n2"), "7"), Pair("q2", "p2", ("m1", "m2"), "x")]


def test_plain_pairs_in_tsv_and_compressed(tmp_path):
    text = "anchor\tpositive\nhello\thi there\n"
    (tmp_path / "a.tsv.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "a.tsv.bz2").write_bytes(bz2.compress(text.encode()))
    for name in ("a.tsv.gz", "a.tsv.bz2"):
        assert load_pairs(tmp_path / name) == [Pair("hello", "hi there")]


@pytest.mark.parametrize(
    "columns, expected",
    [
        (["anchor", "positive"], ()),
        (["anchor", "positive", "negative"], ("negative",)),
        (["negative_3", "anchor", "negative_1", "negative_2"], ("negative_1", "negative_2", "negative_3")),
    ],
)
def test_negative_columns(columns, expected):
    assert negative_columns("f.csv", columns) == expected


@pytest.mark.parametrize(
    "columns, message",
    [
        (
            ["negative_1", "negative_3"],
            "f.csv: the negative columns are negative_1, negative_3; they are numbered negative_1 .. negative_n "
            "without gaps (here negative_1, negative_2)",
        ),
        (
            ["negative_0", "negative_1"],
            "f.csv: the negative columns are negative_0, negative_1; they are numbered negative_1 .. negative_n "
            "without gaps (here negative_1, negative_2)",
        ),
        (
            ["negative", "negative_1"],
            "f.csv: both a 'negative' column and numbered ones (negative_1, ...): use one or the other",
        ),
    ],
)
def test_negative_columns_refused(columns, message):
    with pytest.raises(ValueError) as e:
        negative_columns("f.csv", columns)
    assert str(e.value) == message


def bad_pairs(tmp_path, name: str, text: str) -> str:
    path = write(tmp_path / name, text)
    with pytest.raises(ValueError) as e:
        load_pairs(path)
    return str(e.value).replace(str(path), "F")


def test_pairs_refusals(tmp_path):
    assert (
        bad_pairs(tmp_path, "a.csv", "anchor,pos\na,b\n")
        == "F: missing column(s) ['positive']; found ['anchor', 'pos']"
    )
    assert bad_pairs(tmp_path, "b.csv", "anchor,positive\na,\n") == "F, line 2: 'positive' is empty or not text: ''"
    assert (
        bad_pairs(tmp_path, "c.csv", "anchor,positive,negative_1,negative_2\na,b,c,d\ne,f,g,\n")
        == "F, line 3: no 'negative_2', which line 2 has: every row needs the same 2 negatives (negative_1, negative_2)"
    )
    assert (
        bad_pairs(tmp_path, "d.csv", "anchor,positive,negative\na,b,\nc,d,\n")
        == "F: the column 'negative' is empty in every row"
    )
    records = [{"anchor": "a", "positive": "b"}, {"anchor": "c", "positive": "d", "negative": "e"}]
    assert (
        bad_pairs(tmp_path, "e.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        == "F, line 1: no 'negative', which line 2 has: every row needs the same 1 negative (negative)"
    )
    assert (
        bad_pairs(tmp_path, "f.jsonl", json.dumps({"anchor": ["a"], "positive": "b"}) + "\n")
        == "F, line 1: 'anchor' is empty or not text: ['a']"
    )
    assert bad_pairs(tmp_path, "g.csv", "anchor,positive\n") == "F has no data rows"


def test_scored_pairs(tmp_path):
    path = write(tmp_path / "s.csv", "sentence1,sentence2,score\na,b,0.5\nc,d, 1 \ne,f,0\n")
    assert load_scored_pairs(path) == [ScoredPair("a", "b", 0.5), ScoredPair("c", "d", 1.0), ScoredPair("e", "f", 0.0)]
    records = [{"sentence1": "a", "sentence2": "b", "score": 0.25, "label": "x"}]
    assert load_scored_pairs(jsonl(tmp_path / "s.jsonl", records)) == [ScoredPair("a", "b", 0.25)]


SCALE = "(scale scores given on another range, such as STS-B's 0-5, to 0..1)"


@pytest.mark.parametrize(
    "body, message",
    [
        ("sentence1,sentence2,score\na,b,0.5\nc,d,4.2\n", f"F, line 3: 'score' is '4.2', not a number in 0..1 {SCALE}"),
        ("sentence1,sentence2,score\na,b,high\n", f"F, line 2: 'score' is 'high', not a number in 0..1 {SCALE}"),
        ("sentence1,sentence2,score\na,b,nan\n", f"F, line 2: 'score' is 'nan', not a number in 0..1 {SCALE}"),
        ("sentence1,sentence2,score\na,b,-0.1\n", f"F, line 2: 'score' is '-0.1', not a number in 0..1 {SCALE}"),
        ("sentence1,sentence2,score\na,b,\n", f"F, line 2: 'score' is '', not a number in 0..1 {SCALE}"),
        (
            "sentence1,sentence2,label\na,b,1\n",
            "F: missing column(s) ['score']; found ['label', 'sentence1', 'sentence2']",
        ),
        ("sentence1,sentence2,score\n ,b,1\n", "F, line 2: 'sentence1' is empty or not text: ' '"),
    ],
)
def test_scored_pairs_refusals(tmp_path, body, message):
    path = write(tmp_path / "s.csv", body)
    with pytest.raises(ValueError) as e:
        load_scored_pairs(path)
    assert str(e.value).replace(str(path), "F") == message


def test_a_json_true_is_not_a_score(tmp_path):
    path = jsonl(tmp_path / "s.jsonl", [{"sentence1": "a", "sentence2": "b", "score": True}])
    with pytest.raises(ValueError, match=r"line 1: 'score' is True, not a number in 0\.\.1"):
        load_scored_pairs(path)
