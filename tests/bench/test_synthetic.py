"""The synthetic held-out sets (bench/synthetic.py): deterministic, train and test entities disjoint,
files the readers take back, IOB2 valid, SQuAD offsets right."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.synthetic import (
    NER_TEMPLATES,
    NER_TEST_ONLY,
    QA_QUESTIONS,
    Pools,
    detokenize,
    ner_split,
    ner_splits,
    qa_split,
    write_ner,
    write_qa,
)
from model.data.token_classification import read_tagged


def entities(tokens: list[str], tags: list[str]) -> list[tuple[str, str]]:
    """(type, text) of each IOB2 entity, lower-cased (the model is uncased)."""
    out = []
    for token, tag in zip(tokens, tags):
        if tag.startswith("B-"):
            out.append([tag[2:], [token]])
        elif tag.startswith("I-"):
            out[-1][1].append(token)
    return [(kind, " ".join(words).lower()) for kind, words in out]


def qa_items(squad: dict) -> list[tuple[str, dict]]:
    return [(p["context"], qa) for article in squad["data"] for p in article["paragraphs"] for qa in p["qas"]]


@pytest.fixture(scope="module")
def ner():
    return ner_splits(seed=0, n_train=1500, n_test=400)


@pytest.fixture(scope="module")
def qa():
    return {split: qa_split(split, n, seed=0) for split, n in (("train", 600), ("test", 150))}


def test_same_seed_same_files_other_seed_other_files(tmp_path):
    a, b, c = (write_ner(tmp_path / d, seed=s, n_train=50, n_test=20) for d, s in (("a", 3), ("b", 3), ("c", 4)))
    q = [write_qa(tmp_path / d, seed=s, n_train=20, n_test=5) for d, s in (("a", 3), ("b", 3), ("c", 4))]
    for key in ("train", "test"):
        for x, y, z in ((a, b, c), tuple(q)):
            data = [Path(r[key]).read_bytes() for r in (x, y, z)]
            assert data[0] == data[1] and data[0] != data[2]
    assert (a["train_sentences"], a["test_sentences"]) == (50, 20)
    assert (q[0]["train_contexts"], q[0]["test_contexts"]) == (20, 5)


def test_pools_are_disjoint_by_construction():
    train, test = Pools.for_split("train"), Pools.for_split("test")
    for field in ("first", "last", "roots", "years"):
        assert not set(getattr(train, field)) & set(getattr(test, field)), field
        assert len(getattr(test, field)) >= 14


def test_ner_entities_of_the_test_split_never_occur_in_training(ner):
    seen = {e for tokens, tags in ner["train"] for e in entities(tokens, tags)}
    held = [e for tokens, tags in ner["test"] for e in entities(tokens, tags)]
    assert not set(held) & seen
    train_words = {w.lower() for tokens, tags in ner["train"] for w, t in zip(tokens, tags) if t.endswith("PER")}
    test_names = {w.lower() for tokens, tags in ner["test"] for w, t in zip(tokens, tags) if t.endswith("PER")}
    assert {w for w in test_names & train_words if not w.endswith(".")} == set()  # only middle initials shared
    kinds = {kind for kind, _ in held}
    assert kinds == {"PER", "LOC", "ORG", "DATE"}
    assert all(any(kind == k and " " in text for kind, text in held) for k in kinds)  # multiword of each type


def test_ner_files_read_back_as_iob2_with_templates_held_out(tmp_path, ner):
    paths = write_ner(tmp_path, seed=0, n_train=1500, n_test=400)
    for split in ("train", "test"):
        sentences = read_tagged(paths[split])  # checks IOB2
        assert [(s.tokens, s.tags) for s in sentences] == ner[split]
    assert len(NER_TEMPLATES) - NER_TEST_ONLY >= 30
    unseen = {"suggest", "mapped", "retired", "customers", "survived"}  # words only test-only templates use
    assert all(any(w in NER_TEMPLATES[-i] for i in range(1, NER_TEST_ONLY + 1)) for w in unseen)
    words = {split: {t.lower() for tokens, _ in ner[split] for t in tokens} for split in ner}
    assert unseen <= words["test"] and not unseen & words["train"]
    lowered = sum(all(t == t.lower() for t in tokens) for tokens, _ in ner["train"])
    assert 0.05 < lowered / len(ner["train"]) < 0.2


def test_ner_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split must be one of \\('train', 'test'\\), got 'dev'"):
        ner_split("dev", 5)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        ner_split("train", 0)


def test_squad_answers_sit_at_their_offsets(qa):
    for split, squad in qa.items():
        assert squad["version"] == "v2.0"
        items = qa_items(squad)
        assert len({q["id"] for _, q in items}) == len(items)
        for context, q in items:
            assert q["is_impossible"] == (q["answers"] == [])
            for answer in q["answers"]:
                start = answer["answer_start"]
                assert context[start : start + len(answer["text"])] == answer["text"], q
        impossible = sum(q["is_impossible"] for _, q in items) / len(items)
        assert 0.12 < impossible < 0.22, (split, impossible)


def test_squad_answers_of_the_test_split_never_occur_in_training(qa):
    answers = {
        split: {a["text"].lower() for _, q in qa_items(squad) for a in q["answers"]} for split, squad in qa.items()
    }
    assert len(answers["test"]) > 300
    assert not answers["test"] & answers["train"]
    train_text = " ".join(c + " " + q["question"] for c, q in qa_items(qa["train"])).lower()
    assert not [a for a in answers["test"] if f" {a} " in f" {train_text} " and not a.isdigit()]


def form_pattern(form: str) -> re.Pattern:
    """A question form as a regex: each slot any text; case and the final '?' optional."""
    parts = re.split(r"\{\w+\}", form.removesuffix(" ?"))
    return re.compile(".+".join(re.escape(p) for p in parts) + r"\??$", re.IGNORECASE)


def test_squad_test_split_asks_question_forms_training_never_does(qa):
    test_only = [form_pattern(forms[-1]) for *_, forms in QA_QUESTIONS]
    count = {
        split: sum(any(p.match(q["question"]) for p in test_only) for _, q in qa_items(squad))
        for split, squad in qa.items()
    }
    assert count["train"] == 0 and count["test"] > 40, count


def test_squad_json_file_round_trips(tmp_path):
    paths = write_qa(tmp_path, seed=1, n_train=10, n_test=4)
    assert json.loads(Path(paths["test"]).read_text(encoding="utf-8")) == qa_split("test", 4, seed=1)
    assert paths["test_questions"] == len(qa_items(qa_split("test", 4, seed=1)))


def test_detokenize_keeps_no_space_before_punctuation():
    assert detokenize(["December", "6", ",", "1901"]) == "December 6, 1901"
    assert detokenize(["(", "born", "1901", ")", "."]) == "(born 1901)."
