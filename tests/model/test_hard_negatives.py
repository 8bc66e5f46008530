"""Hard-negative mining (model/training/hard_negatives.py) against sentence-transformers' mine_hard_negatives:
on the embeddings the reference itself makes (a tiny model saved with its modules and "query"/"passage"
prompts, loaded by SentenceTransformer), every option set gives the reference's rows exactly, random sampling
included (the same seed); and the plan's rules (distinct texts, positives, the query's own text) on their own."""

from __future__ import annotations

import json
import random

import pytest
import torch

from model.modeling import BertModel
from model.sentence_modules import SentenceModules, write_sentence_modules
from model.training.hard_negatives import MiningOptions, MiningPlan, mine, negative_columns
from tests.app.conftest import WORDS, save_tiny

PROMPTS = {"prompts": {"query": "the big dog ", "passage": "a red car "}, "default_prompt_name": None}
OPTION_SETS = [
    {},
    {"range_min": 3, "num_negatives": 4},
    {"range_min": 2, "relative_margin": 0.05, "max_score": 0.99},
    {"absolute_margin": 0.0, "min_score": 0.2},
    {"range_min": 1, "range_max": 12, "num_negatives": 5, "sampling_strategy": "random"},
    {"range_max": 40, "num_negatives": 2, "sampling_strategy": "random", "relative_margin": 0.02},
]


def texts(rng: random.Random, n: int) -> list[str]:
    words = [w for w in WORDS if w.isalpha()]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 7))) for _ in range(n)]


def pairs_and_corpus() -> tuple[list[tuple[str, str]], list[str]]:
    """30 anchors, one with two positives, one paired twice with the same positive, one whose positive is
    another anchor (a query that is in the corpus), and 40 more texts."""
    rng = random.Random(0)
    anchors, positives = texts(rng, 30), texts(rng, 31)
    pairs = [
        *zip(anchors, positives),
        (anchors[0], positives[30]),
        (anchors[1], anchors[2]),
        (anchors[3], positives[3]),
    ]
    return pairs, texts(rng, 40)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    pytest.importorskip("datasets", reason="mine_hard_negatives takes a datasets.Dataset (the test extra)")
    path = tmp_path_factory.mktemp("st") / "tiny"
    save_tiny(path, BertModel, seed=3)
    write_sentence_modules(path, SentenceModules())
    (path / "config_sentence_transformers.json").write_text(json.dumps(PROMPTS))
    return sentence_transformers.SentenceTransformer(str(path), device="cpu")


@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_the_rows_are_the_references(reference, options):
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives

    pairs, extra = pairs_and_corpus()
    dataset = Dataset.from_dict({"anchor": [a for a, _ in pairs], "positive": [p for _, p in pairs]})
    random.seed(7)  # the reference draws from the global generator
    expected = mine_hard_negatives(dataset, reference, corpus=extra, output_format="n-tuple", verbose=False, **options)

    plan = MiningPlan.of(pairs, extra)
    corpus_emb = reference.encode_document(plan.corpus, normalize_embeddings=True, convert_to_tensor=True)
    query_emb = reference.encode_query(plan.queries, normalize_embeddings=True, convert_to_tensor=True)
    rows = plan.tuples(mine(query_emb, corpus_emb, plan, MiningOptions(seed=7, **options)))

    columns = negative_columns(options.get("num_negatives", 3))
    assert rows == [(r["anchor"], r["positive"], [r[c] for c in columns]) for r in expected]
    assert len(rows) > 0 and expected.column_names == ["anchor", "positive", *columns]


def test_the_plan_keeps_each_text_once_and_knows_each_querys_positives():
    pairs = [("a", "p"), ("b", "q"), ("a", "r"), ("a", "p"), ("c", "b")]
    plan = MiningPlan.of(pairs, ["x", "q", "y"])
    assert plan.queries == ["a", "b", "c"]
    assert plan.corpus == ["x", "q", "y", "p", "r", "b"]  # the extra corpus first, then the positives
    assert plan.positives == [[3, 4], [1], [5]]
    assert plan.query_rows == [-1, 5, -1]  # "b" is a corpus text: never its own negative
    assert (plan.max_positives, plan.pairs) == (3, 4)  # "a" has three rows (one repeated), two positives


def test_a_query_never_gets_itself_or_its_positives_and_short_rows_are_dropped():
    plan = MiningPlan.of([("c2", "c1"), ("far", "c4")], ["c0", "c2", "c3"])
    assert plan.corpus == ["c0", "c2", "c3", "c1", "c4"]
    corpus_emb = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.8, 0.2], [0.0, 1.0], [-1.0, 0.0]])  # rows as plan.corpus
    query_emb = torch.stack([corpus_emb[1], torch.tensor([-1.0, 0.05])])  # "c2" embeds as its corpus row
    found = mine(query_emb, corpus_emb, plan, MiningOptions(num_negatives=2))
    assert found.negatives.tolist() == [[0, 2], [3, 2]]  # not itself (row 1), not its positive (row 3 / row 4)
    found = mine(query_emb, corpus_emb, plan, MiningOptions(num_negatives=2, max_score=0.9))
    assert torch.isinf(found.scores).tolist() == [[False, True], [False, False]]  # c2: one candidate under 0.9
    assert plan.tuples(found) == [("far", "c4", ["c1", "c3"])]  # so its row goes


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_negatives": 0}, "num_negatives must be at least 1, got 0"),
        ({"range_min": -1}, "range_min must be non-negative, got -1"),
        ({"range_min": 5, "range_max": 5}, "range_min must be smaller than range_max, got range_min=5 and range_max=5"),
        (
            {"range_min": 5, "range_max": 6, "num_negatives": 2},
            "cannot mine 2 negatives per anchor: only 1 candidate remains after skipping the first range_min=5 of "
            "range_max=6",
        ),
    ],
)
def test_options_that_cannot_mine_are_refused_with_their_values(options, message):
    with pytest.raises(ValueError) as e:
        MiningOptions(**options).check()
    assert str(e.value) == message


def test_the_default_range_widens_for_filters_as_the_references():
    assert MiningOptions(range_min=10, num_negatives=3).ranks(2) == 15
    assert MiningOptions(range_min=10, num_negatives=3, relative_margin=0.05).ranks(2) == 42
    assert MiningOptions(num_negatives=3, min_score=0.1).ranks(1) == 4  # min_score alone does not widen it
    assert MiningOptions(range_max=7).ranks(9) == 7
