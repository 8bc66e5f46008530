"""Late interaction (ColBERT): a BERT's token vectors projected to a small dimension and scored by MaxSim,
as PyLate runs and trains them, read from either of the two layouts such checkpoints come in.

    PyLate's   sentence-transformers modules: modules.json lists a Transformer and a `pylate.models.Dense`
               (1_Dense/config.json: in_features, out_features, bias, an Identity activation;
               1_Dense/model.safetensors: linear.weight (dim, hidden)); config_sentence_transformers.json
               holds query_prefix "[Q] ", document_prefix "[D] ", query_length, document_length,
               attend_to_expansion_tokens, skiplist_words and do_query_expansion.
    colbert-ir's   a BertModel checkpoint (config.json's architectures: HF_ColBERT) whose weights also hold
               `linear.weight` (dim, hidden, no bias), with artifact.metadata: query_token_id "[unused0]",
               doc_token_id "[unused1]", query_maxlen, doc_maxlen, attend_to_mask_tokens.

`read_late_interaction(path)` reads either into a `LateInteraction` (None for a directory that is neither);
`write_late_interaction(path, li)` writes PyLate's layout beside a model's config and weights, so that
`pylate.models.ColBERT(path)` loads it (an import of either layout is stored so).

What a text becomes (pylate/models/colbert.py, ColBERT.tokenize and encode):
- a query: its tokens truncated to query_length - 1 ([CLS] and [SEP] included) and, with query expansion,
  padded with [MASK] up to that length; the query marker's id inserted after [CLS]. The [MASK] tokens are
  left out of the attention (attend_to_expansion_tokens false) but keep their vectors: every one of the
  query_length vectors is the query's. Without expansion, its tokens only.
- a document: the same with document_length and the document marker, no padding; its vectors are those
  of the tokens not in the skiplist (its words' ids: string.punctuation by default).
- each vector: the encoder's last hidden state through the projection, scaled to unit L2 norm.
MaxSim of a query and a document: the sum over the query's vectors of the largest dot product with any of
the document's (pylate/scores/colbert.py colbert_scores). The losses are pylate/losses/contrastive.py's
(in-batch and hard negatives, cross entropy over the scores / temperature) and distillation.py's
(KL divergence from a teacher's scores, both log-softmaxed, the student's min-max normalised first).
Reference: Khattab & Zaharia 2020 (ColBERT); https://github.com/lightonai/pylate
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from datadir.files import atomic_write_bytes

DENSE_DIR = "1_Dense"
DENSE_TYPE = "pylate.models.Dense.Dense"
TRANSFORMER_TYPE = "sentence_transformers.models.Transformer"
MODULES_FILE = "modules.json"
SENTENCE_TRANSFORMERS_CONFIG = "config_sentence_transformers.json"
COLBERT_METADATA = "artifact.metadata"  # colbert-ir's ColBERTConfig, as JSON
COLBERT_ARCHITECTURE = "HF_ColBERT"
LINEAR_KEY = "linear.weight"  # colbert-ir's projection inside the BERT's own weights
IDENTITY = "torch.nn.modules.linear.Identity"
MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class ColBERTSettings:
    """How texts become token vectors: PyLate's ColBERT options, with its defaults."""

    query_prefix: str = "[Q] "  # a token of the vocabulary, inserted after [CLS] ("": none)
    document_prefix: str = "[D] "
    query_length: int = 32  # tokens a query becomes, its marker included
    document_length: int = 180  # tokens a document may have, its marker included
    attend_to_expansion_tokens: bool = False  # whether the query's [MASK] padding is attended to
    skiplist_words: tuple[str, ...] = tuple(string.punctuation)  # document tokens whose vectors are dropped
    do_query_expansion: bool = True  # pad queries with [MASK] to query_length

    def __post_init__(self) -> None:
        object.__setattr__(self, "skiplist_words", tuple(self.skiplist_words))
        for name in ("query_length", "document_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 3:
                raise ValueError(f"{name} must be an integer of at least 3, got {value!r}")
        if not self.do_query_expansion:  # as PyLate: nothing to attend to
            object.__setattr__(self, "attend_to_expansion_tokens", False)

    def to_config(self) -> dict[str, Any]:
        """config_sentence_transformers.json's ColBERT keys, as PyLate's ColBERT.save writes them."""
        return {
            "query_prefix": self.query_prefix,
            "document_prefix": self.document_prefix,
            "query_length": self.query_length,
            "document_length": self.document_length,
            "attend_to_expansion_tokens": self.attend_to_expansion_tokens,
            "skiplist_words": list(self.skiplist_words),
            "do_query_expansion": self.do_query_expansion,
        }


@dataclass
class LateInteraction:
    """A ColBERT model's settings and its projection (token vector -> `dim`)."""

    settings: ColBERTSettings
    weight: torch.Tensor  # (dim, hidden)
    bias: torch.Tensor | None = None  # (dim,)
    layout: str = "pylate"  # where it was read from: "pylate" or "colbert-ir"
    _ids: dict = field(default_factory=dict, repr=False)

    @property
    def dim(self) -> int:
        return self.weight.shape[0]

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., dim), unit length: the Dense, then Normalize (in float32)."""
        weight = self.weight.to(hidden.device, torch.float32)
        bias = None if self.bias is None else self.bias.to(hidden.device, torch.float32)
        return F.normalize(F.linear(hidden.float(), weight, bias), p=2, dim=-1)

    def token_ids(self, tokenizer) -> dict[str, Any]:
        """The ids a tokenizer gives the markers, [MASK] and the skiplist (PyLate's convert_tokens_to_ids:
        a word outside the vocabulary is [UNK]'s id, so [UNK] is skipped then, as there)."""
        key = id(tokenizer)
        if key not in self._ids:
            s = self.settings
            ids = {
                "query": tokenizer.convert_tokens_to_ids(s.query_prefix) if s.query_prefix else None,
                "document": tokenizer.convert_tokens_to_ids(s.document_prefix) if s.document_prefix else None,
                "mask": tokenizer.mask_token_id,
                "skip": sorted({tokenizer.convert_tokens_to_ids(w) for w in s.skiplist_words}),
            }
            for which, prefix in (("query", s.query_prefix), ("document", s.document_prefix)):
                if prefix and ids[which] == tokenizer.unk_token_id and prefix != tokenizer.unk_token:
                    raise ValueError(f"the {which} marker {prefix!r} is not a token of the model's vocabulary")
            self._ids = {key: ids}
        return self._ids[key]

    # -- texts to rows ---------------------------------------------------------------------------

    def encode(self, tokenizer, text: str, is_query: bool) -> tuple[list[int], int]:
        """One text's input ids as PyLate tokenizes it, and how many of them are attended to (the rest are
        the query's [MASK] expansion)."""
        s, known = self.settings, self.token_ids(tokenizer)
        room = (s.query_length if is_query else s.document_length) - (
            known["query" if is_query else "document"] is not None
        )
        return self.row(tokenizer, tokenizer.encode(text, max_length=room, truncation=True)["input_ids"], is_query)

    def row(self, tokenizer, ids: list[int], is_query: bool) -> tuple[list[int], int]:
        """`encode` of a text tokenized already ([CLS] text [SEP], cut anywhere past the row's length): cut
        to query_length or document_length less the marker, [SEP] kept, as the tokenizer's truncation cuts."""
        s, known = self.settings, self.token_ids(tokenizer)
        prefix = known["query" if is_query else "document"]
        room = (s.query_length if is_query else s.document_length) - (prefix is not None)
        row = list(ids) if len(ids) <= room else [*ids[: room - 1], ids[-1]]
        attended = len(row) + (prefix is not None)
        if is_query and s.do_query_expansion:
            row = row + [known["mask"]] * (room - len(row))
        if prefix is not None:
            row = row[:1] + [prefix] + row[1:]
        if is_query and s.attend_to_expansion_tokens:
            attended = len(row)
        return row, attended

    def kept(self, tokenizer, input_ids: torch.Tensor, attention_mask: torch.Tensor, is_query: bool) -> torch.Tensor:
        """(B, T) bool: the vectors a text keeps. A query with expansion: all of them; a query without: the
        attended ones; a document: the attended tokens not in the skiplist."""
        if is_query:
            if self.settings.do_query_expansion:
                return torch.ones_like(input_ids, dtype=torch.bool)
            return attention_mask.bool()
        skip = torch.tensor(self.token_ids(tokenizer)["skip"], dtype=input_ids.dtype, device=input_ids.device)
        return attention_mask.bool() & ~torch.isin(input_ids, skip)


# -- the forward pass ------------------------------------------------------------------------------


def token_vectors(
    bert, li: LateInteraction, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids=None
) -> torch.Tensor:
    """(B, T) rows -> (B, T, dim) unit vectors. The encoder runs padded (never packed): a query's expansion
    tokens are masked out of the attention yet need their own outputs, which a packed pass leaves at zero."""
    from model.modeling import attention_mask_for

    mask = attention_mask_for(attention_mask, input_ids)
    x = bert.embeddings(input_ids, token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids))
    hidden = bert.encoder(x, None if mask is None else mask.to(x.device))
    return li.project(hidden)


