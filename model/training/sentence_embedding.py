"""Sentence-embedding training, as sentence-transformers 6.x trains a SentenceTransformer: the encoder pooled
by the model's own sentence-transformers modules, a retrieval loss over columns of texts, and evaluation
by retrieval or by similarity.

    model = SentenceEmbeddingModel.from_pretrained("models/minilm", loss=EmbeddingLoss("mnrl"))
    out = model(**batch)             # batch: model/data/pair_batches.py's (B, C, T) columns; out.loss
    model.save_pretrained(path, tokenizer)   # a BertModel directory with its sentence-transformers files
    metrics = RetrievalEvaluation(retrieval_set, tokenizer, max_seq_len=128).evaluate_model(model, ...)

SentenceEmbeddingModel is a BertModel (the same parameter names, so its state dict is the directory's) whose
`embed(features)` is the encoder then model.sentence_modules' pooling and Normalize, exactly what the service
serves on /embeddings; `forward` splits a batch into its columns and returns the loss the options choose
(model/training/losses.py): in-batch negatives (MultipleNegativesRankingLoss, or by GradCache with `cached`)
on pairs, CoSENT on scored pairs, either wrapped in MatryoshkaLoss with `matryoshka_dims`. It saves as a
BertModel directory (architectures ["BertModel"], no head) plus the sentence-transformers files of the model it
started from (pooling, Normalize, max_seq_length, prompts), so every checkpoint and the final model load in
sentence-transformers and serve as they are.

The evaluations are sentence-transformers' evaluators on the embeddings `embed` gives (retrieval_eval.py):
InformationRetrievalEvaluator's cosine_ndcg@10, cosine_mrr@10, cosine_recall@1/10/100 and cosine_map@100 over
a retrieval set (held-out pairs become one: model/data/pair_batches.py's retrieval_set), and
EmbeddingSimilarityEvaluator's pearson_cosine and spearman_cosine over scored pairs. They are EvaluationSets
(model/training/trainer.py), so model.training.evaluation.evaluate and the trainer's baseline run them.

References: sentence-transformers 6.x, sentence_transformer/losses/ (MultipleNegativesRankingLoss,
CachedMultipleNegativesRankingLoss, CoSENTLoss, MatryoshkaLoss), sentence_transformer/evaluation/;
Reimers & Gurevych 2019, "Sentence-BERT".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.compute.precision import autocast
from model.data.pair_batches import PAIRS, SCORED_PAIRS, retrieval_set
from model.data.pairs import Pair, ScoredPair
from model.data.retrieval_data import RetrievalSet
from model.modeling import BertModel
from model.sentence_modules import (
    SENTENCE_TRANSFORMERS_CONFIG,
    SentenceModules,
    read_sentence_modules,
    write_sentence_modules,
)
from model.training.losses import (
    CachedMultipleNegativesRankingLoss,
    CoSENTLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
    check_ranking_options,
)
from model.training.retrieval_eval import embed, evaluate_retrieval, similarity_correlation
from model.training.trainer import EvaluationStopped

LOSSES = {"mnrl": PAIRS, "cosent": SCORED_PAIRS}  # a loss -> the data it trains on
DATA_COLUMNS = {PAIRS: "anchor, positive, negatives", SCORED_PAIRS: "sentence1, sentence2, score"}
RANKING_OPTIONS = ("directions", "partition_mode", "cached", "mini_batch_size")  # in-batch negatives' own
RETRIEVAL_METRICS = (
    "cosine_ndcg@10",
    "cosine_mrr@10",
    "cosine_recall@1",
    "cosine_recall@10",
    "cosine_recall@100",
    "cosine_map@100",
)
BEST_METRIC = {PAIRS: "cosine_ndcg@10", SCORED_PAIRS: "spearman_cosine"}  # what picks the best checkpoint


# ---------------------------------------------------------------------------- options


@dataclass(frozen=True)
class EmbeddingLoss:
    """The loss options (model/options.py declares their defaults and bounds: sentence-transformers')."""

    loss: str  # "mnrl" (pairs) or "cosent" (scored pairs)
    scale: float = 20.0
    directions: tuple[str, ...] = ("query_to_doc",)
    partition_mode: str = "joint"
    cached: bool = False
    mini_batch_size: int = 32
    matryoshka_dims: tuple[int, ...] | None = None

    def build(self, embed: Callable[[dict[str, Tensor]], Tensor]):
        """The loss over columns, `loss(features, scores)`, with `embed` as its embedding function."""
        inner: MultipleNegativesRankingLoss | CachedMultipleNegativesRankingLoss | CoSENTLoss
        if self.loss == "cosent":
            inner = CoSENTLoss(embed, scale=self.scale)
        elif self.cached:
            inner = CachedMultipleNegativesRankingLoss(
                embed, self.scale, self.mini_batch_size, self.directions, self.partition_mode
            )
        else:
            inner = MultipleNegativesRankingLoss(embed, self.scale, self.directions, self.partition_mode)
        return MatryoshkaLoss(inner, list(self.matryoshka_dims)) if self.matryoshka_dims else inner


def loss_for(loss: str | None, kind: str, data: str = "the data") -> str:
    """The loss that trains on `kind` data (PAIRS or SCORED_PAIRS): `loss`, or the data's own when unset; a
    ValueError for a loss that takes other data."""
    if loss is None:
        return next(name for name, wanted in LOSSES.items() if wanted == kind)
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {tuple(LOSSES)}, got {loss!r}")
    if LOSSES[loss] != kind:
        right = loss_for(None, kind)
        raise ValueError(
            f"loss {loss} trains on {LOSSES[loss]} ({DATA_COLUMNS[LOSSES[loss]]}), but {data} is {kind} "
            f"({DATA_COLUMNS[kind]}): give loss {right}, or leave it unset"
        )
    return loss


def check_embedding_options(values: dict[str, Any], defaults: dict[str, Any], dimension: int | None = None) -> None:
    """A ValueError for options that do not go together: `values` the options as given (`loss` resolved, or None
    when not known yet), `defaults` theirs; `dimension` the model's embedding size, when known."""
    check_matryoshka_dims(values.get("matryoshka_dims"), dimension)
    changed = [n for n in RANKING_OPTIONS if n in values and _plain(values[n]) != _plain(defaults[n])]
    if values.get("loss") == "cosent" and changed:
        raise ValueError(f"{changed[0]} is for loss mnrl (in-batch negatives), not cosent")
    if "mini_batch_size" in changed and not values.get("cached"):
        raise ValueError("mini_batch_size is for cached: true (GradCache's mini-batches)")
    if values.get("loss") != "cosent" and "directions" in values and "partition_mode" in values:
        check_ranking_options(values.get("scale", 20.0), values["directions"], values["partition_mode"], None, 0.0)


def check_matryoshka_dims(dims: Sequence[int] | None, dimension: int | None = None) -> None:
    """A ValueError unless `dims` descend without repeats and (`dimension` given) fit the embeddings."""
    if not dims:
        return
    if list(dims) != sorted(set(dims), reverse=True):
        raise ValueError(f"matryoshka_dims must descend without repeats (largest first), got {list(dims)}")
    if dimension is not None and dims[0] > dimension:
        raise ValueError(f"matryoshka_dims {dims[0]} exceeds the model's {dimension}-dimensional embeddings")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# ---------------------------------------------------------------------------- the model


@dataclass
class EmbeddingOutput:
    loss: Tensor


class SentenceEmbeddingModel(BertModel):
    """A BertModel trained as a sentence-embedding model; see the module docstring. `sentence_modules` pool
    and normalise (read from the directory it loads), `loss` is set by `use_loss`."""

    def __init__(self, config, add_pooling_layer: bool = True):
        super().__init__(config, add_pooling_layer)
        self.sentence_modules = SentenceModules()
        self.prompts_file: bytes | None = None  # the start model's config_sentence_transformers.json, kept
        self.loss: Callable[..., Tensor] | None = None

    @property
    def architecture(self) -> str:
        return "BertModel"  # what it is on disk: sentence-transformers and this service load the encoder

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", init_missing_heads: bool = False, **overrides
    ):
        """The encoder of any model directory (its heads are left out; none is added), its sentence-transformers
        modules, and `loss=EmbeddingLoss(...)` when given."""
        loss: EmbeddingLoss | None = overrides.pop("loss", None)
        model = super().from_pretrained(path, device, False, **overrides)
        model.sentence_modules = read_sentence_modules(path)
        prompts = Path(path) / SENTENCE_TRANSFORMERS_CONFIG
        model.prompts_file = prompts.read_bytes() if prompts.is_file() else None
        if loss is not None:
            model.use_loss(loss)
        return model

    @property
    def dimension(self) -> int:
        """The size of its sentence embeddings."""
        return self.sentence_modules.pooling.dimension(self.config.hidden_size)

    def use_loss(self, options: EmbeddingLoss) -> None:
        check_matryoshka_dims(options.matryoshka_dims, self.dimension)
        self.loss = options.build(self.embed)

    def embed(self, features: dict[str, Tensor]) -> Tensor:
        """(B, T) input_ids, attention_mask (on any device), token_type_ids -> (B, D) sentence embeddings."""
        mask = features["attention_mask"]
        hidden = super().forward(features["input_ids"], mask, features.get("token_type_ids")).last_hidden_state
        return self.sentence_modules.embed(hidden, mask.to(hidden.device, non_blocking=True))

    def forward(  # type: ignore[override]  # a batch of columns in, a loss out
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        scores: Tensor | None = None,
    ) -> EmbeddingOutput:
        """The loss of (B, C, T) columns of texts (and scores (B,) for CoSENT)."""
        if self.loss is None:
            raise ValueError("no loss: call use_loss(EmbeddingLoss(...)) first")
        if input_ids.dim() != 3 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and attention_mask must be (batch, columns, seq_len), got {tuple(input_ids.shape)} "
                f"and {tuple(attention_mask.shape)}"
            )
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        columns = [_column(input_ids[:, c], attention_mask[:, c], types[:, c]) for c in range(input_ids.shape[1])]
        return EmbeddingOutput(loss=self.loss(columns, scores))

    def write_files(self, out: Path, tokenizer=None) -> None:
        """The encoder's files, then the sentence-transformers ones (its prompts file first, which they keep)."""
        super().write_files(out, tokenizer)
        if self.prompts_file is not None:
            (out / SENTENCE_TRANSFORMERS_CONFIG).write_bytes(self.prompts_file)
        write_sentence_modules(out, self.sentence_modules)


