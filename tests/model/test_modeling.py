"""The in-house BERT against transformers on the same weights, plus the seed posts' own checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from model import modeling
from model.compute import kernels
from model.config import BertConfig
from model.modeling import BertForMaskedLM, BertForPreTraining, BertForSequenceClassification, BertModel, load_model
from model.weights import heads_in_dir
from tests.conftest import tiny_config_dict

ATOL = 1e-5
CLASSES = ["BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForSequenceClassification"]
OURS = {c.__name__: c for c in (BertModel, BertForPreTraining, BertForMaskedLM, BertForSequenceClassification)}


def padded_batch(vocab_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab_size, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    ids[mask == 0] = 0
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    return ids, mask, types


def hf_model(name: str, **cfg):
    torch.manual_seed(0)
    config = transformers.BertConfig(**tiny_config_dict(**cfg), attn_implementation="sdpa")
    model = getattr(transformers, name)(config).eval()
    # Random, non-trivial LayerNorm and bias values, so a swapped name cannot hide behind 1s and 0s.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "LayerNorm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def assert_same_outputs(hf_out, our_out, mask):
    checked = 0
    for field in ("last_hidden_state", "pooler_output", "prediction_logits", "seq_relationship_logits", "logits"):
        theirs = getattr(hf_out, field, None)
        if theirs is None:
            continue
        ours = getattr(our_out, field)
        if theirs.dim() == 3:  # padded positions hold no meaning in either implementation
            theirs, ours = theirs[mask.bool()], ours[mask.bool()]
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0, msg=field)
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("name", CLASSES)
def test_transformers_checkpoint_loads_with_identical_outputs(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    ours = OURS[name].from_pretrained(tmp_path)
    ids, mask, types = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        assert_same_outputs(hf(input_ids=ids, attention_mask=mask, token_type_ids=types), ours(ids, mask, types), mask)


@pytest.mark.parametrize("name", CLASSES)
def test_our_checkpoint_loads_in_transformers_with_identical_outputs(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path / "hf")
    OURS[name].from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "ours")
    back = getattr(transformers, name).from_pretrained(tmp_path / "ours").eval()
    ids, mask, types = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        assert_same_outputs(
            hf(input_ids=ids, attention_mask=mask, token_type_ids=types),
            back(input_ids=ids, attention_mask=mask, token_type_ids=types),
            mask,
        )
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == [name]


def test_state_dict_names_are_huggingface_names():
    ours = set(BertForPreTraining(BertConfig(**tiny_config_dict())).state_dict())
    theirs = set(hf_model("BertForPreTraining").state_dict())
    # HF keeps the tied decoder in its state dict; we keep only the tie (and its bias).
    assert ours == theirs - {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    assert "bert.encoder.layer.1.attention.self.query.weight" in ours


def test_pretraining_loss_equals_transformers(tmp_path):
    hf = hf_model("BertForPreTraining")
    hf.save_pretrained(tmp_path)
    ours = BertForPreTraining.from_pretrained(tmp_path)
    ids, mask, types = padded_batch(hf.config.vocab_size)
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[1, 3], labels[2, 1] = 7, 9, 11
    nsp = torch.tensor([0, 1, 0])
    with torch.no_grad():
        a = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp)
        b = ours(ids, mask, types, labels=labels, next_sentence_label=nsp)
    torch.testing.assert_close(b.loss, a.loss, atol=1e-6, rtol=0)
    # Logits at the labelled positions only, in row-major order.
    torch.testing.assert_close(b.prediction_logits, a.prediction_logits[labels != -100], atol=ATOL, rtol=0)


def test_nsp_loss_counts_both_labels(tiny_config):
    """The seed's bug: NSP loss that ignored label 0. Both labels must move the loss."""
    model = BertForPreTraining(tiny_config).eval()
    ids, mask, types = padded_batch(tiny_config.vocab_size)
    with torch.no_grad():
        logits = model(ids, mask, types).seq_relationship_logits
        for label in (0, 1):
            target = torch.full((3,), label)
            loss = model(ids, mask, types, next_sentence_label=target).nsp_loss
            expected = torch.nn.functional.cross_entropy(logits, target)
            torch.testing.assert_close(loss, expected)
            assert loss > 0