# -- MaxSim ----------------------------------------------------------------------------------------


def maxsim(query: torch.Tensor, document: torch.Tensor) -> torch.Tensor:
    """(S, dim) query vectors, (..., T, dim) documents -> (...) scores: per query vector, its best dot product
    with a document vector, summed."""
    return torch.einsum("sh,...th->...st", query, document).max(dim=-1).values.sum(dim=-1)


def colbert_scores(
    queries: torch.Tensor, documents: torch.Tensor, queries_mask=None, documents_mask=None
) -> torch.Tensor:
    """(A, S, H) queries x (B, T, H) documents -> (A, B), as pylate.scores.colbert_scores: masked similarities
    are zeros (multiplied), so a padded document's masked positions count as a 0 in the max."""
    scores = torch.einsum("ash,bth->abst", queries, documents)
    if queries_mask is not None:
        scores = scores * queries_mask[:, None, :, None]
    if documents_mask is not None:
        scores = scores * documents_mask[None, :, None, :]
    return scores.max(dim=-1).values.sum(dim=-1)


def grouped_scores(queries: torch.Tensor, documents: torch.Tensor, queries_mask, documents_mask) -> torch.Tensor:
    """(B, S, H) queries x (B, N, T, H) documents -> (B, B * N), column j * N + k: query i against row j's
    k-th document (its positive first), as pylate.scores.ColBERTScores."""
    B, N = documents.shape[:2]
    per = [colbert_scores(queries, documents[:, k], queries_mask, documents_mask[:, k]) for k in range(N)]
    return torch.stack(per, dim=2).reshape(-1, B * N)  # (B, B, N) -> (B, B * N)


