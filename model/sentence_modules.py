"""A model directory's sentence-transformers modules: how its embeddings are pooled and whether they are
normalised, read from and written to the files sentence-transformers keeps beside the weights, and the
pooling itself.

    modules.json                        the modules in order: a Transformer, a Pooling, an optional Normalize
    1_Pooling/config.json               the Pooling's modes (pooling_mode_cls_token, ..._mean_tokens, ...), include_prompt
    2_Normalize/                        the Normalize module (it has no settings)
    sentence_bert_config.json           the Transformer's max_seq_length and do_lower_case
    config_sentence_transformers.json   the named prompts (model.model_dir.read_prompts), kept as they are

A sparse encoder (sentence-transformers' SparseEncoder, model_type "SparseEncoder") lists a Transformer
(`transformer_task` "fill-mask" in sentence_bert_config.json) or an MLMTransformer, then a SpladePooling
(1_SpladePooling/config.json: pooling_strategy, activation_function): its `SentenceModules.splade` says
so, and its embeddings are model/sparse.py's, one weight per vocabulary token.

`read_sentence_modules(path)` gives a `SentenceModules`; `write_sentence_modules(path, modules)` writes these
files so that `sentence_transformers.SentenceTransformer(path)` loads the directory and encodes as
`SentenceModules.embed` does. A directory without modules.json gets `SentenceModules()`: mean pooling
and unit length, which is how the service has always served such a directory. (sentence-transformers
itself would load it with mean pooling and no Normalize.) A model whose modules this project cannot run
(a Dense, a second Transformer, a custom module, ...) is a ValueError naming the module's type.

`pool` is sentence-transformers' Pooling.forward on a padded batch (sentence_transformer/modules/pooling.py,
`_forward_padded`): each mode over the tokens the attention mask keeps, in float32 for 16-bit inputs,
several modes concatenated in their order, and with include_prompt false the prompt's tokens ([CLS]
with them, as sentence-transformers counts a prompt's length) left out.
Reference: https://sbert.net/docs/package_reference/sentence_transformer/models.html
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.nn.functional as F

from datadir.files import atomic_write_bytes
from model.config import BertConfig

MODULES_FILE = "modules.json"
SENTENCE_BERT_CONFIG = "sentence_bert_config.json"
SENTENCE_TRANSFORMERS_CONFIG = "config_sentence_transformers.json"
POOLING_DIR = "1_Pooling"  # where write_sentence_modules puts each module, as sentence-transformers names them
NORMALIZE_DIR = "2_Normalize"
MAX_FILE_BYTES = 1 << 20  # each of these files is a few hundred bytes

# sentence-transformers' modes, in the order it concatenates them when a config sets them by these keys
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# The module types a model may list (the class name after any sentence_transformers module path, old or new),
# in the one order this project runs them.
TRANSFORMER, POOLING, NORMALIZE = "Transformer", "Pooling", "Normalize"
MLM_TRANSFORMER, SPLADE_POOLING = "MLMTransformer", "SpladePooling"
RUNNABLE = "a Transformer, then a Pooling, then an optional Normalize"  # (or a sparse encoder's two: _read_sparse)
SPLADE_DIR = "1_SpladePooling"
SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


@dataclass(frozen=True)
class Pooling:
    """sentence-transformers' Pooling: its modes (concatenated in this order) and whether a prompt's tokens count."""

    modes: tuple[str, ...] = ("mean",)
    include_prompt: bool = True  # false: a prompt's tokens ([CLS] and the prompt's own) are left out

    def __post_init__(self) -> None:
        modes = (self.modes,) if isinstance(self.modes, str) else tuple(self.modes)
        object.__setattr__(self, "modes", modes)  # a list or one mode's name reads as the tuple
        if not modes or any(mode not in POOLING_MODES for mode in modes):
            raise ValueError(f"pooling modes must be one or more of {', '.join(POOLING_MODES)}, got {list(modes)}")

    def dimension(self, hidden_size: int) -> int:
        """The pooled vector's size for token vectors of `hidden_size`."""
        return len(self.modes) * hidden_size


