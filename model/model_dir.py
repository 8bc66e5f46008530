"""Model directories as a whole: importing a Hugging Face BERT into the project's layout, and a summary
of what a directory holds (`bert import` and `bert info` print these).

The project's layout is HF's (config.json, weights, tokenizer files) with safetensors weights and a
tokenizer.json beside vocab.txt, so a directory written here also loads in transformers. A
sentence-transformers model's named prompts are read from its config_sentence_transformers.json, as
sentence-transformers reads them (SentenceTransformer.__init__: "prompts", "default_prompt_name").
"""

from __future__ import annotations

import json
from pathlib import Path

from datadir.files import atomic_write_bytes
from model.config import BertConfig
from model.errors import UserError
from model.modeling import class_for_heads
from model.tokenizer import BertTokenizer
from model.weights import LEGACY_KEYS, heads_of_keys, load_state_dict, normalize_state_dict

SENTENCE_TRANSFORMERS_CONFIG = "config_sentence_transformers.json"


def import_model(src: str | Path, dst: str | Path) -> dict:
    """Validate any HF BERT directory and write it in the project's layout; returns `summarize(dst)`.

    The weights go through our own model class (so a directory that would not load is refused
    before anything is written), and out as safetensors with tokenizer.json beside them.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise UserError(f"{src} is not a directory")
    if not (src / "config.json").is_file():
        raise UserError(f"{src} has no config.json: not a Hugging Face model directory")
    try:
        state = normalize_state_dict(load_state_dict(src))
        architectures = BertConfig.from_json_file(src / "config.json").architectures
        model = class_for_heads(heads_of_keys(state), architectures)._from_state(src, state, "cpu", False, {})
        tokenizer = BertTokenizer.from_pretrained(src)
        prompts, _ = read_prompts(src)
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    if tokenizer.vocab_size != model.config.vocab_size:
        raise UserError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model.config.vocab_size}"
        )
    model.save_pretrained(dst, tokenizer=tokenizer)
    if prompts:  # a sentence-transformers model's named prompts travel with it
        atomic_write_bytes(dst / SENTENCE_TRANSFORMERS_CONFIG, (src / SENTENCE_TRANSFORMERS_CONFIG).read_bytes())
    return summarize(dst)


def summarize(path: str | Path) -> dict:
    """Architecture, parameter count, heads and vocabulary of a model directory (loads its weights)."""
    path = Path(path)
    config = BertConfig.from_json_file(path / "config.json")
    state = normalize_state_dict(load_state_dict(path))
    heads = heads_of_keys(state)
    vocab = None
    if (path / "tokenizer.json").is_file() or (path / "vocab.txt").is_file():
        tok = BertTokenizer.from_pretrained(path)
        vocab = {"size": tok.vocab_size, "lowercase": tok.lowercase}
    return {
        "path": str(path),
        "architecture": class_for_heads(heads, config.architectures).__name__,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "heads": config.num_attention_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "parameters": sum(v.numel() for k, v in state.items() if k not in LEGACY_KEYS),
        "model_heads": sorted(heads),
        "labels": [config.id2label[i] for i in sorted(config.id2label)] if config.id2label else None,
        "vocab": vocab,
    }


def read_prompts(path: str | Path) -> tuple[dict[str, str], str | None]:
    """(prompts by name, the default prompt's name or None) from a model directory's
    config_sentence_transformers.json; ({}, None) without one. A prompt is text put before each input."""
    file = Path(path) / SENTENCE_TRANSFORMERS_CONFIG
    if not file.is_file():
        return {}, None
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{SENTENCE_TRANSFORMERS_CONFIG} is not valid JSON: {e}") from None
    prompts = (config.get("prompts") if isinstance(config, dict) else None) or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{SENTENCE_TRANSFORMERS_CONFIG}: prompts must map names to texts, got {prompts!r}")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ValueError(
            f"{SENTENCE_TRANSFORMERS_CONFIG}: default_prompt_name {default!r} is not one of its prompts "
            f"({', '.join(sorted(prompts)) or 'none'})"
        )
    return prompts, default
