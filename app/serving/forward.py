"""Forward passes for each task, run by the engine's inference thread on one padded batch.

Each runner takes a LoadedModel and an engine Batch and returns one plain-Python result per batch
row (so the event loop never touches a tensor). The reference for each is the model's own forward
pass: fill-mask = softmax of BertForMaskedLM logits (as transformers' FillMaskPipeline), nsp =
softmax of BertForPreTraining's seq_relationship logits, embeddings = BertModel's last_hidden_state
pooled (and normalised) as the model's sentence-transformers modules do, classify = BertForSequenceClassification logits through the function transformers'
TextClassificationPipeline would apply, token_classify = softmax of BertForTokenClassification logits
per token (as TokenClassificationPipeline), qa = BertForQuestionAnswering's start and end logits
(scored by app/serving/qa_pipeline.py, which needs each window's own), sparse_encode = SPLADE over the MLM
head's logits (model/sparse.py, chunked), token_encode = BertModel's last_hidden_state per real token.
(scored by app/serving/qa_pipeline.py, which needs each window's own), late_interaction = a ColBERT's kept
token vectors as PyLate's ColBERT.encode gives them (model/late_interaction.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.serving.engine import Runner
from model.late_interaction import token_vectors
from model.modeling import upload
from model.sentence_modules import Pooling, pool
from model.sparse import SPLADE, splade_entries

# An embedding request's explicit `pooling` (app/schemas/embeddings.py), instead of the model's own: one
# mode over every token the mask keeps, a prompt's included
REQUEST_POOLINGS = {"mean": Pooling(("mean",)), "cls": Pooling(("cls",))}


def run_encode(lm, batch) -> list[list[float]]:
    """One sentence embedding per row, as its params ask: "pooling" None pools as the model's own Pooling
    module (model.sentence_modules, with its "prompt_length" when that leaves a prompt out), "mean" or "cls"
    as REQUEST_POOLINGS; "normalize" None is the model's Normalize, else true or false."""
    hidden = lm.encoder(batch.input_ids, batch.model_mask, batch.token_type_ids).last_hidden_state.float()
    modules = lm.sentence_modules
    groups: dict[tuple, list[int]] = {}  # rows pooled alike (usually all of them)
    for row, p in enumerate(batch.params):
        normalize = modules.normalize if p.get("normalize") is None else p["normalize"]
        groups.setdefault((p.get("pooling"), p.get("prompt_length"), normalize), []).append(row)
    out: list = [None] * len(batch.params)
    for (asked, prompt_length, normalize), rows in groups.items():
        pooling = REQUEST_POOLINGS[asked] if asked else modules.pooling
        index = upload(torch.tensor(rows), hidden.device) if len(groups) > 1 else slice(None)
        pooled = pool(hidden[index], batch.attention_mask[index], pooling, None if asked else prompt_length)
        pooled = F.normalize(pooled, dim=-1) if normalize else pooled
        for row, vector in zip(rows, pooled.cpu().tolist()):
            out[row] = vector
    return out


