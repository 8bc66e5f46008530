"""model/sizing.py: parameter counts against built models, the memory formula against its reference
(Korthikanti et al. 2022) and its own parts, a served model's weights against its tensors at each
precision. The measured check is bench/sizing_bench.py."""

from __future__ import annotations

import pytest

from model.compute.precision import apply_precision
from model.config import BertConfig
from model.modeling import MODEL_CLASSES, BertModel
from model.sizing import (
    ARCHITECTURES,
    RUNTIME_OVERHEAD_BYTES,
    activation_bytes,
    count_parameters,
    engine_working_bytes,
    estimate_training,
    format_bytes,
    format_count,
    inference_weight_bytes,
    layer_activation_bytes,
)
from model.training.runs import freeze_encoder

CONFIGS = [
    dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=40,
    ),
    dict(
        vocab_size=50,
        hidden_size=24,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        type_vocab_size=3,
    ),
]


def built(architecture: str, config: BertConfig):
    return BertModel(config) if architecture == "BertModel" else MODEL_CLASSES[architecture](config)


@pytest.mark.parametrize("values", CONFIGS)
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("labels", [["a", "b", "c"], ["score"]])
def test_parameter_count_is_exact(architecture, values, labels):
    config = BertConfig(**values).with_labels(labels)
    model = built(architecture, config)
    assert count_parameters(config, architecture, num_labels=len(labels)) == sum(p.numel() for p in model.parameters())
    assert count_parameters(values, architecture, num_labels=len(labels)) == count_parameters(
        config, architecture, num_labels=len(labels)
    )  # a dict of the fields works as well as a BertConfig


@pytest.mark.parametrize("architecture", ["BertForPreTraining", "BertForMaskedLM"])
def test_frozen_encoder_trains_only_what_freeze_encoder_leaves(architecture):
    config = BertConfig(**CONFIGS[0])
    model = built(architecture, config)
    freeze_encoder(model)
    size = estimate_training(config, architecture, batch_size=2, seq_len=8, precision="fp32", freeze_encoder=True)
    assert size.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert (size.gradient_bytes, size.optimizer_bytes) == (4 * size.trainable, 8 * size.trainable)


def test_a_layer_in_16_bit_is_korthikantis_34_sbh_plus_5_as2b():
    """The reference's per-layer count (16-bit activations, I = 4h, 1-byte masks)."""
    s, b, h, a = 128, 4, 64, 4
    config = dict(hidden_size=h, intermediate_size=4 * h, num_attention_heads=a)
    assert (
        layer_activation_bytes(config, b, s, e=2, mask_bytes=1, scaled_qk=False) == 34 * s * b * h + 5 * a * s * s * b
    )
    # As PyTorch runs it on a CPU: masks in the activations' dtype, scaled copies of Q and K.
    assert layer_activation_bytes(config, b, s, e=4, mask_bytes=4) == 4 * (
        12 * s * b * h + 2 * s * b * 4 * h + 3 * a * s * s * b
    )
    one = {**config, "num_hidden_layers": 1, "vocab_size": 10}
    two = {**one, "num_hidden_layers": 2}
    layer = activation_bytes(two, b, s, "fp32") - activation_bytes(one, b, s, "fp32")
    assert layer == layer_activation_bytes(config, b, s, e=4, mask_bytes=4)


def test_memory_adds_up_and_scales():
    config = BertConfig(**CONFIGS[0])
    fp32 = estimate_training(config, "BertForPreTraining", batch_size=8, seq_len=32, precision="fp32")
    n = fp32.parameters
    assert (fp32.weights_bytes, fp32.gradient_bytes, fp32.optimizer_bytes) == (4 * n, 4 * n, 8 * n)
    assert fp32.memory_bytes == 16 * n + fp32.activation_bytes + RUNTIME_OVERHEAD_BYTES
    bf16 = estimate_training(config, "BertForPreTraining", batch_size=8, seq_len=32, precision="bf16")
    assert bf16.weights_bytes == 6 * n and bf16.activation_bytes < fp32.activation_bytes
    auto = estimate_training(config, "BertForPreTraining", batch_size=8, seq_len=32)
    assert auto.memory_bytes == max(fp32.memory_bytes, bf16.memory_bytes)
    # Activations grow with the batch; the states do not.
    single, double = (
        estimate_training(config, "BertModel", batch_size=b, seq_len=32, precision="fp32") for b in (8, 16)
    )
    assert double.activation_bytes == 2 * single.activation_bytes
    assert double.memory_bytes - double.activation_bytes == single.memory_bytes - single.activation_bytes
    # The MLM head's log-probabilities: only heads that have it pay for them.
    mlm = estimate_training(config, "BertForMaskedLM", batch_size=8, seq_len=32, precision="fp32")
    clf = estimate_training(config, "BertForSequenceClassification", batch_size=8, seq_len=32, precision="fp32")
    assert mlm.activation_bytes - clf.activation_bytes == 3 * 4 * (round(8 * 32 * 0.15) * config.vocab_size - 8 * 2)


