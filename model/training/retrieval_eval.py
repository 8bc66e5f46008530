"""Retrieval, reranking and similarity metrics, computed as sentence-transformers' evaluators compute them.

    metrics = information_retrieval(query_emb, corpus_emb, relevant)    # embeddings, integer ids
    metrics = evaluate_retrieval(encode, queries, corpus, relevant)     # texts, string ids
    candidates = retrieve(encode, queries, corpus, top_k=100)           # a first stage for rerank
    metrics = rerank(score, queries, corpus, relevant, candidates)
    metrics = similarity_correlation(emb1, emb2, gold_scores)

Retrieval is an exact cosine search over the whole corpus in chunks (`search`), so at most
QUERY_ROWS x chunk_size scores are held at once. Queries without relevant documents are left out;
a relevant id that is not in the corpus still counts (it can never be found, so it lowers recall,
NDCG and MAP). Equal scores rank the lower corpus id first: the corpus row for integer ids, the
string order of the ids for texts, as the reference's (-score, corpus_id) order. Keys:
cosine_accuracy@k, cosine_precision@k, cosine_recall@k, cosine_ndcg@k, cosine_mrr@k, cosine_map@k.

Reranking scores each query's first-stage top_k candidates with a cross-encoder `score(pairs)`. As the
reference's default (always_rerank_positives=True), relevant documents missing from the candidates are
added and scored too; every relevant id counts in NDCG's ideal and MAP's denominator. Keys: rerank_map,
rerank_mrr@10, rerank_ndcg@10 and the first stage's ranking of the same candidates, rerank_base_map,
rerank_base_mrr@10, rerank_base_ndcg@10 (the reference's keys for an evaluator named "rerank").

References: sentence-transformers 6.x, sentence_transformer/evaluation/information_retrieval.py
(InformationRetrievalEvaluator), cross_encoder/evaluation/reranking.py (CrossEncoderRerankingEvaluator,
which uses scikit-learn's tie-averaged dcg_score, McSherry & Najork 2008, and average_precision_score),
sentence_transformer/evaluation/embedding_similarity.py (EmbeddingSimilarityEvaluator: Pearson and
Spearman of the cosines, as scipy.stats computes them).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

Encode = Callable[[list[str]], torch.Tensor]  # texts -> (len(texts), D) embeddings
Score = Callable[[list[tuple[str, str]]], Sequence[float]]  # (query, document) pairs -> relevance scores

CHUNK_SIZE = 16_384  # corpus rows scored at a time
QUERY_ROWS = 256  # queries scored at a time: with CHUNK_SIZE, 16 MiB of float32 scores
SIMILARITY = "cosine"  # the metric keys' prefix, the reference's name of its score function
SIMILARITIES = ("cosine", "dot")  # cosine (dense embeddings) or the dot product (sparse ones: SPLADE's)


# ---------------------------------------------------------------------------- exact search


def search(
    query_emb: torch.Tensor,
    corpus_emb: torch.Tensor,
    k: int,
    *,
    chunk_size: int = CHUNK_SIZE,
    similarity: str = SIMILARITY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, min(k, N)) scores (cosine, or the dot product with `similarity` "dot") and corpus rows of each
    query's nearest rows, best first, equal scores by the lower row. Exact: every row is scored, `chunk_size`
    corpus rows at a time, on the queries' device."""
    _check_embeddings(query_emb, corpus_emb)
    _check_positive(chunk_size=chunk_size, k=k)
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
    unit = similarity == "cosine"
    queries = F.normalize(query_emb.float(), p=2, dim=-1) if unit else query_emb.float()
    blocks = [
        _search_block(queries[s : s + QUERY_ROWS], corpus_emb, k, chunk_size, unit)
        for s in range(0, len(queries), QUERY_ROWS)
    ]
    return torch.cat([b[0] for b in blocks]), torch.cat([b[1] for b in blocks])


def _search_block(queries: torch.Tensor, corpus_emb: torch.Tensor, k: int, chunk_size: int, unit: bool = True):
    best: tuple[torch.Tensor, torch.Tensor] | None = None
    for start in range(0, len(corpus_emb), chunk_size):
        chunk = corpus_emb[start : start + chunk_size].to(queries.device).float()
        chunk = F.normalize(chunk, p=2, dim=-1) if unit else chunk
        scores, rows = _top_k(queries @ chunk.T, k)  # (q, c) -> (q, k)
        found = (scores, rows + start)
        if best is not None:  # earlier chunks hold lower rows: a stable sort keeps them first among equal scores
            found = _ranked(torch.cat([best[0], found[0]], 1), torch.cat([best[1], found[1]], 1), k)
        best = found
    assert best is not None
    return best


