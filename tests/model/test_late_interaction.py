"""Late interaction (model/late_interaction.py): both ColBERT layouts imported and read, texts made into rows as
PyLate makes them, token vectors checked against transformers' BertModel and the projection computed here,
MaxSim and the losses against plain loops; and, where BERT_PYLATE_PYTHON names a Python with PyLate, every
vector, score and loss against PyLate itself on the same checkpoint (tests/reference/pylate_ref.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from model.errors import UserError
from model.late_interaction import (
    ColBERTSettings,
    colbert_scores,
    contrastive_loss,
    distillation_loss,
    maxsim,
    read_late_interaction,
    token_vectors,
)
from model.model_dir import import_model
from model.modeling import load_model
from model.tokenizer import BertTokenizer
from tests.hub_server import COLBERT_DIM, tiny_colbert_dir

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "pylate_ref.py"
QUERIES = ["the cat sat on the mat", "who is the man ?", "a big red car runs fast on the river at night"]
DOCUMENTS = [
    "the cat sat on the mat .",
    "a man , a woman ; the dog !",
    "the big red car runs fast on the river at night and the dog eats bread",
]
TEACHER = [[1.0, 0.2], [0.1, 0.5], [0.3, 0.3]]


def imported(tmp_path: Path, layout: str, **settings) -> Path:
    source = tiny_colbert_dir(tmp_path / "source", layout, **settings)
    import_model(source, tmp_path / f"{layout}-imported")
    return tmp_path / f"{layout}-imported"


def encode(path: Path, texts: list[str], is_query: bool) -> list[torch.Tensor]:
    """Each text's kept unit vectors, one text at a time."""
    li, bert, tok = read_late_interaction(path), load_model(path), BertTokenizer.from_pretrained(path)
    out = []
    with torch.no_grad():
        for text in texts:
            ids, attended = li.encode(tok, text, is_query)
            row = torch.tensor([ids])
            mask = (torch.arange(len(ids)) < attended).long()[None]
            out.append(token_vectors(bert, li, row, mask)[0][li.kept(tok, row, mask, is_query)[0]])
    return out


@pytest.mark.parametrize("layout", ["pylate", "colbert-ir"])
def test_import_stores_pylate_layout(tmp_path, layout):
    path = imported(tmp_path, layout)
    modules = json.loads((path / "modules.json").read_text())
    assert [m["type"] for m in modules] == ["sentence_transformers.models.Transformer", "pylate.models.Dense.Dense"]
    li = read_late_interaction(path)
    assert li is not None and li.layout == "pylate" and li.dim == COLBERT_DIM
    marker = ("[Q] ", "[D] ") if layout == "pylate" else ("[unused0]", "[unused1]")
    assert (li.settings.query_prefix, li.settings.document_prefix) == marker
    assert (li.settings.query_length, li.settings.document_length) == (8, 12)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["BertModel"]
    source = read_late_interaction(tmp_path / "source" / f"colbert-{layout}-0")
    assert torch.equal(li.weight, source.weight)


def test_rows_follow_pylate(tmp_path):
    path = imported(tmp_path, "pylate")
    li, tok = read_late_interaction(path), BertTokenizer.from_pretrained(path)
    q, d, mask = (tok.convert_tokens_to_ids(t) for t in ("[Q] ", "[D] ", "[MASK]"))
    cls, sep, cat = tok.cls_token_id, tok.sep_token_id, tok.convert_tokens_to_ids("cat")
    assert li.encode(tok, "cat", is_query=True) == ([cls, q, cat, sep, mask, mask, mask, mask], 4)
    assert li.encode(tok, "cat", is_query=False) == ([cls, d, cat, sep], 4)
    long_ids, attended = li.encode(tok, " ".join(["cat"] * 30), is_query=False)
    assert len(long_ids) == 12 and attended == 12 and long_ids[-1] == sep  # document_length, [SEP] kept
    attending = li.__class__(ColBERTSettings(query_length=8, attend_to_expansion_tokens=True), li.weight)
    assert attending.encode(tok, "cat", is_query=True)[1] == 8
    no_expansion = li.__class__(ColBERTSettings(query_length=8, do_query_expansion=False), li.weight)
    assert no_expansion.encode(tok, "cat", is_query=True) == ([cls, q, cat, sep], 4)
    row = torch.tensor([li.encode(tok, "cat , dog !", is_query=False)[0]])
    assert li.kept(tok, row, torch.ones_like(row), is_query=False)[0].tolist() == [
        True,
        True,
        True,
        False,
        True,
        False,
        True,
    ]


