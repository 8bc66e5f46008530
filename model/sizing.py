"""How big a training run and a served model are, from the config alone: parameters, peak training
memory, and a served model's weights and forward-pass working set.

Pure arithmetic (no torch), so the service can size a job before anything is queued. The parameter
count is exact for the classes of model/modeling.py (tests/model/test_sizing.py checks it against
built models); the memory is an estimate, checked against measured runs by bench/sizing_bench.py.

Parameters (h hidden, I intermediate, L layers, V vocabulary, P positions, T token types):

    embeddings   (V + P + T) h + 2h                      word, position, segment tables + LayerNorm
    each layer   4h^2 + 2hI + 9h + I                     fused QKV + output (4h^2 + 4h), FFN (2hI + I + h),
                                                         two LayerNorms (4h)
    pooler       h^2 + h                                 BertForPreTraining, BertForSequenceClassification,
                                                         BertForMultipleChoice
    MLM head     h^2 + 3h + V                            transform + LayerNorm + bias; the decoder is tied
    NSP head     2h + 2
    classifier   n h + n                                 n labels (sequence and token classification)
    QA head      2h + 2                                  a start and an end logit per token
    choice head  h + 1                                   one score per choice (multiple choice)

Peak training memory, in bytes, of one optimizer step (N parameters, N_t of them trainable):

    states       4 N  +  4 N_t  +  8 N_t                 fp32 weights, fp32 gradients, AdamW's two fp32
                                                         moments (exp_avg, exp_avg_sq)
               + 2 N                                     bf16 only: autocast's bf16 copies of the weights
    activations  (L + 1) e (12 sbh + 2 sbI + 3 a s^2 b)  every layer's, and one layer's worth of
                                                         gradients in flight in the backward pass
               + e 3 sbh                                 the embeddings' sum, LayerNorm and dropout
               + 3 * 4 m V                               MLM: fp32 logits and log-probabilities of the
                                                         m = b s p masked positions, and their gradient
               + 3 * 4 r n                               classifiers: the same for the logits of n labels
                                                         on r = b rows (sequence classification) or
                                                         r = b s tokens (token classification)

A sentence-embedding model (BertModel) embeds each of an example's c texts (columns: anchor, positive,
hard negatives) in its own rows, so its activations are those of b c rows; with GradCache (`mini_batch_size`
m) only m rows' at a time (each mini-batch is embedded again, with gradients, one after another). In-batch
negatives add a (b, b (c - 1)) matrix of similarities (m rows of it at a time with GradCache), counted as
logits above (3 * 4 bytes each); the embeddings themselves are small beside them and left out.

    overhead     256 MiB                                 kernels, workspaces, allocator slack (measured)

with b the (micro-)batch size, s the sequence length, a the heads and e the bytes of an activation
(4 in fp32, 2 in bf16). The per-layer term is Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.1: e (8 sbh + 2 sbI + 2 a s^2 b) plus 1 byte
per dropout mask element (2 sbh + a s^2 b), which is 34 sbh + 5 a s^2 b bytes in 16-bit with I = 4h;
per layer the backward pass keeps the QKV input, Q, K and V, the softmax output, its dropout mask
and output, the attention context, the FFN input, the GELU input and output, two LayerNorm inputs
and two dropout masks. Two changes for PyTorch as this project runs it, both measured
(bench/sizing_bench.py): on a CPU, dropout keeps its mask in the activations' dtype (e bytes, not 1),
and unfused ("math") attention keeps scaled copies of Q and K (+ e 2 sbh). On a GPU, fused dropout
and attention kernels keep less, so there the estimate errs high.

Gradient accumulation does not enter: only one micro-batch's activations are alive at a time, and
its gradients add into the same buffers. Precision "auto" is fp32 on a CPU and bf16 on a GPU; a
service that does not know where its jobs run takes the larger of the two (`precision="auto"`).
The memory is that of the device that trains: RAM on a CPU, GPU memory on CUDA (plus, there, the
CUDA context, about 0.5 GB, which the estimate leaves out).

Serving memory (`inference_weight_bytes`, `engine_working_bytes`): a served model holds its weights,
and the one inference thread holds the activations of one forward pass at a time, whichever model
runs it. N parameters, W = L (4h^2 + 2hI) of them the encoder's Linear weights, R = L (5h + I) those
weights' output rows:

    weights      fp32  4 N                               model.compute.precision.apply_precision's result
                 bf16  2 N
                 int8  4 N - 3 W + 4 R                   the encoder's Linear weights in int8 with an
                                                         fp32 scale per output row; the rest stays fp32
               + 8 P                                     the position-ids buffer (int64)
    working set  e (6 th + 2 tI + 2 a t s)               one encoder layer's forward pass without
                                                         autograd: its input and output (2 th), fused
                                                         QKV (3 th), the attention context (th), the
                                                         scores and their softmax (2 a t s, unfused
                                                         attention), the FFN's input and GELU output (2 tI)

    packed       e' (W + h^2 [pooler] + h^2 + V h [MLM])  where oneDNN serves the dense layers (fp32 and bf16 on a
                                                         CPU that has it): the reordered copy of each dense
                                                         weight it keeps beside the weight (model.compute.onednn;
                                                         the MLM decoder's is the word embeddings'), e' 4 or 2

with t the padded tokens of one forward pass (BERT_MAX_BATCH_TOKENS), s = min(t, P) its longest row,
and e 4 (fp32 and int8, whose activations are fp32) or 2 (bf16). A layer's tensors are freed before
the next layer's are made, so the working set is one layer's, not L. The heads' outputs are left
out: fill-mask decodes only the [MASK] positions, the other heads' logits are a few per row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# What each model class has beside the encoder (model/modeling.py).
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "BertModel": ("pooler",),
    "BertForPreTraining": ("pooler", "mlm", "nsp"),
    "BertForMaskedLM": ("mlm",),
    "BertForSequenceClassification": ("pooler", "classifier"),
    "BertForTokenClassification": ("classifier",),
    "BertForQuestionAnswering": ("qa",),
    "BertForMultipleChoice": ("pooler", "choice"),
}
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2}
GB = 1024**3
# What training adds beyond tensors: the math libraries' kernels and workspaces and the allocator's
# slack. Measured (bench/sizing_bench.py): 0.13 GB for a 5.5 M-parameter model, 0.22 GB for BERT-base.
RUNTIME_OVERHEAD_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class TrainingSize:
    """A training run's size; the byte counts add up to `memory_bytes`."""

    parameters: int
    trainable: int
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    precision: str  # the one the estimate is for ("fp32" or "bf16")
    overhead_bytes: int = RUNTIME_OVERHEAD_BYTES

    @property
    def memory_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.gradient_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + self.overhead_bytes
        )

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "memory_bytes": self.memory_bytes, "memory_gb": round(self.memory_gb, 3)}


