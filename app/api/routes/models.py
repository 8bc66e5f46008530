"""GET /models and GET /models/{name}: what the registry holds (rescanned on every listing), each model's
promoted version and its versions, each with its card (where it came from, its held-out scores) and
its named prompts and its embeddings' pooling.
A key sees the models it may use (app/keys/ownership.py): its own, the shared ones, those its key lists.
Behind the admin scope: POST /models imports a model from the Hugging Face Hub or an uploaded archive, as
a job; PATCH /models/{name} shares it with every key or stops sharing it; POST /models/{name}/promote,
DELETE /models/{name} and DELETE /models/{name}/versions/{version} manage its versions."""

import asyncio
import shutil
from typing import Annotated, Any

import torch
from fastapi import APIRouter, Depends, Path, Request, Response

from app.api.auditing import audited
from app.api.deps import CallerDep, CatalogDep, ImportsDep, ServiceDep, require_admin
from app.errors import ServiceError, responses
from app.jobs.imports import receive_request
from app.keys.keyfile import Key
from app.keys.keyring import ANONYMOUS
from app.keys.ownership import may_read_model
from app.schemas.jobs import JobStatus
from app.schemas.models import (
    IMPORT_EXAMPLE,
    ImportModelRequest,
    MemoryInfo,
    ModelDetail,
    ModelInfo,
    ModelsResponse,
    ModelVersion,
    PromoteRequest,
    ShareRequest,
)
from app.schemas.shared import DeletedResponse
from app.serving.service import Service
from app.serving.stored_models import StoredModel
from datadir import NAME_MAX_LENGTH, NAME_PATTERN, list_versions
from datadir.cards import read_card
from datadir.versions import disk_bytes
from model.compute import kernels
from model.model_dir import read_prompts
from model.sentence_modules import read_sentence_modules

router = APIRouter(tags=["models"])
admin = APIRouter(tags=["models"], dependencies=[Depends(require_admin)])

ModelName = Annotated[str, Path(pattern=NAME_PATTERN, max_length=NAME_MAX_LENGTH)]
VersionNumber = Annotated[int, Path(ge=1, le=999_999_999, description="As GET /models/{name} lists it.")]

IMPORT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": ImportModelRequest.model_json_schema(),
                "examples": {"hub": {"value": IMPORT_EXAMPLE}},
            },
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "name"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "A .tar, .tar.gz, .tgz or .zip of a Hugging Face model directory.",
                        },
                        "name": {"type": "string", "pattern": NAME_PATTERN},
                    },
                }
            },
        },
    }
}


@admin.post(
    "/models",
    status_code=202,
    response_model=JobStatus,
    openapi_extra=IMPORT_BODY,
    responses=responses("validation", "unauthorized", "conflict", "too_large", "insufficient_storage"),
)
async def import_model(request: Request, imports: ImportsDep, response: Response, caller: CallerDep) -> JobStatus:
    """Import a model from a Hub repo id (JSON) or an archive (multipart) as a job; GET /jobs/{id} follows it."""
    async with audited(request, "model.import", "model") as entry:
        name, source, upload = await receive_request(request, imports.data_dir, request.app.state.settings)
        entry["target"] = f"model {name}"
        try:
            record = await asyncio.to_thread(imports.submit, name, source, upload, owner=caller.name)
        finally:
            if upload is not None:
                shutil.rmtree(upload.parent, ignore_errors=True)
        entry["target"] = f"model {name} (job {record['id']})"
    response.headers["Location"] = f"/jobs/{record['id']}"
    return JobStatus.from_record(record)


def model_info(entry: StoredModel, service: Service, bytes_on_disk: int = 0) -> ModelInfo:
    """(Reads the model's card.json: call it off the event loop.)"""
    config, registry = entry.config, service.registry
    default, (precision, chosen) = registry.default(), service.precision_choice(entry.name)
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
        pinned=registry.is_pinned(entry.name),
        estimated_bytes=registry.estimate(entry)[0] or None,
        version=entry.version,
        num_versions=len(entry.versions),
        disk_bytes=bytes_on_disk,
        owner=entry.access.owner,
        shared=entry.access.shared,
        card=read_card(entry.path) or None,
        prompts=_prompts(entry),
        **_embedding(entry),
        **(_kernels(entry.loaded.precision, service.device, chosen) if entry.loaded is not None else {}),
    )


def _kernels(precision: str, device: torch.device, chosen: str) -> dict[str, str]:
    """The loaded model's kernels, and why: the setting that chose its precision, then what the machine has."""
    plan = kernels.describe(precision, device)
    return {"kernels": plan["kernels"], "why": f"{chosen}; {plan['why']}"}


def _prompts(entry: StoredModel) -> dict[str, str] | None:
    """The model's prompts, as loaded, else as its directory has them (None when it cannot say)."""
    if entry.loaded is not None:
        return entry.loaded.prompts or None
    try:
        return read_prompts(entry.path)[0] or None
    except ValueError:
        return None