def run_mlm(lm, batch) -> list[list[tuple[list[float], list[int]]]]:
    """Per row, per [MASK] (in position order): (top-k probabilities, token ids), best first. The masks are found
    on the host ids (the model takes its rows there, no sync), and one copy per pass brings the answers back."""
    masked = batch.ids_on_host == lm.mask_token_id  # (B, T); the decoder runs only here
    out = lm.model(batch.input_ids, batch.model_mask, batch.token_type_ids, masked_positions=masked)
    logits = out.logits if hasattr(out, "logits") else out.prediction_logits  # (N, V), row-major (b, t)
    probs = logits.float().softmax(-1)
    counts = masked.sum(1).tolist()
    starts = [sum(counts[:r]) for r in range(len(counts))]
    params = batch.params
    if not any(p.get("target_ids") for p in params):  # one top-k for the whole batch, one copy
        k = min(max(p["top_k"] for p in params), probs.shape[-1])
        values, ids = (t.cpu().tolist() for t in probs.topk(k, dim=-1))
        return [
            [(values[j][: p["top_k"]], ids[j][: p["top_k"]]) for j in range(s, s + n)]
            for p, s, n in zip(params, starts, counts)
        ]
    targets = upload(torch.tensor([t for p in params for t in p.get("target_ids") or []]), probs.device)
    picked, first = [], 0
    for p, s, n in zip(params, starts, counts):
        picked.append(_top_k(probs[s : s + n], p, targets[first : first + len(p.get("target_ids") or [])]))
        first += len(p.get("target_ids") or [])
    # (values, ids) of every row, as float64 (ids are exact there), brought back in one copy
    flat = torch.cat([t.reshape(-1).double() for pair in picked for t in pair]).cpu().tolist()
    answers, at = [], 0
    for values, _ in picked:
        size = values.numel()
        rows = [flat[at + r * values.shape[1] : at + (r + 1) * values.shape[1]] for r in range(values.shape[0])]
        ids = [
            flat[at + size + r * values.shape[1] : at + size + (r + 1) * values.shape[1]]
            for r in range(values.shape[0])
        ]
        answers.append([(v, [int(i) for i in row_ids]) for v, row_ids in zip(rows, ids)])
        at += 2 * size
    return answers


def _top_k(probs: torch.Tensor, p: dict, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k probabilities, token ids) of one row's masks, on the device."""
    if not p.get("target_ids"):
        return probs.topk(min(p["top_k"], probs.shape[-1]), dim=-1)
    # scores stay full-vocabulary probabilities, as transformers reports them
    values, idx = probs[:, target_ids].topk(min(p["top_k"], len(target_ids)), dim=-1)
    return values, target_ids[idx]


def run_nsp(lm, batch) -> list[float]:
    """P(B follows A) per row: softmax(seq_relationship_logits)[0] (label 0 = "is next")."""
    none = torch.zeros_like(batch.ids_on_host, dtype=torch.bool)  # skip the MLM decoder entirely (on the host)
    out = lm.model(batch.input_ids, batch.model_mask, batch.token_type_ids, masked_positions=none)
    return out.seq_relationship_logits.float().softmax(-1)[:, 0].cpu().tolist()


def run_classify(lm, batch) -> list:
    """Per row, one score per label (id order), as its params ask: "scoring" "pipeline" (the default,
    score_logits), "tei" (TEI's: softmax, sigmoid for one label) or "logits" (the logits themselves;
    "logits": true says so too). With "top_k" below the label count, a row is (scores, label ids) of
    its k best instead, best first: a model with many labels answers a few, chosen here."""
    logits = lm.model(batch.input_ids, batch.model_mask, batch.token_type_ids).logits.float()  # (B, L)
    kinds = [p.get("scoring") or ("logits" if p.get("logits") else "pipeline") for p in batch.params]
    scored = {kind: SCORINGS[kind](logits, lm.config).cpu() for kind in set(kinds)}  # (B, L) each: one copy
    ks = [p.get("top_k") or logits.shape[-1] for p in batch.params]
    if len(scored) == 1 and all(k >= logits.shape[-1] for k in ks):
        return next(iter(scored.values())).tolist()
    out = []
    for row, (kind, k) in enumerate(zip(kinds, ks)):
        scores = scored[kind][row]  # on the host: a row's top-k is no device round trip
        if k < scores.shape[-1]:
            values, ids = scores.topk(k)
            out.append((values.tolist(), ids.tolist()))
        else:
            out.append(scores.tolist())
    return out


def score_logits(logits: torch.Tensor, config) -> torch.Tensor:
    """transformers' TextClassificationPipeline default: none for regression, sigmoid for one
    label or multi-label, softmax otherwise."""
    if config.problem_type == "regression":
        return logits
    if config.problem_type == "multi_label_classification" or logits.shape[-1] == 1:
        return logits.sigmoid()
    return logits.softmax(-1)