def test_mlm_decoder_is_tied_to_word_embeddings(tiny_config):
    model = BertForPreTraining(tiny_config)
    emb = model.bert.embeddings.word_embeddings
    with torch.no_grad():
        emb.weight[7].fill_(0.5)
    h = torch.randn(1, tiny_config.hidden_size)
    expected = (
        model.cls.predictions.transform.LayerNorm(torch.nn.functional.gelu(model.cls.predictions.transform.dense(h)))
        @ emb.weight.T
    )
    torch.testing.assert_close(model.cls.predictions(h), expected + model.cls.predictions.bias)
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


def test_masked_positions_give_the_same_logits_as_the_full_decoder(tiny_config):
    model = BertForMaskedLM(tiny_config).eval()
    ids, mask, types = padded_batch(tiny_config.vocab_size)
    where = torch.zeros_like(ids, dtype=torch.bool)
    where[0, 3] = where[2, 1] = where[1, 5] = True
    with torch.no_grad():
        full = model(ids, mask, types).logits
        gathered = model(ids, mask, types, masked_positions=where).logits
    assert gathered.shape == (3, tiny_config.vocab_size)
    torch.testing.assert_close(gathered, full[where])


def test_only_masked_positions_contribute_gradient(tiny_config):
    """A position labelled -100 contributes exactly nothing: its label cannot change the loss or grads."""
    model = BertForMaskedLM(BertConfig(**tiny_config_dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))
    ids, mask, types = padded_batch(tiny_config.vocab_size)
    labels = torch.full_like(ids, -100)
    labels[0, 2] = 9

    def grads(lbl):
        model.zero_grad()
        loss = model(ids, mask, types, labels=lbl).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss_a, grads_a = grads(labels)
    # Another labelled position changes the loss; a different token at an ignored position does not.
    other = labels.clone()
    other[1, 1] = 12
    assert not torch.equal(grads(other)[0], loss_a)
    loss_b, grads_b = grads(labels)
    assert torch.equal(loss_a, loss_b)
    # The decoder bias gets gradient only from the one labelled row: softmax(p) - onehot(9).
    bias_grad = grads_a[[n for n, _ in model.named_parameters()].index("cls.predictions.bias")]
    logits = model(ids, mask, types, masked_positions=labels != -100).logits.detach()
    expected = torch.softmax(logits[0], -1) - torch.nn.functional.one_hot(torch.tensor(9), tiny_config.vocab_size)
    torch.testing.assert_close(bias_grad, expected, atol=1e-6, rtol=0)


def test_padding_never_changes_real_token_outputs(tiny_config):
    model = BertModel(tiny_config).eval()
    ids = torch.randint(5, tiny_config.vocab_size, (1, 9))
    padded = torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 9), torch.zeros(1, 6)], dim=1).long()
    with torch.no_grad():
        alone = model(ids)
        with_pad = model(padded, mask)
    torch.testing.assert_close(with_pad.last_hidden_state[:, :9], alone.last_hidden_state, atol=1e-6, rtol=0)
    torch.testing.assert_close(with_pad.pooler_output, alone.pooler_output, atol=1e-6, rtol=0)


def test_tiny_model_overfits_a_handful_of_pairs(tiny_config):
    """The seed posts' first check: MLM + NSP loss reach near zero on a few examples."""
    torch.manual_seed(0)
    config = BertConfig(**tiny_config_dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model = BertForPreTraining(config).train()
    ids = torch.randint(5, config.vocab_size, (4, 10))
    ids[:, 0], ids[:, 5], ids[:, 9] = 2, 3, 3
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    labels[:, 7] = ids[:, 7]
    masked = ids.clone()
    masked[:, 3] = masked[:, 7] = 4
    nsp = torch.tensor([0, 1, 0, 1])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = model(masked, None, types, labels=labels, next_sentence_label=nsp).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


def test_too_long_input_is_a_clear_error(tiny_config):
    model = BertModel(tiny_config)
    with pytest.raises(ValueError, match="sequence length 65 exceeds max_position_embeddings 64"):
        model(torch.ones(1, 65, dtype=torch.long))


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            dict(hidden_size=30, num_attention_heads=4),
            r"hidden_size \(30\) is not a multiple of num_attention_heads \(4\)",
        ),
        (dict(hidden_act="swish2"), "unknown hidden_act 'swish2'"),
        (dict(vocab_size=0), "vocab_size must be a positive integer, got 0"),
        (dict(hidden_dropout_prob=1.5), r"hidden_dropout_prob must be in \[0, 1\), got 1.5"),
    ],
)
def test_inconsistent_config_raises_value_error_quoting_values(bad, message):
    with pytest.raises(ValueError, match=message):
        BertConfig(**tiny_config_dict(**bad))