def _embedding(entry: StoredModel) -> dict[str, Any]:
    """Its pooling modes (["splade"]: a sparse encoder) and Normalize, as loaded, else as its directory has them (None when it cannot say)."""
    if entry.loaded is not None and entry.loaded.embedding_error is not None:
        return {}
    try:
        modules = entry.loaded.sentence_modules if entry.loaded is not None else read_sentence_modules(entry.path)
    except ValueError:
        return {}
    return {"pooling": modules.pooling_names, "normalize": modules.normalize}


@router.get("/models", response_model=ModelsResponse, responses=responses("unauthorized"))
async def list_models(service: ServiceDep, caller: CallerDep) -> ModelsResponse:
    """Every model in DATA_DIR/models/ the key may use: its promoted version's heads and size, its versions and
    disk use, its owner, whether it is shared, loaded, pinned or the default, and the memory budget."""
    registry = service.registry
    entries = [e for e in await asyncio.to_thread(registry.scan) if may_read_model(caller, e.name, e.access)]
    sizes = await asyncio.to_thread(lambda: [disk_bytes(service.settings.data_dir, e.name) for e in entries])
    models = await asyncio.to_thread(
        lambda: [model_info(e, service, size) for e, size in zip(entries, sizes, strict=True)]
    )
    counted, working = registry.memory_in_use()
    held = registry.held_bytes()
    memory = MemoryInfo(
        budget_bytes=registry.memory_budget, loaded_bytes=counted - held, held_bytes=held, working_set_bytes=working
    )
    return ModelsResponse(models=models, default=registry.default(), memory=memory)


@router.get(
    "/models/{name}", response_model=ModelDetail, responses=responses("unauthorized", "not_found", "validation")
)
async def get_model(name: ModelName, service: ServiceDep, caller: CallerDep) -> ModelDetail:
    """One model's description, with every version: when and by what it was made, its disk use and card."""
    return await _detail(service, name, caller)


@admin.patch(
    "/models/{name}",
    response_model=ModelDetail,
    responses=responses("unauthorized", "not_found", "validation"),
)
async def share_model(
    name: ModelName, req: ShareRequest, service: ServiceDep, catalog: CatalogDep, request: Request
) -> ModelDetail:
    """Share a model with every key (they may use it and train from it), or stop sharing it."""
    async with audited(request, "model.share" if req.shared else "model.unshare", f"model {name}"):
        await catalog.share(name, req.shared)
    return await _detail(service, name)


@admin.post(
    "/models/{name}/promote",
    response_model=ModelDetail,
    responses=responses("unauthorized", "not_found", "validation"),
)
async def promote_model(
    name: ModelName, req: PromoteRequest, service: ServiceDep, catalog: CatalogDep, request: Request
) -> ModelDetail:
    """Serve another version of a model (a rollback: an older one); requests in flight finish on the old one."""
    async with audited(request, "model.promote", f"model {name} version {req.version}"):
        await catalog.promote(name, req.version)
    return await _detail(service, name)


@admin.delete(
    "/models/{name}",
    response_model=DeletedResponse,
    responses=responses("unauthorized", "not_found", "validation", "conflict"),
)
async def delete_model(name: ModelName, catalog: CatalogDep, request: Request) -> DeletedResponse:
    """Delete a model with every version (409 while it is a default model or a queued or running job's base model)."""
    async with audited(request, "model.delete", f"model {name}"):
        freed = await catalog.delete_model(name)
    return DeletedResponse(deleted="model", name=name, freed_bytes=freed)


@admin.delete(
    "/models/{name}/versions/{version}",
    response_model=DeletedResponse,
    responses=responses("unauthorized", "not_found", "validation", "conflict"),
)
async def delete_model_version(
    name: ModelName, version: VersionNumber, catalog: CatalogDep, request: Request
) -> DeletedResponse:
    """Delete one version (409 for the promoted one while others exist; the last one deletes the model)."""
    async with audited(request, "model.delete", f"model {name} version {version}"):
        freed = await catalog.delete_model(name, version)
    return DeletedResponse(deleted="version", name=name, version=version, freed_bytes=freed)


async def _detail(service: Service, name: str, caller: Key = ANONYMOUS) -> ModelDetail:
    entry = await service.registry.lookup(name)
    if not may_read_model(caller, entry.name, entry.access):  # another key's: not shown, as its jobs are not
        raise ServiceError("not_found", f"model '{name}' not found")
    versions = await asyncio.to_thread(list_versions, service.settings.data_dir, name)
    listed = [
        ModelVersion(
            version=v.version,
            promoted=v.version == entry.version,
            created_at=v.created_at,
            disk_bytes=v.disk_bytes,
            made_by=v.made_by,
            owner=v.owner,
            card=await asyncio.to_thread(read_card, v.path),
        )
        for v in versions
    ]
    size = await asyncio.to_thread(disk_bytes, service.settings.data_dir, name)
    info = await asyncio.to_thread(model_info, entry, service, size)
    return ModelDetail(**{**info.model_dump(), "num_versions": len(listed)}, versions=listed)
