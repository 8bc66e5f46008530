"""Shared by the trainer and evaluation tests: a handful of sentence pairs and tiny models to train on them."""

from __future__ import annotations

import pytest
import torch

from model.config import BertConfig
from model.data.corpus import load_corpus
from model.data.pretraining import PretrainingData
from model.modeling import BertForPreTraining
from tests.conftest import tiny_config_dict

PAIRS = [
    ("the cat sat on the mat", "the dog eats bread"),
    ("she reads a book", "the sky is blue"),
    ("he ran fast", "the car is red"),
    ("we love the movie", "it was a great film"),
    ("the river runs at night", "the tree is big"),
    ("a man eats food", "a woman reads"),
    ("the city is small", "the mountain is green"),
]


@pytest.fixture
def corpus(tmp_path, tiny_tokenizer):
    path = tmp_path / "pairs.tsv"
    path.write_text("".join(f"{a}\t{b}\n" for a, b in PAIRS))
    return load_corpus(path, tiny_tokenizer, cache_dir=tmp_path / "cache")


def pretraining_data(corpus, tokenizer, seed=0):
    # 7 pairs in batches of 3: three batches an epoch, the last one short.
    return PretrainingData(corpus, tokenizer, batch_size=3, max_seq_len=24, seed=seed)


def tiny_model(seed=0, **overrides) -> BertForPreTraining:
    torch.manual_seed(seed)
    return BertForPreTraining(BertConfig(**tiny_config_dict(**overrides)))


class FixedBatches:
    """The same batches every epoch (no dynamic masking): what the seed project's overfit check used."""

    def __init__(self, batches):
        self.batches = batches

    def num_batches(self, epoch):
        return len(self.batches)

    def iter_batches(self, epoch, start_batch=0):
        yield from self.batches[start_batch:]
