"""POST /embed_multi's request and response (app/api/routes/embed_multi.py): a late-interaction
(ColBERT) model's token vectors, as PyLate's ColBERT.encode gives them. /rerank with such a model takes
TEI's RerankRequest (app/schemas/tei.py) and scores by MaxSim."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from app.schemas.shared import ModelName, Strict, examples


class EmbedMultiRequest(Strict):
    """Texts (at most BERT_MAX_INPUTS) to turn into token vectors: as queries (the query marker, [MASK]
    expansion up to the model's query_length) or as documents (the document marker, punctuation left out),
    each cut to the model's query_length or document_length as PyLate cuts it."""

    model_config = examples(
        queries={"inputs": ["what is late interaction?"], "is_query": True, "model": "colbert"},
        documents={"inputs": ["ColBERT scores a document by MaxSim.", "BERT reads text."], "model": "colbert"},
    )
    inputs: str | Annotated[list[str], Field(min_length=1)]
    is_query: bool = Field(False, description="Encode the inputs as queries (true) or as documents (false).")
    model: ModelName | None = None


# Per input, its token vectors (each unit length, the model's projection's size), a list even for one input
EmbedMultiResponse = list[list[list[float]]]
