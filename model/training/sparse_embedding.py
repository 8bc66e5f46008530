"""Sparse-embedding (SPLADE) training, as sentence-transformers 6.x trains a SparseEncoder of an MLMTransformer and
SpladePooling with SpladeLoss over SparseMultipleNegativesRankingLoss.

    model = SparseEmbeddingModel.from_pretrained("models/splade", splade=SpladeOptions())   # needs an MLM head
    model.progress = lambda: (trainer.step, trainer.total_steps)   # the regularisers' warm-up reads it
    out = model(**batch)            # batch: model/data/pair_batches.py's (B, C, T) columns; out.loss and its parts
    model.save_pretrained(path, tokenizer)   # a BertForMaskedLM directory in SparseEncoder's layout
    metrics = SparseRetrievalEvaluation(retrieval_set, tokenizer, max_seq_len=128).evaluate_model(model, ...)

A text's sparse embedding is `splade_pool` of the MLM head's logits (BertForMaskedLM of model/modeling.py):
log(1 + relu(logit)) max-pooled over the tokens the attention mask keeps ([CLS] and [SEP] included, padding
left out), one weight per vocabulary entry, most of them zero. Training columns are pairs (anchor, positive,
negative_1..n); the loss of a batch is

    ranking_loss               SparseMultipleNegativesRankingLoss: cross-entropy of each anchor's positive among
                               every candidate of the batch by dot product, scale 1 (query_to_doc, joint)
    query_regularizer_loss     FLOPS of the anchors (Paria et al. 2020: the squared L2 norm of the batch's mean
                               embedding) times query_regularizer_weight
    document_regularizer_loss  FLOPS of every positive and negative together times document_regularizer_weight

and `loss` their sum. Both weights grow from 0 as SpladeRegularizerWeightSchedulerCallback grows them (its
quadratic schedule): at optimizer step s (the steps done before this one) of a run of S, weight * (s / w)^2
while s < w = max(1, int(S * regularizer_warmup_ratio)), the full weight after.

Saved model: a BertForMaskedLM directory (config.json, model.safetensors, tokenizer) plus the files
SparseEncoder.save writes for MLMTransformer + SpladePooling (`write_sparse_encoder_files`), so
`sentence_transformers.SparseEncoder(dir)` loads it and encodes as `embed` does, and the service recognises the
SPLADE pooling.

Evaluation (SparseRetrievalEvaluation, an EvaluationSet) is SparseInformationRetrievalEvaluator's on a
retrieval set (held-out pairs become one): dot_ndcg@10, dot_mrr@10, dot_recall@1/10/100 and dot_map@100 by exact
dot products (model/training/retrieval_eval.py), query_active_dims and corpus_active_dims (the mean number of
non-zero terms of a query and of a document) and avg_flops (the expected number of multiplications of a query
with a document: the dot product of the mean query's and the mean document's non-zero indicators).

References: sentence-transformers 6.x, sparse_encoder/losses/ (SpladeLoss, FlopsLoss,
SparseMultipleNegativesRankingLoss), sparse_encoder/modules/splade_pooling.py, sparse_encoder/callbacks/
splade_callbacks.py, sparse_encoder/evaluation/sparse_information_retrieval.py; Formal et al. 2021, "SPLADE v2"
(arXiv:2109.10086); Paria et al. 2020, "Minimizing FLOPs to learn efficient sparse representations"
(arXiv:2004.05665).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from datadir.files import atomic_write_bytes
from model import options
from model.data.pair_batches import retrieval_set
from model.data.pairs import Pair
from model.data.retrieval_data import RetrievalSet
from model.modeling import BertForMaskedLM
from model.sentence_modules import MODULES_FILE, SENTENCE_BERT_CONFIG, SENTENCE_TRANSFORMERS_CONFIG
from model.training.losses import Features, embed_columns
from model.training.retrieval_eval import evaluate_retrieval
from model.training.sentence_embedding import _Encoder

BEST_METRIC = "dot_ndcg@10"
RETRIEVAL_METRICS = ("dot_ndcg@10", "dot_mrr@10", "dot_recall@1", "dot_recall@10", "dot_recall@100", "dot_map@100")
SPARSITY_METRICS = ("query_active_dims", "corpus_active_dims", "avg_flops")
SPLADE_POOLING_DIR = "1_SpladePooling"
_ST = "sentence_transformers.sparse_encoder.modules"
MODULES = [  # SparseEncoder.save's modules.json for an MLMTransformer and a SpladePooling
    {"idx": 0, "name": "0", "path": "", "type": f"{_ST}.mlm_transformer.MLMTransformer"},
    {"idx": 1, "name": "1", "path": SPLADE_POOLING_DIR, "type": f"{_ST}.splade_pooling.SpladePooling"},
]
TRANSFORMER_CONFIG = {  # MLMTransformer's sentence_bert_config.json: the fill-mask logits are its token embeddings
    "transformer_task": "fill-mask",
    "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
    "module_output_name": "token_embeddings",
}


# ---------------------------------------------------------------------------- the representation


def splade_pool(logits: Tensor, attention_mask: Tensor) -> Tensor:
    """(B, T, V) MLM logits, (B, T) mask -> (B, V): log(1 + relu(logit)) max-pooled over the kept tokens, as
    SpladePooling("max", "relu") computes it (padding's logits are zeroed first, so it adds nothing)."""
    masked = logits * attention_mask.unsqueeze(-1).to(logits.dtype)  # (B, T, V)
    return torch.log1p(torch.relu(masked)).max(dim=1).values


def flops(embeddings: Tensor) -> Tensor:
    """FLOPS regularisation of (N, V) embeddings: the squared L2 norm of their mean (FlopsLoss, no threshold)."""
    return torch.sum(torch.mean(embeddings, dim=0) ** 2)


def sparse_ranking_loss(anchors: Tensor, candidates: Sequence[Tensor], scale: float = 1.0) -> Tensor:
    """SparseMultipleNegativesRankingLoss with its defaults: each anchor (B, V) against every candidate of the
    batch (positives, then each hard-negative column, each (B, V)) by dot product times `scale`; cross-entropy
    of its own positive (query_to_doc, joint)."""
    docs = torch.cat(list(candidates))  # (C * B, V)
    scores = anchors.float() @ docs.float().T * scale  # (B, C * B)
    return F.cross_entropy(scores, torch.arange(len(anchors), device=anchors.device))


# ---------------------------------------------------------------------------- options and the loss


_DEFAULTS = options.defaults("finetune", "sparse-embedding", trainer=False)


@dataclass(frozen=True)
class SpladeOptions:
    """SpladeLoss's weights and their warm-up (model/options.py declares the defaults and bounds)."""

    query_regularizer_weight: float = _DEFAULTS["query_regularizer_weight"]
    document_regularizer_weight: float = _DEFAULTS["document_regularizer_weight"]
    regularizer_warmup_ratio: float = _DEFAULTS["regularizer_warmup_ratio"]

    def weights_at(self, step: int, total_steps: int) -> tuple[float, float]:
        """(query, document) weights at optimizer step `step` (steps done) of `total_steps`: the quadratic
        warm-up of SpladeRegularizerWeightSchedulerCallback."""
        warmup = max(1, int(total_steps * self.regularizer_warmup_ratio))
        factor = 1.0 if step >= warmup else (step / warmup) ** 2
        return self.query_regularizer_weight * factor, self.document_regularizer_weight * factor


@dataclass
class SparseEmbeddingOutput:
    loss: Tensor
    ranking_loss: Tensor
    query_regularizer_loss: Tensor
    document_regularizer_loss: Tensor


def splade_loss(embeddings: list[Tensor], query_weight: float, document_weight: float) -> SparseEmbeddingOutput:
    """SpladeLoss of the columns' sparse embeddings [anchors, positives, negatives...], each (B, V)."""
    ranking = sparse_ranking_loss(embeddings[0], embeddings[1:])
    documents = flops(torch.cat(embeddings[1:]).float()) * document_weight
    queries = flops(embeddings[0].float()) * query_weight
    return SparseEmbeddingOutput(ranking + documents + queries, ranking, queries, documents)


# ---------------------------------------------------------------------------- the model


class SparseEmbeddingModel(BertForMaskedLM):
    """A BertForMaskedLM trained as a SPLADE model; see the module docstring. `splade` holds the loss's options,
    `progress() -> (step, total_steps)` the run's position (the regularisers' warm-up; full weights without)."""

    def __init__(self, config):
        super().__init__(config)
        self.splade = SpladeOptions()
        self.progress: Callable[[], tuple[int, int]] | None = None

    @property
    def architecture(self) -> str:
        return "BertForMaskedLM"

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", init_missing_heads: bool = False, **overrides
    ):
        """The model directory's encoder and MLM head (a ValueError naming the head when it has none: SPLADE's
        terms are its logits), with `splade=SpladeOptions(...)` when given."""
        splade: SpladeOptions | None = overrides.pop("splade", None)
        model = super().from_pretrained(path, device, False, **overrides)
        if splade is not None:
            model.splade = splade
        return model

    def embed(self, features: dict[str, Tensor]) -> Tensor:
        """(B, T) input_ids, attention_mask (on any device), token_type_ids -> (B, V) sparse embeddings."""
        mask = features["attention_mask"]
        hidden = self.bert(features["input_ids"], mask, features.get("token_type_ids")).last_hidden_state
        logits = self.cls.predictions(hidden)  # (B, T, H) -> (B, T, V)
        return splade_pool(logits.float(), mask.to(logits.device, non_blocking=True))

    def forward(  # type: ignore[override]  # a batch of columns in, the SPLADE loss out
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> SparseEmbeddingOutput:
        """The loss of (B, C, T) columns of texts: anchors, positives, any hard negatives."""
        if input_ids.dim() != 3 or attention_mask.shape != input_ids.shape or input_ids.shape[1] < 2:
            raise ValueError(
                f"input_ids and attention_mask must be (batch, columns >= 2, seq_len), got {tuple(input_ids.shape)} "
                f"and {tuple(attention_mask.shape)}"
            )
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        columns = [_column(input_ids[:, c], attention_mask[:, c], types[:, c]) for c in range(input_ids.shape[1])]
        step, total = self.progress() if self.progress is not None else (1, 1)
        return splade_loss(embed_columns(self.embed, columns), *self.splade.weights_at(step, total))

    def write_files(self, out: Path, tokenizer=None) -> None:
        """The BertForMaskedLM's files, then SparseEncoder's."""
        super().write_files(out, tokenizer)
        write_sparse_encoder_files(out, self.config.vocab_size)


def _column(input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor) -> Features:
    """One column's features, cut after its longest text (sentence_embedding's rule: a column of short queries is
    not run at the width of the batch's documents)."""
    width = int(attention_mask.sum(dim=-1).max())
    return {
        "input_ids": input_ids[:, :width],
        "attention_mask": attention_mask[:, :width],
        "token_type_ids": token_type_ids[:, :width],
    }


def is_sparse_encoder(path: str | Path) -> bool:
    """Whether a model directory says it is a SparseEncoder (config_sentence_transformers.json's model_type)."""
    file = Path(path) / SENTENCE_TRANSFORMERS_CONFIG
    try:
        return json.loads(file.read_text()).get("model_type") == "SparseEncoder"
    except (OSError, ValueError, AttributeError):
        return False


def write_sparse_encoder_files(out: str | Path, vocab_size: int) -> None:
    """What SparseEncoder.save writes beside the transformer's files for MLMTransformer + SpladePooling("max",
    "relu"): modules.json, sentence_bert_config.json, 1_SpladePooling/config.json and
    config_sentence_transformers.json (model_type SparseEncoder, dot-product similarity, the query and document
    prompts empty). The texts' length limit is the tokenizer's model_max_length, where sentence-transformers 6
    keeps it."""
    out = Path(out)
    transformer = TRANSFORMER_CONFIG
    pooling = {"pooling_strategy": "max", "activation_function": "relu", "embedding_dimension": vocab_size}
    sentence_transformers = {
        "model_type": "SparseEncoder",
        "prompts": {"query": "", "document": ""},
        "default_prompt_name": None,
        "similarity_fn_name": "dot",
    }
    (out / SPLADE_POOLING_DIR).mkdir(exist_ok=True)
    for name, value in (
        (MODULES_FILE, MODULES),
        (SENTENCE_BERT_CONFIG, transformer),
        (f"{SPLADE_POOLING_DIR}/config.json", pooling),
        (SENTENCE_TRANSFORMERS_CONFIG, sentence_transformers),
    ):
        atomic_write_bytes(out / name, (json.dumps(value, indent=2) + "\n").encode())


# ---------------------------------------------------------------------------- evaluation


class SparseRetrievalEvaluation:
    """SparseInformationRetrievalEvaluator's metrics of the model on a retrieval set (an EvaluationSet); see
    the module docstring."""

    def __init__(self, data: RetrievalSet | Sequence[Pair], tokenizer, *, max_seq_len: int, batch_size: int = 32):
        self.data = data if isinstance(data, RetrievalSet) else retrieval_set(list(data))
        self.tokenizer, self.max_seq_len, self.batch_size = tokenizer, max_seq_len, batch_size

    def encoder(self, model: SparseEmbeddingModel, device, precision: str, should_stop, seen: list[Tensor]):
        """The sentence-embedding evaluation's `encode(texts) -> (n, V)`, appending each batch's embeddings to
        `seen` (for the sparsity figures)."""
        embedder = _Encoder(self.tokenizer, self.max_seq_len, self.batch_size)
        encode = embedder.encoder(model, device, precision, should_stop)  # type: ignore[arg-type]  # any .embed

        def recorded(texts: list[str]) -> Tensor:
            out = encode(texts)
            seen.append(out)
            return out

        return recorded

    def evaluate_model(self, model, *, device, precision, max_batches=None, should_stop=None) -> dict[str, Any]:
        queries, corpus, relevant = self.data
        seen: list[Tensor] = []
        encode = self.encoder(model, device, precision, should_stop, seen)
        # The queries (those with a relevant document) are embedded first, then the corpus: `seen` splits there.
        asked = [q for q in queries if relevant.get(q)]
        metrics = evaluate_retrieval(
            encode,
            queries,
            corpus,
            relevant,
            batch_size=self.batch_size,
            accuracy_at_k=(1,),
            precision_recall_at_k=(1, 10, 100),
            similarity="dot",
        )
        everything = torch.cat(seen)
        sparsity = sparsity_metrics(everything[: len(asked)], everything[len(asked) :])
        return {
            **{k: metrics[k] for k in RETRIEVAL_METRICS},
            **sparsity,
            "queries": len(asked),
            "documents": len(corpus),
        }


def sparsity_metrics(query_emb: Tensor, corpus_emb: Tensor) -> dict[str, float]:
    """query_active_dims, corpus_active_dims (mean non-zero terms) and avg_flops, as
    SparseInformationRetrievalEvaluator reports them."""
    query_nonzero, corpus_nonzero = (query_emb != 0).double(), (corpus_emb != 0).double()
    return {
        "query_active_dims": float(query_nonzero.sum(1).mean()),
        "corpus_active_dims": float(corpus_nonzero.sum(1).mean()),
        "avg_flops": float(query_nonzero.mean(0) @ corpus_nonzero.mean(0)),
    }


def evaluation_for(
    data: Sequence[Pair] | RetrievalSet, tokenizer, *, max_seq_len: int, batch_size: int = 32
) -> SparseRetrievalEvaluation:
    """The evaluation of held-out pairs or a given retrieval set."""
    return SparseRetrievalEvaluation(data, tokenizer, max_seq_len=max_seq_len, batch_size=batch_size)
