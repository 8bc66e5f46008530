"""Fine-tuning for token classification and extractive QA through model/training/runs.py: a tiny model overfits a
handful of tagged sentences / SQuAD questions (F1 -> 1.0), a stopped run resumes to the same weights as
an uninterrupted one, the published model loads as its class with its tag map, evaluate_model scores it,
and the best checkpoint is chosen by f1."""

from __future__ import annotations

import json

import pytest
import torch

from model.config import BertConfig
from model.errors import UserError
from model.modeling import (
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForTokenClassification,
    class_for_dir,
    load_model,
)
from model.tokenizer import BertTokenizer
from model.training.checkpoint import list_checkpoints
from model.training.runs import FinetuneSpec, evaluate_model, run_finetuning
from tests.conftest import TINY_VOCAB, tiny_config_dict
from tests.helpers import StopAt

NER = [
    (["the", "cat", "sat", "on", "the", "mat"], ["O", "B-ANIMAL", "O", "O", "O", "B-THING"]),
    (["she", "reads", "a", "book", "in", "the", "city"], ["B-PER", "O", "O", "B-THING", "O", "O", "B-LOC"]),
    (["the", "big", "red", "house", "is", "good"], ["O", "B-THING", "I-THING", "I-THING", "O", "O"]),
    (["he", "eats", "food", "at", "the", "river"], ["B-PER", "O", "B-THING", "O", "O", "B-LOC"]),
    (["a", "dog", "runs", "fast"], ["O", "B-ANIMAL", "O", "O"]),
    (["the", "woman", "and", "the", "man"], ["O", "B-PER", "O", "O", "B-PER"]),
]
CONTEXTS = [
    "the cat sat on the mat . the dog eats bread",
    "she reads a book in the city at night",
    "the big red house is on the mountain by the river",
]
QUESTIONS = [
    ("what sat on the mat ?", 0, "the cat"),
    ("what does the dog eat ?", 0, "bread"),
    ("where is she ?", 1, "the city"),
    ("what does she read ?", 1, "a book"),
    ("what is red ?", 2, "the big red house"),
    ("where is the house ?", 2, "the mountain"),
]


def squad(questions=QUESTIONS, impossible=()):
    paragraphs = []
    for k, context in enumerate(CONTEXTS):
        qas = [
            {"id": f"q{i}", "question": q, "answers": [{"text": a, "answer_start": context.index(a)}]}
            for i, (q, c, a) in enumerate(questions)
            if c == k
        ]
        qas += [
            {"id": f"x{i}", "question": q, "answers": [], "is_impossible": True}
            for i, (q, c) in enumerate(impossible)
            if c == k
        ]
        paragraphs.append({"context": context, "qas": qas})
    return {"version": "v2.0" if impossible else "v1.1", "data": [{"title": "t", "paragraphs": paragraphs}]}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    tokenizer = BertTokenizer.from_vocab(TINY_VOCAB, lowercase=True)
    torch.manual_seed(0)
    BertForPreTraining(BertConfig(**tiny_config_dict())).save_pretrained(root / "base", tokenizer=tokenizer)
    (root / "ner.jsonl").write_text("".join(json.dumps({"tokens": t, "tags": g}) + "\n" for t, g in NER))
    (root / "qa.json").write_text(json.dumps(squad()))
    (root / "qa2.json").write_text(json.dumps(squad(impossible=[("what is blue ?", 0), ("who is green ?", 2)])))
    return root


def spec(files, out, task, data, steps=40, lr=3e-3, **kw):
    train = {"max_steps": steps, "lr": lr, "warmup_steps": 0, **kw.pop("train", {})}
    fields = dict(
        train_file=str(files / data),
        eval_file=str(files / data),
        from_model=str(files / "base"),
        out=str(out),
        task=task,
        batch_size=6,
        max_seq_len=32,
        train=train,
    )
    return FinetuneSpec.from_dict({**fields, **kw})


def test_tiny_model_overfits_tagged_sentences(files, tmp_path):
    result = run_finetuning(spec(files, tmp_path / "run", "token-classification", "ner.jsonl"))
    assert result.eval_metrics["f1"] == result.eval_metrics["accuracy"] == 1.0
    assert result.eval_metrics["precision"] == result.eval_metrics["recall"] == 1.0
    model_dir = tmp_path / "run" / "model"
    assert class_for_dir(model_dir) is BertForTokenClassification
    config = json.loads((model_dir / "config.json").read_text())
    tags = sorted({t for _, g in NER for t in g})
    assert config["architectures"] == ["BertForTokenClassification"]
    assert config["id2label"] == {str(i): t for i, t in enumerate(tags)}
    assert config["label2id"] == {t: i for i, t in enumerate(tags)}
    metrics = evaluate_model(tmp_path / "run", files / "ner.jsonl", max_seq_len=32, device="cpu")
    assert {k: metrics[k] for k in ("precision", "recall", "f1", "accuracy")} == dict.fromkeys(
        ("precision", "recall", "f1", "accuracy"), 1.0
    )


