"""Tests for model/scores: entity scores against the seqeval package (default mode) and hand-counted
cases, and SQuAD EM/F1 against hand-computed values of the official scripts' rules."""

from __future__ import annotations

import random

import pytest

from model.scores import answer_f1, entities, exact_match, normalize_answer, squad_scores, tagging_scores

# ---------------------------------------------------------------------------- tagging


def test_entities_by_hand():
    assert entities(["B-PER", "I-PER", "O", "B-LOC", "B-LOC", "I-LOC"]) == [("PER", 0, 1), ("LOC", 3, 3), ("LOC", 4, 5)]
    # Predictions need not be valid IOB2: conlleval's reading, as seqeval's default mode.
    assert entities(["I-PER", "I-PER", "I-LOC", "O", "I-ORG"]) == [("PER", 0, 1), ("LOC", 2, 2), ("ORG", 4, 4)]
    assert entities(["B-PER", "I-LOC"]) == [("PER", 0, 0), ("LOC", 1, 1)]
    assert entities(["O", "O"]) == []


def test_scores_by_hand():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "B-LOC"]]
    # gold: PER, LOC, ORG; predicted: PER, ORG, ORG, LOC; right: PER and the second sentence's ORG.
    # Words right: 4 of 6 (LOC -> ORG and O -> LOC are wrong).
    scores = tagging_scores(gold, pred)
    assert scores == pytest.approx(
        {"precision": 2 / 4, "recall": 2 / 3, "f1": 2 * (1 / 2) * (2 / 3) / (1 / 2 + 2 / 3), "accuracy": 4 / 6}
    )
    # A boundary off by one is a miss: strict span and type.
    assert tagging_scores([["B-PER", "I-PER"]], [["B-PER", "O"]])["f1"] == 0.0
    assert tagging_scores([["O"]], [["O"]]) == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "accuracy": 1.0}


def random_tags(rng, n):
    tags = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
    return [rng.choice(tags) for _ in range(n)]


def test_scores_equal_seqeval_default_mode():
    seqeval = pytest.importorskip("seqeval.metrics")
    from seqeval.metrics.sequence_labeling import get_entities

    rng = random.Random(0)
    for _ in range(50):
        gold = [random_tags(rng, rng.randint(1, 12)) for _ in range(rng.randint(1, 6))]
        pred = [[t if rng.random() < 0.6 else rng.choice(["O", "B-PER", "I-LOC", "I-MISC"]) for t in s] for s in gold]
        ours = tagging_scores(gold, pred)
        assert ours == pytest.approx(
            {
                "precision": seqeval.precision_score(gold, pred, zero_division=0),
                "recall": seqeval.recall_score(gold, pred, zero_division=0),
                "f1": seqeval.f1_score(gold, pred, zero_division=0),
                "accuracy": seqeval.accuracy_score(gold, pred),
            }
        ), (gold, pred)
        for g in gold + pred:
            assert [(t, s, e) for t, s, e in get_entities(g)] == entities(g)


def test_length_mismatch():
    with pytest.raises(ValueError, match="^2 gold tags but 1 predicted$"):
        tagging_scores([["O", "O"]], [["O"]])


# ---------------------------------------------------------------------------- SQuAD


def test_normalisation_as_the_official_script():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an apple, a pear and THE plum") == "apple pear and plum"
    assert normalize_answer("theory") == "theory"  # articles are whole words only


def test_em_and_f1_by_hand():
    assert exact_match("the Cat.", "cat") == 1.0
    assert answer_f1("the big red house", "red house on the hill") == pytest.approx(
        2 * (2 / 3) * (2 / 4) / (2 / 3 + 2 / 4)
    )
    assert answer_f1("dog", "cat") == 0.0
    assert answer_f1("", "") == 1.0 and answer_f1("a", "") == 1.0  # "a" normalises to nothing
    assert answer_f1("cat", "") == 0.0


def test_squad_scores_best_over_golds_and_impossible():
    golds = {"q1": ["Denver Broncos", "The Denver Broncos"], "q2": ["1889"], "q3": [], "q4": ["Paris"]}
    predictions = {"q1": "the denver broncos", "q2": "in 1889", "q3": "", "q4": "London"}
    scores = squad_scores(predictions, golds)
    # q1: EM 1 F1 1; q2: EM 0 F1 2*(1/2)*1/(1.5)=2/3; q3 (impossible, ""): 1, 1; q4: 0, 0
    assert scores == pytest.approx({"exact_match": 2 / 4, "f1": (1 + 2 / 3 + 1 + 0) / 4})
    assert squad_scores({"q3": "something"}, {"q3": []}) == {"exact_match": 0.0, "f1": 0.0}
    assert squad_scores({}, {"q2": ["1889"]}) == {"exact_match": 0.0, "f1": 0.0}  # missing: 0
