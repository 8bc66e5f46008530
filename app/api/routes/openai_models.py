"""GET /v1/models and GET /v1/models/{id}: the servable models in OpenAI's format, for OpenAI's clients.

`created` is the model directory's modification time (unix seconds); a directory that cannot be served
is left out, as OpenAI lists only models a request may name. Errors answer in OpenAI's shape (app/errors.py).
"""

import asyncio

from fastapi import APIRouter

from app.api.deps import CallerDep, ServiceDep
from app.errors import ServiceError, responses
from app.keys.ownership import may_read_model
from app.schemas.openai_models import OpenAIModel, OpenAIModelsResponse
from app.serving.stored_models import StoredModel

router = APIRouter(tags=["models"])
OWNED_BY = "bertserve"


def openai_model(entry: StoredModel) -> OpenAIModel:
    """(Reads the directory's mtime: call it off the event loop.)"""
    return OpenAIModel(id=entry.name, created=int(entry.path.stat().st_mtime), owned_by=OWNED_BY)


@router.get("/v1/models", response_model=OpenAIModelsResponse, responses=responses("unauthorized", openai=True))
async def list_openai_models(service: ServiceDep, caller: CallerDep) -> OpenAIModelsResponse:
    """Every model a request of this key can name, in OpenAI's list format."""
    entries = [e for e in await asyncio.to_thread(service.registry.scan) if may_read_model(caller, e.name, e.access)]
    data = await asyncio.to_thread(lambda: [openai_model(e) for e in entries if e.error is None])
    return OpenAIModelsResponse(data=data)


@router.get(
    "/v1/models/{model_id}",
    response_model=OpenAIModel,
    responses=responses("unauthorized", "not_found", "unavailable", openai=True),
)
async def get_openai_model(model_id: str, service: ServiceDep, caller: CallerDep) -> OpenAIModel:
    """One model, in OpenAI's format."""
    entry = await service.registry.lookup(model_id)
    if not may_read_model(caller, entry.name, entry.access):  # another key's: not shown
        raise ServiceError("not_found", f"model '{model_id}' not found")
    if entry.error is not None:
        raise ServiceError("not_found", f"model '{model_id}' cannot be served: {entry.error}")
    return await asyncio.to_thread(openai_model, entry)
