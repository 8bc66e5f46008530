"""GET /v1/models' responses, OpenAI's model object and list (app/api/routes/openai_models.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class OpenAIModel(BaseModel):
    id: str = Field(description="The model's name, as requests name it.")
    object: Literal["model"] = "model"
    created: int = Field(description="When its directory was last written (unix seconds).")
    owned_by: str


class OpenAIModelsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]
