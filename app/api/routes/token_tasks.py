"""POST /token-classification and POST /question-answering, in the shapes of transformers'
token-classification and (4.x) question-answering pipelines (app/serving/ner_pipeline.py and
app/serving/qa_pipeline.py say what is followed)."""

from typing import Annotated, Any

from fastapi import Body

from app.api.deps import ServiceDep
from app.api.inference import INFERENCE_ERRORS, InferenceRouter, ok
from app.schemas.shared import body_examples
from app.schemas.token_tasks import (
    QuestionAnsweringRequest,
    QuestionAnsweringResponse,
    TokenClassificationRequest,
    TokenClassificationResponse,
)
from app.serving import ner_pipeline, qa_pipeline

router = InferenceRouter(tags=["inference"])
TokenClassificationBody = Annotated[
    TokenClassificationRequest, Body(openapi_examples=body_examples(TokenClassificationRequest))
]
QuestionAnsweringBody = Annotated[
    QuestionAnsweringRequest, Body(openapi_examples=body_examples(QuestionAnsweringRequest))
]

ENTITIES = [
    {"entity_group": "PER", "score": 0.998, "word": "wolfgang", "start": 11, "end": 19},
    {"entity_group": "LOC", "score": 0.999, "word": "berlin", "start": 34, "end": 40},
]
ANSWER = {"score": 0.97, "start": 15, "end": 21, "answer": "london"}


@router.post(
    "/token-classification",
    response_model=TokenClassificationResponse,
    response_model_exclude_none=True,
    responses={**INFERENCE_ERRORS, **ok(ENTITIES)},
)
async def token_classification_route(req: TokenClassificationBody, service: ServiceDep) -> Any:
    """Entities (or every token's label) in each text, with character offsets (needs a token classifier)."""
    return await ner_pipeline.token_classification(service, req)


@router.post(
    "/question-answering", response_model=QuestionAnsweringResponse, responses={**INFERENCE_ERRORS, **ok(ANSWER)}
)
async def question_answering_route(req: QuestionAnsweringBody, service: ServiceDep) -> Any:
    """The span of each context that answers its question, with character offsets (needs a QA head)."""
    return await qa_pipeline.question_answering(service, req)