@dataclass(frozen=True)
class Splade:
    """sentence-transformers' SpladePooling: how the MLM logits become one weight per vocabulary token."""

    strategy: str = "max"  # over the tokens: "max" (SPLADE v2) or "sum"
    activation: str = "relu"  # "relu": log(1 + relu(logit)); "log1p_relu": log1p of that once more

    def __post_init__(self) -> None:
        if self.strategy not in SPLADE_STRATEGIES or self.activation not in SPLADE_ACTIVATIONS:
            raise ValueError(
                f"SPLADE pooling_strategy must be one of {', '.join(SPLADE_STRATEGIES)} and activation_function "
                f"one of {', '.join(SPLADE_ACTIVATIONS)}, got {self.strategy!r} and {self.activation!r}"
            )


@dataclass(frozen=True)
class SentenceModules:
    """What a model's sentence-transformers modules do after the encoder; the defaults are a directory's
    without modules.json."""

    pooling: Pooling = field(default_factory=Pooling)
    normalize: bool = True  # a Normalize module: each vector scaled to unit L2 norm
    max_seq_length: int | None = None  # sentence-transformers' window in tokens (None: the tokenizer's)
    do_lower_case: bool = False  # sentence-transformers lowercases each text before its tokenizer sees it
    splade: Splade | None = None  # a sparse encoder's SpladePooling (then `pooling` and `normalize` are unused)

    @property
    def pooling_names(self) -> list[str]:
        """What its embeddings are pooled by, as GET /models shows it: the Pooling's modes, or ["splade"]."""
        return ["splade"] if self.splade is not None else list(self.pooling.modes)

    def embed(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int | None = None
    ) -> torch.Tensor:
        """(B, T, H) last hidden states -> (B, pooling.dimension(H)) sentence embeddings, normalised if
        the model normalises; `prompt_length` as `pool`'s."""
        pooled = pool(hidden, attention_mask, self.pooling, prompt_length)
        return F.normalize(pooled, p=2, dim=-1) if self.normalize else pooled

    def check_tokenizer(self, lowercase: bool) -> None:
        """Refuse do_lower_case with a cased tokenizer: sentence-transformers would lowercase the texts, and
        the tokenizer (what this project runs) does not."""
        if self.do_lower_case and not lowercase:
            raise ValueError(
                f"{SENTENCE_BERT_CONFIG} says do_lower_case true but the tokenizer is cased: sentence-transformers "
                "lowercases every text first, which this service does not (use an uncased tokenizer, or set "
                "do_lower_case false)"
            )


# -- pooling -------------------------------------------------------------------------------------


def pool(
    hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling, prompt_length: int | None = None
) -> torch.Tensor:
    """sentence-transformers' Pooling of (B, T, H) token vectors under a (B, T) attention mask (1: a token,
    0: padding, either side): (B, len(modes) * H). `prompt_length`, with include_prompt false: the first
    that many tokens after any left padding (the [CLS] token and the prompt's) are left out."""
    mask = attention_mask.to(torch.long)
    original = mask
    if prompt_length and not pooling.include_prompt:
        mask = _without_prompt(mask, prompt_length)
    accumulate = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    return torch.cat([_pool_one(mode, hidden, mask, original, accumulate) for mode in pooling.modes], dim=-1)


