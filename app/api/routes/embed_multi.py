"""POST /embed_multi: a late-interaction (ColBERT) model's token vectors per input. (Its /rerank, by
MaxSim, is TEI's route: app/api/routes/tei.py.)"""

from typing import Annotated

from fastapi import Body

from app.api.deps import ServiceDep
from app.api.inference import INFERENCE_ERRORS, InferenceRouter, ok
from app.schemas.embed_multi import EmbedMultiRequest, EmbedMultiResponse
from app.schemas.shared import body_examples
from app.serving import colbert_pipeline

router = InferenceRouter(tags=["inference"])
EmbedMultiBody = Annotated[EmbedMultiRequest, Body(openapi_examples=body_examples(EmbedMultiRequest))]


@router.post(
    "/embed_multi",
    response_model=EmbedMultiResponse,
    responses={**INFERENCE_ERRORS, **ok([[[0.12, -0.34, 0.93], [0.41, 0.02, -0.91]]])},
)
async def embed_multi(req: EmbedMultiBody, service: ServiceDep) -> list[list[list[float]]]:
    """A ColBERT model's token vectors for each input, as PyLate encodes queries (is_query) or documents."""
    return await colbert_pipeline.embed_multi(service, req)
