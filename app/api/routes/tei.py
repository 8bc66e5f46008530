"""text-embeddings-inference's routes: POST /embed, /embed_sparse, /embed_all, /predict, /rerank, /similarity,
/tokenize, /decode and / in
TEI's shapes (app/serving/tei_compat.py says what is followed), for TEI's clients."""

from typing import Annotated, Any

from fastapi import Body

from app.api.deps import ServiceDep
from app.api.inference import INFERENCE_ERRORS, InferenceRouter, ok
from app.schemas.shared import body_examples
from app.schemas.tei import (
    DecodeRequest,
    DecodeResponse,
    EmbedAllRequest,
    EmbedAllResponse,
    EmbedRequest,
    EmbedResponse,
    EmbedSparseRequest,
    EmbedSparseResponse,
    PredictRequest,
    PredictResponse,
    RerankRequest,
    RerankResponse,
    SimilarityRequest,
    SimilarityResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from app.serving import tei_compat

router = InferenceRouter(tags=["text-embeddings-inference"])
EmbedBody = Annotated[EmbedRequest, Body(openapi_examples=body_examples(EmbedRequest))]
PredictBody = Annotated[PredictRequest, Body(openapi_examples=body_examples(PredictRequest))]
RerankBody = Annotated[RerankRequest, Body(openapi_examples=body_examples(RerankRequest))]
SimilarityBody = Annotated[SimilarityRequest, Body(openapi_examples=body_examples(SimilarityRequest))]
EmbedSparseBody = Annotated[EmbedSparseRequest, Body(openapi_examples=body_examples(EmbedSparseRequest))]
EmbedAllBody = Annotated[EmbedAllRequest, Body(openapi_examples=body_examples(EmbedAllRequest))]
DecodeBody = Annotated[DecodeRequest, Body(openapi_examples=body_examples(DecodeRequest))]
TokenizeBody = Annotated[TokenizeRequest, Body(openapi_examples=body_examples(TokenizeRequest))]


@router.post("/embed", response_model=EmbedResponse, responses={**INFERENCE_ERRORS, **ok([[0.0123, -0.0456, 0.0789]])})
async def embed(req: EmbedBody, service: ServiceDep) -> list[list[float]]:
    """TEI's /embed: one vector per input, pooled as the model says (unit length unless normalize is false)."""
    return await tei_compat.embed(service, req)


@router.post(
    "/embed_sparse",
    response_model=EmbedSparseResponse,
    response_model_exclude_none=True,
    responses={**INFERENCE_ERRORS, **ok([[{"index": 2003, "value": 0.83}, {"index": 4083, "value": 2.21}]])},
)
async def embed_sparse(req: EmbedSparseBody, service: ServiceDep) -> list[list[dict]]:
    """TEI's /embed_sparse: each input's SPLADE vector as its nonzero entries (a SPLADE or masked-LM model)."""
    return await tei_compat.embed_sparse(service, req)


@router.post("/embed_all", response_model=EmbedAllResponse, responses={**INFERENCE_ERRORS, **ok([[[0.12, -0.4]]])})
async def embed_all(req: EmbedAllBody, service: ServiceDep) -> list[list[list[float]]]:
    """TEI's /embed_all: every token's last hidden state, per input ([CLS] and [SEP] included)."""
    return await tei_compat.embed_all(service, req)


@router.post(
    "/predict",
    response_model=PredictResponse,
    responses={**INFERENCE_ERRORS, **ok([{"score": 0.94, "label": "positive"}, {"score": 0.06, "label": "negative"}])},
)
async def predict(req: PredictBody, service: ServiceDep) -> list:
    """TEI's /predict: every label's score for each text or pair, best first (needs a classifier head)."""
    return await tei_compat.predict(service, req)


@router.post(
    "/rerank",
    response_model=RerankResponse,
    response_model_exclude_none=True,
    responses={**INFERENCE_ERRORS, **ok([{"index": 0, "score": 0.98}, {"index": 1, "score": 0.01}])},
)
async def rerank(req: RerankBody, service: ServiceDep) -> list[dict]:
    """TEI's /rerank: the texts by relevance to the query, best first (a cross-encoder's, or a ColBERT's MaxSim)."""
    return await tei_compat.rerank(service, req)


@router.post("/similarity", response_model=SimilarityResponse, responses={**INFERENCE_ERRORS, **ok([0.87, 0.12])})
async def similarity(req: SimilarityBody, service: ServiceDep) -> list[float]:
    """TEI's /similarity: the cosine similarity of source_sentence with each sentence (the model's embeddings)."""
    return await tei_compat.similarity(service, req)


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses={
        **INFERENCE_ERRORS,
        **ok(
            [
                [
                    {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
                    {"id": 3231, "text": "test", "special": False, "start": 0, "stop": 4},
                    {"id": 102, "text": "[SEP]", "special": True, "start": None, "stop": None},
                ]
            ]
        ),
    },
)
async def tokenize(req: TokenizeBody, service: ServiceDep) -> list[list[dict]]:
    """TEI's /tokenize: each input's tokens with ids and character offsets (special tokens: null offsets)."""
    return await tei_compat.tokenize(service, req)


@router.post("/decode", response_model=DecodeResponse, responses={**INFERENCE_ERRORS, **ok(["test"])})
async def decode(req: DecodeBody, service: ServiceDep) -> list[str]:
    """TEI's /decode: the text of each list of token ids (special tokens skipped unless skip_special_tokens is false)."""
    return await tei_compat.decode(service, req)


@router.post(
    "/",
    response_model=EmbedResponse | EmbedSparseResponse | SimilarityResponse | PredictResponse | RerankResponse,
    response_model_exclude_none=True,
    responses={**INFERENCE_ERRORS, **ok([[0.0123, -0.0456, 0.0789]])},
)
async def root(
    body: Annotated[
        dict[str, Any],
        Body(
            openapi_examples={
                "embed": {"summary": "an encoder: /embed", "value": {"inputs": "What is Deep Learning?"}},
                "rerank": {
                    "summary": "a cross-encoder: /rerank",
                    "value": {"query": "What is Deep Learning?", "texts": ["Deep Learning is..."]},
                },
            }
        ),
    ],
    service: ServiceDep,
) -> list:
    """TEI's POST /: /embed, /embed_sparse, /predict or /rerank by the model's type (BERT_DEFAULT_MODEL unless `model`)."""
    return await tei_compat.root(service, body)
