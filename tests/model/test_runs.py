"""model/training/runs.py as the worker and the examples call it: held-out documents, warm starts, frozen encoders."""

from __future__ import annotations

import pytest
import torch

from model.data.corpus import load_corpus
from model.modeling import BertForPreTraining, load_model
from model.tokenizer import BertTokenizer
from model.training.runs import PretrainSpec, _pretraining_model, holdout_documents, run_pretraining
from model.training.trainer import TrainConfig
from model.weights import load_state_dict, normalize_state_dict
from tests.conftest import TINY_VOCAB, make_training_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_training_files(tmp_path_factory.mktemp("runs"))


def test_holdout_documents_are_views_of_the_last_documents(files):
    corpus = load_corpus(files / "corpus.txt", BertTokenizer.from_vocab(TINY_VOCAB), cache_dir=files / "cache")
    train, held = holdout_documents(corpus, 0.25, 1000)
    assert (train.num_documents, held.num_documents) == (9, 3)
    assert [s.tolist() for s in held.document(0)] == [s.tolist() for s in corpus.document(9)]
    assert train.num_tokens + held.num_tokens == corpus.num_tokens
    assert holdout_documents(corpus, 0.9, 1000)[1] is None  # would leave fewer than 2 to train on


@pytest.mark.slow
def test_warm_start_from_minilm_keeps_the_encoder_and_ties_the_decoder(minilm_dir, files, tmp_path):
    spec = PretrainSpec(
        corpus=str(files / "corpus.txt"),
        out=str(tmp_path / "warm"),
        from_model=str(minilm_dir),
        batch_size=2,
        max_seq_len=16,
        eval_fraction=0,
        train=TrainConfig(max_steps=1, log_every=1),
    )
    _, model = _pretraining_model(spec, None)
    assert model.cls.predictions.word_embeddings[0] is model.bert.embeddings.word_embeddings
    source = normalize_state_dict(load_state_dict(minilm_dir))
    ours = model.state_dict()
    encoder = [k for k in ours if k.startswith("bert.")]
    assert encoder and all(torch.equal(ours[k], source[k]) for k in encoder if k in source)

    result = run_pretraining(spec)
    assert result.status == "completed"
    assert type(load_model(result.model_dir)) is BertForPreTraining


def test_freeze_encoder_trains_only_the_heads(files, tmp_path):
    scratch = PretrainSpec(
        corpus=str(files / "corpus.txt"),
        out=str(tmp_path / "base"),
        config=str(files / "tiny.json"),
        vocab=str(files / "vocab"),
        batch_size=4,
        max_seq_len=32,
        eval_fraction=0,
        train=TrainConfig(max_steps=2, log_every=1, lr=1e-3),
    )
    base = run_pretraining(scratch).model_dir
    spec = PretrainSpec(
        corpus=str(files / "corpus.txt"),
        out=str(tmp_path / "frozen"),
        from_model=str(base),
        batch_size=4,
        max_seq_len=32,
        eval_fraction=0,
        freeze_encoder=True,
        train=TrainConfig(max_steps=3, log_every=1, lr=1e-2),
    )
    result = run_pretraining(spec)
    before = normalize_state_dict(load_state_dict(base))
    after = normalize_state_dict(load_state_dict(result.model_dir))
    frozen = [k for k in after if k.startswith(("bert.embeddings.", "bert.encoder."))]
    trained = [k for k in after if k.startswith(("cls.", "bert.pooler."))]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert any(not torch.equal(before[k], after[k]) for k in trained)
