"""POST /embeddings (one vector per input) and POST /v1/embeddings (OpenAI's format)."""

from typing import Annotated, Any

from fastapi import Body

from app.api.deps import ServiceDep
from app.api.inference import INFERENCE_ERRORS, InferenceRouter, ok
from app.errors import responses
from app.schemas.embeddings import (
    EmbeddingsRequest,
    EmbeddingsResponse,
    OpenAIEmbeddingsRequest,
    OpenAIEmbeddingsResponse,
)
from app.schemas.shared import body_examples
from app.serving import embed_pipeline as pipeline

router = InferenceRouter(tags=["inference"])
EmbeddingsBody = Annotated[EmbeddingsRequest, Body(openapi_examples=body_examples(EmbeddingsRequest))]
OpenAIEmbeddingsBody = Annotated[OpenAIEmbeddingsRequest, Body(openapi_examples=body_examples(OpenAIEmbeddingsRequest))]

# As INFERENCE_ERRORS, in OpenAI's error shape (app/errors.py)
OPENAI_ERRORS = responses(
    "validation", "unauthorized", "not_found", "too_large", "overloaded", "unavailable", openai=True
)
OPENAI_EXAMPLE = {
    "object": "list",
    "model": "bert-tiny",
    "data": [{"object": "embedding", "embedding": [0.0123, -0.0456, 0.0789], "index": 0}],
    "usage": {"prompt_tokens": 4, "total_tokens": 4},
}


@router.post(
    "/embeddings",
    response_model=EmbeddingsResponse,
    responses={**INFERENCE_ERRORS, **ok([0.0123, -0.0456, 0.0789])},
)
async def embeddings(req: EmbeddingsBody, service: ServiceDep) -> Any:
    """Sentence embeddings of any model, pooled and normalised as its sentence-transformers modules say."""
    return await pipeline.embeddings(service, req)


@router.post(
    "/v1/embeddings",
    response_model=OpenAIEmbeddingsResponse,
    responses={**OPENAI_ERRORS, **ok(OPENAI_EXAMPLE)},
)
async def openai_embeddings(req: OpenAIEmbeddingsBody, service: ServiceDep) -> dict[str, Any]:
    """OpenAI-compatible embeddings (the model's own pooling, always unit length), for OpenAI's client libraries."""
    return await pipeline.openai_embeddings(service, req)
