"""GET /models and GET /models/{name}: what the store holds (rescanned on every listing)."""

import asyncio
from typing import Annotated

from fastapi import APIRouter, Path

from app.api.deps import ServiceDep
from app.errors import responses
from app.schemas import MemoryInfo, ModelInfo, ModelsResponse
from app.serving.model_registry import ModelRegistry, StoredModel
from model import kernels
from model.datadir import NAME_PATTERN

router = APIRouter(tags=["models"])


def model_info(entry: StoredModel, store: ModelRegistry, device) -> ModelInfo:
    config = entry.config
    default, precision = store.default(), store.precision_of(entry.name)
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
        pinned=store.is_pinned(entry.name),
        estimated_bytes=store.estimate(entry)[0] or None,
        **(kernels.describe(entry.loaded.precision, device) if entry.loaded is not None else {}),
    )


@router.get("/models", response_model=ModelsResponse, responses=responses("unauthorized"))
async def list_models(service: ServiceDep):
    """Every model in DATA_DIR/models/, with its heads, size, whether it is loaded, pinned or the default, and the memory budget."""
    entries = await asyncio.to_thread(service.store.scan)
    store = service.store
    models = [model_info(e, store, service.device) for e in entries]
    loaded, working = store.memory_in_use()
    memory = MemoryInfo(budget_bytes=store.memory_budget, loaded_bytes=loaded, working_set_bytes=working)
    return ModelsResponse(models=models, default=store.default(), memory=memory)


@router.get("/models/{name}", response_model=ModelInfo, responses=responses("unauthorized", "not_found", "validation"))
async def get_model(name: Annotated[str, Path(pattern=NAME_PATTERN, max_length=64)], service: ServiceDep):
    """One model's description."""
    entry = await service.store.lookup(name)
    return model_info(entry, service.store, service.device)
