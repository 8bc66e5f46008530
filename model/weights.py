"""Weight files in Hugging Face's BERT layout: reading them, normalising their names, finding heads.

A model directory holds `model.safetensors` (or a legacy `pytorch_model.bin`, read through
`torch.load(weights_only=True)` only: nothing is ever unpickled). Its keys are HF's names
(`bert.embeddings.word_embeddings.weight`, `cls.predictions.bias`, ...); old checkpoints spell
LayerNorm's parameters gamma/beta, a bare BertModel's keys have no "bert." prefix, and some carry a
position-id buffer or a copy of the tied decoder. `normalize_state_dict` maps them all onto one
layout, and the heads a directory has are read off its key names (`heads_in_dir` reads the
safetensors header only, no tensors).

Head names: "pooler" (bert.pooler), "mlm" (cls.predictions), "nsp" (cls.seq_relationship),
"classifier" (classifier: sequence, token or multiple-choice classification alike), "qa"
(qa_outputs). They describe weights; which class a directory loads as is model.modeling's
`class_for_heads`, and what a model can serve is the service's business.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file

# Head name -> key prefix in the HF layout (encoder keys carry "bert.").
HEAD_PREFIXES = {
    "pooler": "bert.pooler.",
    "mlm": "cls.predictions.",
    "nsp": "cls.seq_relationship.",
    "classifier": "classifier.",
    "qa": "qa_outputs.",
}
HEAD_NAMES = {
    "pooler": "pooler",
    "mlm": "MLM head",
    "nsp": "NSP head",
    "classifier": "classifier head",
    "qa": "question-answering head",
}
# Keys real HF checkpoints carry that hold nothing we need: a buffer and the tied decoder.
LEGACY_KEYS = {"bert.embeddings.position_ids", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Weights of a model directory: model.safetensors, else pytorch_model.bin (weights only)."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return load_file(path / "model.safetensors")
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {path}")


def state_dict_keys(path: str | Path) -> list[str]:
    """Weight names of a model directory; for safetensors read from the header alone."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return list(f.keys())
    return list(load_state_dict(path))


V = TypeVar("V")  # a state dict's values: tensors, or anything when only its keys matter


def normalize_state_dict(state_dict: dict[str, V]) -> dict[str, V]:
    """Any HF BERT state dict -> the "bert."-prefixed layout, with legacy names renamed."""
    out: dict[str, V] = {}
    for key, value in state_dict.items():
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if not key.startswith(("bert.", "cls.", "classifier.", "qa_outputs.")):
            key = "bert." + key  # a bare BertModel's keys
        out[key] = value
    if "cls.predictions.bias" not in out and "cls.predictions.decoder.bias" in out:
        out["cls.predictions.bias"] = out["cls.predictions.decoder.bias"]
    return out


def heads_of_keys(keys: Iterable[str]) -> set[str]:
    """Heads whose weights are among these (normalised) key names."""
    keys = list(keys)
    return {head for head, prefix in HEAD_PREFIXES.items() if any(k.startswith(prefix) for k in keys)}


def heads_in_dir(path: str | Path) -> set[str]:
    """Heads present in a model directory's weights: a subset of HEAD_PREFIXES' names."""
    return heads_of_keys(normalize_state_dict(dict.fromkeys(state_dict_keys(path))))