def _without_prompt(mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """The mask with each row's first `prompt_length` tokens (after its left padding) set to 0."""
    pad_lengths = mask.argmax(dim=1)  # (B,) leading zeros: 0 without left padding
    positions = torch.arange(mask.shape[1], device=mask.device)[None, :]  # (1, T)
    return mask.masked_fill(positions < (pad_lengths + prompt_length)[:, None], 0)


def _pool_one(
    mode: str, hidden: torch.Tensor, mask: torch.Tensor, original: torch.Tensor, accumulate: torch.dtype
) -> torch.Tensor:
    """One mode's (B, H) vectors (pooling.py's `_forward_padded`, branch by branch)."""
    B, T, H = hidden.shape
    if mode == "cls":  # the first token the mask keeps
        first = mask.argmax(dim=1)  # (B,)
        return hidden.gather(1, first[:, None, None].expand(-1, 1, H)).squeeze(1)
    if mode == "max":
        return hidden.masked_fill(mask[:, :, None] == 0, float("-inf")).max(dim=1).values
    if mode in ("mean", "mean_sqrt_len_tokens"):
        kept = mask[:, :, None].to(hidden.dtype)  # (B, T) -> (B, T, 1)
        total = (hidden * kept).sum(dim=1, dtype=accumulate)  # (B, H)
        count = kept.sum(dim=1, dtype=accumulate).clamp(min=1e-9)  # (B, 1)
        return (total / (count if mode == "mean" else count.sqrt())).to(hidden.dtype)
    if mode == "weightedmean":  # token i (from 1, counted from the first after left padding) weighs i
        weights = torch.arange(1, T + 1, device=hidden.device, dtype=accumulate)[None, :, None]  # (1, T, 1)
        weights = weights - original.argmax(dim=1)[:, None, None]  # (B, T, 1)
        weighted = mask[:, :, None].to(accumulate) * weights
        total = (hidden * weighted).sum(dim=1)
        return (total / weighted.sum(dim=1).clamp(min=1e-9)).to(hidden.dtype)
    assert mode == "lasttoken", mode
    found, from_end = mask.flip(1).max(dim=1)  # the last kept token, counted from the end
    from_end = torch.where(found == 0, T - 1, from_end)
    last = T - from_end - 1  # (B,)
    kept = hidden * mask[:, :, None].to(hidden.dtype)
    return kept.gather(1, last[:, None, None].expand(-1, 1, H)).squeeze(1)


# -- reading -------------------------------------------------------------------------------------


def read_sentence_modules(path: str | Path) -> SentenceModules:
    """A model directory's SentenceModules (SentenceModules() without modules.json). A ValueError names
    what is wrong: a module type this project cannot run, modules out of order, a missing or malformed
    file, a value of the wrong type."""
    path = Path(path)
    if not (path / MODULES_FILE).is_file():
        return SentenceModules()
    listed = _read_json(path, MODULES_FILE)
    if not isinstance(listed, list) or not all(
        isinstance(m, dict) and isinstance(m.get("type"), str) and isinstance(m.get("path", ""), str) for m in listed
    ):
        raise ValueError(f"{MODULES_FILE} must be a list of modules, each with a type and a path; got {listed!r}")
    kinds = [_runnable_kind(i, m["type"]) for i, m in enumerate(listed)]
    if kinds in ([TRANSFORMER, SPLADE_POOLING], [MLM_TRANSFORMER, SPLADE_POOLING]):
        return _read_sparse(path, *(_module_dir(m) for m in listed))
    if kinds not in ([TRANSFORMER, POOLING], [TRANSFORMER, POOLING, NORMALIZE]):
        raise ValueError(
            f"{MODULES_FILE} lists {', '.join(kinds) or 'no modules'}: this service runs {RUNNABLE}, in that order"
        )
    transformer_dir, pooling_dir = (_module_dir(m) for m in listed[:2])
    bert_config = _read_json(path, f"{transformer_dir}{SENTENCE_BERT_CONFIG}", missing={})
    if not isinstance(bert_config, dict):
        raise ValueError(f"{SENTENCE_BERT_CONFIG} must be a JSON object, got {bert_config!r}")
    return SentenceModules(
        pooling=_read_pooling(path, f"{pooling_dir}config.json"),
        normalize=len(kinds) == 3,
        max_seq_length=_max_seq_length(bert_config),
        do_lower_case=_boolean(bert_config, "do_lower_case", False, SENTENCE_BERT_CONFIG),
    )


def _runnable_kind(index: int, module_type: str) -> str:
    """Transformer, Pooling or Normalize for a sentence-transformers module of one of those classes
    (`sentence_transformers.models.Pooling`, or a newer module path to the same class); else a ValueError."""
    kind = module_type.rsplit(".", 1)[-1]
    if module_type.startswith("sentence_transformers.") and kind in (
        TRANSFORMER,
        POOLING,
        NORMALIZE,
        MLM_TRANSFORMER,
        SPLADE_POOLING,
    ):
        return kind
    raise ValueError(
        f"{MODULES_FILE}: module {index} is {module_type}, which this service cannot run "
        f"(it runs {RUNNABLE}); its embeddings would differ from sentence-transformers'"
    )


def _read_sparse(path: Path, transformer_dir: str, pooling_dir: str) -> SentenceModules:
    """A sparse encoder's modules: its SpladePooling's config, and its transformer's window and case (a
    Transformer's `transformer_task` must be fill-mask: its output is then the MLM logits)."""
    bert_config = _read_json(path, f"{transformer_dir}{SENTENCE_BERT_CONFIG}", missing={})
    if not isinstance(bert_config, dict):
        raise ValueError(f"{SENTENCE_BERT_CONFIG} must be a JSON object, got {bert_config!r}")
    task = bert_config.get("transformer_task", "fill-mask")
    if task != "fill-mask":
        raise ValueError(f"{SENTENCE_BERT_CONFIG}: a SpladePooling needs transformer_task fill-mask, got {task!r}")
    name = f"{pooling_dir}config.json"
    config = _read_json(path, name, missing={})
    if not isinstance(config, dict):
        raise ValueError(f"{name} must be a JSON object, got {config!r}")
    try:
        splade = Splade(config.get("pooling_strategy", "max"), config.get("activation_function", "relu"))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return SentenceModules(
        normalize=False,
        max_seq_length=_max_seq_length(bert_config),
        do_lower_case=_boolean(bert_config, "do_lower_case", False, SENTENCE_BERT_CONFIG),
        splade=splade,
    )


def _module_dir(module: dict) -> str:
    """A module's folder as a prefix of its files' names ("" for the model's own folder); never outside it."""
    folder = PurePosixPath(module.get("path", ""))
    if folder.is_absolute() or ".." in folder.parts or "\\" in str(folder):
        raise ValueError(f"{MODULES_FILE}: module path {module['path']!r} is outside the model directory")
    return "" if str(folder) in ("", ".") else f"{folder}/"


def _read_pooling(root: Path, name: str) -> Pooling:
    """A Pooling module's config.json, in either of sentence-transformers' forms: one pooling_mode_* flag
    per mode (none set: mean), or (since 6.0) `pooling_mode`, a mode or a list of them, which wins."""
    config = _read_json(root, name)
    if not isinstance(config, dict):
        raise ValueError(f"{name} must be a JSON object, got {config!r}")
    include_prompt = _boolean(config, "include_prompt", True, name)
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        if not (isinstance(modes, str) or (isinstance(modes, list) and all(isinstance(m, str) for m in modes))):
            raise ValueError(f"{name}: pooling_mode must be a mode or a list of modes, got {modes!r}")
    else:
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if _boolean(config, key, False, name)] or ["mean"]
    try:
        return Pooling((modes,) if isinstance(modes, str) else tuple(modes), include_prompt)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _max_seq_length(config: dict) -> int | None:
    value = config.get("max_seq_length")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{SENTENCE_BERT_CONFIG}: max_seq_length must be a positive integer or null, got {value!r}")
    return value


