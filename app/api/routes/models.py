"""GET /models and GET /models/{name}: what the store holds (rescanned on every listing); POST /models
(behind BERT_ADMIN_KEY): import a model from the Hugging Face Hub or an uploaded archive, as a job."""

import asyncio
import shutil
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response

from app.api.deps import ImportsDep, ServiceDep, require_admin_key
from app.errors import responses
from app.jobs.imports import receive_request
from app.schemas import IMPORT_EXAMPLE, ImportModelRequest, JobStatus, ModelInfo, ModelsResponse
from app.serving.model_registry import StoredModel
from model import kernels
from model.datadir import NAME_PATTERN

router = APIRouter(tags=["models"])
admin = APIRouter(tags=["models"], dependencies=[Depends(require_admin_key)])

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
async def import_model(request: Request, imports: ImportsDep, response: Response):
    """Import a model from a Hub repo id (JSON) or an archive (multipart) as a job; GET /jobs/{id} follows it."""
    name, source, upload = await receive_request(request, imports.data_dir, request.app.state.settings)
    try:
        record = await asyncio.to_thread(imports.submit, name, source, upload)
    finally:
        if upload is not None:
            shutil.rmtree(upload.parent, ignore_errors=True)
    response.headers["Location"] = f"/jobs/{record['id']}"
    return JobStatus.from_record(record)


def model_info(entry: StoredModel, default: str | None, precision: str, device) -> ModelInfo:
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
        **(kernels.describe(entry.loaded.precision, device) if entry.loaded is not None else {}),
    )


@router.get("/models", response_model=ModelsResponse, responses=responses("unauthorized"))
async def list_models(service: ServiceDep):
    """Every model in DATA_DIR/models/, with its heads, size, and whether it is loaded or the default."""
    entries = await asyncio.to_thread(service.store.scan)
    default = service.store.default()
    models = [model_info(e, default, service.store.precision_of(e.name), service.device) for e in entries]
    return ModelsResponse(models=models, default=default)


@router.get("/models/{name}", response_model=ModelInfo, responses=responses("unauthorized", "not_found", "validation"))
async def get_model(name: Annotated[str, Path(pattern=NAME_PATTERN, max_length=64)], service: ServiceDep):
    """One model's description."""
    entry = await service.store.lookup(name)
    return model_info(entry, service.store.default(), service.store.precision_of(entry.name), service.device)