@pytest.mark.parametrize(
    "architecture, rows", [("BertForSequenceClassification", 8), ("BertForTokenClassification", 8 * 32)]
)
def test_a_classifiers_label_logits_count_per_row_and_label(architecture, rows):
    """fp32 logits, log-probabilities and their gradient: 12 bytes per row (sequence) or token, per label."""
    config = BertConfig(**CONFIGS[0])
    two, many = (
        estimate_training(config, architecture, batch_size=8, seq_len=32, precision="fp32", num_labels=n)
        for n in (2, 10_000)
    )
    assert many.activation_bytes - two.activation_bytes == 3 * 4 * rows * (10_000 - 2)


def test_issue_12_job_is_ten_billion_parameters():
    """hidden 4096, 48 layers (FFN 4h), vocabulary 200,000: 12 L h^2 = 9.7 B in the encoder alone, 10.5 B all told."""
    config = dict(
        vocab_size=200_000,
        hidden_size=4096,
        num_hidden_layers=48,
        num_attention_heads=64,
        intermediate_size=16384,
        max_position_embeddings=4096,
        type_vocab_size=2,
    )
    size = estimate_training(config, "BertForPreTraining", batch_size=4096, seq_len=4096)
    assert format_count(size.parameters) == "10.5 B" and size.memory_gb > 1e6


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="precision must be 'fp32', 'bf16' or 'auto', got 'int8'"):
        estimate_training(CONFIGS[0], "BertModel", batch_size=1, seq_len=8, precision="int8")
    with pytest.raises(ValueError, match="unknown architecture 'GPT2'"):
        estimate_training(CONFIGS[0], "GPT2", batch_size=1, seq_len=8)


def test_format_count():
    assert [format_count(n) for n in (999, 1_500, 20_714, 335e6, 9.66e9)] == [
        "999",
        "1.5 K",
        "20.7 K",
        "335.0 M",
        "9.7 B",
    ]


@pytest.mark.parametrize("values", CONFIGS)
@pytest.mark.parametrize("architecture", ["BertModel", "BertForPreTraining", "BertForSequenceClassification"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_served_weights_are_the_bytes_of_the_models_tensors(values, architecture, precision):
    config = BertConfig(**values)
    model = apply_precision(built(architecture, config).eval(), precision)
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()  # tied weights once
    held = sum(t.numel() * t.element_size() for t in tensors)
    assert inference_weight_bytes(config, built(architecture, config).num_parameters(), precision) == held


def test_working_set_is_one_layers_forward_pass():
    """BERT-base at 4096 tokens: e (6th + 2tI + 2ats) with s = 512 positions, 4 bytes (fp32, int8) or 2 (bf16)."""
    base = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, max_position_embeddings=512)
    elements = 6 * 4096 * 768 + 2 * 4096 * 3072 + 2 * 12 * 4096 * 512
    assert [engine_working_bytes(base, 4096, p) for p in ("fp32", "bf16", "int8")] == [
        4 * elements,
        2 * elements,
        4 * elements,
    ]
    assert engine_working_bytes(base, 100, "fp32") == 4 * (6 * 100 * 768 + 2 * 100 * 3072 + 2 * 12 * 100 * 100)
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, int8, got 'auto'"):
        engine_working_bytes(base, 1, "auto")


def test_format_bytes():
    assert [format_bytes(n) for n in (2048, 5 * 1024**2 + 1, 3 * 1024**3 // 2)] == ["2.0 KB", "5.0 MB", "1.50 GB"]


@pytest.mark.parametrize("architecture", ["BertModel", "BertForPreTraining", "BertForMaskedLM"])
def test_packed_bytes_are_onednns_copies_of_the_dense_weights(architecture):
    """packed_weight_bytes against the reordered weights oneDNN keeps after an inference pass large enough for
    every dense layer to take its path; the pooler reads one token a row, so its small pass may not."""
    import torch

    from model.compute import onednn
    from model.sizing import packed_weight_bytes

    if not onednn.available():
        pytest.skip("oneDNN's fp32 path does not run on this machine")
    config = BertConfig(**CONFIGS[0])
    model = built(architecture, config).eval()
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (64, 40)))
    packed = [m.__dict__["_onednn_packed"].source() for m in model.modules() if "_onednn_packed" in m.__dict__]
    measured = sum(w.numel() * w.element_size() for w in packed)
    estimate = packed_weight_bytes(config, architecture, "fp32")
    pooler = 4 * config.hidden_size**2 if "pooler" in ARCHITECTURES[architecture] else 0
    assert measured <= estimate <= measured + pooler
    assert packed_weight_bytes(config, architecture, "int8") == 0


def test_a_sentence_embedding_job_counts_each_text_or_gradcaches_mini_batch():
    config = BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    size = estimate_training(config, "BertModel", batch_size=32, seq_len=64, precision="fp32", columns=3)
    # every text its own row (3 x 32), and the (32, 64) in-batch similarities
    assert size.activation_bytes == activation_bytes(config, 96, 64, "fp32", label_logits=32 * 32 * 2)
    cached = estimate_training(
        config, "BertModel", batch_size=1024, seq_len=64, precision="fp32", columns=3, mini_batch_size=32
    )
    assert cached.activation_bytes == activation_bytes(config, 32, 64, "fp32", label_logits=32 * 1024 * 2)
    single = estimate_training(config, "BertModel", batch_size=32, seq_len=64, precision="fp32")
    assert single.activation_bytes == activation_bytes(config, 32, 64, "fp32") < size.activation_bytes
