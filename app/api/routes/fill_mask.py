"""POST /fill-mask: the most likely tokens for each [MASK], as transformers' fill-mask pipeline."""

from typing import Annotated

from fastapi import APIRouter, Body

from app.api.deps import ServiceDep
from app.errors import responses
from app.schemas.fill_mask import FILL_MASK_EXAMPLE, FillMaskRequest, FillMaskResponse
from app.schemas.shared import body_examples
from app.serving import pipelines

router = APIRouter(tags=["inference"])
FillMaskBody = Annotated[FillMaskRequest, Body(openapi_examples=body_examples(FillMaskRequest))]

INFERENCE_ERRORS = responses("validation", "unauthorized", "not_found", "too_large", "overloaded", "unavailable")


def ok(example) -> dict:
    """OpenAPI's 200 with an example body, for routes whose response model has none."""
    return {200: {"content": {"application/json": {"example": example}}}}


@router.post(
    "/fill-mask",
    response_model=FillMaskResponse,
    responses={**INFERENCE_ERRORS, 200: {"content": {"application/json": {"example": FILL_MASK_EXAMPLE}}}},
)
async def fill_mask(req: FillMaskBody, service: ServiceDep):
    """Top-k tokens for each [MASK]: one list per mask, one entry per input (needs an MLM head)."""
    return await pipelines.fill_mask(service, req)