def test_tiny_model_overfits_squad_questions(files, tmp_path):
    result = run_finetuning(
        spec(files, tmp_path / "run", "question-answering", "qa.json", steps=150, max_query_length=8)
    )
    assert (result.eval_metrics["exact_match"], result.eval_metrics["f1"]) == (1.0, 1.0)
    assert class_for_dir(tmp_path / "run" / "model") is BertForQuestionAnswering
    metrics = evaluate_model(tmp_path / "run", files / "qa.json", max_seq_len=32, max_query_length=8, device="cpu")
    assert (metrics["exact_match"], metrics["f1"], metrics["questions"]) == (1.0, 1.0, 6)


def test_v2_data_learns_to_answer_nothing(files, tmp_path):
    result = run_finetuning(
        spec(files, tmp_path / "run", "question-answering", "qa2.json", steps=300, max_query_length=8)
    )
    assert result.eval_metrics["questions"] == 8 and result.eval_metrics["exact_match"] == 1.0
    model = load_model(tmp_path / "run" / "model")
    assert isinstance(model, BertForQuestionAnswering)


@pytest.mark.parametrize("task, data", [("token-classification", "ner.jsonl"), ("question-answering", "qa2.json")])
def test_resume_gives_the_weights_of_an_uninterrupted_run(files, tmp_path, task, data):
    kw = dict(steps=7, batch_size=4, train={"log_every": 1, "seed": 3}, max_query_length=8)
    straight = run_finetuning(spec(files, tmp_path / "a", task, data, **kw))
    stopped = run_finetuning(spec(files, tmp_path / "b", task, data, **kw), callbacks=[StopAt(3)])
    assert (stopped.status, stopped.step) == ("stopped", 3)
    resumed = run_finetuning(spec(files, tmp_path / "b", task, data, **kw))
    assert (resumed.status, resumed.step) == ("completed", 7)
    a, b = load_model(straight.model_dir).state_dict(), load_model(resumed.model_dir).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.eval_metrics == straight.eval_metrics


def test_best_checkpoint_is_the_best_f1(files, tmp_path):
    s = spec(
        files,
        tmp_path / "run",
        "token-classification",
        "ner.jsonl",
        steps=12,
        train={"eval_every": 3, "save_every": 3, "keep_last": 1},
    )
    assert (s.train.best_metric, s.train.greater_is_better) == ("f1", True)
    result = run_finetuning(s)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["type"] == "eval"]
    best = max(evals, key=lambda r: (r["f1"], -r["step"]))  # the first of equals stays best
    assert result.best_checkpoint.endswith(f"step-{best['step']}")
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == sorted(
        {f"step-{best['step']}", "step-12"}, key=lambda n: int(n.split("-")[1])
    )
    explicit = spec(files, tmp_path / "x", "question-answering", "qa.json", train={"best_metric": "loss"})
    assert (explicit.train.best_metric, explicit.train.greater_is_better) == ("loss", False)


def test_user_errors(files, tmp_path):
    with pytest.raises(
        ValueError,
        match="^unknown task 'ner'; expected one of sequence-classification, token-classification, question-answering, "
        "sentence-embedding, cross-encoder, late-interaction, sparse-embedding$",
    ):
        spec(files, tmp_path / "x", "ner", "ner.jsonl")
    with pytest.raises(UserError) as e:
        run_finetuning(spec(files, tmp_path / "y", "question-answering", "ner.jsonl"))
    assert str(e.value) == f"{files / 'ner.jsonl'}: not JSON: Extra data: line 2 column 1 (char 107)"
    with pytest.raises(UserError) as e:
        run_finetuning(spec(files, tmp_path / "z", "token-classification", "qa.json"))
    assert str(e.value) == (
        f"cannot tell the format of {files / 'qa.json'}: expected CoNLL columns (.conll, .iob, "
        ".iob2, .bio, .txt, .tsv) or JSONL (.jsonl, .ndjson)"
    )
