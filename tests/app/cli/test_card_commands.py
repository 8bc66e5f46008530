"""`bert evaluate-card DIR` writes a model's held-out scores into its card.json; `bert info DIR` shows them."""

from __future__ import annotations

import json

import torch

from app.cli import main
from datadir.cards import read_card, update_card
from model.config import BertConfig
from model.modeling import BertForPreTraining
from model.precision_choice import auto_choice, cpu_kind, native_precisions
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
    if native_precisions() == ["fp32"]:  # a CPU with neither native bf16 nor VNNI: nothing to compare
        assert f"  precisions on {cpu_kind()}: fp32 only (no other precision is native there)\n" in out
    else:
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


def test_a_directory_import_on_a_cpu_with_only_fp32_native_says_so(tmp_path, capsys, monkeypatch):
    """`bert import SRC DST` measures into the card as an import into DATA_DIR does; on a CPU without native bf16
    or VNNI (an AVX2 EPYC, made to look like one) that row holds fp32 alone, and the import says auto is fp32."""
    from tests.cpu_kinds import pretend_avx2

    pretend_avx2(monkeypatch.setattr)
    src, dst = tmp_path / "src", tmp_path / "dst"
    torch.manual_seed(0)
    BertForPreTraining(BertConfig(**tiny_config_dict())).save_pretrained(
        src, tokenizer=BertTokenizer.from_vocab(TINY_VOCAB)
    )
    assert main(["import", str(src), str(dst)]) == 0
    out = capsys.readouterr().out
    card = read_card(dst)
    assert cpu_kind() == "x86 avx2"
    assert card["precision"]["x86 avx2"]["precisions"] == {"fp32": {"speed": 1.0}}
    assert card["source"] == {"kind": "directory", "path": str(src.resolve())}
    assert "mlm_top1" in card["evaluation"]  # the held-out evaluation too, as `bert evaluate-card` writes it
    assert out.endswith(
        "  precisions on x86 avx2: fp32 only (no other precision is native there)\n"
        "  auto on this CPU: fp32 (only fp32 is native on this kind of CPU (x86 avx2))\n"
    )