def _top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of each row by (-score, column), in that order. torch.topk is right about which values
    but not about which of several equal values at the k-th place: those go to the lowest columns."""
    k = min(k, scores.shape[1])
    threshold = scores.topk(k, dim=1).values[:, -1:]  # (q, 1): each row's k-th best score
    above, at = scores > threshold, scores == threshold
    wanted = k - above.sum(1, keepdim=True)  # how many of the tied scores make the cut
    keep = above | (at & (at.cumsum(1, dtype=torch.int32) <= wanted))  # exactly k a row
    columns = keep.nonzero()[:, 1].view(-1, k)  # (q, k), ascending in each row
    return _ranked(scores.gather(1, columns), columns, k)


def _ranked(scores: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best by score, keeping the given order among equal scores (stable)."""
    scores, order = scores.sort(dim=1, descending=True, stable=True)
    return scores[:, :k], rows.gather(1, order[:, :k])


# ---------------------------------------------------------------------------- retrieval metrics


def information_retrieval(
    query_emb: torch.Tensor,
    corpus_emb: torch.Tensor,
    relevant: Sequence[Collection[int]] | Mapping[int, Collection[int]],
    *,
    mrr_at_k: Sequence[int] = (10,),
    ndcg_at_k: Sequence[int] = (10,),
    accuracy_at_k: Sequence[int] = (1, 3, 5, 10),
    precision_recall_at_k: Sequence[int] = (1, 3, 5, 10, 100),
    map_at_k: Sequence[int] = (100,),
    chunk_size: int = CHUNK_SIZE,
    similarity: str = SIMILARITY,
) -> dict[str, float]:
    """InformationRetrievalEvaluator's metrics of cosine search (or, `similarity` "dot", of the dot product,
    as SparseInformationRetrievalEvaluator's dot_* keys); `relevant` holds corpus rows per query
    row (a list, one per query, or a dict by query row). Rows outside the corpus count as relevant and
    unfindable; queries with no relevant rows are left out. The cut-offs are the reference's defaults,
    with precision@100 and recall@100 added (how much of what is relevant a first stage of 100 keeps)."""
    if isinstance(relevant, Mapping):
        strays = [q for q in relevant if not (isinstance(q, int) and 0 <= q < len(query_emb))]
        if strays:
            raise ValueError(f"relevant is keyed by query rows 0..{len(query_emb) - 1}, got {strays[:8]}")
        relevant = [relevant.get(i, ()) for i in range(len(query_emb))]
    elif len(relevant) != len(query_emb):
        raise ValueError(f"relevant has {len(relevant)} entries but there are {len(query_emb)} queries")
    sets = [_row_set(ids, i) for i, ids in enumerate(relevant)]
    asked = [i for i, ids in enumerate(sets) if ids]
    if not asked:
        raise ValueError(f"none of the {len(sets)} queries has a relevant document")
    ks = dict(
        mrr_at_k=mrr_at_k,
        ndcg_at_k=ndcg_at_k,
        accuracy_at_k=accuracy_at_k,
        precision_recall_at_k=precision_recall_at_k,
        map_at_k=map_at_k,
    )
    max_k = max(max(_ks(name, values)) for name, values in ks.items())
    _, rows = search(query_emb[asked], corpus_emb, max_k, chunk_size=chunk_size, similarity=similarity)
    hits = np.array([[r in sets[q] for r in found] for q, found in zip(asked, rows.tolist())], dtype=bool)
    n_relevant = np.array([len(sets[q]) for q in asked])
    return {f"{similarity}_{key}": value for key, value in ranking_metrics(hits, n_relevant, **ks).items()}


def ranking_from_scores(scores: torch.Tensor, relevant: Sequence[set[int]], **ks: Sequence[int]) -> dict[str, float]:
    """`ranking_metrics` (unprefixed keys) of a (Q, D) matrix of any scores, higher better (a late-interaction
    model's MaxSim: model/training/colbert.py), with relevant corpus rows per query (rows past D: unfindable);
    equal scores rank the lower row first, as `search`."""
    if len(relevant) != scores.shape[0] or not all(relevant):
        raise ValueError(f"relevant must give each of the {scores.shape[0]} queries at least one row")
    max_k = max(max(values) for values in ks.values()) if ks else 100
    _, rows = _top_k(scores.float(), max(max_k, 100))
    hits = np.array([[r in relevant[q] for r in found] for q, found in enumerate(rows.tolist())], dtype=bool)
    return ranking_metrics(hits, np.array([len(r) for r in relevant]), **ks)