def own_scores(queries: torch.Tensor, documents: torch.Tensor, queries_mask, documents_mask) -> torch.Tensor:
    """(B, S, H) queries x (B, N, T, H) each query's own documents -> (B, N), as pylate.scores.colbert_kd_scores."""
    scores = torch.einsum("ash,abth->abst", queries, documents)
    if queries_mask is not None:
        scores = scores * queries_mask[:, None, :, None]
    scores = scores * documents_mask[:, :, None, :]
    return scores.max(dim=-1).values.sum(dim=-1)


# -- losses ----------------------------------------------------------------------------------------


def contrastive_loss(
    queries: torch.Tensor,
    documents: torch.Tensor,
    queries_mask: torch.Tensor | None,
    documents_mask: torch.Tensor,
    temperature: float = 1.0,
    size_average: bool = True,
) -> torch.Tensor:
    """pylate.losses.Contrastive: (B, S, H) queries, (B, N, T, H) documents (each row's positive, then its hard
    negatives), masks None (queries with expansion) or (B, S), and (B, N, T): cross entropy of each query's
    scores against every document of the batch / temperature, its positive (column i * N) the target."""
    scores = grouped_scores(queries, documents, queries_mask, documents_mask)
    labels = torch.arange(queries.shape[0], device=queries.device) * documents.shape[1]
    return F.cross_entropy(scores / temperature, labels, reduction="mean" if size_average else "sum")


def distillation_loss(
    queries: torch.Tensor,
    documents: torch.Tensor,
    queries_mask: torch.Tensor | None,
    documents_mask: torch.Tensor,
    teacher_scores: torch.Tensor,
    normalize_scores: bool = True,
    size_average: bool = True,
) -> torch.Tensor:
    """pylate.losses.Distillation: KL(teacher || student) over each query's own (B, N) documents, the student's
    MaxSim scores min-max normalised per query (normalize_scores), both through log-softmax; batchmean."""
    scores = own_scores(queries, documents, queries_mask, documents_mask)
    if normalize_scores:
        top, bottom = scores.max(dim=1, keepdim=True).values, scores.min(dim=1, keepdim=True).values
        scores = (scores - bottom) / (top - bottom + 1e-8)
    return F.kl_div(
        F.log_softmax(scores, dim=-1),
        F.log_softmax(teacher_scores.to(scores.dtype), dim=-1),
        reduction="batchmean" if size_average else "sum",
        log_target=True,
    )


