"""Reduced precision (model/compute/precision.py) and the fast fp32 paths (oneDNN, packed batches) on tiny models.

Correctness only, never timing: every fast or low-precision path is checked against plain fp32.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from model import modeling
from model.compute import onednn
from model.compute.precision import Int8Linear, apply_precision, autocast, precision_of, recommended_precision
from model.config import BertConfig
from model.modeling import BertForMaskedLM, BertForSequenceClassification, BertModel
from tests.conftest import tiny_config_dict

torch.set_num_threads(1)


def tiny(cls=BertModel, **overrides):
    torch.manual_seed(0)
    config = BertConfig(**tiny_config_dict(**overrides))
    if cls is BertForSequenceClassification:
        config = config.with_labels(["neg", "pos", "other"])
    model = cls(config).eval()
    with torch.no_grad():  # non-trivial LayerNorm and bias values
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def batch(vocab_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab_size, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[3, 3:] = 0
    return ids, mask


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dim=-1)


# -- apply_precision ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["fp16", "BF16", "", "int4"])
def test_unknown_precision_is_a_value_error_quoting_it(bad):
    with pytest.raises(ValueError, match=f"unknown precision '{bad}'; expected one of fp32, bf16, int8"):
        apply_precision(tiny(), bad)
    with pytest.raises(ValueError, match=f"unknown precision '{bad}'"):
        autocast("cpu", bad)


def test_fp32_is_a_no_op():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_precision(model, "fp32") is model and precision_of(model) == "fp32"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_encoder_outputs_stay_close_to_fp32_and_keep_fp32_dtype(precision):
    model = tiny()
    ids, mask = batch(model.config.vocab_size)
    with torch.no_grad():
        ref = model(ids, mask)
        low_model = apply_precision(copy.deepcopy(model), precision)
        low = low_model(ids, mask)
    assert precision_of(low_model) == precision
    assert low.last_hidden_state.dtype == low.pooler_output.dtype == torch.float32
    real = mask.bool()
    assert cosine(low.last_hidden_state[real], ref.last_hidden_state[real]).min() > 0.99
    assert cosine(low.pooler_output, ref.pooler_output).min() > 0.99


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_fill_mask_and_classification_agree_with_fp32(precision):
    mlm, clf = tiny(BertForMaskedLM), tiny(BertForSequenceClassification)
    ids, mask = batch(mlm.config.vocab_size)
    where = torch.zeros_like(ids, dtype=torch.bool)
    where[:, 2] = True
    with torch.no_grad():
        ref_mlm = mlm(ids, mask, masked_positions=where).logits
        ref_clf = clf(ids, mask).logits
        low_mlm = apply_precision(mlm, precision)(ids, mask, masked_positions=where).logits
        low_clf = apply_precision(clf, precision)(ids, mask).logits
    assert low_mlm.dtype == low_clf.dtype == torch.float32
    assert cosine(low_mlm, ref_mlm).min() > 0.99
    torch.testing.assert_close(low_clf, ref_clf, atol=0.05, rtol=0.05)


def test_bf16_converts_back_to_fp32():
    model = apply_precision(tiny(), "bf16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    apply_precision(model, "fp32")
    assert precision_of(model) == "fp32" and all(p.dtype == torch.float32 for p in model.parameters())
    ids, mask = batch(model.config.vocab_size)
    assert model(ids, mask).last_hidden_state.dtype == torch.float32


def test_int8_quantises_only_the_encoder_and_saves_as_a_plain_checkpoint(tmp_path):
    model = apply_precision(tiny(BertForMaskedLM), "int8")
    quantised = [n for n, m in model.named_modules() if isinstance(m, Int8Linear)]
    assert len(quantised) == 4 * model.config.num_hidden_layers
    assert all(n.startswith("bert.encoder.") for n in quantised)
    assert type(model.cls.predictions.transform.dense) is torch.nn.Linear
    # The state dict keeps HF's names (the fused qkv split back), with dequantised weights.
    state = model.state_dict()
    assert "bert.encoder.layer.0.attention.self.query.weight" in state
    model.save_pretrained(tmp_path)
    again = BertForMaskedLM.from_pretrained(tmp_path)
    assert precision_of(again) == "fp32"
    for key, value in again.state_dict().items():
        torch.testing.assert_close(value, state[key], atol=0, rtol=0, msg=key)


def test_int8_linear_error_is_only_the_roundings():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    q = Int8Linear(linear)
    x = torch.randn(5, 7, 64)
    with torch.no_grad():
        ref, out = linear(x), q(x)
    assert out.shape == ref.shape
    assert ((out - ref).norm() / ref.norm()) < 0.02
    torch.testing.assert_close(
        q.dequantized_weight(), linear.weight.detach(), atol=linear.weight.abs().max().item() / 127, rtol=0
    )


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_takes_its_rows_in_chunks_without_changing_a_value(monkeypatch, bias):
    from model.compute import precision

    torch.manual_seed(0)
    q = Int8Linear(torch.nn.Linear(64, 48, bias=bias))
    x = torch.randn(3, 11, 64)  # 33 rows
    with torch.no_grad():
        whole = q(x)
        monkeypatch.setattr(precision, "CHUNK_ROWS", 4)  # 9 chunks, the last of one row
        assert torch.equal(q(x), whole)  # each row is quantised on its own: chunks change nothing
        assert q(torch.randn(0, 64)).shape == (0, 48)


def test_int8_refuses_training_mode_and_cannot_be_undone():
    with pytest.raises(ValueError, match="int8 is for inference: call model.eval"):
        apply_precision(tiny().train(), "int8")
    model = apply_precision(tiny(), "int8")
    assert apply_precision(model, "int8") is model
    with pytest.raises(ValueError, match="model is int8-quantised; it cannot become 'fp32'"):
        apply_precision(model, "fp32")


def test_autocast_helper():
    model = tiny()
    ids, mask = batch(model.config.vocab_size)
    with autocast("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with torch.no_grad(), autocast(torch.device("cpu"), "bf16"):
        assert torch.is_autocast_enabled("cpu")
        out = model(ids, mask).last_hidden_state
    with torch.no_grad():
        ref = model(ids, mask).last_hidden_state
    assert cosine(out.float()[mask.bool()], ref[mask.bool()]).min() > 0.99
    with pytest.raises(ValueError, match="int8 is a conversion of the model"):
        autocast("cpu", "int8")
    assert recommended_precision("cpu") == "fp32"


# -- the fast fp32 paths -----------------------------------------------------------------------

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="torch without oneDNN")


@pytest.fixture
def onednn_always(monkeypatch):
    """oneDNN for every matmul, however small (tiny models normally fall under the threshold)."""
    monkeypatch.setattr(onednn, "_MIN_MACS", 0)
    old = onednn.use_onednn(True)
    yield
    onednn.use_onednn(old)


def run_both(fn):
    """fn() through oneDNN, then through torch's own GEMM."""
    first = fn()
    old = onednn.use_onednn(False)
    try:
        return first, fn()
    finally:
        onednn.use_onednn(old)