def _boolean(config: dict, key: str, default: bool, name: str) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name}: {key} must be true or false, got {value!r}")
    return value


def _read_json(root: Path, name: str, missing: Any = None) -> Any:
    """The JSON in `root`/`name` (`name` in errors); `missing` when there is no such file, or a
    ValueError when `missing` is None."""
    file = root / name
    if not file.is_file():
        if missing is None:
            raise ValueError(f"{MODULES_FILE} names {name}, which is missing")
        return missing
    if (size := file.stat().st_size) > MAX_FILE_BYTES:
        raise ValueError(f"{name} is {size:,} bytes, more than the {MAX_FILE_BYTES:,} it may be")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None


# -- writing -------------------------------------------------------------------------------------


def write_sentence_modules(path: str | Path, modules: SentenceModules) -> None:
    """Write `modules` into the model directory `path` (its config.json gives the hidden size):
    modules.json, 1_Pooling/config.json, 2_Normalize/ when normalising, sentence_bert_config.json and
    config_sentence_transformers.json, whose prompts (and anything else in it) are kept. The module
    types are `sentence_transformers.models.*`, the names every sentence-transformers version and
    text-embeddings-inference read; the pooling modes are its pooling_mode_* flags when they are in
    the order those flags concatenate, else (sentence-transformers 6.0's form) a `pooling_mode` list."""
    path = Path(path)
    if modules.splade is not None:
        return _write_sparse(path, modules)
    hidden_size = BertConfig.from_json_file(path / "config.json").hidden_size
    listed = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": POOLING_DIR, "type": "sentence_transformers.models.Pooling"},
    ]
    if modules.normalize:
        listed.append({"idx": 2, "name": "2", "path": NORMALIZE_DIR, "type": "sentence_transformers.models.Normalize"})
        (path / NORMALIZE_DIR).mkdir(exist_ok=True)
    (path / POOLING_DIR).mkdir(exist_ok=True)
    _write_json(path / POOLING_DIR / "config.json", pooling_config(modules.pooling, hidden_size))
    _write_json(
        path / SENTENCE_BERT_CONFIG, {"max_seq_length": modules.max_seq_length, "do_lower_case": modules.do_lower_case}
    )
    kept = _read_json(path, SENTENCE_TRANSFORMERS_CONFIG, missing={})
    if not isinstance(kept, dict):
        raise ValueError(f"{SENTENCE_TRANSFORMERS_CONFIG} must be a JSON object, got {kept!r}")
    _write_json(path / SENTENCE_TRANSFORMERS_CONFIG, {"prompts": {}, "default_prompt_name": None, **kept})
    _write_json(path / MODULES_FILE, listed)  # last: a directory with modules.json has every file it names


