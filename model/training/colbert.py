"""Late-interaction (ColBERT) training, as PyLate trains a ColBERT: the encoder's token vectors through a
projection, queries and documents made into rows as PyLate's collator makes them, its Contrastive loss over
each anchor's positive, its hard negatives and the batch's other documents, and retrieval by MaxSim.

    model = ColBERTModel.from_pretrained("models/colbert", temperature=1.0)
    out = model(**batch)            # batch: ColBERTBatches' (B, C, T) columns: anchor, positive, negatives
    model.save_pretrained(path, tokenizer)   # PyLate's layout: pylate.models.ColBERT(path) loads it

ColBERTModel is a BertModel (its state dict is the directory's encoder) with `linear`, the projection. A start
model that is a ColBERT (either layout, model/late_interaction.py) keeps its projection and settings; another
BERT gets PyLate's new head (a 128-wide projection without bias, nn.Linear's initialisation) and PyLate's
default settings, with the markers its vocabulary has: "[Q] " / "[D] " if it holds them, else [unused0] /
[unused1] (where PyLate would add new tokens, this keeps the vocabulary; the markers are saved with the model,
so PyLate encodes it the same way). The batches pad every query to query_length and every document to
document_length with [MASK] (attention 0), as PyLate's collator pads (`pad=True`), so the loss is PyLate's on
the same batch: its masked similarities count as zeros in MaxSim's max.

Evaluation: each held-out anchor searches every held-out document by MaxSim (each document on its own, as
PyLate's retrieval scores it), InformationRetrievalEvaluator's metrics named MaxSim_* (PyLate's evaluator's
score name). References: pylate/models/colbert.py, pylate/losses/contrastive.py, pylate/utils/collator.py,
pylate/evaluation; Khattab & Zaharia 2020.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from model.compute.precision import autocast
from model.data.pair_batches import PairBatches, pad
from model.data.pairs import Pair
from model.data.retrieval_data import RetrievalSet
from model.late_interaction import (
    ColBERTSettings,
    LateInteraction,
    contrastive_loss,
    distillation_loss,
    maxsim,
    read_late_interaction,
    token_vectors,
    write_late_interaction,
)
from model.modeling import BertModel
from model.tokenizer import BertTokenizer
from model.training.retrieval_eval import ranking_from_scores
from model.training.trainer import EvaluationStopped

NEW_DIM = 128  # PyLate's embedding_size when it adds the projection to a plain encoder
MARKERS = (("[Q] ", "[D] "), ("[unused0]", "[unused1]"))  # a new head's markers: the first pair the vocabulary has
SCORE = "MaxSim"
RETRIEVAL_METRICS = tuple(
    f"{SCORE}_{m}" for m in ("ndcg@10", "mrr@10", "recall@1", "recall@10", "recall@100", "map@100")
)
BEST_METRIC = f"{SCORE}_ndcg@10"


@dataclass
class ColBERTOutput:
    loss: Tensor


class ColBERTModel(BertModel):
    """A BertModel with a ColBERT projection (`linear`) and settings; see the module docstring."""

    linear: nn.Linear  # the projection, added by from_pretrained once the encoder's weights are in

    def __init__(self, config, add_pooling_layer: bool = True):
        super().__init__(config, add_pooling_layer)
        self.settings = ColBERTSettings()
        self.tokenizer: BertTokenizer | None = None
        self.temperature = 1.0
        self.distill = False  # learn a teacher's scores (the batch's "scores") by PyLate's Distillation loss

    @property
    def architecture(self) -> str:
        return "BertModel"  # the encoder on disk; the projection is PyLate's Dense beside it

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", init_missing_heads: bool = False, **overrides
    ):
        """The encoder of a model directory and its ColBERT head (its own, else a new one); `temperature` for
        the loss."""
        temperature = overrides.pop("temperature", 1.0)
        distill = overrides.pop("distill", False)
        model = super().from_pretrained(path, "cpu", False, **overrides)
        model.tokenizer = BertTokenizer.from_pretrained(path)
        late = read_late_interaction(path)
        if late is not None:
            model.settings = late.settings
            model.linear = nn.Linear(late.weight.shape[1], late.dim, bias=late.bias is not None)
            with torch.no_grad():
                model.linear.weight.copy_(late.weight)
                if late.bias is not None:
                    model.linear.bias.copy_(late.bias)
        else:
            vocab = model.tokenizer.get_vocab()
            markers = next((pair for pair in MARKERS if all(m in vocab for m in pair)), None)
            if markers is None:
                raise ValueError(
                    "the start model's vocabulary has neither [Q] / [D] nor [unused0] / [unused1] to mark queries "
                    "and documents"
                )
            model.settings = ColBERTSettings(query_prefix=markers[0], document_prefix=markers[1])
            model.linear = nn.Linear(model.config.hidden_size, NEW_DIM, bias=False)
        s, positions = model.settings, model.config.max_position_embeddings
        if max(s.query_length, s.document_length) > positions:
            raise ValueError(
                f"query_length {s.query_length} or document_length {s.document_length} is more than the model's "
                f"max_position_embeddings {positions}"
            )
        model.temperature, model.distill = float(temperature), bool(distill)
        model.late.token_ids(model.tokenizer)  # the markers are tokens of its vocabulary
        return model.to(device)

    @property
    def late(self) -> LateInteraction:
        """Its settings and projection (the parameters themselves: the loss's gradients reach them)."""
        return LateInteraction(self.settings, self.linear.weight, self.linear.bias)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """A checkpoint's model.safetensors holds the encoder; the projection was read from its 1_Dense."""
        linear = self._modules.get("linear")  # none yet while from_pretrained loads the encoder
        own = {f"linear.{k}": v for k, v in linear.state_dict().items()} if linear is not None else {}
        merged = {**own, **dict(state_dict)}
        return super().load_state_dict(merged, strict=strict, assign=assign)

    def vectors(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """(B, T) rows -> (B, T, dim) unit token vectors (model/late_interaction.py's token_vectors)."""
        mask = attention_mask.to(input_ids.device)
        return token_vectors(self, self.late, input_ids, mask, token_type_ids)

    def forward(  # type: ignore[override]  # a batch of columns in, a loss out
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        scores: Tensor | None = None,
        **_: Any,
    ) -> ColBERTOutput:
        """PyLate's Contrastive loss of (B, C, T) columns: the anchors (query rows) and C - 1 documents each; with
        `distill`, its Distillation loss from the teacher's (B, C - 1) `scores` of each row's own documents."""
        if input_ids.dim() != 3 or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids must be (batch, columns >= 2, seq_len), got {tuple(input_ids.shape)}")
        assert self.tokenizer is not None
        s = self.settings
        B, C = input_ids.shape[:2]
        mask = attention_mask.to(input_ids.device)
        q_ids, q_mask = input_ids[:, 0, : s.query_length], mask[:, 0, : s.query_length]
        d_ids = input_ids[:, 1:, : s.document_length].reshape(B * (C - 1), -1)  # (B, C-1, T) -> (B*(C-1), T)
        d_mask = mask[:, 1:, : s.document_length].reshape(B * (C - 1), -1)
        queries, documents = self.vectors(q_ids, q_mask), self.vectors(d_ids, d_mask)
        late = self.late
        queries_mask = None if s.do_query_expansion else q_mask.bool()
        kept = late.kept(self.tokenizer, d_ids, d_mask, is_query=False)
        documents = documents.view(B, C - 1, *documents.shape[1:])  # (B*(C-1), T, dim) -> (B, C-1, T, dim)
        if self.distill:
            if scores is None:
                raise ValueError("a distilling ColBERT needs the teacher's scores of each row's documents")
            loss = distillation_loss(
                queries, documents, queries_mask, kept.view(B, C - 1, -1), scores.to(queries.device)
            )
        else:
            loss = contrastive_loss(queries, documents, queries_mask, kept.view(B, C - 1, -1), self.temperature)
        return ColBERTOutput(loss=loss)

    def write_files(self, out: Path, tokenizer=None) -> None:
        """The encoder's files (without the projection), then PyLate's (1_Dense and the settings)."""
        linear = self.linear
        del self.linear  # model.safetensors holds the encoder alone, as this service and transformers load it
        try:
            super().write_files(out, tokenizer)
        finally:
            self.linear = linear
        write_late_interaction(out, LateInteraction(self.settings, linear.weight, linear.bias))


# ---------------------------------------------------------------------------- batches


class ColBERTBatches(PairBatches):
    """PairBatches' rows (anchor, positive, negatives; no text twice in a batch) made into ColBERT rows: the
    anchor a query padded to query_length, each other text a document padded to document_length, every pad a
    [MASK] with attention 0 (PyLate's collator with pad=True); (B, C, max(query_length, document_length))."""

    def __init__(
        self,
        pairs: Sequence[Pair],
        tokenizer,
        late: LateInteraction,
        *,
        batch_size: int,
        seed: int = 0,
        scores: Sequence[Sequence[float]] | None = None,
    ):
        s = late.settings
        super().__init__(
            pairs, tokenizer, batch_size=batch_size, max_seq_len=max(s.query_length, s.document_length), seed=seed
        )
        self.tokenizer, self.late = tokenizer, late
        # a teacher's scores of each row's documents (positive, then negatives): (N, C - 1)
        self.teacher = None if scores is None else torch.tensor([list(s) for s in scores], dtype=torch.float32)

    def collate(self, rows: np.ndarray) -> dict[str, Tensor]:
        s, mask_id = self.late.settings, self.tokenizer.mask_token_id
        texts = self.rows[rows]  # (B, C) text indices
        ids, attention = [], []
        for row in texts:
            for column, text in enumerate(row):
                is_query = column == 0
                made, attended = self.late.row(self.tokenizer, self.ids[text], is_query)
                length = s.query_length if is_query else s.document_length
                ids.append(made + [mask_id] * (length - len(made)))
                attention.append([1] * attended + [0] * (length - attended))
        input_ids = pad(ids, mask_id).view(len(rows), self.num_columns, -1)  # (B * C, T) -> (B, C, T)
        batch = {
            "input_ids": input_ids,
            "token_type_ids": torch.zeros_like(input_ids),
            "attention_mask": pad(attention, 0).view_as(input_ids),
        }
        if self.teacher is not None:
            batch["scores"] = self.teacher[torch.as_tensor(rows)]  # (B, C - 1)
        return batch


@torch.no_grad()
def teacher_scores(
    model_dir: Path, pairs: Sequence[Pair], tokenizer, device, batch_size: int = 32
) -> list[list[float]]:
    """A cross-encoder's logit for each (anchor, document) of each row, its positive then its negatives: the
    teacher's scores a distilling run learns (as PyLate's distillation data holds a teacher's scores)."""
    from model.modeling import BertForSequenceClassification, load_model

    teacher = load_model(model_dir, device=device).eval()
    if not isinstance(teacher, BertForSequenceClassification) or teacher.config.num_labels != 1:
        raise ValueError("teacher_model must be a cross-encoder: a sequence classifier with one label")
    own = BertTokenizer.from_pretrained(model_dir)
    flat = [(p.anchor, d) for p in pairs for d in (p.positive, *p.negatives)]
    window = min(own.model_max_length, teacher.config.max_position_embeddings)
    logits: list[float] = []
    for start in range(0, len(flat), batch_size):
        chunk = flat[start : start + batch_size]
        enc = own([a for a, _ in chunk], [d for _, d in chunk], truncation=True, max_length=window)
        enc = {k: v.to(device) for k, v in enc.items()}
        logits += teacher(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]).logits[:, 0].float().tolist()
    out, at = [], 0
    for p in pairs:
        n = 1 + len(p.negatives)
        out.append(logits[at : at + n])
        at += n
    return out


# ---------------------------------------------------------------------------- evaluation


class ColBERTRetrievalEvaluation:
    """InformationRetrievalEvaluator's metrics (MaxSim_*) of a ColBERT on a retrieval set (an EvaluationSet)."""

    def __init__(self, data: RetrievalSet, tokenizer, *, batch_size: int = 32):
        self.data, self.tokenizer, self.batch_size = data, tokenizer, batch_size

    def evaluate_model(self, model, *, device, precision, max_batches=None, should_stop=None) -> dict[str, Any]:
        queries, corpus, relevant = self.data
        asked = [q for q in queries if relevant.get(q)]
        ids = sorted(corpus)  # equal scores rank the lower id first
        q = self._encode(model, [queries[x] for x in asked], True, device, precision, should_stop)
        d = self._encode(model, [corpus[x] for x in ids], False, device, precision, should_stop)
        scores = torch.tensor([[maxsim(qi, di).item() for di in d] for qi in q])  # (Q, D)
        row = {cid: i for i, cid in enumerate(ids)}
        outside = iter(range(len(ids), len(ids) + sum(len(relevant[x]) for x in asked)))
        sets = [{row[c] if c in row else next(outside) for c in set(relevant[x])} for x in asked]
        metrics = ranking_from_scores(scores, sets, accuracy_at_k=(1,), precision_recall_at_k=(1, 10, 100))
        named = {f"{SCORE}_{k}": v for k, v in metrics.items()}
        return {**{k: named[k] for k in RETRIEVAL_METRICS}, "queries": len(asked), "documents": len(corpus)}

    @torch.no_grad()
    def _encode(self, model, texts, is_query, device, precision, should_stop) -> list[Tensor]:
        late, out = model.late, []
        for start in range(0, len(texts), self.batch_size):
            if should_stop is not None and should_stop():
                raise EvaluationStopped("the evaluation was stopped between two batches of texts")
            rows = [late.encode(self.tokenizer, t, is_query) for t in texts[start : start + self.batch_size]]
            width = max(len(r) for r, _ in rows)
            ids = torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r, _ in rows])
            attention = torch.tensor([[1] * a + [0] * (width - a) for _, a in rows])
            real = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
            with autocast(device, precision):
                vectors = model.vectors(ids.to(device), attention).float().cpu()
            kept = (
                late.kept(self.tokenizer, ids, real, True) & real.bool()
                if is_query
                else late.kept(self.tokenizer, ids, attention, False)
            )
            out += [v[k] for v, k in zip(vectors, kept)]
        return out
