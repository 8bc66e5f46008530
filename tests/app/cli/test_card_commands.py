"""`bert evaluate-card DIR` writes a model's held-out scores into its card.json; `bert info DIR` shows them."""

from __future__ import annotations

import json

import torch

from app.cli import main
from datadir.cards import read_card, update_card
from model.config import BertConfig
from model.modeling import BertForPreTraining
from model.precision_choice import auto_choice, cpu_kind
from model.tokenizer import BertTokenizer
from tests.conftest import TINY_VOCAB, tiny_config_dict


def test_evaluate_card_then_info(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    torch.manual_seed(0)
    BertForPreTraining(BertConfig(**tiny_config_dict())).save_pretrained(
        model_dir, tokenizer=BertTokenizer.from_vocab(TINY_VOCAB)
    )
    assert main(["info", str(model_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["card"] is None
    assert main(["evaluate-card", str(model_dir)]) == 0
    out = capsys.readouterr().out
    ev = read_card(model_dir)["evaluation"]
    assert out.startswith(f"wrote {model_dir / 'card.json'}\n  evaluation:   wiki-heldout-v1, 128 sequences (")
    assert f"    next sentence: {100 * ev['nsp_accuracy']:.1f}%\n" in out
    # and each precision this CPU runs natively against fp32: what auto chooses from (model/precision_choice.py)
    row = read_card(model_dir)["precision"][cpu_kind()]
    assert f"  precisions on {cpu_kind()} (measured {row['measured']}, against fp32):\n" in out
    assert main(["info", str(model_dir), "--json", "--device", "cpu"]) == 0
    kernels = json.loads(capsys.readouterr().out)["kernels"]
    assert (kernels["auto"], kernels["auto_why"]) == auto_choice(read_card(model_dir)["precision"])
    update_card(model_dir, job_eval={"accuracy": 0.75, "loss": 0.5})
    assert main(["info", str(model_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["card"] == read_card(model_dir)
    assert main(["info", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert f"    masked LM:  top-1 {100 * ev['mlm_top1']:.1f}%, top-5 {100 * ev['mlm_top5']:.1f}%\n" in out
    assert "  job's evaluation: accuracy 0.75, loss 0.5\n" in out
    rows = [
        {"metric": "cosine_ndcg@10", "before": 0.61234, "after": 0.8},
        {"metric": "queries", "before": 5, "after": 5},
    ]
    update_card(model_dir, before_after=rows)  # a job that evaluated its base model first
    assert main(["info", str(model_dir)]) == 0
    assert (
        "  job's evaluation, before -> after training:\n"
        "    cosine_ndcg@10:      0.6123 -> 0.8\n"
        "    queries:             5 -> 5\n"
    ) in capsys.readouterr().out


def test_evaluate_card_refuses_what_is_not_a_model(tmp_path, capsys):
    assert main(["evaluate-card", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err == f"bert evaluate-card: error: {tmp_path} has no config.json: not a model directory\n"
    )
