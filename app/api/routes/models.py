"""GET /models and GET /models/{name}: what the store holds (rescanned on every listing), each with its card."""

import asyncio
from typing import Annotated

from fastapi import APIRouter, Path

from app.api.deps import ServiceDep
from app.errors import responses
from app.schemas import ModelInfo, ModelsResponse
from app.serving.model_registry import StoredModel
from model import kernels
from model.datadir import NAME_PATTERN
from model.datadir.cards import read_card

router = APIRouter(tags=["models"])


def model_info(entry: StoredModel, default: str | None, precision: str, device) -> ModelInfo:
    """(Reads the model's card.json: call it off the event loop.)"""
    config = entry.config
    labels = None
    if config is not None and config.id2label and {"classifier", "token_classifier"} & set(entry.heads):
        labels = [config.id2label[i] for i in sorted(config.id2label)]
    return ModelInfo(
        name=entry.name,
        architecture=entry.architecture,
        heads=entry.heads,
        labels=labels,
        num_parameters=entry.num_parameters,
        max_position_embeddings=config.max_position_embeddings if config else None,
        hidden_size=config.hidden_size if config else None,
        default=entry.name == default,
        loaded=entry.loaded is not None,
        precision=precision,
        error=entry.error,
        card=read_card(entry.path) or None,
        **(kernels.describe(entry.loaded.precision, device) if entry.loaded is not None else {}),
    )


@router.get("/models", response_model=ModelsResponse, responses=responses("unauthorized"))
async def list_models(service: ServiceDep):
    """Every model in DATA_DIR/models/, with its heads, size, and whether it is loaded or the default."""
    entries = await asyncio.to_thread(service.store.scan)
    default = service.store.default()
    models = await asyncio.to_thread(
        lambda: [model_info(e, default, service.store.precision_of(e.name), service.device) for e in entries]
    )
    return ModelsResponse(models=models, default=default)


@router.get("/models/{name}", response_model=ModelInfo, responses=responses("unauthorized", "not_found", "validation"))
async def get_model(name: Annotated[str, Path(pattern=NAME_PATTERN, max_length=64)], service: ServiceDep):
    """One model's description, with its card (where it came from, its held-out scores)."""
    entry = await service.store.lookup(name)
    precision = service.store.precision_of(entry.name)
    return await asyncio.to_thread(model_info, entry, service.store.default(), precision, service.device)