def _row_set(ids: Iterable[int], query: int) -> set[int]:
    try:
        return {operator.index(i) for i in ids}
    except TypeError:
        raise ValueError(f"relevant documents of query {query} must be corpus rows (ints), got {ids!r}") from None


def ranking_metrics(
    hits: np.ndarray,
    n_relevant: np.ndarray,
    *,
    mrr_at_k: Sequence[int] = (10,),
    ndcg_at_k: Sequence[int] = (10,),
    accuracy_at_k: Sequence[int] = (1, 3, 5, 10),
    precision_recall_at_k: Sequence[int] = (1, 3, 5, 10, 100),
    map_at_k: Sequence[int] = (100,),
) -> dict[str, float]:
    """Means over queries, from `hits` (Q, K): whether each query's i-th result is relevant, and `n_relevant`
    (Q,): how many documents are relevant to it, found or not. Per query, over its top k:
      accuracy@k   1 if a relevant document is there, else 0
      precision@k  the relevant ones there / k
      recall@k     the relevant ones there / n_relevant
      ndcg@k       their DCG (the result at rank r is worth 1/log2(r+1)) / the DCG of min(n_relevant, k) on top
      mrr@k        1 / the first relevant one's rank, 0 if there is none
      map@k        the precisions at the ranks of the relevant ones, summed, / min(k, n_relevant)
    """
    hits, n_relevant = np.asarray(hits, dtype=np.float64), np.asarray(n_relevant, dtype=np.float64)
    if hits.ndim != 2 or n_relevant.shape != hits.shape[:1] or (n_relevant < 1).any():
        raise ValueError(f"hits must be (Q, K) and n_relevant (Q,) >= 1, got {hits.shape} and {n_relevant.shape}")
    cut_offs = [
        ("accuracy", "accuracy_at_k", accuracy_at_k),
        ("precision", "precision_recall_at_k", precision_recall_at_k),
        ("recall", "precision_recall_at_k", precision_recall_at_k),
        ("ndcg", "ndcg_at_k", ndcg_at_k),
        ("mrr", "mrr_at_k", mrr_at_k),
        ("map", "map_at_k", map_at_k),
    ]
    return {
        f"{metric}@{k}": float(_PER_QUERY[metric](hits[:, :k], k, n_relevant).mean())
        for metric, param, ks in cut_offs
        for k in _ks(param, ks)
    }


def _ndcg(hits: np.ndarray, k: int, n_relevant: np.ndarray) -> np.ndarray:
    ideal = np.cumsum(_discounts(k))[np.minimum(n_relevant, k).astype(int) - 1]  # all relevant on top
    return (hits * _discounts(hits.shape[1])).sum(1) / ideal


def _reciprocal_rank(hits: np.ndarray, k: int, n_relevant: np.ndarray) -> np.ndarray:
    first = hits.argmax(1)  # the first relevant one's index; 0 where there is none, masked below
    return np.where(hits.any(1), 1.0 / (first + 1), 0.0)


def _average_precision(hits: np.ndarray, k: int, n_relevant: np.ndarray) -> np.ndarray:
    precision = hits.cumsum(1) / np.arange(1, hits.shape[1] + 1)  # at each rank
    return (hits * precision).sum(1) / np.minimum(k, n_relevant)


_PER_QUERY: dict[str, Callable[[np.ndarray, int, np.ndarray], np.ndarray]] = {
    "accuracy": lambda hits, k, n_relevant: hits.max(1),  # 1 if any of the top k is relevant
    "precision": lambda hits, k, n_relevant: hits.sum(1) / k,
    "recall": lambda hits, k, n_relevant: hits.sum(1) / n_relevant,
    "ndcg": _ndcg,
    "mrr": _reciprocal_rank,
    "map": _average_precision,
}


def _discounts(n: int) -> np.ndarray:
    return 1.0 / np.log2(np.arange(n) + 2.0)  # (n,): what a relevant result at rank 1..n is worth


def _ks(name: str, ks: Sequence[int]) -> list[int]:
    ks = list(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"{name} must be ints >= 1, got {ks!r}")
    return ks


# ---------------------------------------------------------------------------- texts and string ids


