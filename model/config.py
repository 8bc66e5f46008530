"""BertConfig: the hyper-parameters of one BERT, serialised exactly as Hugging Face's `config.json`.

Field names and defaults follow `transformers.BertConfig` (bert-base-uncased), so a directory written
by either project reads in the other. Reference: Devlin et al. (2018), Table/Section 3 and appendix A.

Every size is bounded (SIZE_BOUNDS, MAX_CONFIG_BYTES), and a config is checked against the bounds before
anything is built from it: a config.json that says 10,000 layers or 3,000,000 labels is a ValueError,
not a model that takes the process's memory.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "tanh", "silu")

# The most each size may be: field -> (at most, why; the docs' table shows both). BERT-large and the
# largest multilingual BERTs are well inside them, and so is any model a pretraining job may ask for
# (app/schemas/jobs.py ModelSize).
SIZE_BOUNDS: dict[str, tuple[int, str]] = {
    "num_hidden_layers": (48, "BERT-large has 24"),
    "hidden_size": (4096, "BERT-large has 1,024"),
    "intermediate_size": (16384, "4 x the largest hidden_size, as BERT's feed-forward is 4 x hidden"),
    "num_attention_heads": (64, "BERT-large has 16"),
    "vocab_size": (524_288, "LaBSE has 501,153 tokens, multilingual BERT 119,547"),
    "max_position_embeddings": (8192, "BERT has 512; long-context BERTs 8,192"),
    "type_vocab_size": (64, "BERT has 2 (segments A and B)"),
    "num_labels": (10_000, "token-classification tag sets and intent classifiers have tens to thousands"),
}
MAX_LABELS = SIZE_BOUNDS["num_labels"][0]  # num_labels, and the entries of id2label and label2id
# A config.json is a few KB; MAX_LABELS labels with long names in both id2label and label2id are about 3 MB.
MAX_CONFIG_BYTES = 4 << 20


@dataclass
class BertConfig:
    vocab_size: int = 30522  # WordPiece vocabulary; the MLM decoder has one output per entry
    hidden_size: int = 768  # width of every token vector (H in the paper)
    num_hidden_layers: int = 12  # encoder layers (L)
    num_attention_heads: int = 12  # heads per layer (A); hidden_size must divide by it
    intermediate_size: int = 3072  # feed-forward width, 4H in the paper
    hidden_act: str = "gelu"  # feed-forward and MLM-transform activation (exact erf GELU)
    hidden_dropout_prob: float = 0.1  # dropout on embeddings and every sub-layer output
    attention_probs_dropout_prob: float = 0.1  # dropout on attention probabilities
    max_position_embeddings: int = 512  # learned positions; longer inputs are an error, not an IndexError
    type_vocab_size: int = 2  # segment A / segment B
    initializer_range: float = 0.02  # std of the normal init of Linear and Embedding weights (as HF)
    layer_norm_eps: float = 1e-12  # as in Google's TF code
    pad_token_id: int = 0  # id of [PAD]; its embedding row is zeroed at init
    id2label: dict[int, str] | None = None  # classification labels, set by fine-tuning
    label2id: dict[str, int] | None = None
    architectures: list[str] | None = None  # class that wrote the weights, e.g. ["BertForPreTraining"]
    model_type: str = "bert"
    problem_type: str | None = None  # "single_label_classification" or "regression"
    classifier_dropout: float | None = None  # dropout before the classifier; None = hidden_dropout_prob
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # keys we keep but do not use

    def __post_init__(self) -> None:
        self.extra.setdefault("position_embedding_type", "absolute")  # the only kind we implement
        check_label_maps(id2label=self.id2label, label2id=self.label2id)  # before either map is copied
        if self.id2label is not None:
            self.id2label = {int(k): str(v) for k, v in self.id2label.items()}
            if self.label2id is None:
                self.label2id = {v: k for k, v in self.id2label.items()}
        if self.label2id is not None:
            self.label2id = {str(k): int(v) for k, v in self.label2id.items()}
        self.validate()

    def validate(self) -> None:
        for name in SIZE_BOUNDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            check_bound(name, value)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unknown hidden_act {self.hidden_act!r}; expected one of {ACTIVATIONS}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id ({self.pad_token_id}) is outside the vocabulary (vocab_size {self.vocab_size})"
            )
        if self.id2label is not None and sorted(self.id2label) != list(range(len(self.id2label))):
            raise ValueError(f"id2label keys must be 0..n-1, got {sorted(self.id2label)}")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_labels(self) -> int:
        return len(self.id2label) if self.id2label else 2

    def with_labels(self, labels: list[str]) -> BertConfig:
        """A copy with id2label/label2id set from an ordered label list."""
        id2label = dict(enumerate(labels))
        problem = "regression" if len(labels) == 1 else "single_label_classification"
        return dataclasses.replace(self, id2label=id2label, label2id=None, problem_type=problem)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BertConfig:
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        if data.get("model_type", "bert") != "bert":
            raise ValueError(f"model_type {data.get('model_type')!r} is not 'bert'")
        if data.get("is_decoder") or data.get("add_cross_attention"):
            raise ValueError("is_decoder/add_cross_attention configs are not BERT encoders; not supported")
        if data.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type {data['position_embedding_type']!r} "
                "is not supported (only 'absolute', as in the paper)"
            )
        kwargs = {k: v for k, v in data.items() if k in known}
        if "num_labels" in data and "id2label" not in data:
            count = int(data["num_labels"])
            check_bound("num_labels", count)  # before a label is made up for each
            kwargs["id2label"] = {i: f"LABEL_{i}" for i in range(count)}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        ours = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        data = {**self.extra, **{k: v for k, v in ours.items() if v is not None}}
        if self.id2label is not None:
            data["id2label"] = {str(k): v for k, v in self.id2label.items()}
        return data

    @classmethod
    def from_json_file(cls, path: str | Path) -> BertConfig:
        path = Path(path)
        try:
            size = path.stat().st_size
            if size > MAX_CONFIG_BYTES:
                raise ValueError(f"{path} is {size:,} bytes, more than the {MAX_CONFIG_BYTES:,} a config may be")
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object")
        return cls.from_dict(data)

    def to_json_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def check_bound(name: str, value: int) -> None:
    """ValueError when size `name` (a SIZE_BOUNDS key) is above its bound, quoting both."""
    most, why = SIZE_BOUNDS[name]
    if value > most:
        raise ValueError(f"{name} is {value:,}, more than the {most:,} a model may have ({why})")


def check_label_maps(**maps: object) -> None:
    """ValueError when id2label or label2id is not a mapping, or holds more than MAX_LABELS entries."""
    for name, labels in maps.items():
        if labels is None:
            continue
        if not isinstance(labels, dict):
            raise ValueError(f"{name} must be a JSON object, got {type(labels).__name__}")
        if len(labels) > MAX_LABELS:
            raise ValueError(f"{name} has {len(labels):,} labels, more than the {MAX_LABELS:,} a model may have")