# -- reading ---------------------------------------------------------------------------------------


def late_interaction_layout(path: str | Path) -> str | None:
    """ "pylate", "colbert-ir" or None, from the directory's small files and weight names (no tensors)."""
    path = Path(path)
    listed = _read_json(path / MODULES_FILE, None)
    if isinstance(listed, list) and any(isinstance(m, dict) and _is_dense(m.get("type")) for m in listed):
        return "pylate"
    config = _read_json(path / "config.json", {})
    if COLBERT_ARCHITECTURE in ((config.get("architectures") if isinstance(config, dict) else None) or ()):
        return "colbert-ir"
    if (path / COLBERT_METADATA).is_file():
        return "colbert-ir"
    return None


def _is_dense(module_type: Any) -> bool:
    return isinstance(module_type, str) and module_type.startswith("pylate.") and module_type.endswith("Dense")


def read_late_interaction(path: str | Path, state: dict[str, torch.Tensor] | None = None) -> LateInteraction | None:
    """The directory's LateInteraction, or None when it is not a ColBERT model. `state`: its weights, read
    already (colbert-ir keeps the projection among them). A ValueError names what is wrong."""
    path = Path(path)
    layout = late_interaction_layout(path)
    if layout == "pylate":
        return _read_pylate(path)
    if layout == "colbert-ir":
        return _read_colbert_ir(path, state)
    return None


def _read_pylate(path: Path) -> LateInteraction:
    listed = _read_json(path / MODULES_FILE, None)
    types = [m.get("type", "") for m in listed]
    if len(listed) != 2 or not types[0].endswith("Transformer") or not _is_dense(types[1]):
        raise ValueError(
            f"{MODULES_FILE} lists {', '.join(types)}: this service runs a PyLate model of a Transformer and one "
            "Dense, in that order"
        )
    folder = str(listed[1].get("path") or DENSE_DIR)
    if Path(folder).is_absolute() or ".." in Path(folder).parts:
        raise ValueError(f"{MODULES_FILE}: module path {folder!r} is outside the model directory")
    config = _read_json(path / folder / "config.json", None)
    if not isinstance(config, dict):
        raise ValueError(f"{folder}/config.json is missing or not a JSON object")
    if config.get("activation_function", IDENTITY) != IDENTITY or config.get("use_residual"):
        raise ValueError(
            f"{folder}/config.json: this service runs a Dense without activation or residual, got "
            f"activation {config.get('activation_function')!r}, use_residual {config.get('use_residual')!r}"
        )
    from model.weights import load_state_dict

    dense = load_state_dict(path / folder)
    weight, bias = dense.get("linear.weight"), dense.get("linear.bias")
    expected = (config.get("out_features"), config.get("in_features"))
    if weight is None or tuple(weight.shape) != expected or (bias is not None and tuple(bias.shape) != expected[:1]):
        raise ValueError(f"{folder}: linear.weight must have the shape {list(expected)} its config.json gives")
    st = _read_json(path / SENTENCE_TRANSFORMERS_CONFIG, {})
    if not isinstance(st, dict):
        raise ValueError(f"{SENTENCE_TRANSFORMERS_CONFIG} must be a JSON object")
    return LateInteraction(_settings(st, SENTENCE_TRANSFORMERS_CONFIG), weight.float(), _float(bias), "pylate")