@needs_onednn
@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu", "silu"])
def test_onednn_inference_matches_torch(onednn_always, act):
    model = tiny(BertForSequenceClassification, hidden_act=act)
    ids, mask = batch(model.config.vocab_size)
    with torch.inference_mode():
        fast, slow = run_both(lambda: model(ids, mask).logits)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)


@needs_onednn
def test_onednn_training_gradients_match_torch(onednn_always):
    model = tiny(BertForMaskedLM, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
    ids, mask = batch(model.config.vocab_size)
    labels = torch.full_like(ids, -100)
    labels[:, 1] = ids[:, 1]

    def grads():
        model.zero_grad()
        loss = model(ids, mask, labels=labels).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    for fast, slow in zip(*run_both(grads)):
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)


@needs_onednn
def test_packed_weights_follow_in_place_updates_and_copies(onednn_always):
    model = tiny()
    ids, mask = batch(model.config.vocab_size)
    with torch.no_grad():
        model(ids, mask)  # packs the weights
        model.encoder.layer[0].intermediate.dense.weight.mul_(1.5)  # as an optimizer step would
        fast, slow = run_both(lambda: model(ids, mask).last_hidden_state)
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)
        twin = copy.deepcopy(model)  # the opaque packed copies are dropped, not deep-copied
        torch.testing.assert_close(twin(ids, mask).last_hidden_state, fast, atol=1e-5, rtol=0)
        dense = model.encoder.layer[1].output.dense  # a new weight tensor (load_state_dict(assign=True))
        dense.weight = torch.nn.Parameter(torch.randn_like(dense.weight))
        fast, slow = run_both(lambda: model(ids, mask).last_hidden_state)
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)


@pytest.mark.parametrize("training", [False, True])
def test_packed_batches_match_the_padded_path(monkeypatch, training):
    """Padding never computed (the real tokens packed) gives the masked path's outputs and grads."""
    model = tiny(BertForSequenceClassification, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train(
        training
    )
    ids, mask = batch(model.config.vocab_size)
    mask[2] = 0
    mask[2, :1] = 1  # a one-token sequence
    labels = torch.tensor([0, 2, 1, 1])

    def run(min_padding):
        monkeypatch.setattr(modeling, "CPU_UNPAD_MIN_PADDING", min_padding)
        model.zero_grad()
        out = model(ids, mask, labels=labels)
        out.loss.backward()
        hidden = model.bert(ids, mask).last_hidden_state
        return [out.logits, hidden[mask.bool()]] + [p.grad.clone() for p in model.parameters()]

    packed, padded = run(0.0), run(2.0)
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    monkeypatch.setattr(modeling, "CPU_UNPAD_MIN_PADDING", 0.0)
    assert (model.bert(ids, mask).last_hidden_state[~mask.bool()] == 0).all()