def evaluate_retrieval(
    encode: Encode,
    queries: Mapping[str, str],
    corpus: Mapping[str, str],
    relevant: Mapping[str, Collection[str]],
    *,
    batch_size: int = 32,
    mrr_at_k: Sequence[int] = (10,),
    ndcg_at_k: Sequence[int] = (10,),
    accuracy_at_k: Sequence[int] = (1, 3, 5, 10),
    precision_recall_at_k: Sequence[int] = (1, 3, 5, 10, 100),
    map_at_k: Sequence[int] = (100,),
    chunk_size: int = CHUNK_SIZE,
    similarity: str = SIMILARITY,
) -> dict[str, float]:
    """`information_retrieval` of texts by id, as InformationRetrievalEvaluator(queries, corpus, relevant_docs):
    the queries with relevant ids and the corpus are embedded with `encode`, `batch_size` texts a call."""
    asked = _asked(queries, relevant)
    ids = sorted(corpus)  # corpus rows in id order: equal scores then rank the lower id first
    row = {cid: i for i, cid in enumerate(ids)}
    # An id outside the corpus becomes a row outside it: relevant, counted, never found.
    outside = iter(range(len(ids), len(ids) + sum(len(relevant[q]) for q in asked)))
    relevant_rows = [{row[c] if c in row else next(outside) for c in set(relevant[q])} for q in asked]
    return information_retrieval(
        embed(encode, [queries[q] for q in asked], batch_size=batch_size),
        embed(encode, [corpus[c] for c in ids], batch_size=batch_size),
        relevant_rows,
        mrr_at_k=mrr_at_k,
        ndcg_at_k=ndcg_at_k,
        accuracy_at_k=accuracy_at_k,
        precision_recall_at_k=precision_recall_at_k,
        map_at_k=map_at_k,
        chunk_size=chunk_size,
        similarity=similarity,
    )


def retrieve(
    encode: Encode,
    queries: Mapping[str, str],
    corpus: Mapping[str, str],
    *,
    top_k: int = 100,
    batch_size: int = 32,
    chunk_size: int = CHUNK_SIZE,
) -> dict[str, list[str]]:
    """Each query's `top_k` corpus ids by cosine, best first, equal scores by the lower id: the first
    stage `rerank` takes."""
    if not queries or not corpus:
        raise ValueError(f"retrieval needs queries and a corpus, got {len(queries)} queries, {len(corpus)} documents")
    qids, ids = list(queries), sorted(corpus)
    query_emb = embed(encode, [queries[q] for q in qids], batch_size=batch_size)
    _, rows = search(
        query_emb, embed(encode, [corpus[c] for c in ids], batch_size=batch_size), top_k, chunk_size=chunk_size
    )
    return {q: [ids[r] for r in found] for q, found in zip(qids, rows.tolist())}


def embed(encode: Encode, texts: Sequence[str], *, batch_size: int = 32) -> torch.Tensor:
    """(len(texts), D): `encode` on `batch_size` texts at a time, the batches joined."""
    _check_positive(batch_size=batch_size)
    if not texts:
        raise ValueError("no texts to embed")
    parts: list[torch.Tensor] = []
    for start in range(0, len(texts), batch_size):
        batch = list(texts[start : start + batch_size])
        out = torch.as_tensor(encode(batch))
        if out.dim() != 2 or len(out) != len(batch) or (parts and out.shape[1] != parts[0].shape[1]):
            raise ValueError(f"encode gave shape {tuple(out.shape)} for {len(batch)} texts; it must give (texts, D)")
        parts.append(out.to(parts[0].device) if parts else out)
    return torch.cat(parts)


def _asked(queries: Mapping[str, str], relevant: Mapping[str, Collection[str]]) -> list[str]:
    """The query ids with a relevant document, in the queries' order (the reference evaluates only these)."""
    strings = [q for q, ids in relevant.items() if isinstance(ids, str)]
    if strings:
        raise ValueError(f"relevant maps a query id to a set of document ids, got a string for {strings[:8]}")
    asked = [q for q in queries if relevant.get(q)]
    if not asked:
        raise ValueError(
            f"none of the {len(queries)} queries has a relevant document in relevant ({len(relevant)} ids)"
        )
    return asked


# ---------------------------------------------------------------------------- reranking


class _Sample(NamedTuple):
    """One query of a reranking: the reference evaluator's sample with "documents", by id."""

    query: str
    docs: list[str]  # what the cross-encoder scores; none when no relevant document is among them
    is_relevant: np.ndarray  # (len(docs),) 0/1
    base_relevant: np.ndarray  # (candidates,) 0/1, the first stage's order
    n_relevant: int  # every relevant id, in the corpus or not