def test_config_json_round_trips_and_reads_huggingface_json(tmp_path):
    hf = transformers.BertConfig(**tiny_config_dict(), id2label={0: "neg", 1: "pos"})
    hf.save_pretrained(tmp_path)
    ours = BertConfig.from_json_file(tmp_path / "config.json")
    assert ours.id2label == {0: "neg", 1: "pos"} and ours.label2id == {"neg": 0, "pos": 1}
    assert ours.hidden_size == 32 and ours.num_labels == 2
    ours.to_json_file(tmp_path / "again.json")
    assert BertConfig.from_json_file(tmp_path / "again.json") == ours


def test_legacy_keys_load(tmp_path, tiny_config):
    """position_ids, decoder.bias, gamma/beta and pytorch_model.bin, as old HF checkpoints carry."""
    model = BertForPreTraining(tiny_config).eval()
    state = model.state_dict()
    legacy = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in state.items()
    }
    legacy["bert.embeddings.position_ids"] = torch.arange(64)[None]
    legacy["cls.predictions.decoder.bias"] = legacy.pop("cls.predictions.bias")
    legacy["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    tiny_config.to_json_file(tmp_path / "config.json")
    torch.save(legacy, tmp_path / "pytorch_model.bin")
    loaded = BertForPreTraining.from_pretrained(tmp_path)
    for key, value in state.items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_missing_heads_are_named(tmp_path, tiny_config):
    BertModel(tiny_config).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"has no MLM head \(cls\.predictions\.\*\), NSP head "
        r"\(cls\.seq_relationship\.\*\), which BertForPreTraining needs",
    ):
        BertForPreTraining.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no classifier head \(classifier\.\*\)"):
        BertForSequenceClassification.from_pretrained(tmp_path)
    # Warm start: the encoder is kept, only the heads are new, and the decoder stays tied.
    warm = BertForPreTraining.from_pretrained(tmp_path, init_missing_heads=True)
    base = BertModel.from_pretrained(tmp_path)
    assert torch.equal(
        warm.bert.encoder.layer[0].attention.self.qkv.weight, base.encoder.layer[0].attention.self.qkv.weight
    )
    assert warm.cls.predictions.word_embeddings[0] is warm.bert.embeddings.word_embeddings


def test_unknown_and_missing_keys_are_reported_by_name(tmp_path, tiny_config):
    BertModel(tiny_config).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(2)
    del state["encoder.layer.1.output.dense.bias"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"lacks weights BertModel needs: bert\.encoder\.layer\.1\.output\.dense\.bias"
    ):
        BertModel.from_pretrained(tmp_path)
    state["encoder.layer.1.output.dense.bias"] = torch.zeros(32)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"does not know: bert\.encoder\.layer\.0\.attention\.self\.rotary\.weight"):
        BertModel.from_pretrained(tmp_path)


def test_shape_mismatch_is_a_value_error(tmp_path, tiny_config):
    BertModel(tiny_config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="weights do not fit the config"):
        BertModel.from_pretrained(tmp_path, intermediate_size=40)


def test_load_model_picks_the_class_by_heads(tmp_path, tiny_config):
    for cls in OURS.values():
        cls(tiny_config).save_pretrained(tmp_path / cls.__name__)
        assert type(load_model(tmp_path / cls.__name__)) is cls
    assert heads_in_dir(tmp_path / "BertForPreTraining") == {"pooler", "mlm", "nsp"}
    assert heads_in_dir(tmp_path / "BertForMaskedLM") == {"mlm"}
    # An encoder without a pooler (as HF's BertForMaskedLM saves it) loads as a BertModel without one.
    assert BertModel.from_pretrained(tmp_path / "BertForMaskedLM").pooler is None


def test_classification_loss_and_regression(tiny_config):
    model = BertForSequenceClassification(tiny_config.with_labels(["a", "b", "c"])).eval()
    ids, mask, types = padded_batch(tiny_config.vocab_size)
    out = model(ids, mask, types, labels=torch.tensor([0, 2, 1]))
    assert out.logits.shape == (3, 3)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, torch.tensor([0, 2, 1])))
    reg = BertForSequenceClassification(tiny_config.with_labels(["score"])).eval()
    out = reg(ids, mask, types, labels=torch.tensor([0.5, 1.0, -1.0]))
    torch.testing.assert_close(
        out.loss, torch.nn.functional.mse_loss(out.logits.squeeze(-1), torch.tensor([0.5, 1.0, -1.0]))
    )


