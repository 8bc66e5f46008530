"""OpenAI's file and batch objects and its batch request, for /v1/files and /v1/batches
(app/api/routes/openai_batches.py; app/serving/batch_jobs.py runs the batches)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

# The routes a batch's lines may call; each line's body is validated by that route's request model.
BatchEndpoint = Literal[
    "/v1/embeddings",
    "/embeddings",
    "/fill-mask",
    "/nsp",
    "/classify",
    "/token-classification",
    "/question-answering",
    "/rerank",
]
BATCH_ENDPOINTS: tuple[str, ...] = get_args(BatchEndpoint)
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class FileObject(BaseModel):
    """OpenAI's file object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(description="Unix seconds.")
    filename: str
    purpose: str = Field(description='"batch" (an uploaded input), "batch_output" (a batch\'s output or error file).')


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class CreateBatchRequest(BaseModel):
    """POST /v1/batches: OpenAI's batch request."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(description="A file uploaded with purpose batch: one request a line.")
    endpoint: BatchEndpoint = Field(description="The route every line calls (each line's `url` must be it).")
    completion_window: Literal["24h"] = Field(description='Only "24h", as OpenAI\'s API.')
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Up to 16 string pairs, kept as given.")


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    """OpenAI's batch object; the batch is also the job of kind "batch" with the same id (GET /jobs/{id})."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None = None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
