"""Token classification, question answering and multiple choice against transformers on the same
weights: outputs and losses, weights both ways, and which class a directory loads as."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from model.config import BertConfig
from model.model_dir import summarize
from model.modeling import (
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    class_for_dir,
    class_for_heads,
    load_model,
)
from model.tokenizer import BertTokenizer
from model.weights import heads_in_dir
from tests.conftest import tiny_config_dict
from tests.model.test_modeling import hf_model, padded_batch

ATOL = 1e-5
OURS = {c.__name__: c for c in (BertForTokenClassification, BertForQuestionAnswering, BertForMultipleChoice)}
FIELDS = {
    "BertForTokenClassification": ("logits",),
    "BertForQuestionAnswering": ("start_logits", "end_logits"),
    "BertForMultipleChoice": ("logits",),
}
LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


def inputs_for(name: str, vocab_size: int):
    """A padded batch; for multiple choice, six rows as (2 questions, 3 choices, T)."""
    ids, mask, types = padded_batch(vocab_size)
    if name == "BertForMultipleChoice":
        ids, mask, types = (torch.cat([t, t.flip(0)]).view(2, 3, -1) for t in (ids, mask, types))
    return ids, mask, types


def assert_same(name, theirs, ours, mask):
    """Every output field of the class within ATOL; per-token outputs at real tokens only (padded
    positions mean nothing in either implementation)."""
    for field in FIELDS[name]:
        a, b = getattr(theirs, field), getattr(ours, field)
        assert a.shape == b.shape, field
        if name != "BertForMultipleChoice":
            a, b = a[mask.bool()], b[mask.bool()]
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0, msg=field)


def hf_task_model(name: str):
    return hf_model(name, id2label=dict(enumerate(LABELS))) if name == "BertForTokenClassification" else hf_model(name)


@pytest.mark.parametrize("name", OURS)
def test_transformers_checkpoint_loads_with_identical_outputs(name, tmp_path):
    hf = hf_task_model(name)
    hf.save_pretrained(tmp_path)
    ours = OURS[name].from_pretrained(tmp_path)
    ids, mask, types = inputs_for(name, hf.config.vocab_size)
    with torch.no_grad():
        assert_same(name, hf(input_ids=ids, attention_mask=mask, token_type_ids=types), ours(ids, mask, types), mask)
    assert type(load_model(tmp_path)) is OURS[name]


@pytest.mark.parametrize("name", OURS)
def test_our_checkpoint_loads_in_transformers_with_identical_outputs(name, tmp_path):
    hf = hf_task_model(name)
    hf.save_pretrained(tmp_path / "hf")
    OURS[name].from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "ours")
    back = getattr(transformers, name).from_pretrained(tmp_path / "ours").eval()
    ids, mask, types = inputs_for(name, hf.config.vocab_size)
    with torch.no_grad():
        assert_same(
            name,
            hf(input_ids=ids, attention_mask=mask, token_type_ids=types),
            back(input_ids=ids, attention_mask=mask, token_type_ids=types),
            mask,
        )
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == [name]


@pytest.mark.parametrize("name", OURS)
def test_state_dict_names_are_huggingface_names(name):
    ours = set(OURS[name](BertConfig(**tiny_config_dict())).state_dict())
    assert ours == set(hf_model(name).state_dict())


def test_token_classification_loss_ignores_minus_100_as_transformers(tmp_path):
    hf = hf_task_model("BertForTokenClassification")
    hf.save_pretrained(tmp_path)
    ours = BertForTokenClassification.from_pretrained(tmp_path)
    ids, mask, types = padded_batch(hf.config.vocab_size)
    labels = torch.randint(0, len(LABELS), ids.shape, generator=torch.Generator().manual_seed(1))
    labels[mask == 0] = -100
    labels[:, 0] = -100  # [CLS]
    with torch.no_grad():
        a = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
        b = ours(ids, mask, types, labels=labels).loss
        # A position labelled -100 does not count: changing its logit's label changes nothing.
        out = ours(ids, mask, types)
    torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    kept = labels != -100
    expected = torch.nn.functional.cross_entropy(out.logits[kept], labels[kept])
    torch.testing.assert_close(b, expected, atol=1e-6, rtol=0)


def test_qa_loss_clamps_and_ignores_positions_outside_the_sequence_as_transformers(tmp_path):
    hf = hf_task_model("BertForQuestionAnswering")
    hf.save_pretrained(tmp_path)
    ours = BertForQuestionAnswering.from_pretrained(tmp_path)
    ids, mask, types = padded_batch(hf.config.vocab_size)
    T = ids.shape[1]
    # Row 2's answer lies beyond the sequence (a window that cut it off): clamped to T, ignored.
    start, end = torch.tensor([3, 0, T + 5]), torch.tensor([5, 0, T + 9])
    with torch.no_grad():
        # Unpadded: the softmax runs over every position, padded ones included (HF's loss does not
        # mask them), and padded positions' logits are arbitrary in both implementations.
        a = hf(input_ids=ids, token_type_ids=types, start_positions=start, end_positions=end)
        b = ours(ids, None, types, start_positions=start, end_positions=end)
        torch.testing.assert_close(b.loss, a.loss, atol=1e-6, rtol=0)
        padded = ours(ids, mask, types, start_positions=start, end_positions=end)
    ce = torch.nn.functional.cross_entropy
    expected = (ce(padded.start_logits[:2], start[:2]) + ce(padded.end_logits[:2], end[:2])) / 2
    torch.testing.assert_close(padded.loss, expected, atol=1e-6, rtol=0)


def test_multiple_choice_loss_equals_transformers(tmp_path):
    hf = hf_task_model("BertForMultipleChoice")
    hf.save_pretrained(tmp_path)
    ours = BertForMultipleChoice.from_pretrained(tmp_path)
    ids, mask, types = inputs_for("BertForMultipleChoice", hf.config.vocab_size)
    labels = torch.tensor([2, 0])
    with torch.no_grad():
        a = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
        b = ours(ids, mask, types, labels=labels).loss
    torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, num_choices, seq_len\), got shape \(3, 12\)"):
        ours(*padded_batch(hf.config.vocab_size))


def test_heads_and_the_class_a_directory_loads_as(tmp_path, tiny_config):
    """`classifier.*` serves three tasks: config.json's architectures tells them apart; without it,
    the pooler does (sequence classification has one, token classification none)."""
    for cls in (
        BertForSequenceClassification,
        BertForTokenClassification,
        BertForQuestionAnswering,
        BertForMultipleChoice,
    ):
        cls(tiny_config).save_pretrained(tmp_path / cls.__name__)
        assert type(load_model(tmp_path / cls.__name__)) is cls
        assert class_for_dir(tmp_path / cls.__name__) is cls
        assert summarize(tmp_path / cls.__name__)["architecture"] == cls.__name__
    assert heads_in_dir(tmp_path / "BertForTokenClassification") == {"classifier"}
    assert heads_in_dir(tmp_path / "BertForQuestionAnswering") == {"qa"}
    assert heads_in_dir(tmp_path / "BertForMultipleChoice") == {"pooler", "classifier"}
    assert class_for_heads({"classifier"}) is BertForTokenClassification
    assert class_for_heads({"pooler", "classifier"}) is BertForSequenceClassification
    assert class_for_heads({"pooler", "classifier"}, ["BertForMultipleChoice"]) is BertForMultipleChoice
    assert class_for_heads({"qa"}, ["BertModel"]) is BertForQuestionAnswering
    # A config naming another class (bert-base-uncased says BertForMaskedLM) leaves the weights to decide.
    assert class_for_heads({"pooler", "classifier"}, ["BertForMaskedLM"]) is BertForSequenceClassification


def test_missing_task_heads_are_named_and_warm_start_keeps_the_encoder(tmp_path, tiny_config):
    BertModel(tiny_config).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"has no question-answering head \(qa_outputs\.\*\), "
        r"which BertForQuestionAnswering needs",
    ):
        BertForQuestionAnswering.from_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"has no classifier head \(classifier\.\*\), "
        r"which BertForTokenClassification needs",
    ):
        BertForTokenClassification.from_pretrained(tmp_path)
    base = BertModel.from_pretrained(tmp_path)
    for cls in OURS.values():
        warm = cls.from_pretrained(tmp_path, init_missing_heads=True, id2label=dict(enumerate(LABELS)))
        assert torch.equal(warm.bert.encoder.layer[1].output.dense.weight, base.encoder.layer[1].output.dense.weight)
    assert warm.heads == {"pooler", "classifier"}
    assert BertForTokenClassification(tiny_config.with_labels(LABELS)).classifier.out_features == 5


@pytest.mark.parametrize("name", ["BertForTokenClassification", "BertForQuestionAnswering"])
def test_minilm_encoder_with_a_random_head_matches_transformers(name, minilm_dir, tmp_path):
    """The real MiniLM encoder under a fresh head, as fine-tuning starts: same outputs both ways."""
    torch.manual_seed(0)
    kwargs = {"id2label": dict(enumerate(LABELS))} if name == "BertForTokenClassification" else {}
    hf = getattr(transformers, name).from_pretrained(minilm_dir, attn_implementation="sdpa", **kwargs).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    assert type(ours) is OURS[name]
    tok = BertTokenizer.from_pretrained(minilm_dir)
    batch = tok(
        ["Who wrote Hamlet?", "Where does Ada Lovelace live?"],
        ["Hamlet was written by William Shakespeare around 1600.", "She lives in London."],
    )
    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    assert not mask.all()  # the batch is padded
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        assert_same(name, theirs, ours(ids, mask, types), mask)
        ours.save_pretrained(tmp_path / "ours")
        back = getattr(transformers, name).from_pretrained(tmp_path / "ours").eval()
        assert_same(name, theirs, back(input_ids=ids, attention_mask=mask, token_type_ids=types), mask)


@pytest.mark.parametrize("name", OURS)
def test_tiny_task_model_overfits_a_padded_batch(name):
    """Every head learns: tags, answer spans and choices of a few padded examples, loss near zero."""
    torch.manual_seed(0)
    config = BertConfig(
        **tiny_config_dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, id2label=dict(enumerate(LABELS)))
    )
    model = OURS[name](config).train()
    ids, mask, types = inputs_for(name, config.vocab_size)
    g = torch.Generator().manual_seed(2)
    if name == "BertForTokenClassification":
        labels = torch.randint(0, len(LABELS), ids.shape, generator=g).masked_fill(mask == 0, -100)
        targets = {"labels": labels}
    elif name == "BertForQuestionAnswering":
        targets = {"start_positions": torch.tensor([2, 1, 0]), "end_positions": torch.tensor([5, 6, 0])}
    else:
        targets = {"labels": torch.tensor([2, 0])}  # the same row both times (the choices are rows 0-2 and 2-0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(100):
        loss = model(ids, mask, types, **targets).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("name", OURS)
def test_reduced_precision_keeps_task_outputs_fp32_and_close(name, precision):
    """The serving precisions (model.compute.precision) apply to the task heads' classes as to the others."""
    from model.compute.precision import apply_precision, precision_of

    torch.manual_seed(0)
    model = OURS[name](BertConfig(**tiny_config_dict(id2label=dict(enumerate(LABELS))))).eval()
    ids, mask, types = inputs_for(name, model.config.vocab_size)
    with torch.no_grad():
        ref = model(ids, mask, types)
        low_model = apply_precision(model, precision)
        low = low_model(ids, mask, types)
    assert precision_of(low_model) == precision
    for field in FIELDS[name]:
        assert getattr(low, field).dtype == torch.float32
        torch.testing.assert_close(getattr(low, field), getattr(ref, field), atol=0.05, rtol=0.05, msg=field)