@pytest.mark.slow
def test_save_replaces_atomically_and_a_killed_writer_leaves_the_old_model(tmp_path, tiny_config):
    dst = tmp_path / "m"
    BertModel(tiny_config).save_pretrained(dst)
    before = load_file(dst / "model.safetensors")
    # A writer killed while writing into its temp dir: the old directory must stay whole.
    script = textwrap.dedent(f"""
        import os, signal, torch
        from datadir.files import atomic_dir
        with atomic_dir({str(dst)!r}) as tmp:
            (tmp / "config.json").write_text("{{}}")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd())
    assert proc.returncode == -signal.SIGKILL
    after = load_file(dst / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    # An exception inside the write removes the temp dir and keeps the old model.
    with pytest.raises(RuntimeError):
        from datadir.files import atomic_dir

        with atomic_dir(dst) as tmp:
            (tmp / "x").write_text("partial")
            raise RuntimeError("boom")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-") and p.is_dir() and (p / "x").exists()]
    BertModel.from_pretrained(dst)


def test_bf16_autocast_runs_and_stays_close(tiny_config):
    model = BertModel(tiny_config).eval()
    ids, mask, types = padded_batch(tiny_config.vocab_size)
    with torch.no_grad():
        ref = model(ids, mask, types).pooler_output
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(ids, mask, types).pooler_output
    assert torch.nn.functional.cosine_similarity(ref, low.float()).min() > 0.99


def test_masked_lm_and_pretraining_share_one_mlm_loss(tiny_config):
    """BertForMaskedLM's loss is BertForPreTraining's mlm_loss on the same encoder and MLM head."""
    pre = BertForPreTraining(tiny_config).eval()
    mlm = BertForMaskedLM(tiny_config).eval()
    mlm.load_state_dict({k: v for k, v in pre.state_dict().items() if not k.startswith(("bert.pooler.", "cls.seq"))})
    ids, mask, types = padded_batch(tiny_config.vocab_size)
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[1, 3] = 7, 9
    with torch.no_grad():
        a, b = pre(ids, mask, types, labels=labels), mlm(ids, mask, types, labels=labels)
        none = mlm(ids, mask, types, labels=torch.full_like(ids, -100))
    assert torch.equal(a.prediction_logits, b.logits) and torch.equal(a.mlm_loss, b.loss)
    assert a.nsp_loss is None and torch.equal(a.loss, a.mlm_loss)
    assert none.logits.shape == (0, tiny_config.vocab_size) and none.loss.item() == 0.0


def test_flash_varlen_attention_only_for_head_sizes_its_kernel_takes(monkeypatch, kernel_paths):
    """Packed batches on CUDA need flash attention's varlen kernel: half precision, no dropout, and a
    head size that is a multiple of 8 up to 256; otherwise the batch stays padded (SDPA with a mask)."""
    monkeypatch.setattr(modeling, "_varlen_attn", lambda *args: None)  # as on a CUDA build of torch
    kernels.override("flash-varlen", True)  # as on a GPU where its probe agreed
    bf16 = torch.bfloat16
    assert modeling.varlen_fits(bf16, 64, 0.0) and modeling.varlen_fits(torch.float16, 256, 0.0)
    assert not modeling.varlen_fits(bf16, 12, 0.0)  # hidden 48 over 4 heads
    assert not modeling.varlen_fits(bf16, 264, 0.0)
    assert not modeling.varlen_fits(torch.float32, 64, 0.0)
    assert not modeling.varlen_fits(bf16, 64, 0.1)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)[:, None, None, :]
    on_cuda = SimpleNamespace(
        is_cuda=True, dtype=bf16, device=torch.device("cuda")
    )  # what should_unpad reads of the hidden states
    assert modeling.should_unpad(mask, on_cuda, 0.0, 64)
    assert not modeling.should_unpad(mask, on_cuda, 0.0, 12)
    assert modeling.should_unpad(mask, torch.zeros(2, 4, 48), 0.0, 12)  # CPU: SDPA per sequence, any size
    kernels.override("flash-varlen", False)  # a GPU where it is missing or its probe disagreed
    assert modeling.varlen_fits(bf16, 64, 0.0) and not modeling.should_unpad(mask, on_cuda, 0.0, 64)
    monkeypatch.setattr(modeling, "_varlen_attn", None)  # a torch without the kernel
    assert not modeling.varlen_fits(bf16, 64, 0.0) and not modeling.should_unpad(mask, on_cuda, 0.0, 64)
