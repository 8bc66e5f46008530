"""Tests for model/data/store.py (the token store reader) and for pretraining from a store: validation
errors, global offsets, the vectorised packing plan on shards, held-out documents and exact resume."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import model.data.pretraining as pretraining
from bench.plan_bench import sequential_plan
from model.data.corpus import load_corpus, tokenizer_fingerprint
from model.data.pretraining import InstancePlan, PretrainingData, _chunk_starts, plan_instances
from model.data.store import TokenStore, is_store, open_store
from model.tokenizer import BertTokenizer
from model.training.runs import PretrainSpec, evaluate_model, holdout_documents, run_pretraining
from model.training.trainer import TrainConfig
from model.weights import load_state_dict
from tests.conftest import make_training_files
from tests.helpers import StopAt
from tests.model.store_helpers import write_store
from tests.model.test_data import VOCAB, _google_corpus

CUTS = [13, 27]  # 40 documents in shards of 13, 14 and 13


@pytest.fixture(scope="module")
def tok():
    return BertTokenizer.from_vocab(VOCAB)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("store-corpus") / "google.txt"
    _google_corpus(path, n_docs=40, sentences=(1, 20), seed=4)  # some one-sentence documents too
    return load_corpus(path, tok)


@pytest.fixture
def store_dir(tmp_path, corpus, tok) -> Path:
    return write_store(tmp_path / "store", corpus, tok, CUTS)


# ---------------------------------------------------------------------------- reading and validation


def test_a_store_reads_as_the_corpus_it_was_cut_from(store_dir, corpus, tok):
    store = open_store(store_dir, tok)
    assert is_store(store_dir) and not is_store(store_dir.parent) and not is_store(corpus.path)
    assert [s.num_documents for s in store.shards] == [13, 14, 13]
    assert (store.num_documents, store.num_sentences, store.num_tokens) == (
        corpus.num_documents,
        corpus.num_sentences,
        corpus.num_tokens,
    )
    starts = corpus.sentence_offsets
    for i in range(corpus.num_sentences):  # global offsets read the same tokens as the file's
        assert np.array_equal(store.tokens[starts[i] : starts[i + 1]], corpus.tokens[starts[i] : starts[i + 1]])
    assert np.array_equal(store.document_of_token(starts[:-1]), corpus.document_of_token(starts[:-1]))
    edge = int(store.token_bases[1])
    with pytest.raises(ValueError) as e:
        store.tokens[edge - 1 : edge + 1]
    assert str(e.value) == f"tokens[{edge - 1}:{edge + 1}] spans shards 0 and 1; a segment never does"


def _manifest(d: Path, **changes) -> None:
    m = json.loads((d / "manifest.json").read_text())
    for key, value in changes.items():
        m[key] = value(m[key]) if callable(value) else value
    (d / "manifest.json").write_text(json.dumps(m))


def _short_tokens(d: Path) -> None:
    tokens = np.load(d / "shard-00002.tokens.npy")
    np.save(d / "shard-00002.tokens.npy", tokens[:-1])


def _shard_2(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())["shards"][2]


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda d: (d / "manifest.json").unlink(),
            "{d} is not a complete token store: no manifest.json (the builder writes it last)",
        ),
        (
            lambda d: (d / "manifest.json").write_text("{not json"),
            "{d}/manifest.json is not valid JSON: "
            "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        (
            lambda d: _manifest(d, format="bertserve-corpus"),
            "{d}/manifest.json: format is 'bertserve-corpus', expected 'bertserve-token-store'",
        ),
        (
            lambda d: _manifest(d, version=2),
            "{d}/manifest.json: version 2 is not supported (this reader reads version 1)",
        ),
        (lambda d: _manifest(d, dtype="int8"), "{d}/manifest.json: dtype 'int8', expected one of ('uint16', 'int32')"),
        (lambda d: _manifest(d, shards=[]), "{d}/manifest.json: the store has no shards"),
        (
            lambda d: (d / "shard-00001.sentences.npy").unlink(),
            "{d}: shard 'shard-00001' has no shard-00001.sentences.npy (an incomplete or damaged store)",
        ),
        (
            _short_tokens,
            "{d}/shard-00002.tokens.npy has {t_1} entries, the manifest says {t} "
            "(documents 13, sentences {s}, tokens {t})",
        ),
        (
            lambda d: _manifest(d, totals=lambda t: {**t, "tokens": t["tokens"] + 1}),
            "{d}/manifest.json: totals {{'documents': 40, 'sentences': {total_s}, 'tokens': {total_t_1}}} do not match "
            "the shards' sum {{'documents': 40, 'sentences': {total_s}, 'tokens': {total_t}}}",
        ),
    ],
)
def test_a_damaged_store_is_a_value_error_naming_what_is_wrong(store_dir, corpus, tok, damage, message):
    shard = _shard_2(store_dir)
    expected = message.format(
        d=store_dir,
        t=shard["tokens"],
        t_1=shard["tokens"] - 1,
        s=shard["sentences"],
        total_s=corpus.num_sentences,
        total_t=corpus.num_tokens,
        total_t_1=corpus.num_tokens + 1,
    )
    damage(store_dir)
    with pytest.raises(ValueError) as e:
        open_store(store_dir, tok)
    assert str(e.value) == expected


def test_another_tokenizer_or_no_store_is_refused(store_dir, tok, tmp_path):
    other = BertTokenizer.from_vocab(VOCAB + ["zebra"])
    built = json.loads((store_dir / "manifest.json").read_text())["tokenizer"]["fingerprint"]
    with pytest.raises(ValueError) as e:
        open_store(store_dir, other)
    assert str(e.value) == (
        f"{store_dir} was tokenised by another tokenizer: fingerprint {built!r} (vocab_size {len(VOCAB)}, "
        f"lowercase True), but this run's tokenizer is {tokenizer_fingerprint(other)!r} (vocab_size "
        f"{len(VOCAB) + 1}, lowercase True); rebuild the store with this tokenizer or train with the store's"
    )
    assert open_store(store_dir).num_documents == 40  # no tokenizer: nothing to compare
    with pytest.raises(FileNotFoundError, match=f"^token store not found: {tmp_path / 'nowhere'}$"):
        open_store(tmp_path / "nowhere")


# ---------------------------------------------------------------------------- planning


def test_chunk_starts_follow_the_chain_from_the_first_sentence():
    assert _chunk_starts(np.array([2, 3, 3, 5, 5])).tolist() == [0, 2, 3]
    assert _chunk_starts(np.arange(1, 101)).tolist() == list(range(100))  # 7 doubling rounds
    assert _chunk_starts(np.array([9, 2, 3, 4, 5, 6, 7, 8, 9])).tolist() == [0]
    assert _chunk_starts(np.zeros(0, np.int64)).tolist() == []


def test_the_vectorised_plan_has_the_statistics_of_the_sequential_loop_it_replaced(corpus):
    def stats(plans):
        a_lo, a_hi, b_lo, b_hi, is_random = (np.concatenate(c) for c in zip(*plans))
        total = np.minimum(a_hi - a_lo + b_hi - b_lo, 45)
        return np.array([len(a_lo) / len(plans), is_random.mean(), total.mean(), (total < 20).mean()])

    old = stats([sequential_plan(corpus, 45, 0.1, random.Random(e)) for e in range(30)])
    new_plans = [plan_instances(corpus, 45, 0.1, True, np.random.default_rng(e)) for e in range(30)]
    new = stats([[getattr(p, f) for f in ("a_lo", "a_hi", "b_lo", "b_hi", "is_random_next")] for p in new_plans])
    # instances an epoch, NSP share, mean tokens, share of short ones: equal within sampling noise
    assert np.allclose(new, old, rtol=0.03, atol=0.015), (old, new)


def _pooled(data: PretrainingData, epochs: int) -> InstancePlan:
    plans = [data.plan(e) for e in range(epochs)]
    return InstancePlan(
        *(np.concatenate([getattr(p, f) for p in plans]) for f in ("a_lo", "a_hi", "b_lo", "b_hi", "is_random_next"))
    )


def _check_plan(store: TokenStore, plan: InstancePlan) -> None:
    rand = plan.is_random_next.astype(bool)
    doc_a, doc_b = store.document_of_token(plan.a_lo), store.document_of_token(plan.b_lo)
    assert (doc_a == store.document_of_token(plan.a_hi - 1)).all()  # segments never straddle documents
    assert (doc_b == store.document_of_token(plan.b_hi - 1)).all()
    assert (doc_a[rand] != doc_b[rand]).all()
    assert (doc_a[~rand] == doc_b[~rand]).all() and (plan.b_lo[~rand] == plan.a_hi[~rand]).all()
    starts = set(np.concatenate([s.sentence_offsets + b for s, b in zip(store.shards, store.token_bases)]).tolist())
    assert all(int(x) in starts for x in np.r_[plan.a_lo, plan.a_hi, plan.b_lo, plan.b_hi])


def test_a_store_is_packed_from_whole_documents_with_balanced_nsp_across_shards(store_dir, corpus, tok):
    store = open_store(store_dir, tok)
    data = PretrainingData(store, tok, max_seq_len=48, seed=3)
    plan = _pooled(data, 10)  # each epoch packs anew: pool them for the statistics
    rand = plan.is_random_next.astype(bool)
    assert 0.45 < rand.mean() < 0.55 and len(plan) > 1000
    _check_plan(store, plan)
    shard_of = np.searchsorted(store.token_bases, plan.a_lo, side="right") - 1
    other_shard = np.searchsorted(store.token_bases, plan.b_lo, side="right") - 1
    assert (shard_of[~rand] == other_shard[~rand]).all() and (shard_of[rand] != other_shard[rand]).mean() > 0.4
    assert set(shard_of.tolist()) == {0, 1, 2}
    lengths = [len(data.example(0, i)["input_ids"]) for i in range(data.num_examples(0))]
    assert max(lengths) <= 48 and np.mean(np.array(lengths) >= 40) > 0.5


def test_an_empty_shard_is_read_and_planned_past(tmp_path, corpus, tok):
    store = open_store(write_store(tmp_path / "gap", corpus, tok, [13, 13, 27]), tok)
    assert [s.num_documents for s in store.shards] == [13, 0, 14, 13]
    starts = corpus.sentence_offsets
    assert np.array_equal(store.tokens[starts[130] : starts[131]], corpus.tokens[starts[130] : starts[131]])
    _check_plan(store, PretrainingData(store, tok, max_seq_len=48, seed=3).plan(0))
    assert len(PretrainingData(store, tok, max_seq_len=48, nsp=False).plan(0)) > 0


def test_blocks_of_a_shard_are_planned_alike(store_dir, corpus, tok, monkeypatch):
    store = open_store(store_dir, tok)
    whole = len(PretrainingData(store, tok, max_seq_len=48, seed=3).plan(0))
    monkeypatch.setattr(pretraining, "PLAN_BLOCK_SENTENCES", 40)  # a block is a few documents
    data = PretrainingData(store, tok, max_seq_len=48, seed=3)
    _check_plan(store, _pooled(data, 3))
    assert abs(len(data.plan(0)) - whole) < 0.1 * whole


def test_a_store_of_one_shard_gives_the_batches_of_its_file(tmp_path, corpus, tok):
    store = open_store(write_store(tmp_path / "one", corpus, tok, []), tok)
    for nsp in (True, False):
        kw = dict(batch_size=8, max_seq_len=40, seed=5, nsp=nsp)
        from_file, from_store = PretrainingData(corpus, tok, **kw), PretrainingData(store, tok, **kw)
        for f in ("a_lo", "a_hi", "b_lo", "b_hi", "is_random_next"):
            assert np.array_equal(getattr(from_file.plan(1), f), getattr(from_store.plan(1), f))
        a, b = next(from_file.iter_batches(1, 2)), next(from_store.iter_batches(1, 2))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_store_batches_are_a_function_of_seed_epoch_and_batch(store_dir, tok):
    def batches(seed, epoch, start):
        data = PretrainingData(open_store(store_dir, tok), tok, batch_size=8, max_seq_len=48, seed=seed)
        return list(data.iter_batches(epoch, start))

    full, resumed = batches(5, 1, 0), batches(5, 1, 3)
    assert len(full) > 10 and len(resumed) == len(full) - 3
    assert all(all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(full[3:], resumed))
    assert not torch.equal(full[0]["input_ids"], batches(5, 2, 0)[0]["input_ids"])
    assert not torch.equal(full[0]["input_ids"], batches(6, 1, 0)[0]["input_ids"])


# ---------------------------------------------------------------------------- runs


def test_held_out_documents_of_a_store_are_its_last_ones_in_as_many_shards_as_they_take(store_dir, corpus, tok):
    store = open_store(store_dir, tok)
    train, held = holdout_documents(store, 0.1, 1000)
    assert [s.num_documents for s in train.shards] == [13, 14, 9] and [s.num_documents for s in held.shards] == [4]
    assert [s.tolist() for s in held.shards[0].document(0)] == [s.tolist() for s in corpus.document(36)]
    train, held = holdout_documents(store, 0.6, 1000)  # 24 documents: the tail of shard 1 and all of shard 2
    assert [s.num_documents for s in train.shards] == [13, 3] and [s.num_documents for s in held.shards] == [11, 13]
    first = int(corpus.document_offsets[16])  # the first held-out sentence, and its first token
    t = int(corpus.sentence_offsets[first])
    for lo, hi in zip(corpus.sentence_offsets[first:-1], corpus.sentence_offsets[first + 1 :]):
        assert np.array_equal(held.tokens[lo - t : hi - t], corpus.tokens[lo:hi])  # the corpus's last documents
    train, held = holdout_documents(store, 27 / 40, 1000)  # exactly shards 1 and 2
    assert [s.num_documents for s in train.shards] == [13] and [s.num_documents for s in held.shards] == [14, 13]
    assert train.num_tokens + held.num_tokens == corpus.num_tokens
    assert holdout_documents(store, 0.99, 1000)[1] is None  # would leave fewer than 2 to train on
    for side in holdout_documents(store, 0.6, 1000):  # each side plans on its own
        _check_plan(side, PretrainingData(side, tok, max_seq_len=48, seed=1).plan(0))


def test_a_run_on_a_store_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    files = make_training_files(tmp_path)
    tok = BertTokenizer.from_pretrained(files / "vocab")
    store = write_store(tmp_path / "store", load_corpus(files / "corpus.txt", tok), tok, [5])

    def spec(out):
        return PretrainSpec(
            corpus=str(store),
            out=str(tmp_path / out),
            config=str(files / "tiny.json"),
            vocab=str(files / "vocab"),
            batch_size=4,
            max_seq_len=32,
            eval_fraction=0.2,
            train=TrainConfig(max_steps=9, lr=1e-3, warmup_steps=2, save_every=100, seed=3, log_every=1, eval_every=3),
        )

    straight = run_pretraining(spec("straight"))
    assert run_pretraining(spec("stopped"), callbacks=[StopAt(4)]).status == "stopped"
    resumed = run_pretraining(spec("stopped"))
    assert (straight.status, resumed.status, resumed.step) == ("completed", "completed", 9)
    epochs = [json.loads(x).get("epoch", 0) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert max(epochs) > 1  # the run crossed epochs, so plans of several epochs were resumed into
    a, b = load_state_dict(straight.model_dir), load_state_dict(resumed.model_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    metrics = evaluate_model(straight.model_dir, store, batch_size=4, max_seq_len=32)  # `bert evaluate --data`
    assert metrics["data"] == str(store) and 0 <= metrics["nsp_accuracy"] <= 1 and metrics["mlm_loss"] > 0
