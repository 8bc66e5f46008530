"""bench/learning_runs.py stays runnable: its --quick smoke run goes through the real `bert finetune`
and `bert evaluate` subprocesses on MiniLM and writes its table and results.json (no verdict)."""

import json
from pathlib import Path

import pytest

from bench import learning_runs

pytestmark = pytest.mark.slow


def test_quick_run_trains_and_scores(tmp_path, minilm_dir, capsys):
    """The whole script on NER (bert finetune and bert evaluate as subprocesses); the QA run goes through
    the same two commands, which tests/app/cli/test_finetune_tasks_cli.py runs on SQuAD files: here its
    sets are checked (below) rather than trained on twice."""
    assert learning_runs.main(["--quick", "--tasks", "ner", "--out", str(tmp_path), "--threads", "1"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["task"] for r in results] == ["ner"]
    assert set(results[0]["metrics"]) >= {"precision", "recall", "f1", "accuracy"}
    assert all(0.0 <= r["metrics"]["f1"] <= 1.0 and r["finetune_s"] > 0 for r in results)
    table = capsys.readouterr().out
    assert "| ner | 64 / 32 sentences | 6 |" in table and "(quick)" in table


def test_the_qa_sets_are_squad_files_of_the_sizes_asked(tmp_path):
    args = learning_runs.parse_args(["--quick", "--tasks", "qa"])
    run = learning_runs.make_data(tmp_path, args)["qa"]
    for path, size in ((run.train, args.qa_train), (run.dev, args.qa_dev), (run.test, args.qa_test)):
        data = json.loads(Path(path).read_text())["data"]
        questions = [qa for doc in data for p in doc["paragraphs"] for qa in p["qas"]]
        assert len(questions) >= size, path
        for doc in data:
            for p in doc["paragraphs"]:
                for qa in p["qas"]:
                    for answer in qa["answers"]:  # every answer is where it says in its context
                        start = answer["answer_start"]
                        assert p["context"][start : start + len(answer["text"])] == answer["text"]


def test_tasks_option_is_checked():
    with pytest.raises(SystemExit):
        learning_runs.parse_args(["--tasks", "ner,pos"])
    assert learning_runs.parse_args(["--tasks", "qa"]).tasks == ["qa"]
