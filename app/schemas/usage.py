"""GET /usage's response: each key's usage (app/api/routes/usage.py)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class KeyUsage(BaseModel):
    requests: int = Field(description="Requests made with the key since the service started (refused ones included).")
    tokens: int = Field(description="Tokens of its inference requests since the service started.")
    rate_limited: int = Field(description="Its requests refused (429) by its own limits since the service started.")
    job_seconds: float = Field(description="Worker time of its jobs, from the job records (all time).")


class UsageResponse(BaseModel):
    """Usage per key, by the key's name; the counters are this replica's, since it started."""

    keys: dict[str, KeyUsage]
