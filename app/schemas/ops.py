"""The operations routes' responses: /health, /ready and /info (app/api/routes/ops.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.errors import JobProgress


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"
    model: str
    mlm_model: str | None = Field(
        None,
        description="The model /fill-mask and /nsp answer with now when a request names none: the default MLM "
        "model once it is there (else `model`, when there is no default MLM model and `model` has an MLM head); "
        "null while none can, e.g. while the bootstrap job still trains `wiki-mlm` (`mlm_job`).",
    )
    mlm_job: JobProgress | None = Field(
        None,
        description="The job making the default MLM model while it is not there (the bootstrap job, or the import "
        "of BERT_MLM_MODEL): its state, step of total, phase and ETA; or the one that was to and was cancelled or "
        "failed. Null when there is none, and where /fill-mask needs a key (its 503 shows the job to a key that may see "
        "it).",
    )


class InfoResponse(BaseModel):
    name: str
    version: str
    device: str
    cpu: str = Field(
        description="The processor and what torch reports it can do, e.g. "
        '"AMD EPYC: cpu AVX2, no native bf16, no VNNI".'
    )
    torch: str
    python: str
    settings: dict
    keys: dict = Field(
        description="The keys file, how many keys it holds, the built-in keys that are set, and the error of "
        "its last change when that change could not be read (the keys read before stay in use)."
    )
