"""A model with one segment (config.json's type_vocab_size 1, as RoBERTa-style checkpoints have) given a text pair,
over a real `bert serve`: every route that sends pairs answers 200, and as the model was trained (every token type
0), not with the 500 of an index past its one-row table (on CUDA, a device-side assert that poisons every later
batch)."""

from __future__ import annotations

import httpx
import pytest
import torch

from model.modeling import BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification
from model.tokenizer import BertTokenizer
from tests.app.conftest import VOCAB, save_tiny
from tests.app.test_server import free_port, start_server

pytestmark = pytest.mark.slow

PAIR = ("the cat sat on the mat", "the dog ran to the river")
MODELS = {
    "one-pt": (BertForPreTraining, {}),
    "one-qa": (BertForQuestionAnswering, {}),
    "one-cls": (BertForSequenceClassification, {"id2label": {0: "negative", 1: "positive"}}),
    "one-rerank": (BertForSequenceClassification, {"id2label": {0: "LABEL_0"}}),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("one-segment")
    models = {
        name: save_tiny(data_dir / "models" / name, cls, seed=i, type_vocab_size=1, **extra)
        for i, (name, (cls, extra)) in enumerate(MODELS.items())
    }
    port = free_port()
    proc = start_server(data_dir, port, BERT_DEFAULT_MODEL="one-pt")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            yield client, models
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def zero_type_logits(model, a: str, b: str) -> torch.Tensor:
    """The model's logits for the pair with every token type 0 (how a one-segment model was trained)."""
    enc = BertTokenizer.from_vocab(VOCAB).encode(a, b)
    with torch.inference_mode():
        out = model(torch.tensor([enc["input_ids"]]), token_type_ids=torch.zeros(1, len(enc["input_ids"]), dtype=int))
    return (out.seq_relationship_logits if hasattr(out, "seq_relationship_logits") else out.logits)[0]


def test_nsp_of_a_pair_is_the_models_own_answer(served):
    client, models = served
    r = client.post("/nsp", json={"inputs": {"text_a": PAIR[0], "text_b": PAIR[1]}, "model": "one-pt"})
    assert r.status_code == 200, r.text
    expected = torch.softmax(zero_type_logits(models["one-pt"], *PAIR), -1)[0].item()
    assert r.json()["score"] == pytest.approx(expected, abs=1e-5)


def test_pair_classification_answers(served):
    client, models = served
    r = client.post("/classify", json={"inputs": {"text_a": PAIR[0], "text_b": PAIR[1]}, "model": "one-cls"})
    assert r.status_code == 200, r.text
    expected = torch.softmax(zero_type_logits(models["one-cls"], *PAIR), -1)
    assert [r.json()["scores"][k] for k in ("negative", "positive")] == pytest.approx(expected.tolist(), abs=1e-5)


def test_rerank_answers(served):
    client, models = served
    r = client.post("/rerank", json={"query": PAIR[0], "texts": [PAIR[1]], "model": "one-rerank"})
    assert r.status_code == 200, r.text
    expected = torch.sigmoid(zero_type_logits(models["one-rerank"], *PAIR)[0]).item()
    assert r.json() == [{"index": 0, "score": pytest.approx(expected, abs=1e-5)}]


def test_question_answering_answers(served):
    client, _ = served
    r = client.post("/question-answering", json={"question": "where did the dog run", "context": PAIR[1]})
    assert r.status_code == 422  # the default model has no QA head: the route is the same for a named one
    r = client.post(
        "/question-answering", json={"question": "where did the dog run", "context": PAIR[1], "model": "one-qa"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["answer"] in PAIR[1]


def test_the_server_still_answers_afterwards(served):
    client, _ = served
    assert client.post("/embeddings", json={"inputs": "the cat"}).status_code == 200
