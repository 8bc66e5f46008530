"""The held-out evaluation of model cards (model/model_card.py): its scores against a direct computation
with torch, its determinism, the set's rules, and a failed evaluation that is recorded, not raised."""

from __future__ import annotations

import collections
import json
import math

import pytest
import torch

from datadir.cards import read_card
from model.config import BertConfig
from model.model_card import (
    SET_NAME,
    before_after,
    build_sequences,
    evaluate_card,
    heldout_leads,
    is_content_word,
    is_heldout,
    write_card,
)
from model.modeling import BertForMaskedLM, BertForPreTraining, BertForSequenceClassification
from model.tokenizer import BertTokenizer
from tests.conftest import MINILM_DIR, tiny_config_dict


@pytest.fixture(scope="module")
def tokenizer():
    return BertTokenizer.from_pretrained(MINILM_DIR)  # a real English WordPiece vocabulary


def _model(cls, tokenizer, seed=0):
    """A tiny model whose MLM head leans towards frequent tokens (words more than punctuation and stopwords),
    so it gets some masked tokens right."""
    torch.manual_seed(seed)
    model = cls(BertConfig(**tiny_config_dict(vocab_size=tokenizer.vocab_size)))
    counts = collections.Counter(
        t for _, sentences in heldout_leads() for s in sentences for t in tokenizer.token_ids(s)
    )
    bias = torch.zeros(tokenizer.vocab_size)
    for token, n in counts.items():
        bias[token] = math.log(n) + 4.0 * is_content_word(tokenizer.convert_ids_to_tokens([token]), 0)
    with torch.no_grad():
        model.cls.predictions.bias.copy_(bias)
    return model.eval()


def test_scores_match_a_direct_computation(tokenizer):
    model = _model(BertForPreTraining, tokenizer)
    card = evaluate_card(model, tokenizer, max_sequences=40)
    hits = collections.Counter()
    with torch.no_grad():
        for s in build_sequences(tokenizer, max_sequences=40):  # one at a time, unpadded, every position's logits
            out = model(torch.tensor([s["input_ids"]]), token_type_ids=torch.tensor([s["token_type_ids"]]))
            logits = out.prediction_logits[0, s["positions"]]  # (T, V) -> (masked, V)
            for row, target, content in zip(logits, s["targets"], s["content"]):
                top1, top5 = row.argmax().item() == target, target in row.topk(5).indices.tolist()
                hits.update(masked=1, top1=top1, top5=top5, content=content)
                hits.update(content_top1=top1 and content, content_top5=top5 and content)
            hits["nsp"] += out.seq_relationship_logits[0].argmax().item() == s["next_sentence_label"]
    assert 0 < hits["top1"] < hits["top5"] < hits["masked"] and 0 < hits["content_top5"] < hits["content"]
    assert card == {
        "set": SET_NAME,
        "seed": 0,
        "sequences": 40,
        "tokens": card["tokens"],
        "masked_tokens": hits["masked"],
        "content_tokens": hits["content"],
        "mlm_top1": pytest.approx(hits["top1"] / hits["masked"]),
        "mlm_top5": pytest.approx(hits["top5"] / hits["masked"]),
        "content_top1": pytest.approx(hits["content_top1"] / hits["content"]),
        "content_top5": pytest.approx(hits["content_top5"] / hits["content"]),
        "nsp_accuracy": pytest.approx(hits["nsp"] / 40),
    }


def test_the_sequences_follow_the_rules(tokenizer):
    sequences = build_sequences(tokenizer, max_tokens=32)
    assert len(sequences) == 128 and [s["next_sentence_label"] for s in sequences].count(1) == 64
    special = set(tokenizer.all_special_ids)
    for i, s in enumerate(sequences):
        ids = s["input_ids"]
        assert len(ids) <= 32 and ids.count(tokenizer.sep_token_id) == 2
        assert all(ids[p] == tokenizer.mask_token_id for p in s["positions"]) and s["positions"] == sorted(
            s["positions"]
        )
        real = sum(t not in special for t in ids) + len(s["positions"])  # the masked ones were real tokens
        assert len(s["positions"]) == max(1, round(0.15 * real))
        first = tokenizer.token_ids(heldout_leads()[i][1][0])
        unmasked = list(ids)
        for p, t in zip(s["positions"], s["targets"]):
            unmasked[p] = t
        assert unmasked[1 : 1 + min(len(first), 5)] == first[:5]  # A is the lead's first sentence
    assert build_sequences(tokenizer, seed=1, max_tokens=32) != sequences


def test_the_evaluation_is_deterministic_and_picks_the_heads(tokenizer):
    model = _model(BertForPreTraining, tokenizer)
    first = evaluate_card(model, tokenizer, max_sequences=16)
    assert evaluate_card(model, tokenizer, max_sequences=16) == first and 0 < first["nsp_accuracy"] < 1
    mlm_only = evaluate_card(_model(BertForMaskedLM, tokenizer), tokenizer, max_sequences=16)
    assert mlm_only["nsp_accuracy"] is None and mlm_only["mlm_top5"] > 0
    classifier = BertForSequenceClassification(BertConfig(**tiny_config_dict(vocab_size=tokenizer.vocab_size)))
    assert evaluate_card(classifier, tokenizer) == {
        "set": SET_NAME,
        "skipped": "BertForSequenceClassification has no masked-LM or next-sentence head",
    }


def test_content_words():
    tokens = ["[CLS]", "the", "paint", "##ing", "art", "1884", "Seurat", ",", "[SEP]"]
    assert [is_content_word(tokens, p) for p in range(len(tokens))] == [
        False, False, False, False, True, False, True, False, False,
    ]  # fmt: skip


def test_the_set_is_the_rule_applied():
    leads = heldout_leads()
    assert len(leads) == 156 and all(is_heldout(title) and len(s) >= 2 for title, s in leads)
    assert len({title for title, _ in leads}) == 156


def test_write_card_records_a_failure_and_keeps_the_rest(tmp_path, tokenizer):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(tiny_config_dict()))  # no weights, no tokenizer
    card = write_card(broken, job_eval={"accuracy": 0.5}, source={"kind": "job", "job_id": "j1"})
    assert card["evaluation"]["set"] == SET_NAME and "error" in card["evaluation"]
    assert read_card(broken) == card and card["job_eval"] == {"accuracy": 0.5}
    good = tmp_path / "good"
    _model(BertForPreTraining, tokenizer).save_pretrained(good, tokenizer=tokenizer)
    evaluation = write_card(good)["evaluation"]
    assert evaluation == read_card(good)["evaluation"] and evaluation["sequences"] == 128


def test_a_job_that_evaluated_its_base_model_gets_a_before_and_after_table(tmp_path, tokenizer):
    job_eval = {"type": "eval", "step": 30, "cosine_ndcg@10": 0.8, "queries": 5, "base_cosine_ndcg@10": 0.6}
    job_eval["base_queries"] = 5
    assert before_after(job_eval) == [
        {"metric": "cosine_ndcg@10", "before": 0.6, "after": 0.8},
        {"metric": "queries", "before": 5, "after": 5},
    ]
    assert before_after({"accuracy": 0.5}) == [] and before_after(None) == []
    for name in ("m", "n"):
        _model(BertForPreTraining, tokenizer).save_pretrained(tmp_path / name, tokenizer=tokenizer)
    card = write_card(tmp_path / "n", job_eval=job_eval)
    assert read_card(tmp_path / "n")["before_after"] == before_after(job_eval) == card["before_after"]
    assert "before_after" not in write_card(tmp_path / "m", job_eval={"accuracy": 0.5})
