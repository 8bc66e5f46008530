"""The operations routes' responses: /health, /ready and /info (app/api/routes/ops.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"
    model: str
    mlm_model: str | None = Field(
        None, description="The model /fill-mask and /nsp use when a request names none (null: `model`)."
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
