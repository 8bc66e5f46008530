"""A late-interaction (ColBERT) model's routes: /embed_multi's token vectors and /rerank by MaxSim.

Texts become rows as PyLate's ColBERT.tokenize makes them (model/late_interaction.py: the query or document
marker after [CLS], a query's [MASK] expansion to query_length, cut to query_length or document_length);
the engine's "late_interaction" runner (app/serving/forward.py) gives each row its kept unit vectors. /rerank
scores each text (a document) against the query by MaxSim, each document on its own (pylate.scores.colbert_scores
of one query and one document), best first as TEI's /rerank answers. A request's rows count against
BERT_MAX_REQUEST_TOKENS at their full length, a query's expansion included, so its answer (a vector per row
token at most) is bounded as every route's is.
"""

from __future__ import annotations

import torch

from app.errors import ServiceError
from app.schemas.embed_multi import EmbedMultiRequest
from app.schemas.tei import RerankRequest
from app.serving.pipelines import Row, _infer, as_list
from app.serving.service import Service, check_dropped
from app.serving.stored_models import LoadedModel
from model.late_interaction import LateInteraction, maxsim


def late_model(lm: LoadedModel, route: str) -> LateInteraction:
    """The model's LateInteraction, or a 422 naming the route for a model that is not a ColBERT."""
    if lm.late_interaction is None:
        raise ServiceError(
            "validation",
            f"model '{lm.name}' is not a late-interaction (ColBERT) model: {route} needs one (a PyLate or "
            "colbert-ir checkpoint)",
        )
    return lm.late_interaction


def rows_of(lm: LoadedModel, texts: list[str], is_query: list[bool], route: str) -> tuple[list[Row], dict]:
    """In the thread pool: each text's row, and per row (is_query, tokens attended to) for the runner."""
    li = late_model(lm, route)
    rows, late = [], []
    for text, query in zip(texts, is_query):
        check_dropped()
        ids, attended = li.encode(lm.tokenizer, text, query)
        rows.append((ids, [0] * len(ids)))
        late.append((query, attended))
    return rows, {"late": late}


async def embed_multi(svc: Service, req: EmbedMultiRequest) -> list[list[list[float]]]:
    texts, _ = as_list(req.inputs)
    outcome = await _infer(
        svc,
        "late_interaction",
        req.model,
        texts,
        lambda lm, items: rows_of(lm, items, [req.is_query] * len(items), "/embed_multi"),
    )
    return outcome.results


async def is_late(svc: Service, name: str | None, route: str) -> bool:
    """Whether the model a request names (None: the route's default) is a ColBERT."""
    return (await svc.loaded_model(name, None, route)).late_interaction is not None


async def rerank(svc: Service, req: RerankRequest, name: str | None) -> list[dict]:
    """TEI's /rerank for a ColBERT: the texts by MaxSim with the query, best first."""
    flags = [True] + [False] * len(req.texts)  # the query's row first: the texts are what BERT_MAX_INPUTS counts
    outcome = await _infer(
        svc,
        "late_interaction",
        name,
        req.texts,
        lambda lm, items: rows_of(lm, [req.query, *items], flags, "/rerank"),
        route="/rerank",
    )
    scores = await svc.off_loop(_maxsim_each, outcome.results)
    ranks = []
    for index, score in enumerate(scores):
        rank: dict[str, int | float | str] = {"index": index, "score": score}
        if req.return_text:
            rank["text"] = req.texts[index]
        ranks.append(rank)
    return sorted(ranks, key=lambda r: r["score"])[::-1]  # as TEI: ties in reverse input order


def _maxsim_each(vectors: list[list[list[float]]]) -> list[float]:
    query = torch.tensor(vectors[0])
    return [maxsim(query, torch.tensor(document)).item() for document in vectors[1:]]