def _write_sparse(path: Path, modules: SentenceModules) -> None:
    """A sparse encoder's files, with sentence-transformers 5's module names (6.x reads them too)."""
    assert modules.splade is not None
    vocab_size = BertConfig.from_json_file(path / "config.json").vocab_size
    listed = [
        {"idx": 0, "name": "0", "path": "", "type": f"sentence_transformers.sparse_encoder.models.{MLM_TRANSFORMER}"},
        {
            "idx": 1,
            "name": "1",
            "path": SPLADE_DIR,
            "type": f"sentence_transformers.sparse_encoder.models.{SPLADE_POOLING}",
        },
    ]
    (path / SPLADE_DIR).mkdir(exist_ok=True)
    splade = {
        "pooling_strategy": modules.splade.strategy,
        "activation_function": modules.splade.activation,
        "embedding_dimension": vocab_size,
    }
    _write_json(path / SPLADE_DIR / "config.json", splade)
    _write_json(
        path / SENTENCE_BERT_CONFIG, {"max_seq_length": modules.max_seq_length, "do_lower_case": modules.do_lower_case}
    )
    kept = _read_json(path, SENTENCE_TRANSFORMERS_CONFIG, missing={})
    if not isinstance(kept, dict):
        raise ValueError(f"{SENTENCE_TRANSFORMERS_CONFIG} must be a JSON object, got {kept!r}")
    sparse = {"prompts": {}, "default_prompt_name": None, **kept, "model_type": "SparseEncoder"}
    _write_json(path / SENTENCE_TRANSFORMERS_CONFIG, sparse)
    _write_json(path / MODULES_FILE, listed)


def pooling_config(pooling: Pooling, hidden_size: int) -> dict:
    """1_Pooling/config.json for `pooling` over token vectors of `hidden_size`."""
    canonical = tuple(mode for mode in POOLING_MODES if mode in pooling.modes)
    if pooling.modes != canonical:  # an order (or a repeat) the flags cannot say
        return {
            "embedding_dimension": hidden_size,
            "pooling_mode": list(pooling.modes),
            "include_prompt": pooling.include_prompt,
        }
    flags = {key: mode in pooling.modes for key, mode in LEGACY_POOLING_KEYS.items()}
    return {"word_embedding_dimension": hidden_size, **flags, "include_prompt": pooling.include_prompt}


def _write_json(file: Path, value: Any) -> None:
    atomic_write_bytes(file, (json.dumps(value, indent=2) + "\n").encode())
