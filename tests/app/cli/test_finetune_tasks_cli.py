"""`bert finetune --task token-classification|question-answering` and `bert evaluate --json` on their
data: the pinned option names and JSON keys (a bench script reads them), and one-line user errors."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from model.modeling import BertForQuestionAnswering, BertForTokenClassification, load_model
from tests.model.test_finetune_tasks import files  # noqa: F401  (the fixture: a tiny base model, NER and SQuAD files)


def finetune(fixture_dir, out, task, data, *extra):
    return main(
        [
            "finetune",
            "--task",
            task,
            "--train",
            str(fixture_dir / data),
            "--eval",
            str(fixture_dir / data),
            "--from",
            str(fixture_dir / "base"),
            "--out",
            str(out),
            "--max-steps",
            "40",
            "--lr",
            "3e-3",
            "--warmup",
            "0",
            "--batch-size",
            "6",
            "--max-seq-len",
            "32",
            "--threads",
            "1",
            *map(str, extra),
        ]
    )


def evaluate_json(capsys, model, data, *extra):
    capsys.readouterr()
    assert (
        main(
            ["evaluate", "--model", str(model), "--data", str(data), "--json", "--max-seq-len", "32", *map(str, extra)]
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)


def test_finetune_and_evaluate_token_classification(files, tmp_path, capsys):  # noqa: F811
    assert finetune(files, tmp_path / "ner", "token-classification", "ner.jsonl") == 0
    assert "eval: " in capsys.readouterr().out
    assert isinstance(load_model(tmp_path / "ner" / "model"), BertForTokenClassification)
    metrics = evaluate_json(capsys, tmp_path / "ner", files / "ner.jsonl")
    assert {k: metrics[k] for k in ("f1", "precision", "recall", "accuracy")} == dict.fromkeys(
        ("f1", "precision", "recall", "accuracy"), 1.0
    )
    assert metrics["loss"] > 0 and metrics["rows"] == 6


def test_finetune_and_evaluate_question_answering(files, tmp_path, capsys):  # noqa: F811
    code = finetune(
        files,
        tmp_path / "qa",
        "question-answering",
        "qa.json",
        "--max-query-length",
        8,
        "--doc-stride",
        4,
        "--max-steps",
        150,
    )
    assert code == 0, capsys.readouterr().err
    assert isinstance(load_model(tmp_path / "qa" / "model"), BertForQuestionAnswering)
    metrics = evaluate_json(capsys, tmp_path / "qa", files / "qa.json", "--max-query-length", 8, "--doc-stride", 4)
    assert (metrics["exact_match"], metrics["f1"], metrics["questions"]) == (1.0, 1.0, 6)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "ner"], "argument --task: invalid choice: 'ner'"),
    ],
)
def test_bad_task_is_refused_by_the_parser(files, tmp_path, capsys, args, message):  # noqa: F811
    with pytest.raises(SystemExit):
        main(
            [
                "finetune",
                *args,
                "--train",
                str(files / "ner.jsonl"),
                "--from",
                str(files / "base"),
                "--out",
                str(tmp_path / "x"),
            ]
        )
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["finetune", "--max-stesp", "3"],
            "bert finetune: error: unrecognized arguments: --max-stesp 3 (did you mean --max-steps?)",
        ),
        (
            ["pretrain", "--max_steps=3"],
            "bert pretrain: error: unrecognized arguments: --max_steps=3 (did you mean --max-steps?)",
        ),
        (["finetune", "--momentum", "3"], "bert finetune: error: unrecognized arguments: --momentum 3"),
        (
            ["datasets", "list", "--jsn"],
            "bert datasets list: error: unrecognized arguments: --jsn (did you mean --json?)",
        ),
    ],
)
def test_an_unknown_option_is_refused_by_its_command_naming_the_one_it_looks_like(tmp_path, capsys, args, message):
    required = {
        "finetune": ["--train", "t.csv", "--from", "m", "--out", "o"],
        "pretrain": ["--corpus", "c.txt", "--out", "o"],
    }
    with pytest.raises(SystemExit) as e:
        main([*args, *required.get(args[0], [])])
    assert (e.value.code, capsys.readouterr().err.splitlines()[-1]) == (2, message)


def test_user_errors_are_one_line(files, tmp_path, capsys):  # noqa: F811
    assert finetune(files, tmp_path / "r", "token-classification", "ner.jsonl", "--regression") == 2
    assert capsys.readouterr().err == (
        "bert finetune: error: --regression is for --task sequence-classification, not token-classification\n"
    )
    assert finetune(files, tmp_path / "q", "question-answering", "qa.json", "--doc-stride", 40) == 2
    assert capsys.readouterr().err == (
        "bert finetune: error: question 'q0': doc_stride 40 must be at least 0 and "
        "less than the 23 context tokens that fit beside its 6 tokens in a window "
        "of max_seq_len 32\n"
    )