def _column(input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor) -> dict[str, Tensor]:
    """One column's features, cut after its longest text (a column of short queries is not run at the width
    of the batch's documents); read off the mask where it is, the host for the trainer's batches."""
    width = int(attention_mask.sum(dim=-1).max())
    return {
        "input_ids": input_ids[:, :width],
        "attention_mask": attention_mask[:, :width],
        "token_type_ids": token_type_ids[:, :width],
    }


# ---------------------------------------------------------------------------- evaluation


class _Encoder:
    """What both evaluations share: texts to embeddings with the model being evaluated."""

    def __init__(self, tokenizer, max_seq_len: int, batch_size: int):
        self.tokenizer, self.max_seq_len, self.batch_size = tokenizer, max_seq_len, batch_size

    def encoder(self, model: SentenceEmbeddingModel, device: torch.device, precision: str, should_stop):
        """`encode(texts) -> (n, D)` on `device` in `precision`, raising EvaluationStopped when asked to stop."""

        @torch.no_grad()
        def encode(texts: list[str]) -> Tensor:
            if should_stop is not None and should_stop():
                raise EvaluationStopped("the evaluation was stopped between two batches of texts")
            batch = self.tokenizer(texts, max_length=self.max_seq_len, truncation=True)
            features = {k: v if k == "attention_mask" else v.to(device) for k, v in batch.items()}
            with autocast(device, precision):
                return model.embed(features).float()

        return encode


