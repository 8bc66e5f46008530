"""Model directories as a whole: importing a Hugging Face BERT into the project's layout, and a summary
of what a directory holds (`bert import` and `bert info` print these).

The project's layout is HF's (config.json, weights, tokenizer files) with safetensors weights and a
tokenizer.json beside vocab.txt, so a directory written here also loads in transformers. A
sentence-transformers model's named prompts are read from its config_sentence_transformers.json, as
sentence-transformers reads them (SentenceTransformer.__init__: "prompts", "default_prompt_name"), and its
modules (pooling, Normalize) by model/sentence_modules.py, which refuses modules this project cannot run
and writes them into the imported directory. A sparse encoder's (a SpladePooling) are kept the same way;
`pooling="splade"` (`bert import --pooling splade`) makes a masked-LM model whose files do not say it one,
such as SPLADE checkpoints published as a plain BertForMaskedLM. A ColBERT (late interaction) in PyLate's
layout or colbert-ir's is stored in PyLate's (model/late_interaction.py).

An import validates before it allocates: the config's sizes are within model.config's bounds, the
model it describes fits the memory budget (model/sizing.py's count, in fp32), the files read into
memory are small, and the weights file fits the config (its size on disk, and each tensor's shape in
a safetensors header) before a tensor is read or a module built.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from datadir.files import atomic_write_bytes
from model.config import BertConfig
from model.errors import UserError
from model.late_interaction import LINEAR_KEY, late_interaction_layout, read_late_interaction, write_late_interaction
from model.modeling import class_for_heads
from model.options import IMPORT_POOLINGS
from model.sentence_modules import (
    MODULES_FILE,
    SENTENCE_TRANSFORMERS_CONFIG,
    SentenceModules,
    Splade,
    read_sentence_modules,
    write_sentence_modules,
)
from model.sizing import ARCHITECTURES, count_parameters, format_bytes, format_count, part_parameters
from model.tokenizer import CONFIG_FILE, TOKENIZER_FILE, VOCAB_FILE, BertTokenizer
from model.weights import (
    LEGACY_KEYS,
    MAX_HEADER_BYTES,
    expected_shapes,
    heads_of_keys,
    load_state_dict,
    normalize_state_dict,
    safetensors_shapes,
    weights_file,
)

# The model's fp32 weights may take at most this where the importer has no memory budget to compare them
# with (`bert import`): BERT-large's take 1.3 GB, LaBSE's 1.9 GB.
MAX_IMPORT_WEIGHT_BYTES = 4 << 30
# Files an import reads whole into memory besides config.json and the weights; a multilingual
# tokenizer.json is about 10 MB.
MAX_TEXT_FILE_BYTES = 64 << 20
TEXT_FILES = (TOKENIZER_FILE, VOCAB_FILE, CONFIG_FILE, SENTENCE_TRANSFORMERS_CONFIG)


def import_model(
    src: str | Path,
    dst: str | Path,
    *,
    label: str | None = None,
    memory_budget: int | None = None,
    pooling: str | None = None,
) -> dict:
    """Validate any HF BERT directory and write it in the project's layout; returns `summarize(dst)`.

    Its sizes are checked first (`check_config`, `check_text_files`, `check_weights`), and its
    sentence-transformers modules (model.sentence_modules: a module this project cannot run, such as a
    Dense, is refused), then the weights go through our own model class (so a directory that would not
    load is refused before anything is written), and out as safetensors with tokenizer.json beside
    them, and the modules beside those (write_sentence_modules) when it has a modules.json. `label` names the
    source in errors instead of `src` (whose path they never show then); `memory_budget`: the bytes
    the service's models may take, which the model's weights may not exceed; `pooling` "splade": a sparse
    encoder, whatever its files say (it needs a masked-LM head; a SpladePooling's own settings are kept).
    """
    src, dst = Path(src), Path(dst)
    if pooling is not None and pooling not in IMPORT_POOLINGS:
        raise UserError(f"pooling must be one of {', '.join(IMPORT_POOLINGS)}, got {pooling!r}")
    if not src.is_dir():
        raise UserError(f"{label or src} is not a directory")
    if not (src / "config.json").is_file():
        raise UserError(f"{label or src} has no config.json: not a Hugging Face model directory")
    try:
        config = check_config(BertConfig.from_json_file(src / "config.json"), memory_budget)
        check_text_files(src)
        tokenizer = BertTokenizer.from_pretrained(src)
        prompts, _ = read_prompts(src)
        colbert = late_interaction_layout(src)  # a ColBERT's modules are PyLate's (model.late_interaction)
        if colbert is not None and pooling is not None:
            raise ValueError(f"a ColBERT (late interaction) model takes no pooling, got pooling {pooling!r}")
        modules = _with_pooling(read_sentence_modules(src), pooling) if colbert is None else None
        if modules is not None:
            modules.check_tokenizer(tokenizer.lowercase)
        if tokenizer.vocab_size != config.vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {config.vocab_size}"
            )
        check_weights(src, config)
        state = normalize_state_dict(load_state_dict(src))
        late = read_late_interaction(src, state) if colbert else None
        if late is not None and late.weight.shape[1] != config.hidden_size:
            raise ValueError(
                f"the ColBERT projection takes vectors of {late.weight.shape[1]}, but the model's hidden_size is "
                f"{config.hidden_size}"
            )
        state.pop("bert." + LINEAR_KEY, None)  # colbert-ir's projection: written as PyLate's Dense below
        model = class_for_heads(heads_of_keys(state), config.architectures)._from_state(src, state, "cpu", False, {})
        if modules is not None and modules.splade is not None and "mlm" not in model.heads:
            raise ValueError(
                f"SPLADE pooling needs a masked-LM head (cls.predictions.*), and the weights load as a "
                f"{type(model).__name__} without one"
            )
    except (ValueError, FileNotFoundError) as e:
        raise UserError(_relative(str(e), src, label)) from None
    model.save_pretrained(dst, tokenizer=tokenizer)
    sentence_model = (src / MODULES_FILE).is_file()
    if prompts or (sentence_model and (src / SENTENCE_TRANSFORMERS_CONFIG).is_file()):  # its prompts travel with it
        atomic_write_bytes(dst / SENTENCE_TRANSFORMERS_CONFIG, (src / SENTENCE_TRANSFORMERS_CONFIG).read_bytes())
    if late is not None:  # either ColBERT layout is stored as PyLate's
        write_late_interaction(dst, late)
    elif modules is not None and (sentence_model or modules.splade is not None):  # as read (and checked) above
        write_sentence_modules(dst, modules)
    return summarize(dst)


def _with_pooling(modules: SentenceModules, pooling: str | None) -> SentenceModules:
    """The modules an import writes: the source's, or with `pooling` "splade" a sparse encoder's (its own
    SpladePooling if it has one, else SPLADE v2's), with the source's window and case."""
    if pooling != "splade" or modules.splade is not None:
        return modules
    return SentenceModules(
        normalize=False, max_seq_length=modules.max_seq_length, do_lower_case=modules.do_lower_case, splade=Splade()
    )


def _relative(message: str, src: Path, label: str | None) -> str:
    """`message` with `src` named by `label`, and the files below it by their path inside it."""
    if label is None:
        return message
    return message.replace(f"{src}/", "").replace(str(src), label)


# -- what an import checks before it reads the weights -------------------------------------------------


def check_config(config: BertConfig, memory_budget: int | None = None) -> BertConfig:
    """`config` (within its bounds, as any BertConfig), when the largest model it describes has fp32
    weights within `memory_budget`, else within MAX_IMPORT_WEIGHT_BYTES; a ValueError naming both."""
    parameters = max(count_parameters(config, a, config.num_labels) for a in ARCHITECTURES)
    limit = MAX_IMPORT_WEIGHT_BYTES if memory_budget is None else memory_budget
    if 4 * parameters > limit:
        which = "an import may take" if memory_budget is None else "model memory budget"
        raise ValueError(
            f"config.json describes a model of {format_count(parameters)} parameters: an estimated "
            f"{format_bytes(4 * parameters)} of fp32 weights, more than the {format_bytes(limit)} {which}"
        )
    return config


def check_text_files(src: Path) -> None:
    """Refuse a tokenizer or sentence-transformers file larger than MAX_TEXT_FILE_BYTES before it is read."""
    for name in TEXT_FILES:
        if (src / name).is_file() and (size := (src / name).stat().st_size) > MAX_TEXT_FILE_BYTES:
            raise ValueError(f"{name} is {size:,} bytes, more than the {MAX_TEXT_FILE_BYTES:,} an import reads")


def weights_size_range(config: BertConfig) -> tuple[int, int]:
    """(fewest, most) bytes a weights file of a BERT of `config` takes: the encoder alone in 16-bit, and
    every head in fp32 with the legacy keys (a copy of the decoder, the position ids) and the file's
    own headers."""
    parts = part_parameters(config, config.num_labels)
    h, v, p = config.hidden_size, config.vocab_size, config.max_position_embeddings
    tensors = 4 * (sum(parts.values()) + v * h + v) + 8 * p
    return 2 * (parts["embeddings"] + parts["encoder"]), tensors + tensors // 100 + MAX_HEADER_BYTES


def check_weights_size(name: str, size: int, config: BertConfig) -> None:
    """Refuse a weights file whose size on disk cannot hold a BERT of `config` (weights_size_range)."""
    fewest, most = weights_size_range(config)
    if not fewest <= size <= most:
        raise ValueError(
            f"{name} is {format_bytes(size)} ({size:,} bytes), but a BERT of config.json's sizes takes "
            f"{fewest:,} to {most:,} bytes"
        )


def check_weights(src: Path, config: BertConfig) -> None:
    """Refuse a weights file that does not fit `config` before a tensor is read: a safetensors header's
    shapes (check_shapes), and the file's size on disk (check_weights_size)."""
    file = weights_file(src)
    if file.suffix == ".safetensors":
        check_shapes(file.name, safetensors_shapes(file), config)
    check_weights_size(file.name, file.stat().st_size, config)


def check_shapes(name: str, shapes: dict[str, tuple[int, ...]], config: BertConfig) -> None:
    """Each tensor of a weights file has the shape `config` implies for its name (model.weights'
    expected_shapes; a legacy key's may be smaller), and one of another name is no larger than the
    largest of those."""
    shapes = normalize_state_dict(shapes)
    architecture = class_for_heads(heads_of_keys(shapes), config.architectures).__name__
    classifier = "choice" if architecture == "BertForMultipleChoice" else "classifier"
    expected = expected_shapes(config, ("pooler", "mlm", "nsp", "qa", classifier))
    largest = max(math.prod(s) for s in expected.values())
    for key, shape in shapes.items():
        want = expected.get(key)
        if want is None and math.prod(shape) > largest:
            raise ValueError(
                f"{name}: tensor {key} has {math.prod(shape):,} elements, more than the largest tensor "
                f"config.json implies ({largest:,})"
            )
        if want is not None and shape != want and not (key in LEGACY_KEYS and math.prod(shape) <= math.prod(want)):
            raise ValueError(f"{name}: tensor {key} has shape {list(shape)}, but config.json implies {list(want)}")


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
