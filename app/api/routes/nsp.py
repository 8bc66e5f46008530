"""POST /nsp: next-sentence prediction with BERT's pre-training NSP head."""

from typing import Annotated, Any

from fastapi import Body

from app.api.deps import ServiceDep
from app.api.inference import INFERENCE_ERRORS, InferenceRouter, ok
from app.schemas.nsp import NspRequest, NspResponse
from app.schemas.shared import body_examples
from app.serving import pipelines

router = InferenceRouter(tags=["inference"])
NspBody = Annotated[NspRequest, Body(openapi_examples=body_examples(NspRequest))]


@router.post(
    "/nsp",
    response_model=NspResponse,
    responses={**INFERENCE_ERRORS, **ok({"is_next": True, "score": 0.9987})},
)
async def nsp(req: NspBody, service: ServiceDep) -> Any:
    """Probability that text_b follows text_a, per pair (needs an NSP head, BertForPreTraining)."""
    return await pipelines.nsp(service, req)
