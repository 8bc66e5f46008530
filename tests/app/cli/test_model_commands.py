"""`bert vocab`, `bert import`, `bert info`, run as a user runs them (a subprocess), and the real
pretrained MiniLM encoder imported and compared with transformers on the same weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from model.modeling import BertModel
from model.tokenizer import BertTokenizer

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Une phrase en français, avec des accents!",
]

pytestmark = pytest.mark.slow  # the bert command in subprocesses, and MiniLM imported and compared


def bert(*args):
    proc = subprocess.run([sys.executable, "-m", "app.cli", *map(str, args)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc


def mean_pool(hidden, mask):
    mask = mask[..., None].to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


@pytest.fixture(scope="module")
def minilm_import(tmp_path_factory):
    """(the directory `bert import MINILM_DIR DST` wrote, what it printed)"""
    from tests.conftest import MINILM_DIR

    dst = tmp_path_factory.mktemp("models") / "minilm"
    out = bert("import", MINILM_DIR, dst).stdout
    assert "BertModel (6 layers, hidden 384, 12 heads" in out
    return dst, out


@pytest.fixture(scope="module")
def imported_minilm(minilm_import):
    return minilm_import[0]


def test_import_writes_the_project_layout(imported_minilm):
    assert sorted(p.name for p in imported_minilm.iterdir()) == [
        "1_Pooling",  # its sentence-transformers modules (model/sentence_modules.py): mean pooling, Normalize
        "2_Normalize",
        "card.json",  # measured at import (below)
        "config.json",
        "config_sentence_transformers.json",
        "model.safetensors",
        "modules.json",
        "sentence_bert_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
    ]


def test_a_directory_import_measures_the_precisions_auto_chooses_from(minilm_import):
    """As an import into DATA_DIR does: each precision this CPU runs natively against fp32 goes into the card, so
    a service serving the directory chooses its precision at load; the import says what auto serves here."""
    from datadir.cards import read_card
    from model.precision_choice import auto_choice, cpu_kind, native_precisions
    from tests.conftest import MINILM_DIR

    dst, out = minilm_import
    card = read_card(dst)
    assert card["source"] == {"kind": "directory", "path": str(MINILM_DIR.resolve())}
    row = card["precision"][cpu_kind()]
    assert row["outputs"] == ["embeddings"]  # an encoder without heads: its embeddings are all it serves
    assert sorted(row["precisions"]) == sorted(native_precisions())
    for precision in native_precisions()[1:]:
        assert 0.9 < row["precisions"][precision]["embeddings"]["min_cosine"] <= 1.0
    auto, why = auto_choice(card["precision"])
    assert out.endswith(f"  auto on this CPU: {auto} ({why})\n")
    if native_precisions() == ["fp32"]:
        assert f"  precisions on {cpu_kind()}: fp32 only (no other precision is native there)\n" in out
    else:
        assert f"  precisions on {cpu_kind()} (measured {row['measured']}, against fp32):\n" in out


def test_imported_minilm_embeds_like_transformers(imported_minilm, minilm_dir):
    ours, tok = BertModel.from_pretrained(imported_minilm), BertTokenizer.from_pretrained(imported_minilm)
    theirs = transformers.BertModel.from_pretrained(minilm_dir).eval()
    batch = tok(SENTENCES)
    with torch.no_grad():
        a = mean_pool(
            ours(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).last_hidden_state,
            batch["attention_mask"],
        )
        b = mean_pool(theirs(**batch).last_hidden_state, batch["attention_mask"])
    assert (a * b).sum(-1).min() >= 0.9999
    # The sentence-transformers model card's example pair.
    assert (a[0] @ a[1]).item() == pytest.approx(0.755, abs=0.005)


def test_info_reports_architecture_heads_and_vocabulary(imported_minilm, capsys):
    from app.cli import main

    assert main(["info", str(imported_minilm), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "BertModel"
    assert info["parameters"] == 22_713_216
    assert info["model_heads"] == []  # as GET /models says: a pooler serves no route
    assert info["vocab"] == {"size": 30522, "lowercase": True}
    assert main(["info", str(imported_minilm)]) == 0
    text = capsys.readouterr().out
    assert "parameters:   22,713,216" in text and "heads:        none" in text


def test_import_refuses_bad_sources_with_one_line_errors(tmp_path, imported_minilm, capsys):
    # In-process (the subprocess path is covered above): main() returns the exit status.
    from app.cli import main

    assert main(["import", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == f"bert import: error: {tmp_path / 'nope'} is not a directory\n"
    (tmp_path / "empty").mkdir()
    assert main(["import", str(tmp_path / "empty"), str(tmp_path / "x")]) == 2
    assert "has no config.json: not a Hugging Face model directory" in capsys.readouterr().err
    assert main(["import", str(imported_minilm), str(imported_minilm)]) == 2
    assert "exists; pass --force to replace it" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_vocab_trains_a_vocabulary_the_tokenizer_loads(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n".join(
            ["the quick brown fox jumps over the lazy dog", "a lazy dog sleeps in the sun", "foxes are quick and brown"]
            * 50
        )
    )
    out = bert("vocab", corpus, "-o", tmp_path / "vocab", "--vocab-size", "120").stdout
    assert "uncased vocabulary" in out
    tok = BertTokenizer.from_pretrained(tmp_path / "vocab")
    assert tok.vocab_size <= 120
    ids = tok.encode("the lazy fox")["input_ids"]
    assert tok.unk_token_id not in ids and ids[0] == tok.cls_token_id
    from app.cli import main

    assert main(["vocab", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "v2")]) == 2
    assert f"no such file: {tmp_path / 'missing.txt'}" in capsys.readouterr().err
