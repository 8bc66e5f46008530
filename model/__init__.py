"""bertserve's model package: BERT (Devlin et al., 2018) from scratch in PyTorch, its tokenizer,
data pipeline, trainer and checkpoints. Importable on its own: it never imports app/ or worker/."""

from .config import BertConfig
from .modeling import (
    BertForMaskedLM,
    BertForPreTraining,
    BertForSequenceClassification,
    BertModel,
    load_model,
)
from .tokenizer import BertTokenizer

__all__ = [
    "BertConfig",
    "BertModel",
    "BertForPreTraining",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "BertTokenizer",
    "load_model",
]