def _get(config: Any, name: str) -> int:
    if isinstance(config, Mapping):
        return config.get(name, 2) if name == "type_vocab_size" else config[name]  # BERT's default: 2
    return getattr(config, name)


def part_parameters(config: Any, num_labels: int = 2) -> dict[str, int]:
    """Parameters of each part of a BERT (`config`: a BertConfig or a dict with its fields)."""
    h, i = _get(config, "hidden_size"), _get(config, "intermediate_size")
    v = _get(config, "vocab_size")
    tables = v + _get(config, "max_position_embeddings") + _get(config, "type_vocab_size")
    return {
        "embeddings": tables * h + 2 * h,
        "encoder": _get(config, "num_hidden_layers") * (4 * h * h + 2 * h * i + 9 * h + i),
        "pooler": h * h + h,
        "mlm": h * h + 3 * h + v,
        "nsp": 2 * h + 2,
        "classifier": num_labels * h + num_labels,
        "qa": 2 * h + 2,
        "choice": h + 1,
    }


def count_parameters(config: Any, architecture: str, num_labels: int = 2) -> int:
    """Exactly what `sum(p.numel() for p in cls(config).parameters())` is for that model class."""
    parts = part_parameters(config, num_labels)
    return parts["embeddings"] + parts["encoder"] + sum(parts[p] for p in ARCHITECTURES[architecture])


