"""POST /fill-mask: the most likely tokens for each [MASK], as transformers' fill-mask pipeline."""

from typing import Annotated, Any

from fastapi import Body

from app.api.deps import ServiceDep
from app.api.inference import INFERENCE_ERRORS, InferenceRouter, ok
from app.schemas.fill_mask import FILL_MASK_EXAMPLE, FillMaskRequest, FillMaskResponse
from app.schemas.shared import body_examples
from app.serving import pipelines

router = InferenceRouter(tags=["inference"])
FillMaskBody = Annotated[FillMaskRequest, Body(openapi_examples=body_examples(FillMaskRequest))]


@router.post(
    "/fill-mask",
    response_model=FillMaskResponse,
    responses={**INFERENCE_ERRORS, **ok(FILL_MASK_EXAMPLE)},
)
async def fill_mask(req: FillMaskBody, service: ServiceDep) -> Any:
    """Top-k tokens for each [MASK]: one list per mask, one entry per input (needs an MLM head)."""
    return await pipelines.fill_mask(service, req)
