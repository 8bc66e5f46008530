"""model/data/pair_batches.py: each column tokenised on its own, no text twice in a batch (the batches
sentence-transformers' NoDuplicatesBatchSampler makes for the same seed), every batch a pure function of
(seed, epoch, index), and the held-out share (whole anchors) or an evaluation file."""

from __future__ import annotations

import random

import datasets
import pytest
import torch
from sentence_transformers.base.sampler import NoDuplicatesBatchSampler

from model.data.pair_batches import (
    PairBatches,
    ScoredPairBatches,
    load_embedding_data,
    no_duplicate_batches,
    retrieval_set,
)
from model.data.pairs import Pair, ScoredPair, load_pairs
from model.data.retrieval_data import RetrievalSet
from tests.conftest import WORDS

# 40 pairs over a pool of 12 short texts: many share a text, so a batch must leave some of them out.
POOL = [" ".join(random.Random(i).sample(WORDS, 3)) for i in range(12)]
PAIRS = [
    Pair(POOL[i % 12], POOL[(i * 5 + 1) % 12], (POOL[(i * 7 + 3) % 12],))
    for i in range(40)
    if len({i % 12, (i * 5 + 1) % 12, (i * 7 + 3) % 12}) == 3
]


def texts_of(batch, tokenizer):
    """The texts of a (B, C, T) batch, row by row, decoded from its ids."""
    return [[tokenizer.decode(column[m.bool()]) for column, m in zip(row, mask)] for row, mask in zip(
        batch["input_ids"], batch["attention_mask"]
    )]  # fmt: skip


def test_no_text_appears_twice_in_a_batch_and_every_row_once_an_epoch(tiny_tokenizer):
    data = PairBatches(PAIRS, tiny_tokenizer, batch_size=8, max_seq_len=16, seed=1)
    for epoch in range(3):
        plan = data.plan(epoch)
        rows = sorted(int(i) for batch in plan for i in batch)
        assert rows == list(range(len(PAIRS)))
        for batch, rows in zip(data.iter_batches(epoch), plan):
            texts = [t for row in texts_of(batch, tiny_tokenizer) for t in row]
            assert len(texts) == len(set(texts)) == 3 * len(rows) <= 3 * 8
            assert texts == [t for i in rows for t in (PAIRS[i].anchor, PAIRS[i].positive, *PAIRS[i].negatives)]
    assert len(data.plan(0)) > len(PAIRS) / 8  # the duplicates did make some rows wait


@pytest.mark.parametrize("seed", [0, 3])
def test_the_batches_are_sentence_transformers_no_duplicates_batches(tiny_tokenizer, seed):
    columns = {"anchor": [p.anchor for p in PAIRS], "positive": [p.positive for p in PAIRS]}
    columns["negative"] = [p.negatives[0] for p in PAIRS]
    sampler = NoDuplicatesBatchSampler(
        datasets.Dataset.from_dict(columns), batch_size=8, drop_last=False, generator=torch.Generator(), seed=seed
    )
    ours = PairBatches(PAIRS, tiny_tokenizer, batch_size=8, max_seq_len=16, seed=seed)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert [b.tolist() for b in ours.plan(epoch)] == list(sampler)


def test_a_row_that_repeats_a_text_waits_in_order_for_the_next_batch():
    import numpy as np

    rows = np.array([[0, 1], [1, 2], [3, 4], [0, 5], [6, 7]])  # text ids; row 1 and row 3 clash with row 0
    assert [b.tolist() for b in no_duplicate_batches(np.arange(5), rows, 3)] == [[0, 2, 4], [1, 3]]
    assert [b.tolist() for b in no_duplicate_batches(np.arange(5), rows, 2)] == [[0, 2], [1, 3], [4]]


def test_batches_are_a_pure_function_of_seed_epoch_and_index(tiny_tokenizer):
    def batches(seed, epoch, start=0):
        data = PairBatches(PAIRS, tiny_tokenizer, batch_size=8, max_seq_len=16, seed=seed)
        return list(data.iter_batches(epoch, start))

    first = batches(7, 1)
    again, resumed = batches(7, 1), batches(7, 1, start=3)  # new objects: nothing carried over
    assert len(first) >= 5 and len(resumed) == len(first) - 3
    for a, b in zip(first, again):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for a, b in zip(first[3:], resumed):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(first[0]["input_ids"][:, 0, :4], batches(7, 2)[0]["input_ids"][:, 0, :4])