def layer_activation_bytes(
    config: Any, batch_size: int, seq_len: int, e: int, mask_bytes: int, scaled_qk: bool = True
) -> int:
    """One encoder layer's activations kept for the backward pass (module docstring)."""
    h, i, a = (_get(config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads"))
    sbh, sbi, attention = seq_len * batch_size * h, seq_len * batch_size * i, a * seq_len * seq_len * batch_size
    kept = e * (8 * sbh + 2 * sbi + 2 * attention) + mask_bytes * (2 * sbh + attention)
    return kept + (e * 2 * sbh if scaled_qk else 0)


def activation_bytes(
    config: Any,
    batch_size: int,
    seq_len: int,
    precision: str,
    masked_lm_prob: float | None = None,
    label_logits: int = 0,
) -> int:
    """Bytes of one micro-batch's activations at the peak of the backward pass (module docstring);
    `label_logits`: a classifier's logits in one micro-batch (rows x labels)."""
    e = ACTIVATION_BYTES[precision]
    b, s, h = batch_size, seq_len, _get(config, "hidden_size")
    layer = layer_activation_bytes(config, b, s, e, mask_bytes=e)
    total = (_get(config, "num_hidden_layers") + 1) * layer + e * 3 * s * b * h
    if masked_lm_prob is not None:
        total += 3 * 4 * round(b * s * masked_lm_prob) * _get(config, "vocab_size")
    return total + 3 * 4 * label_logits


def label_logits(architecture: str, batch_size: int, seq_len: int, num_labels: int) -> int:
    """A classifier's logits in one micro-batch: a row per sequence, or per token for token classification."""
    if "classifier" not in ARCHITECTURES[architecture]:
        return 0
    rows = batch_size * seq_len if architecture == "BertForTokenClassification" else batch_size
    return rows * num_labels


def estimate_training(
    config: Any,
    architecture: str,
    *,
    batch_size: int,
    seq_len: int,
    precision: str = "auto",
    num_labels: int = 2,
    masked_lm_prob: float = 0.15,
    freeze_encoder: bool = False,
    columns: int = 1,
    mini_batch_size: int | None = None,
) -> TrainingSize:
    """Parameters and peak memory of training `architecture` (a model/modeling.py class name) with
    AdamW at this micro-batch size and sequence length; `precision` "fp32", "bf16" or "auto" (the
    larger of the two). `freeze_encoder`: embeddings and encoder get no gradient (heads-only).
    `columns`: texts per example, each embedded alone (sentence embeddings); `mini_batch_size`: GradCache's
    rows at a time (module docstring)."""
    if precision == "auto":
        return max(
            (
                estimate_training(
                    config,
                    architecture,
                    batch_size=batch_size,
                    seq_len=seq_len,
                    precision=p,
                    num_labels=num_labels,
                    masked_lm_prob=masked_lm_prob,
                    freeze_encoder=freeze_encoder,
                    columns=columns,
                    mini_batch_size=mini_batch_size,
                )
                for p in ACTIVATION_BYTES
            ),
            key=lambda size: size.memory_bytes,
        )
    if precision not in ACTIVATION_BYTES:
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'auto', got {precision!r}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; expected one of {sorted(ARCHITECTURES)}")
    parts = part_parameters(config, num_labels)
    total = count_parameters(config, architecture, num_labels)
    trainable = total - (parts["embeddings"] + parts["encoder"] if freeze_encoder else 0)
    mlm = masked_lm_prob if "mlm" in ARCHITECTURES[architecture] else None
    logits = label_logits(architecture, batch_size, seq_len, num_labels)
    rows = batch_size
    if columns > 1:  # sentence embeddings: every text its own row, and the in-batch similarities
        rows = min(mini_batch_size, batch_size) if mini_batch_size else batch_size * columns
        logits += (min(mini_batch_size, batch_size) if mini_batch_size else batch_size) * batch_size * (columns - 1)
    return TrainingSize(
        parameters=total,
        trainable=trainable,
        weights_bytes=4 * total + (2 * total if precision == "bf16" else 0),
        gradient_bytes=4 * trainable,
        optimizer_bytes=8 * trainable,
        activation_bytes=activation_bytes(config, rows, seq_len, precision, mlm, logits),
        precision=precision,
    )


def format_count(n: float) -> str:
    """1234 -> "1.2 K", 9.7e9 -> "9.7 B" (parameters)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(int(n))


# -- serving ---------------------------------------------------------------------------------------

# Bytes per weight at each serving precision (model/compute/precision.py); int8 is the encoder's Linear weights only.
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
SERVING_ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "int8": 4}  # int8's Int8Linear computes in fp32


def inference_weight_bytes(config: Any, parameters: int, precision: str) -> int:
    """Bytes a served model's tensors take at `precision` ("fp32", "bf16" or "int8"; module docstring):
    `parameters` is its exact count (model/modeling.py's num_parameters), heads included."""
    if precision not in WEIGHT_BYTES:
        raise ValueError(f"precision must be one of {', '.join(WEIGHT_BYTES)}, got {precision!r}")
    h, i, layers = (_get(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))
    buffers = 8 * _get(config, "max_position_embeddings")  # position ids, int64
    if precision != "int8":
        return WEIGHT_BYTES[precision] * parameters + buffers
    linear, rows = layers * (4 * h * h + 2 * h * i), layers * (5 * h + i)
    return 4 * (parameters - linear) + linear + 4 * rows + buffers


def packed_weight_bytes(config: Any, architecture: str, precision: str) -> int:
    """Bytes of the reordered copies of a served model's dense weights that oneDNN keeps beside them (module
    docstring), for a model served at `precision` where oneDNN runs its dense layers; int8 has none."""
    if precision not in WEIGHT_BYTES:
        raise ValueError(f"precision must be one of {', '.join(WEIGHT_BYTES)}, got {precision!r}")
    if precision == "int8":
        return 0
    h, i, layers = (_get(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))
    parts = ARCHITECTURES[architecture]
    dense = layers * (4 * h * h + 2 * h * i) + (h * h if "pooler" in parts else 0)
    dense += h * h + _get(config, "vocab_size") * h if "mlm" in parts else 0
    return WEIGHT_BYTES[precision] * dense


def engine_working_bytes(config: Any, max_batch_tokens: int, precision: str) -> int:
    """Bytes of one forward pass's activations at most, for BERT_MAX_BATCH_TOKENS = `max_batch_tokens`
    padded tokens (module docstring)."""
    if precision not in SERVING_ACTIVATION_BYTES:
        raise ValueError(f"precision must be one of {', '.join(SERVING_ACTIVATION_BYTES)}, got {precision!r}")
    h, i, a = (_get(config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads"))
    t = max_batch_tokens
    s = min(t, _get(config, "max_position_embeddings"))
    return SERVING_ACTIVATION_BYTES[precision] * (6 * t * h + 2 * t * i + 2 * a * t * s)


def format_bytes(n: float) -> str:
    """1.5e9 -> "1.40 GB", 2.5e6 -> "2.4 MB" (binary units, as the budget settings count GB)."""
    if n >= GB:
        return f"{n / GB:.2f} GB"
    if n >= 1024**2:
        return f"{n / 1024**2:.1f} MB"
    return f"{n / 1024:.1f} KB"