def rerank(
    score: Score,
    queries: Mapping[str, str],
    corpus: Mapping[str, str],
    relevant: Mapping[str, Collection[str]],
    candidates: Mapping[str, Sequence[str]],
    *,
    top_k: int = 100,
    at_k: int = 10,
    always_rerank_positives: bool = True,
    batch_size: int = 64,
) -> dict[str, float]:
    """CrossEncoderRerankingEvaluator's MAP, MRR@at_k and NDCG@at_k after `score` reorders each query's first
    `top_k` candidates (best first, as `retrieve` gives them), and the same of the candidates' own order
    (rerank_base_*). With `always_rerank_positives` (the reference's default) the relevant documents missing
    from the candidates are added and scored; without, they stay out and count as relevant and unfound.
    Only queries with relevant ids are evaluated; `score` gets `batch_size` (query, document) pairs a call."""
    _check_positive(top_k=top_k, at_k=at_k, batch_size=batch_size)
    samples = [
        _sample(q, corpus, relevant, candidates, top_k, always_rerank_positives) for q in _asked(queries, relevant)
    ]
    scores = _scores(score, [(queries[s.query], corpus[d]) for s in samples for d in s.docs], batch_size)
    rows, offset = [], 0
    for s in samples:
        predicted, offset = scores[offset : offset + len(s.docs)], offset + len(s.docs)
        first_stage = np.arange(len(s.base_relevant), 0, -1)  # the candidates' order as scores
        rows.append(
            _rerank_metrics(s.is_relevant, predicted, s.n_relevant, at_k)
            + _rerank_metrics(s.base_relevant, first_stage, s.n_relevant, at_k)
        )
    names = ["map", f"mrr@{at_k}", f"ndcg@{at_k}", "base_map", f"base_mrr@{at_k}", f"base_ndcg@{at_k}"]
    return {f"rerank_{name}": float(value) for name, value in zip(names, np.mean(rows, axis=0))}


def _sample(
    query: str,
    corpus: Mapping[str, str],
    relevant: Mapping[str, Collection[str]],
    candidates: Mapping[str, Sequence[str]],
    top_k: int,
    always_rerank_positives: bool,
) -> _Sample:
    if query not in candidates:
        raise ValueError(f"query {query!r} has relevant documents but no candidates")
    found = list(candidates[query])[:top_k]
    unknown = [c for c in found if c not in corpus]
    if unknown:
        raise ValueError(f"candidates of query {query!r} are not in the corpus: {unknown[:8]}")
    positives = set(relevant[query])
    base_relevant = np.array([c in positives for c in found], dtype=np.float64)
    docs, is_relevant = found, base_relevant
    if always_rerank_positives:  # the relevant ones first, then the other candidates, as the reference orders them
        added = sorted(c for c in positives if c in corpus)
        docs = added + [c for c in found if c not in positives]
        is_relevant = np.array([1.0] * len(added) + [0.0] * (len(docs) - len(added)))
    if not is_relevant.any():  # nothing to find: the reference scores 0 without asking the model
        docs, is_relevant = [], is_relevant[:0]
    return _Sample(query, docs, is_relevant, base_relevant, len(positives))


def _scores(score: Score, pairs: list[tuple[str, str]], batch_size: int) -> np.ndarray:
    parts: list[np.ndarray] = []
    for start in range(0, len(pairs), batch_size):
        batch = pairs[start : start + batch_size]
        out = np.asarray(score(batch), dtype=np.float64).reshape(-1)
        if len(out) != len(batch) or not np.isfinite(out).all():
            raise ValueError(f"score gave {out.tolist()[:8]} for {len(batch)} pairs; it must give a finite score each")
        parts.append(out)
    return np.concatenate(parts) if parts else np.zeros(0)