@pytest.mark.parametrize("layout", ["pylate", "colbert-ir"])
def test_vectors_match_transformers(tmp_path, layout):
    """The vectors are transformers' BertModel's last hidden state (the expansion masked out of its attention)
    through the projection, unit length."""
    path = imported(tmp_path, layout)
    li, tok = read_late_interaction(path), BertTokenizer.from_pretrained(path)
    reference = transformers.BertModel.from_pretrained(path, add_pooling_layer=False).eval()
    ours = encode(path, QUERIES + DOCUMENTS, is_query=True)
    for text, vectors in zip(QUERIES + DOCUMENTS, ours):
        ids, attended = li.encode(tok, text, is_query=True)
        mask = torch.tensor([[1] * attended + [0] * (len(ids) - attended)])
        with torch.no_grad():
            hidden = reference(torch.tensor([ids]), attention_mask=mask).last_hidden_state[0]
        expected = F.normalize(hidden @ li.weight.T, dim=-1)
        assert vectors.shape == (8, COLBERT_DIM)
        torch.testing.assert_close(vectors, expected, atol=1e-5, rtol=0)


def test_maxsim_and_scores():
    torch.manual_seed(0)
    q, d = F.normalize(torch.randn(4, 8), dim=-1), F.normalize(torch.randn(6, 8), dim=-1)
    expected = sum(max(float(qi @ dj) for dj in d) for qi in q)
    assert maxsim(q, d).item() == pytest.approx(expected, abs=1e-5)
    padded = torch.cat([d, torch.zeros(2, 8)])[None]
    mask = torch.tensor([[1] * 6 + [0] * 2])
    scores = colbert_scores(q[None], padded, None, mask)  # a masked position counts as a 0, as PyLate's
    assert scores.item() == pytest.approx(sum(max(max(float(qi @ dj) for dj in d), 0.0) for qi in q), abs=1e-5)


def test_losses_against_loops():
    torch.manual_seed(0)
    B, N, S, T, H = 3, 2, 4, 5, 8
    q = F.normalize(torch.randn(B, S, H), dim=-1)
    docs = F.normalize(torch.randn(B, N, T, H), dim=-1)
    dmask = torch.rand(B, N, T) > 0.3
    dmask[..., 0] = True

    def score(i, j, k):
        sims = (q[i] @ docs[j, k].T) * dmask[j, k]  # masked similarities are zeros
        return sims.max(dim=-1).values.sum()

    loss = 0.0
    for i in range(B):
        row = torch.stack([score(i, j, k) for j in range(B) for k in range(N)]) / 0.5
        loss += -F.log_softmax(row, dim=0)[i * N]
    assert contrastive_loss(q, docs, None, dmask, temperature=0.5).item() == pytest.approx(loss.item() / B, abs=1e-5)
    teacher = torch.randn(B, N)
    kl = 0.0
    for i in range(B):
        s = torch.stack([score(i, i, k) for k in range(N)])
        s = (s - s.min()) / (s.max() - s.min() + 1e-8)
        p = F.softmax(teacher[i], dim=0)
        kl += (p * (p.log() - F.log_softmax(s, dim=0))).sum()
    assert distillation_loss(q, docs, None, dmask, teacher).item() == pytest.approx(kl.item() / B, abs=1e-5)


