"""Weight files in Hugging Face's BERT layout: reading them, normalising their names, finding heads.

A model directory holds `model.safetensors` (or a legacy `pytorch_model.bin`, read through
`torch.load(weights_only=True)` only: nothing is ever unpickled). Its keys are HF's names
(`bert.embeddings.word_embeddings.weight`, `cls.predictions.bias`, ...); old checkpoints spell
LayerNorm's parameters gamma/beta, a bare BertModel's keys have no "bert." prefix, and some carry a
position-id buffer or a copy of the tied decoder. `normalize_state_dict` maps them all onto one
layout, and the heads a directory has are read off its key names (`heads_in_dir` reads the
safetensors header only, no tensors). `expected_shapes` says, from a config alone, the name and shape of
every tensor a BERT of that config has, so a weights file can be checked against its config.json before
a tensor is read (`safetensors_shapes` reads a header; format: https://github.com/huggingface/safetensors).

Head names: "pooler" (bert.pooler), "mlm" (cls.predictions), "nsp" (cls.seq_relationship),
"classifier" (classifier: sequence, token or multiple-choice classification alike), "qa"
(qa_outputs). They describe weights; which class a directory loads as is model.modeling's
`class_for_heads`, and what a model can serve is the service's business.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

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
# A 48-layer BERT's safetensors header is about 100 KB (some 800 tensors); safetensors itself allows 100 MB.
MAX_HEADER_BYTES = 4 << 20


def weights_file(path: str | Path) -> Path:
    """The weights file of a model directory: model.safetensors, else pytorch_model.bin."""
    path = Path(path)
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {path}")


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Weights of a model directory: model.safetensors, else pytorch_model.bin (weights only)."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        return read_safetensors(file)
    return torch.load(file, map_location="cpu", weights_only=True)


# safetensors' dtype names (https://github.com/huggingface/safetensors, its format section)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors(file: str | Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, each read into its own memory (not mapped from the file, as safetensors'
    `load_file` does): the pages of a mapped file count in the process's RSS beside any copy made of them, so
    a load that converts or joins tensors would briefly hold the weights twice. Data is little-endian, as the
    format says and as x86 and ARM Linux store it."""
    file = Path(file)
    if torch.tensor([1], dtype=torch.int16).numpy().tobytes() != b"\x01\x00":  # a big-endian host: the library's reader
        return load_file(file)
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{file.name}: its header is {length:,} bytes, more than {MAX_HEADER_BYTES:,}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
        if not isinstance(header, dict):
            raise ValueError(f"{file.name} is not a safetensors file (its header is not a JSON object)")
        header.pop("__metadata__", None)
        out: dict[str, torch.Tensor] = {}
        for name, entry in header.items():
            dtype = SAFETENSORS_DTYPES.get(str(entry.get("dtype"))) if isinstance(entry, dict) else None
            offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
            if dtype is None or not isinstance(offsets, list) or len(offsets) != 2:
                raise ValueError(f"{file.name}: tensor {name!r} has a dtype or offsets this reader does not know")
            tensor = torch.empty(_shape(file.name, name, entry), dtype=dtype)
            size = tensor.numel() * tensor.element_size()
            if offsets[1] - offsets[0] != size:
                raise ValueError(f"{file.name}: tensor {name!r} takes {offsets[1] - offsets[0]:,} bytes, not {size:,}")
            f.seek(8 + length + offsets[0])
            if size and f.readinto(tensor.reshape(-1).view(torch.uint8).numpy().data) != size:
                raise ValueError(f"{file.name} ends inside tensor {name!r}")
            out[name] = tensor
    return out


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


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a safetensors file, read from its header alone (an 8-byte little-endian
    length, then JSON: name -> dtype, shape, offsets); a ValueError when the header is not one."""
    path = Path(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path.name}: its header is {length:,} bytes, more than {MAX_HEADER_BYTES:,}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return {name: _shape(path.name, name, entry) for name, entry in header.items()}


def _shape(file: str, name: str, entry: Any) -> tuple[int, ...]:
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"{file}: tensor {name!r} has no valid shape in the header")
    return tuple(shape)


def expected_shapes(config: Any, parts: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a BERT of `config` (a BertConfig) with the encoder and these
    parts (model.sizing's names: pooler, mlm, nsp, classifier, qa, choice), normalised names, as
    model/modeling.py's classes hold them; with the legacy keys' shapes besides."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes = {
        "bert.embeddings.word_embeddings.weight": (v, h),
        "bert.embeddings.position_embeddings.weight": (config.max_position_embeddings, h),
        "bert.embeddings.token_type_embeddings.weight": (config.type_vocab_size, h),
        **_layer_norm("bert.embeddings.LayerNorm", h),
    }
    for n in range(config.num_hidden_layers):
        layer = f"bert.encoder.layer.{n}."
        for name in ("query", "key", "value"):
            shapes |= _linear(f"{layer}attention.self.{name}", h, h)
        shapes |= _linear(f"{layer}attention.output.dense", h, h) | _layer_norm(f"{layer}attention.output.LayerNorm", h)
        shapes |= _linear(f"{layer}intermediate.dense", h, i) | _linear(f"{layer}output.dense", i, h)
        shapes |= _layer_norm(f"{layer}output.LayerNorm", h)
    heads = {
        "pooler": _linear("bert.pooler.dense", h, h),
        "mlm": _linear("cls.predictions.transform.dense", h, h)
        | _layer_norm("cls.predictions.transform.LayerNorm", h)
        | {"cls.predictions.bias": (v,)},
        "nsp": _linear("cls.seq_relationship", h, 2),
        "classifier": _linear("classifier", h, config.num_labels),
        "qa": _linear("qa_outputs", h, 2),
        "choice": _linear("classifier", h, 1),
    }
    for part in parts:
        shapes |= heads[part]
    legacy = {
        "bert.embeddings.position_ids": (1, config.max_position_embeddings),
        "cls.predictions.decoder.weight": (v, h),
        "cls.predictions.decoder.bias": (v,),
    }
    return shapes | legacy


def _linear(name: str, fan_in: int, fan_out: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (fan_out, fan_in), f"{name}.bias": (fan_out,)}


def _layer_norm(name: str, width: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (width,), f"{name}.bias": (width,)}