def _read_colbert_ir(path: Path, state: dict[str, torch.Tensor] | None) -> LateInteraction:
    from model.weights import load_state_dict

    state = state if state is not None else load_state_dict(path)
    weight = state.get(LINEAR_KEY, state.get("bert." + LINEAR_KEY))
    if weight is None or weight.dim() != 2:
        raise ValueError(
            f"a colbert-ir checkpoint keeps its projection as {LINEAR_KEY} (dim, hidden); this one has none"
        )
    meta = _read_json(path / COLBERT_METADATA, {})
    if not isinstance(meta, dict):
        raise ValueError(f"{COLBERT_METADATA} must be a JSON object")
    if meta.get("dim") not in (None, weight.shape[0]):
        raise ValueError(f"{COLBERT_METADATA} says dim {meta['dim']} but {LINEAR_KEY} projects to {weight.shape[0]}")
    values = {  # as PyLate reads artifact.metadata (ColBERT.__init__), with its defaults besides
        "query_prefix": meta.get("query_token_id") or "[unused0]",
        "document_prefix": meta.get("doc_token_id") or "[unused1]",
        "query_length": meta.get("query_maxlen"),
        "document_length": meta.get("doc_maxlen"),
        "attend_to_expansion_tokens": meta.get("attend_to_mask_tokens"),
    }
    return LateInteraction(_settings(values, COLBERT_METADATA), weight.float(), None, "colbert-ir")


def _settings(values: dict, name: str) -> ColBERTSettings:
    """ColBERTSettings from a config's keys (a missing or null one: PyLate's default)."""
    given = {k: values[k] for k in ColBERTSettings.__dataclass_fields__ if values.get(k) is not None}
    for key in ("query_prefix", "document_prefix"):
        if key in given and not isinstance(given[key], str):
            raise ValueError(f"{name}: {key} must be a string, got {given[key]!r}")
    for key in ("attend_to_expansion_tokens", "do_query_expansion"):
        if key in given and not isinstance(given[key], bool):
            raise ValueError(f"{name}: {key} must be true or false, got {given[key]!r}")
    words = given.get("skiplist_words", ())
    if not isinstance(words, list | tuple) or not all(isinstance(w, str) for w in words):
        raise ValueError(f"{name}: skiplist_words must be a list of strings")
    try:
        return ColBERTSettings(**given)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _read_json(file: Path, missing: Any) -> Any:
    if not file.is_file():
        return missing
    if file.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{file.name} is larger than the {MAX_FILE_BYTES:,} bytes it may be")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file.name} is not valid JSON: {e}") from None


# -- writing ---------------------------------------------------------------------------------------


def write_late_interaction(path: str | Path, li: LateInteraction, max_seq_length: int | None = None) -> None:
    """PyLate's files into the model directory `path` (beside config.json and the encoder's weights):
    modules.json, sentence_bert_config.json, 1_Dense/ (config and weights), config_sentence_transformers.json
    (its prompts and other keys kept, the ColBERT ones replaced)."""
    from safetensors.torch import save_file

    path = Path(path)
    dense = path / DENSE_DIR
    dense.mkdir(exist_ok=True)
    tensors = {"linear.weight": li.weight.detach().float().cpu().contiguous()}
    if li.bias is not None:
        tensors["linear.bias"] = li.bias.detach().float().cpu().contiguous()
    save_file(tensors, dense / "model.safetensors", metadata={"format": "pt"})
    _write_json(
        dense / "config.json",
        {
            "in_features": li.weight.shape[1],
            "out_features": li.dim,
            "bias": li.bias is not None,
            "activation_function": IDENTITY,
            "use_residual": False,
        },
    )
    _write_json(
        path / "sentence_bert_config.json",
        {"max_seq_length": max_seq_length or li.settings.document_length - 1, "do_lower_case": False},
    )
    kept = _read_json(path / SENTENCE_TRANSFORMERS_CONFIG, {})
    kept = kept if isinstance(kept, dict) else {}
    config = {
        "prompts": {},
        "default_prompt_name": None,
        **kept,
        "similarity_fn_name": "MaxSim",
        **li.settings.to_config(),
    }
    _write_json(path / SENTENCE_TRANSFORMERS_CONFIG, config)
    listed = [
        {"idx": 0, "name": "0", "path": "", "type": TRANSFORMER_TYPE},
        {"idx": 1, "name": "1", "path": DENSE_DIR, "type": DENSE_TYPE},
    ]
    _write_json(path / MODULES_FILE, listed)  # last: a directory with modules.json has every file it names


def with_settings(li: LateInteraction, **changes) -> LateInteraction:
    """A copy of `li` with some settings changed."""
    return LateInteraction(replace(li.settings, **changes), li.weight, li.bias, li.layout)


def _write_json(file: Path, value: Any) -> None:
    atomic_write_bytes(file, (json.dumps(value, indent=2) + "\n").encode())
