"""late-interaction fine-tuning (model/training/colbert.py): a batch's Contrastive loss equals the one computed
from rows made one text at a time (and, with BERT_PYLATE_PYTHON, PyLate's on the same texts); a run evaluates by
MaxSim, trains, resumes exactly and publishes PyLate's layout, which this service and PyLate both load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.late_interaction import contrastive_loss, read_late_interaction
from model.model_dir import import_model
from model.modeling import load_model
from model.training.colbert import ColBERTBatches, ColBERTModel
from model.training.runs import FinetuneSpec, run_finetuning
from tests.helpers import StopAt
from tests.hub_server import tiny_colbert_dir
from tests.model.test_late_interaction import DOCUMENTS, PYLATE, QUERIES, encode, loss_batch, pylate
from tests.model.test_sentence_embedding import PAIRS, pairs_csv

TEXT_PAIRS = [type(PAIRS[0])(q, d, (n,)) for q, d, n in zip(QUERIES, DOCUMENTS, DOCUMENTS[::-1])]


def start(tmp_path, **settings):
    path = tmp_path / "start"
    import_model(tiny_colbert_dir(tmp_path / "source", "pylate", **settings), path)
    return path


@pytest.mark.parametrize("settings", [{}, {"do_query_expansion": False}])
def test_a_batch_loss_is_the_loss_of_its_rows(tmp_path, settings):
    path = start(tmp_path, **settings)
    model = ColBERTModel.from_pretrained(path, temperature=0.5).eval()
    batches = ColBERTBatches(TEXT_PAIRS, model.tokenizer, model.late, batch_size=3, seed=0)
    batch = batches.collate(torch.arange(3).numpy())
    with torch.no_grad():
        loss = model(**batch).loss.item()
    q, qmask, docs, dmask = loss_batch(path, QUERIES, [DOCUMENTS, DOCUMENTS[::-1]])
    assert loss == pytest.approx(contrastive_loss(q, docs, qmask, dmask, temperature=0.5).item(), abs=1e-5)
    if PYLATE:  # and PyLate's own Contrastive on the same texts
        pairs = {"anchor": QUERIES, "positive": DOCUMENTS, "negative": DOCUMENTS[::-1], "teacher": [[0, 0]] * 3}
        ref = pylate(
            {"model": str(path), "queries": QUERIES, "documents": DOCUMENTS, "pairs": pairs, "temperature": 0.5}
        )
        assert loss == pytest.approx(ref["contrastive"], abs=1e-5)


def spec(tmp_path, out, train_file, **kw):
    train = {"max_steps": 6, "log_every": 1, "save_every": 3, "lr": 1e-3, "seed": 5}
    values = {"task": "late-interaction", "batch_size": 4, "eval_fraction": 0.25, **kw}
    return FinetuneSpec.from_dict(
        dict(train_file=str(train_file), from_model=str(tmp_path / "start"), out=str(out), **values, train=train)
    )


def test_a_run_evaluates_by_maxsim_trains_resumes_and_publishes_pylates_layout(tmp_path):
    start(tmp_path)
    data = pairs_csv(tmp_path / "pairs.csv")
    straight = run_finetuning(spec(tmp_path, tmp_path / "a", data))
    evals = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [0, 6]
    assert {"MaxSim_ndcg@10", "MaxSim_mrr@10", "MaxSim_recall@1", "MaxSim_map@100"} <= set(evals[0])
    assert "base_MaxSim_ndcg@10" in straight.eval_metrics
    out = straight.model_dir
    late, first = read_late_interaction(out), read_late_interaction(tmp_path / "start")
    assert late is not None and late.settings == first.settings and not torch.equal(late.weight, first.weight)
    assert "linear.weight" not in load_model(out).state_dict()  # the encoder alone: the service loads it
    stopped = run_finetuning(spec(tmp_path, tmp_path / "b", data), callbacks=[StopAt(2)])
    assert (stopped.status, stopped.step) == ("stopped", 2)
    resumed = run_finetuning(spec(tmp_path, tmp_path / "b", data))
    assert (resumed.status, resumed.step) == ("completed", 6)
    a, b = load_model(out).state_dict(), load_model(resumed.model_dir).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(read_late_interaction(resumed.model_dir).weight, late.weight)
    if PYLATE:  # pylate.models.ColBERT(dir) loads what the run published, and encodes as this service does
        ref = pylate({"model": str(out), "queries": QUERIES, "documents": DOCUMENTS})
        for ours, theirs in zip(
            encode(out, QUERIES, True) + encode(out, DOCUMENTS, False), ref["queries"] + ref["documents"]
        ):
            torch.testing.assert_close(ours, torch.tensor(theirs), atol=1e-5, rtol=0)


def test_a_plain_bert_gets_pylates_new_head(tmp_path):
    source = tiny_colbert_dir(tmp_path / "source", "colbert-ir", positions=256)  # all four markers in its vocabulary
    (source / "artifact.metadata").unlink()
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}))
    state = load_file(source / "model.safetensors")
    state.pop("linear.weight")
    save_file(state, source / "model.safetensors")
    model = ColBERTModel.from_pretrained(source)
    assert (model.settings.query_prefix, model.settings.document_prefix) == ("[Q] ", "[D] ")  # in its vocabulary
    assert model.linear.weight.shape == (128, 32) and model.linear.bias is None
    assert (model.settings.query_length, model.settings.document_length) == (32, 180)


def test_distillation_batches_carry_the_teachers_scores_and_learn_them(tmp_path):
    from model.late_interaction import distillation_loss
    from model.modeling import BertForSequenceClassification
    from model.tokenizer import BertTokenizer
    from model.training.colbert import teacher_scores
    from tests.helpers import VOCAB, tiny_config
    from tests.model.test_late_interaction import TEACHER

    path = start(tmp_path)
    model = ColBERTModel.from_pretrained(path, distill=True).eval()
    batches = ColBERTBatches(TEXT_PAIRS, model.tokenizer, model.late, batch_size=3, seed=0, scores=TEACHER)
    batch = batches.collate(torch.arange(3).numpy())
    assert torch.equal(batch["scores"], torch.tensor(TEACHER))
    with torch.no_grad():
        loss = model(**batch).loss.item()
    q, qmask, docs, dmask = loss_batch(path, QUERIES, [DOCUMENTS, DOCUMENTS[::-1]])
    assert loss == pytest.approx(distillation_loss(q, docs, qmask, dmask, torch.tensor(TEACHER)).item(), abs=1e-5)
    if PYLATE:  # PyLate's Distillation on the same anchors, candidates and teacher scores
        pairs = {"anchor": QUERIES, "positive": DOCUMENTS, "negative": DOCUMENTS[::-1], "teacher": TEACHER}
        ref = pylate({"model": str(path), "queries": QUERIES, "documents": DOCUMENTS, "pairs": pairs})
        assert loss == pytest.approx(ref["distillation"], abs=1e-5)
    teacher = tmp_path / "teacher"
    torch.manual_seed(3)
    cross = BertForSequenceClassification(tiny_config(id2label={0: "LABEL_0"})).eval()
    cross.save_pretrained(teacher, tokenizer=BertTokenizer.from_vocab(VOCAB))
    scores = teacher_scores(teacher, TEXT_PAIRS[:1], BertTokenizer.from_vocab(VOCAB), torch.device("cpu"))
    tok = BertTokenizer.from_vocab(VOCAB)
    with torch.no_grad():
        expected = [cross(**tok([QUERIES[0]], [d])).logits[0, 0].item() for d in (DOCUMENTS[0], DOCUMENTS[-1])]
    assert scores == [pytest.approx(expected, abs=1e-5)]
    data = pairs_csv(tmp_path / "pairs.csv")
    result = run_finetuning(spec(tmp_path, tmp_path / "run", data, teacher_model=str(teacher)))
    assert result.status == "completed" and read_late_interaction(result.model_dir) is not None