def tei_softmax(logits: torch.Tensor, config) -> torch.Tensor:
    """text-embeddings-inference's predict (core/src/infer.rs): sigmoid for one label, else softmax."""
    return logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)


SCORINGS = {"pipeline": score_logits, "tei": tei_softmax, "logits": lambda logits, config: logits}


def _unpadded(batch, values: torch.Tensor) -> list:
    """Per row, its values at its real (not padding) positions: (B, T, ...) -> B lists."""
    lengths = batch.lengths
    return [row[:n] for row, n in zip(values.cpu().tolist(), lengths)]


def run_token_classify(lm, batch) -> list[list[list[float]]]:
    """Per row, per token: every label's probability (softmax over labels)."""
    logits = lm.model(batch.input_ids, batch.model_mask, batch.token_type_ids).logits.float()  # (B, T, L)
    return _unpadded(batch, logits.softmax(-1))


def run_qa(lm, batch) -> list[tuple[list[float], list[float]]]:
    """Per row (a window): its start and end logits, one per token."""
    out = lm.model(batch.input_ids, batch.model_mask, batch.token_type_ids)
    return list(zip(_unpadded(batch, out.start_logits.float()), _unpadded(batch, out.end_logits.float())))


def run_sparse_encode(lm, batch) -> list[tuple[list[int], list[float]]]:
    """Per row, its SPLADE vector's entries above its params' "threshold" (indices, values), by index, or its
    "top_k" largest, largest first; pooled as the model's SpladePooling says (SPLADE v2's without one)."""
    hidden = lm.encoder(batch.input_ids, batch.model_mask, batch.token_type_ids).last_hidden_state
    mask = batch.host_mask if batch.host_mask is not None else batch.attention_mask
    splade, params = lm.sentence_modules.splade or SPLADE, batch.params
    thresholds, top_ks = [p["threshold"] for p in params], [p.get("top_k") for p in params]
    return splade_entries(lm.model.cls.predictions, hidden, mask, splade, thresholds, top_ks)


def run_token_encode(lm, batch) -> list[list[list[float]]]:
    """Per row, per real token: its last hidden state."""
    hidden = lm.encoder(batch.input_ids, batch.model_mask, batch.token_type_ids).last_hidden_state
    return _unpadded(batch, hidden.float())


def run_late_interaction(lm, batch) -> list[list[list[float]]]:
    """Per row, its kept unit token vectors: each row's item says (is_query, tokens attended) in "late"; the
    rest of a query's row (its [MASK] expansion) is masked out of the attention but keeps its vectors."""
    li, late = lm.late_interaction, [item.params["late"][i] for item, i in batch.origin]
    positions = torch.arange(batch.input_ids.shape[1])[None, :]  # (1, T)
    mask = (positions < torch.tensor([attended for _, attended in late])[:, None]).long()  # (B, T), on the host
    vectors = token_vectors(lm.encoder, li, batch.input_ids, mask.to(batch.input_ids.device), batch.token_type_ids)
    queries = torch.tensor([query for query, _ in late])[:, None]  # (B, 1)
    real = (positions < torch.tensor(batch.lengths)[:, None]).long()  # (B, T): a row's own tokens, expansion too
    ids = batch.input_ids.cpu()
    as_query = li.kept(lm.tokenizer, ids, real, True) & real.bool()  # the batch's padding is no row's
    kept = torch.where(queries, as_query, li.kept(lm.tokenizer, ids, mask, False))
    vectors = vectors.cpu()
    return [vectors[r][kept[r]].tolist() for r in range(len(late))]


RUNNERS: dict[str, Runner] = {
    "encode": run_encode,
    "mlm": run_mlm,
    "nsp": run_nsp,
    "classify": run_classify,
    "token_classify": run_token_classify,
    "qa": run_qa,
    "sparse_encode": run_sparse_encode,
    "token_encode": run_token_encode,
    "late_interaction": run_late_interaction,
}
