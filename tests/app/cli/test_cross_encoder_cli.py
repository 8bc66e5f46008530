"""`bert finetune --task cross-encoder`: its flags reach the run, and a loss that does not fit the data or a
flag of another task is a one-line error."""

from __future__ import annotations

import json

from app.cli import main
from tests.model.test_cross_encoder import files  # noqa: F401  (the fixture: a tiny encoder and pairs files)


def finetune(fixture_dir, out, data, *extra):
    argv = ["finetune", "--train", str(fixture_dir / data), "--from", str(fixture_dir / "base"), "--out", str(out)]
    argv += ["--max-steps", "2", "--batch-size", "4", "--max-seq-len", "32", "--threads", "1", *map(str, extra)]
    return main(argv)


def test_a_reranker_from_the_command_line(files, tmp_path, capsys):  # noqa: F811
    assert finetune(files, tmp_path / "r", "pairs.csv", "--task", "cross-encoder", "--num-negatives", 2) == 0
    assert "rerank_ndcg@10=" in capsys.readouterr().out
    state = json.loads((tmp_path / "r" / "checkpoints" / "step-2" / "state.json").read_text())["trainer"]
    assert (state["best_metric"], state["config"]["eval_on_start"], state["base_eval"]["queries"]) == (
        "rerank_ndcg@10",
        True,
        1,  # 10% of 9 anchors held out
    )


def test_user_errors_are_one_line(files, tmp_path, capsys):  # noqa: F811
    assert finetune(files, tmp_path / "a", "scored.csv", "--task", "cross-encoder", "--loss", "mnrl") == 2
    err = capsys.readouterr().err
    assert err.startswith("bert finetune: error: ") and err.endswith(
        "holds scored-pairs; loss mnrl ranks each anchor's positive above its negatives, so it trains on pairs "
        "(anchor, positive[, negative ...]): use loss bce\n"
    )
    assert finetune(files, tmp_path / "b", "labelled.csv", "--num-negatives", 2) == 2
    assert capsys.readouterr().err == (
        "bert finetune: error: --num-negatives is for --task cross-encoder, not sequence-classification\n"
    )
