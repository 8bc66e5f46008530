"""bertserve's model package: BERT (Devlin et al., 2018) from scratch in PyTorch, its tokenizer, data
pipeline, trainer and checkpoints, and the data-directory contract (model.datadir) that the service
and the workers share. Importable on its own: it never imports app/ or worker/.

The names below load on first use, so `import model.datadir` (standard library only) does not pull
in torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BertConfig": ".config",
    "BertModel": ".modeling",
    "BertForPreTraining": ".modeling",
    "BertForMaskedLM": ".modeling",
    "BertForSequenceClassification": ".modeling",
    "BertForTokenClassification": ".modeling",
    "BertForQuestionAnswering": ".modeling",
    "BertForMultipleChoice": ".modeling",
    "load_model": ".modeling",
    "BertTokenizer": ".tokenizer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