class RetrievalEvaluation(_Encoder):
    """InformationRetrievalEvaluator's metrics of the model on a retrieval set (an EvaluationSet)."""

    def __init__(self, data: RetrievalSet, tokenizer, *, max_seq_len: int, batch_size: int = 32):
        super().__init__(tokenizer, max_seq_len, batch_size)
        self.data = data

    def evaluate_model(self, model, *, device, precision, max_batches=None, should_stop=None) -> dict[str, Any]:
        queries, corpus, relevant = self.data
        metrics = evaluate_retrieval(
            self.encoder(model, device, precision, should_stop),
            queries,
            corpus,
            relevant,
            batch_size=self.batch_size,
            accuracy_at_k=(1,),
            precision_recall_at_k=(1, 10, 100),
        )
        return {**{k: metrics[k] for k in RETRIEVAL_METRICS}, "queries": len(queries), "documents": len(corpus)}


def evaluation_for(
    data: Sequence[Pair] | Sequence[ScoredPair] | RetrievalSet, tokenizer, *, max_seq_len: int, batch_size: int = 32
) -> RetrievalEvaluation | SimilarityEvaluation:
    """The evaluation of held-out or given data: a retrieval set (pairs become one) or scored pairs."""
    if isinstance(data, RetrievalSet):
        return RetrievalEvaluation(data, tokenizer, max_seq_len=max_seq_len, batch_size=batch_size)
    if data and isinstance(data[0], ScoredPair):
        return SimilarityEvaluation(data, tokenizer, max_seq_len=max_seq_len, batch_size=batch_size)  # type: ignore[arg-type]
    pairs = [p for p in data if isinstance(p, Pair)]
    return RetrievalEvaluation(retrieval_set(pairs), tokenizer, max_seq_len=max_seq_len, batch_size=batch_size)


class SimilarityEvaluation(_Encoder):
    """EmbeddingSimilarityEvaluator's pearson_cosine and spearman_cosine of the model on scored pairs."""

    def __init__(self, pairs: Sequence[ScoredPair], tokenizer, *, max_seq_len: int, batch_size: int = 32):
        super().__init__(tokenizer, max_seq_len, batch_size)
        self.pairs = list(pairs)

    def evaluate_model(self, model, *, device, precision, max_batches=None, should_stop=None) -> dict[str, Any]:
        encode = self.encoder(model, device, precision, should_stop)
        first = embed(encode, [p.sentence1 for p in self.pairs], batch_size=self.batch_size)
        second = embed(encode, [p.sentence2 for p in self.pairs], batch_size=self.batch_size)
        return {**similarity_correlation(first, second, [p.score for p in self.pairs]), "pairs": len(self.pairs)}