def _rerank_metrics(
    is_relevant: np.ndarray, scores: np.ndarray, n_positives: int, at_k: int
) -> tuple[float, float, float]:
    """(map, mrr@at_k, ndcg@at_k) of one query, as CrossEncoderRerankingEvaluator.compute_metrics. MRR takes the
    order of NumPy's argsort, reversed (as the reference); NDCG and AP give tied scores their mean (as
    scikit-learn's dcg_score and average_precision_score). Both are normalised by all known positives."""
    found = is_relevant.sum()
    if found == 0:
        return 0.0, 0.0, 0.0
    n_positives = max(n_positives, int(found))
    top = is_relevant[np.argsort(scores)[::-1][:at_k]]
    mrr = 1.0 / (top.argmax() + 1) if top.any() else 0.0
    _, group, counts = np.unique(-scores, return_inverse=True, return_counts=True)  # tied scores, best first
    group_found = np.bincount(group, weights=is_relevant, minlength=len(counts))
    ends = np.cumsum(counts)  # the rank each group ends at
    discounts = _discounts(len(scores))
    discounts[at_k:] = 0.0
    group_discounts = np.diff(np.cumsum(discounts)[ends - 1], prepend=0.0)
    dcg = (group_found / counts * group_discounts).sum()
    ndcg = dcg / _discounts(min(n_positives, at_k)).sum()
    ap = (group_found * np.cumsum(group_found) / ends).sum() / n_positives
    return float(ap), float(mrr), float(ndcg)


# ---------------------------------------------------------------------------- similarity


def similarity_correlation(
    emb1: torch.Tensor, emb2: torch.Tensor, gold_scores: Sequence[float] | np.ndarray
) -> dict[str, float]:
    """EmbeddingSimilarityEvaluator's pearson_cosine and spearman_cosine: the correlations of the pairs'
    cosines (emb1[i], emb2[i]) with their gold scores. NaN when every cosine is the same, as scipy's;
    gold scores that are all the same are an error (the reference gives NaN)."""
    emb1, emb2 = torch.as_tensor(emb1), torch.as_tensor(emb2)
    gold = np.asarray(gold_scores, dtype=np.float64)
    if emb1.dim() != 2 or emb1.shape != emb2.shape or gold.shape != emb1.shape[:1] or len(gold) < 2:
        raise ValueError(
            f"need two (n, D) embeddings and n >= 2 gold scores, got {tuple(emb1.shape)}, "
            f"{tuple(emb2.shape)} and {gold.shape}"
        )
    if not np.isfinite(gold).all() or gold.min() == gold.max():
        raise ValueError(f"gold scores must be finite and not all equal, got {gold.tolist()[:8]}")
    cosines = (F.normalize(emb1.float(), p=2, dim=-1) * F.normalize(emb2.float(), p=2, dim=-1)).sum(-1)
    cosines_np = cosines.cpu().numpy()
    return {"pearson_cosine": pearson(gold, cosines_np), "spearman_cosine": spearman(gold, cosines_np)}


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson's r in float64; NaN when either side is constant (scipy.stats.pearsonr's value)."""
    xm = np.asarray(x, dtype=np.float64) - np.mean(x, dtype=np.float64)
    ym = np.asarray(y, dtype=np.float64) - np.mean(y, dtype=np.float64)
    norms = np.sqrt((xm * xm).sum()) * np.sqrt((ym * ym).sum())
    return float(np.clip((xm * ym).sum() / norms, -1.0, 1.0)) if norms > 0 else float("nan")


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho: Pearson's r of the ranks, tied values sharing their mean rank (scipy.stats.spearmanr)."""
    return pearson(average_ranks(x), average_ranks(y))


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 1, tied values sharing the mean of their ranks (scipy.stats.rankdata(method="average"))."""
    x = np.asarray(x)
    order = np.argsort(x, kind="stable")
    ordered = x[order]
    starts = np.r_[True, ordered[1:] != ordered[:-1]]  # where each run of equal values begins
    group = np.cumsum(starts) - 1
    ends = np.r_[np.nonzero(starts)[0][1:], len(x)]  # (groups,): one past each run's last position
    counts = np.diff(np.r_[0, ends])
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = (ends - (counts - 1) / 2.0)[group]  # a run ending at rank e of c values: mean e - (c-1)/2
    return ranks


# ---------------------------------------------------------------------------- checks


def _check_embeddings(query_emb: torch.Tensor, corpus_emb: torch.Tensor) -> None:
    if query_emb.dim() != 2 or corpus_emb.dim() != 2 or query_emb.shape[1] != corpus_emb.shape[1]:
        raise ValueError(
            f"need (Q, D) query and (N, D) corpus embeddings, got {tuple(query_emb.shape)} and {tuple(corpus_emb.shape)}"
        )
    if not len(query_emb) or not len(corpus_emb):
        raise ValueError(f"need at least one query and one document, got {len(query_emb)} and {len(corpus_emb)}")
    for name, emb in (("query", query_emb), ("corpus", corpus_emb)):
        if not torch.isfinite(emb).all():
            raise ValueError(f"{name} embeddings hold NaN or infinite values")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
