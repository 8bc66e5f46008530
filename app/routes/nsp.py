"""POST /nsp: next-sentence prediction with BERT's pre-training NSP head."""

from fastapi import APIRouter

from .. import pipelines
from ..deps import ServiceDep
from ..schemas import NspRequest, NspResponse
from .fill_mask import INFERENCE_ERRORS

router = APIRouter(tags=["inference"])


@router.post("/nsp", response_model=NspResponse, responses={
    **INFERENCE_ERRORS, 200: {"content": {"application/json": {"example": {"is_next": True, "score": 0.9987}}}}})
async def nsp(req: NspRequest, service: ServiceDep):
    """Probability that text_b follows text_a, per pair (needs an NSP head, BertForPreTraining)."""
    return await pipelines.nsp(service, req)
