"""bench/learning_runs.py stays runnable: its --quick smoke run goes through the real `bert finetune`
and `bert evaluate` subprocesses on MiniLM and writes its table and results.json (no verdict)."""

import json

import pytest

from bench import learning_runs

pytestmark = pytest.mark.slow


def test_quick_run_trains_and_scores_both_tasks(tmp_path, minilm_dir, capsys):
    assert learning_runs.main(["--quick", "--out", str(tmp_path), "--threads", "1"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["task"] for r in results] == ["ner", "qa"]
    assert set(results[0]["metrics"]) >= {"precision", "recall", "f1", "accuracy"}
    assert set(results[1]["metrics"]) >= {"exact_match", "f1"}
    assert all(0.0 <= r["metrics"]["f1"] <= 1.0 and r["finetune_s"] > 0 for r in results)
    table = capsys.readouterr().out
    assert "| ner | 64 / 32 sentences | 6 |" in table and "(quick)" in table


def test_tasks_option_is_checked():
    with pytest.raises(SystemExit):
        learning_runs.parse_args(["--tasks", "ner,pos"])
    assert learning_runs.parse_args(["--tasks", "qa"]).tasks == ["qa"]