def test_each_text_is_tokenised_alone_and_cut_to_max_seq_len(tiny_tokenizer):
    pairs = [Pair("the cat", " ".join(WORDS[:20])), Pair("a dog", "the man")]
    batch = next(PairBatches(pairs, tiny_tokenizer, batch_size=2, max_seq_len=8, shuffle=False).iter_batches(0))
    assert batch["input_ids"].shape == (2, 2, 8) and not batch["token_type_ids"].any()
    for pair, ids, mask in zip(pairs, batch["input_ids"], batch["attention_mask"]):
        for text, row, kept in zip((pair.anchor, pair.positive), ids, mask):
            assert row[kept.bool()].tolist() == tiny_tokenizer.encode(text, max_length=8, truncation=True)["input_ids"]
            assert row[~kept.bool()].eq(tiny_tokenizer.pad_token_id).all()


def test_scored_pairs_carry_their_scores(tiny_tokenizer):
    scored = [ScoredPair(f"the {w}", f"a {w}", i / 10) for i, w in enumerate(WORDS[:10])]
    data = ScoredPairBatches(scored, tiny_tokenizer, batch_size=4, max_seq_len=16, seed=2)
    assert data.num_batches(0) == 3 and sorted(int(i) for b in data.plan(0) for i in b) == list(range(10))
    for batch, rows in zip(data.iter_batches(0), data.plan(0)):
        assert batch["input_ids"].shape[1] == 2
        assert batch["scores"].tolist() == pytest.approx([scored[i].score for i in rows])


def test_pairs_are_held_out_by_whole_anchors_and_read_as_a_retrieval_set(tmp_path):
    rows = ["anchor,positive,negative"] + [f"{p.anchor},{p.positive},{p.negatives[0]}" for p in PAIRS]
    (tmp_path / "pairs.csv").write_text("\n".join(rows) + "\n")
    data = load_embedding_data(tmp_path / "pairs.csv", None, 0.25, seed=4)
    assert data.kind == "pairs" and len(data.train) + len(data.eval) == len(PAIRS)
    assert not {p.anchor for p in data.train} & {p.anchor for p in data.eval}
    assert 0.25 * len(PAIRS) <= len(data.eval) < 0.25 * len(PAIRS) + 4  # whole anchors, up to the share
    assert load_embedding_data(tmp_path / "pairs.csv", None, 0.25, seed=4) == data
    held = retrieval_set(data.eval)
    assert set(held.queries.values()) == {p.anchor for p in data.eval}
    assert set(held.corpus.values()) == {t for p in data.eval for t in (p.positive, *p.negatives)}
    for qid, relevant in held.relevant.items():
        positives = {p.positive for p in data.eval if p.anchor == held.queries[qid]}
        assert {held.corpus[d] for d in relevant} == positives


def test_an_evaluation_file_of_the_right_kind(tmp_path):
    from tests.helpers import ROOT

    pairs, retrieval, scored = (ROOT / "examples" / "data" / f for f in ("pairs.csv", "retrieval.jsonl", "stsb.csv"))
    given = load_embedding_data(pairs, retrieval, 0.1, seed=0)
    assert given.train == load_pairs(pairs) and isinstance(given.eval, RetrievalSet) and len(given.eval.queries) == 3
    assert load_embedding_data(pairs, pairs, 0.1, seed=0).eval == load_pairs(pairs)
    assert load_embedding_data(pairs, ROOT / "examples" / "data" / "beir-mini", 0.1, seed=0).eval.queries
    assert load_embedding_data(scored, scored, 0.1, seed=0).kind == "scored-pairs"
    with pytest.raises(ValueError) as e:
        load_embedding_data(pairs, scored, 0.1, seed=0)
    assert (
        str(e.value) == f"{scored}: the model trains on pairs, so its evaluation data must be pairs or a retrieval set"
    )
    with pytest.raises(ValueError) as e:
        load_embedding_data(scored, retrieval, 0.1, seed=0)
    assert str(e.value) == f"{retrieval}: the model trains on scored-pairs, so its evaluation data must be scored pairs"
    (tmp_path / "labels.csv").write_text("text,label\nhi,a\n")
    with pytest.raises(ValueError) as e:
        load_embedding_data(tmp_path / "labels.csv", None, 0.1, seed=0)
    assert str(e.value) == (
        f"{tmp_path / 'labels.csv'}: not pairs (columns anchor, positive and optionally negatives) nor scored pairs "
        "(columns sentence1, sentence2 and score)"
    )


def test_a_bad_line_of_an_evaluation_file_is_named(tmp_path):
    (tmp_path / "train.csv").write_text("anchor,positive\nthe cat,a cat\nthe dog,a dog\n")
    (tmp_path / "dev.csv").write_text("anchor,positive\nthe cat,\n")
    with pytest.raises(ValueError) as e:
        load_embedding_data(tmp_path / "train.csv", tmp_path / "dev.csv", 0.1, seed=0)
    assert str(e.value) == f"{tmp_path / 'dev.csv'}, line 2: 'positive' is empty or not text: ''"