def test_bad_checkpoints(tmp_path):
    path = tiny_colbert_dir(tmp_path, "pylate")
    config = json.loads((path / "1_Dense" / "config.json").read_text())
    (path / "1_Dense" / "config.json").write_text(json.dumps({**config, "activation_function": "torch.nn.Tanh"}))
    with pytest.raises(UserError, match="this service runs a Dense without activation or residual"):
        import_model(path, tmp_path / "out")
    ir = tiny_colbert_dir(tmp_path, "colbert-ir")
    (ir / "artifact.metadata").write_text(json.dumps({"dim": 64}))
    with pytest.raises(UserError, match="artifact.metadata says dim 64 but linear.weight projects to 16"):
        import_model(ir, tmp_path / "out2")
    st = tiny_colbert_dir(tmp_path, "pylate", seed=1)
    config = json.loads((st / "config_sentence_transformers.json").read_text())
    (st / "config_sentence_transformers.json").write_text(json.dumps({**config, "query_length": 1}))
    with pytest.raises(UserError, match="query_length must be an integer of at least 3, got 1"):
        import_model(st, tmp_path / "out3")


# -- parity with PyLate itself ----------------------------------------------------------------------

PYLATE = os.environ.get("BERT_PYLATE_PYTHON")
needs_pylate = pytest.mark.skipif(
    not PYLATE, reason="BERT_PYLATE_PYTHON (a Python with pylate installed) is not set: PyLate parity not checked"
)


def pylate(spec: dict) -> dict:
    done = subprocess.run(
        [PYLATE or sys.executable, str(REFERENCE)], input=json.dumps(spec), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


# colbert-ir's artifact.metadata has no query-expansion switch: that setting is PyLate's layout's alone
PARITY_CASES = [
    ("pylate", {}),
    ("pylate", {"attend_to_expansion_tokens": True}),
    ("pylate", {"do_query_expansion": False}),
    ("colbert-ir", {}),
    ("colbert-ir", {"attend_to_expansion_tokens": True}),
]


@needs_pylate
@pytest.mark.parametrize("layout, settings", PARITY_CASES)
def test_parity_with_pylate(tmp_path, layout, settings):
    """PyLate on the checkpoint as published, this project on its import: the same vectors, MaxSim scores and losses."""
    path = imported(tmp_path, layout, **settings)
    pairs = {"anchor": QUERIES, "positive": DOCUMENTS, "negative": DOCUMENTS[::-1], "teacher": TEACHER}
    ref = pylate(
        {
            "model": str(tmp_path / "source" / f"colbert-{layout}-0"),
            "queries": QUERIES,
            "documents": DOCUMENTS,
            "pairs": pairs,
            "temperature": 0.5,
        }
    )
    queries, documents = encode(path, QUERIES, True), encode(path, DOCUMENTS, False)
    for ours, theirs in zip(queries + documents, ref["queries"] + ref["documents"]):
        torch.testing.assert_close(ours, torch.tensor(theirs), atol=1e-5, rtol=0)
    scores = [[maxsim(q, d).item() for d in documents] for q in queries]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(ref["scores"]), atol=1e-5, rtol=0)
    q, qmask, docs, dmask = loss_batch(path, QUERIES, [DOCUMENTS, DOCUMENTS[::-1]])
    assert contrastive_loss(q, docs, qmask, dmask, temperature=0.5).item() == pytest.approx(
        ref["contrastive"], abs=1e-5
    )
    teacher = torch.tensor(TEACHER)
    assert distillation_loss(q, docs, qmask, dmask, teacher).item() == pytest.approx(ref["distillation"], abs=1e-5)


def loss_batch(path: Path, anchors: list[str], columns: list[list[str]]):
    """A training batch as PyLate's collator pads it (every column to its length) through token_vectors."""
    li, bert, tok = read_late_interaction(path), load_model(path), BertTokenizer.from_pretrained(path)

    def rows(texts, is_query):
        length = li.settings.query_length if is_query else li.settings.document_length
        encoded = [li.encode(tok, t, is_query) for t in texts]
        ids = torch.tensor([r + [tok.mask_token_id] * (length - len(r)) for r, _ in encoded])
        mask = torch.tensor([[1] * a + [0] * (length - a) for _, a in encoded])
        with torch.no_grad():
            return token_vectors(bert, li, ids, mask), li.kept(tok, ids, mask, is_query)

    q, qkept = rows(anchors, True)
    docs = [rows(texts, False) for texts in columns]
    qmask = None if li.settings.do_query_expansion else qkept
    return q, qmask, torch.stack([v for v, _ in docs], dim=1), torch.stack([k for _, k in docs], dim=1)
