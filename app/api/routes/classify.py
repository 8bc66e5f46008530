"""POST /classify: fine-tuned sequence classifiers (labels from the model's config.id2label)."""

from typing import Annotated, Any

from fastapi import Body

from app.api.deps import ServiceDep
from app.api.inference import INFERENCE_ERRORS, InferenceRouter, ok
from app.schemas.classify import ClassifyRequest, ClassifyResponse
from app.schemas.shared import body_examples
from app.serving import pipelines

router = InferenceRouter(tags=["inference"])
ClassifyBody = Annotated[ClassifyRequest, Body(openapi_examples=body_examples(ClassifyRequest))]

EXAMPLE = {"label": "positive", "score": 0.94, "scores": {"negative": 0.06, "positive": 0.94}}


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    responses={**INFERENCE_ERRORS, **ok(EXAMPLE)},
)
async def classify(req: ClassifyBody, service: ServiceDep) -> Any:
    """Label and per-label scores for each text or text pair (needs a classifier head)."""
    return await pipelines.classify(service, req)
